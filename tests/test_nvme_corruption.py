"""Corruption of the data files, every kind, under an open store and across a reopen: each
read either returns exactly the bytes written or raises a typed error
(SwapCorruptionError naming key, file, offset and both digests, or another SwapError);
0 silent wrong tensors. Padding and free space are shown harmless."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tiers.aio import AioEngine
from tiers.config import AioConfig
from tiers.errors import SwapCorruptionError, SwapError
from tiers.nvme import ChecksumError, Extent, NvmeStore, content_hash

KiB = 1024
STRIPE = 64 * KiB
SIZES = {"a": 200_000, "b": 200_000, "c": 5_000, "d": STRIPE}


@pytest.fixture(scope="module")
def engine() -> Iterator[AioEngine]:
    with AioEngine(AioConfig(num_threads=2, block_size=16 * KiB)) as e:
        yield e


def _originals() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        k: torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for k, n in SIZES.items()
    }


def _patch(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_at(path: Path, offset: int, nbytes: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(nbytes)


@dataclass
class Scene:
    """A store and what was written; corruptions act on its files."""

    dirs: list[Path]
    extents: dict[str, tuple[Extent, ...]]
    touched: set[str] = field(default_factory=set)  #: keys whose bytes a corruption hit

    def data(self, e: Extent) -> Path:
        return self.dirs[e.dir_index] / "swapper-store.bin"

    def flip(self, key: str, i: int, where: str) -> None:
        e = self.extents[key][i]
        at = {"first": 0, "middle": e.nbytes // 2, "last": e.nbytes - 1}[where]
        old = _read_at(self.data(e), e.offset + at, 1)
        _patch(self.data(e), e.offset + at, bytes([old[0] ^ 0x01]))
        self.touched.add(key)


def _flip(key: str, i: int, where: str) -> Callable[[Scene], None]:
    return lambda s: s.flip(key, i, where)


def _zero_page(s: Scene) -> None:
    e = s.extents["a"][1]
    _patch(s.data(e), e.offset + 8 * KiB, bytes(4 * KiB))
    s.touched.add("a")


def _swap(x: tuple[str, int], y: tuple[str, int]) -> Callable[[Scene], None]:
    def corrupt(s: Scene) -> None:
        ex, ey = s.extents[x[0]][x[1]], s.extents[y[0]][y[1]]
        assert ex.nbytes == ey.nbytes
        bx, by = (
            _read_at(s.data(ex), ex.offset, ex.nbytes),
            _read_at(s.data(ey), ey.offset, ey.nbytes),
        )
        _patch(s.data(ex), ex.offset, by)
        _patch(s.data(ey), ey.offset, bx)
        s.touched.update({x[0], y[0]})

    return corrupt


def _padding(s: Scene) -> None:
    """Garbage in the padding after c's last byte (up to its 4 KiB boundary)."""
    (e,) = s.extents["c"]
    _patch(s.data(e), e.offset + e.nbytes, b"\xa5" * (e.allocated_nbytes - e.nbytes))


def _free_space(s: Scene) -> None:
    """Garbage past the end of every extent (file space not allocated to anything)."""
    for i, d in enumerate(s.dirs):
        ends = [
            e.offset + e.allocated_nbytes
            for ext in s.extents.values()
            for e in ext
            if e.dir_index == i
        ]
        _patch(d / "swapper-store.bin", max(ends), b"\x5a" * 8 * KiB)


def _every_extent(s: Scene) -> None:
    for key, extents in s.extents.items():
        for i in range(len(extents)):
            s.flip(key, i, "middle")


def _truncate(s: Scene) -> None:
    os.truncate(s.dirs[1] / "swapper-store.bin", 0)
    s.touched.update(k for k, ext in s.extents.items() if any(e.dir_index == 1 for e in ext))


def _delete(s: Scene) -> None:
    (s.dirs[1] / "swapper-store.bin").unlink()
    s.touched.update(k for k, ext in s.extents.items() if any(e.dir_index == 1 for e in ext))


def _replace(kind: str) -> Callable[[Scene], None]:
    def corrupt(s: Scene) -> None:
        path = s.dirs[1] / "swapper-store.bin"
        path.rename(s.dirs[1] / "moved.bin")
        if kind == "symlink":
            path.symlink_to(s.dirs[1] / "moved.bin")
        elif kind == "fifo":
            os.mkfifo(path, 0o600)
        else:
            path.mkdir()
        s.touched.update(k for k, ext in s.extents.items() if any(e.dir_index == 1 for e in ext))

    return corrupt


def _zeros_everywhere(s: Scene) -> None:
    for d in s.dirs:
        path = d / "swapper-store.bin"
        _patch(path, 0, bytes(path.stat().st_size))
    s.touched.update(s.extents)


# id, corruption, detected (True: every touched key must fail) or harmless (False)
KINDS: list[tuple[str, Callable[[Scene], None], bool]] = [
    ("flip-first", _flip("a", 0, "first"), True),
    ("flip-middle", _flip("a", 1, "middle"), True),
    ("flip-last", _flip("a", 3, "last"), True),  # the short last chunk, next to its padding
    ("flip-last-full-chunk", _flip("d", 0, "last"), True),
    ("flip-single-extent", _flip("c", 0, "middle"), True),
    ("zeroed-page", _zero_page, True),
    ("swap-across-tensors", _swap(("a", 0), ("b", 0)), True),
    ("swap-within-tensor", _swap(("a", 0), ("a", 2)), True),
    ("swap-whole-tensors", _swap(("d", 0), ("a", 1)), True),
    ("every-extent", _every_extent, True),
    ("all-zero", _zeros_everywhere, True),
    ("padding", _padding, False),
    ("free-space", _free_space, False),
    ("truncated", _truncate, True),
    ("deleted", _delete, True),
    ("symlink", _replace("symlink"), True),
    ("fifo", _replace("fifo"), True),
    ("directory", _replace("dir"), True),
]

# File-level changes an open store does not see (it holds descriptors): harmless then.
_INVISIBLE_WHILE_OPEN = {"deleted", "symlink", "fifo", "directory"}


@dataclass
class Tally:
    correct: int = 0
    detected: int = 0
    silent_wrong: int = 0
    errors: list[BaseException] = field(default_factory=list)


def _read_all(
    store: NvmeStore, originals: dict[str, torch.Tensor], tally: Tally
) -> dict[str, bool]:
    """Read every key; True where a typed error came back."""
    failed = {}
    for key, want in originals.items():
        out = torch.full_like(want, 0x77)
        try:
            store.read(key, out).result(timeout=10)
        except SwapError as exc:
            tally.detected += 1
            tally.errors.append(exc)
            failed[key] = True
            continue
        if torch.equal(out, want):
            tally.correct += 1
        else:
            tally.silent_wrong += 1
        failed[key] = False
    return failed


@pytest.mark.parametrize("mode", ["open", "reopen"])
@pytest.mark.parametrize(("corrupt", "detected"), [pytest.param(c, d, id=i) for i, c, d in KINDS])
def test_corruption_is_detected_or_harmless(
    tmp_path: Path,
    engine: AioEngine,
    corrupt: Callable[[Scene], None],
    detected: bool,
    mode: str,
    request: pytest.FixtureRequest,
) -> None:
    kind = request.node.callspec.id.rsplit("-", 1)[0]
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    originals = _originals()
    store: NvmeStore | None = NvmeStore(dirs, engine, stripe_nbytes=STRIPE)
    try:
        for key, t in originals.items():
            store.write(key, t).result(timeout=10)
        scene = Scene(dirs, {k: store.info(k).extents for k in originals})
        assert (
            len(scene.extents["a"]) == 4
            and scene.extents["a"][0].dir_index != scene.extents["a"][1].dir_index
        )  # striped over both directories
        if mode == "reopen":
            store.close()
            store = None
        corrupt(scene)
        tally = Tally()
        if mode == "reopen":
            try:
                store = NvmeStore.open(dirs, engine)
            except SwapError as exc:  # the whole store refused, typed: nothing silent
                assert detected, f"{kind}: harmless corruption refused the store: {exc}"
                return
        assert store is not None
        failed = _read_all(store, originals, tally)
        assert tally.silent_wrong == 0, f"{kind}/{mode}: silent wrong tensors"
        if not detected or (mode == "open" and kind in _INVISIBLE_WHILE_OPEN):
            assert tally.detected == 0 and tally.correct == len(originals), tally.errors
        else:
            assert scene.touched and all(failed[k] for k in scene.touched), (failed, scene.touched)
            assert all(not failed[k] for k in set(originals) - scene.touched)
        for exc in tally.errors:
            if isinstance(exc, SwapCorruptionError):
                _check_corruption_error(exc, scene, originals)
    finally:
        if store is not None:
            store.close()


def _check_corruption_error(
    exc: SwapCorruptionError, scene: Scene, originals: dict[str, torch.Tensor]
) -> None:
    """The error names the key, the file, the offset and both digests, and they are true."""
    extents = scene.extents[exc.key]
    (e,) = [e for e in extents if e.offset == exc.offset and str(scene.data(e)) == exc.path]
    assert exc.nbytes == e.nbytes and exc.expected == e.checksum != exc.actual
    message = str(exc)
    for part in (
        f"key={exc.key!r}",
        exc.path,
        str(exc.offset),
        f"{exc.expected:#018x}",
        f"{exc.actual:#018x}",
    ):
        assert part in message, (part, message)
    start = sum(x.nbytes for x in extents[: extents.index(e)])
    want = originals[exc.key][start : start + e.nbytes]
    assert exc.expected == content_hash(want)  # the digest of the bytes written


def test_corrupted_key_stays_and_can_be_rewritten(tmp_path: Path, engine: AioEngine) -> None:
    with NvmeStore([tmp_path / "d"], engine, stripe_nbytes=STRIPE) as store:
        t = _originals()["a"]
        store.write("a", t).result()
        e = store.info("a").extents[2]
        _patch(tmp_path / "d" / "swapper-store.bin", e.offset + 7, b"\x00\x01\x02")
        for _ in range(2):  # every read fails the same way; the key is still there
            with pytest.raises(SwapCorruptionError) as info:
                store.read("a", torch.empty_like(t)).result()
            assert info.value.offset == e.offset and "a" in store
        with pytest.raises(ChecksumError):  # the old name catches it too
            store.verify("a")
        store.write("a", t).result()  # the caller decides: write it again from its copy
        out = torch.empty_like(t)
        store.read("a", out).result()
        assert torch.equal(out, t) and store.verify("a")


def test_verify_off_returns_what_the_disk_holds(tmp_path: Path, engine: AioEngine) -> None:
    """The documented switch: verify=False reads unchecked (store.verify still checks);
    checksum=False records nothing, so nothing can be checked."""
    dirs = [tmp_path / "d"]
    t = _originals()["a"]
    with NvmeStore(dirs, engine, stripe_nbytes=STRIPE) as store:
        store.write("a", t).result()
        e = store.info("a").extents[0]
    _patch(dirs[0] / "swapper-store.bin", e.offset, b"\xff\xfe")
    with NvmeStore.open(dirs, engine, verify=False) as store:
        assert not store.verify_reads
        out = torch.empty_like(t)
        store.read("a", out).result()  # no error: verification is off
        assert not torch.equal(out, t) and out[0] == 0xFF
        with pytest.raises(SwapCorruptionError):
            store.verify("a")
    with NvmeStore([tmp_path / "off"], engine, checksum=False) as store:
        store.write("a", t).result()
        assert all(e.checksum is None for e in store.info("a").extents)
        assert not store.verify_reads and store.verify("a") is False
        (e0,) = store.info("a").extents
        _patch(tmp_path / "off" / "swapper-store.bin", e0.offset, b"\x00")
        store.read("a", out).result()
        assert out[0] == 0


def test_padding_is_never_read(tmp_path: Path, engine: AioEngine, monkeypatch: pytest.MonkeyPatch):
    """Not only harmless: no read request reaches past an extent's last byte."""
    with NvmeStore([tmp_path / "d"], engine, stripe_nbytes=STRIPE) as store:
        store.write("c", _originals()["c"]).result()
        (e,) = store.info("c").extents
        spans = []
        real = engine.pread

        def pread(buffer, file, offset=0, nbytes=None):  # type: ignore[no-untyped-def]
            spans.append((offset, buffer.numel() if nbytes is None else nbytes))
            return real(buffer, file, offset, nbytes)

        monkeypatch.setattr(engine, "pread", pread)
        store.read("c", torch.empty(SIZES["c"], dtype=torch.uint8)).result()
        assert spans == [(e.offset, e.nbytes)] and e.nbytes < e.allocated_nbytes
