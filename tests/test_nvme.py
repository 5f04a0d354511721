"""Tests of tiers.nvme: round trips, striping, allocation, manifest, faults, bad input."""

from __future__ import annotations

import concurrent.futures
import errno
import gc
import itertools
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tiers.aio import AioEngine, IOFuture
from tiers.aio.engine import Op
from tiers.buffers import allocate
from tiers.config import AioConfig, Backend
from tiers.errors import SwapConfigError, SwapError, SwapIOError, SwapNoSpaceError
from tiers.extents import RangeAllocator
from tiers.nvme import (
    MANIFEST_VERSION,
    ChecksumError,
    ManifestError,
    NvmeStore,
    StoreClosedError,
    StoreExistsError,
    StoreKeyError,
    content_hash,
)
from tiers.nvme.journal import Journal
from tiers.nvme.placement import REGION_ALIGN_NBYTES

KiB = 1024
STRIPE = 64 * KiB
DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
]


@pytest.fixture(scope="module")
def engine() -> Iterator[AioEngine]:
    with AioEngine(AioConfig(num_threads=2, block_size=64 * KiB)) as e:
        yield e


def _dirs(root: Path, n: int) -> list[Path]:
    return [root / f"d{i}" for i in range(n)]


def _make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=g).to(
        dtype
    )


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _read(store: NvmeStore, key: str) -> torch.Tensor:
    info = store.info(key)
    out = torch.empty(info.shape, dtype=info.dtype)
    assert store.read(key, out).result(timeout=10) == info.nbytes
    return out


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- round trips --------------------------------------------------------------------------

_shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 9), min_size=1, max_size=3).map(tuple),
    st.lists(st.integers(1, 70), min_size=1, max_size=3).map(tuple),
    st.tuples(st.integers(8_000, 40_000)),  # 8 KB .. 320 KB: several stripes of 64 KiB
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    tensors=st.lists(st.tuples(st.sampled_from(DTYPES), _shapes), min_size=1, max_size=5),
    n_dirs=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31),
)
def test_round_trip_property(
    engine: AioEngine,
    tmp_path_factory: pytest.TempPathFactory,
    tensors: list[tuple[torch.dtype, tuple[int, ...]]],
    n_dirs: int,
    seed: int,
) -> None:
    root = tmp_path_factory.mktemp("rt")
    originals = {f"t{i}": _make(d, s, seed + i) for i, (d, s) in enumerate(tensors)}
    with NvmeStore(_dirs(root, n_dirs), engine, stripe_nbytes=STRIPE) as store:
        # All writes in flight at once, then all reads.
        futures = [store.write(k, t) for k, t in originals.items()]
        for f in futures:
            f.result(timeout=10)
        assert sorted(store.keys()) == sorted(originals)
        for key, original in originals.items():
            info = store.info(key)
            nbytes = original.numel() * original.element_size()
            assert (info.dtype, info.shape, info.nbytes) == (original.dtype, original.shape, nbytes)
            assert sum(e.nbytes for e in info.extents) == nbytes
            assert all(e.offset % 4096 == 0 for e in info.extents)
            if nbytes > STRIPE:
                assert len(info.extents) >= (2 if n_dirs == 2 else 1)
                if n_dirs == 2:
                    assert {e.dir_index for e in info.extents} == {0, 1}
                    assert all(e.nbytes <= STRIPE for e in info.extents)
            assert _same_bits(_read(store, key), original)
            assert store.verify(key)
        store.close(remove=True)


@pytest.mark.parametrize("backend", [Backend.AUTO, Backend.THREADS])
@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, STRIPE, 3 * STRIPE + 17])
def test_round_trip_sizes_and_backends(tmp_path: Path, backend: Backend, nbytes: int) -> None:
    with (
        AioEngine(AioConfig(backend=backend, block_size=16 * KiB, num_threads=2)) as engine,
        NvmeStore(_dirs(tmp_path, 2), engine, stripe_nbytes=STRIPE) as store,
    ):
        t = _make(torch.uint8, (nbytes,), nbytes)
        store.write("x", t).result()
        assert _same_bits(_read(store, "x"), t)
        # A staging buffer of another dtype/shape but the same byte count works too.
        if nbytes % 4 == 0:
            staging = torch.empty(nbytes // 4, dtype=torch.float32)
            store.read("x", staging).result()
            assert torch.equal(_bytes(staging), t)


def test_small_tensors_balance_over_dirs(tmp_path: Path, engine: AioEngine) -> None:
    with NvmeStore(_dirs(tmp_path, 2), engine, stripe_nbytes=STRIPE) as store:
        for i in range(6):
            store.write(f"k{i}", torch.zeros(1000)).result()
        used = [u.allocated_nbytes for u in store.dir_usage()]
        assert used[0] == used[1] == 3 * 4096


# -- overwrite, delete, allocation --------------------------------------------------------


def test_overwrite_same_and_different_size(tmp_path: Path, engine: AioEngine) -> None:
    with NvmeStore(_dirs(tmp_path, 2), engine, stripe_nbytes=STRIPE) as store:
        v1 = _make(torch.float32, (50_000,), 1)
        store.write("w", v1).result()
        before = store.info("w")
        allocated = sum(u.allocated_nbytes for u in store.dir_usage())

        v2 = _make(torch.float32, (50_000,), 2)
        store.write("w", v2).result()
        assert _same_bits(_read(store, "w"), v2)
        assert store.info("w").extents != before.extents  # copy on write...
        assert sum(u.allocated_nbytes for u in store.dir_usage()) == allocated  # ...old freed

        v3 = _make(torch.bfloat16, (3, 7), 3)
        store.write("w", v3).result()
        assert _same_bits(_read(store, "w"), v3)
        assert store.info("w").shape == (3, 7) and len(store) == 1
        assert sum(u.allocated_nbytes for u in store.dir_usage()) == 4096
        assert store.verify("w")


def test_delete_reuses_holes_and_coalesces(
    tmp_path: Path, engine: AioEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with NvmeStore([tmp_path / "d"], engine, stripe_nbytes=STRIPE) as store:
        for key in "abcd":
            store.write(key, torch.full((16 * KiB,), ord(key), dtype=torch.uint8)).result()
        file_nbytes = store.dir_usage()[0].file_nbytes
        assert file_nbytes == 4 * 16 * KiB
        b_offset = store.info("b").extents[0].offset

        store.delete("b")
        assert "b" not in store and len(store) == 3
        with pytest.raises(StoreKeyError, match="key='b'"):
            store.info("b")
        # b's extents are reused only once its delete is durable: hold the journal (the
        # committer waits in its append), so the delete cannot become durable while e0
        # is placed. (Without the hold, whether a commit ran first is timing.)
        gate = threading.Event()
        real_append = Journal.append

        def held_append(journal: Journal, payloads: list[bytes]) -> None:
            gate.wait(10)
            real_append(journal, payloads)

        monkeypatch.setattr(Journal, "append", held_append)
        e0 = store.write("e0", torch.ones(10 * KiB, dtype=torch.uint8))
        deadline = time.monotonic() + 10
        while "e0" not in store:  # committed (its data written), not yet durable
            assert time.monotonic() < deadline, "e0's data write never finished"
            time.sleep(0.002)
        assert not e0.done()  # its record waits behind the held journal
        assert store.info("e0").extents[0].offset == file_nbytes
        gate.set()
        monkeypatch.setattr(Journal, "append", real_append)
        e0.result(timeout=10)
        store.delete("e0")
        store.sync()
        store.write("e", torch.ones(10 * KiB, dtype=torch.uint8)).result()
        assert store.info("e").extents[0].offset == b_offset  # first fit: b's hole
        grown = file_nbytes + 12 * KiB  # e0's padded 10 KiB
        assert store.dir_usage()[0].file_nbytes == grown  # e did not grow the file

        # a (at 0) and e (b's old place) are adjacent once both go: one coalesced hole.
        store.delete("a")
        store.delete("e")
        store.sync()
        store.write("f", torch.ones(32 * KiB, dtype=torch.uint8)).result()
        assert store.info("f").extents[0].offset == 0
        assert store.dir_usage()[0].file_nbytes == grown
        for key in "cd":
            assert torch.equal(
                _read(store, key), torch.full((16 * KiB,), ord(key), dtype=torch.uint8)
            )
        with pytest.raises(StoreKeyError):
            store.delete("b")


def test_allocator_first_fit_coalescing_and_double_free() -> None:
    a = RangeAllocator()
    offsets = [a.allocate(4096) for _ in range(4)]
    assert offsets == [0, 4096, 8192, 12288] and a.end_nbytes == 16384
    a.free(4096, 4096)
    a.free(8192, 4096)
    assert a.holes == [(4096, 8192)]  # merged
    assert a.allocate(4096) == 4096  # first fit
    a.free(12288, 4096)  # merges with the hole before it, and that reaches the end:
    assert a.holes == [] and a.end_nbytes == 8192 and a.used_nbytes == 8192
    b = RangeAllocator.rebuild([(8192, 4096), (0, 4096)])
    assert b.holes == [(4096, 4096)] and b.end_nbytes == 12288 and b.used_nbytes == 8192
    with pytest.raises(ValueError, match="overlaps"):
        RangeAllocator.rebuild([(0, 8192), (4096, 4096)])


def test_allocator_aligned_leaves_the_skipped_space_free() -> None:
    a = RangeAllocator()
    assert a.allocate(4096) == 0
    mib = 1 << 20
    assert a.allocate(2 * mib, mib) == mib  # [4096, 1 MiB) skipped, left as a hole
    assert a.holes == [(4096, mib - 4096)] and a.end_nbytes == 3 * mib
    assert a.allocate(8192) == 4096  # a smaller one takes the skipped space
    a.free(4096, 8192)
    a.free(0, 4096)
    a.free(mib, 2 * mib)
    assert a.holes == [] and a.end_nbytes == 0 and a.used_nbytes == 0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 600), st.sampled_from([1, 2, 64, 256]), st.booleans()),
        max_size=40,
    )
)
def test_allocator_aligned_ranges_never_overlap(ops: list[tuple[int, int, bool]]) -> None:
    # sizes and alignments in 4 KiB pages; each op allocates, or frees the oldest range
    a = RangeAllocator()
    held: list[tuple[int, int]] = []
    for pages, align_pages, free in ops:
        if free and held:
            a.free(*held.pop(0))
            continue
        offset = a.allocate(pages * 4096, align_pages * 4096)
        assert offset % (align_pages * 4096) == 0
        held.append((offset, pages * 4096))
    spans = sorted(held)
    for (o1, n1), (o2, _) in itertools.pairwise(spans):
        assert o1 + n1 <= o2
    assert a.used_nbytes == sum(n for _, n in held)
    assert all(o + n <= a.end_nbytes for o, n in held)
    assert RangeAllocator.rebuild(held).used_nbytes == a.used_nbytes


def test_large_tensors_start_on_a_mib_boundary(tmp_path: Path, engine: AioEngine) -> None:
    # a small tensor first, so that a 4 KiB-aligned region would start unaligned
    with NvmeStore(_dirs(tmp_path, 1), engine) as store:
        store.write("small", torch.zeros(1000, dtype=torch.uint8)).result()
        big = torch.arange(3 * (1 << 20) // 4 + 5, dtype=torch.float32)
        store.write("big", big).result()
        assert all(e.offset % REGION_ALIGN_NBYTES == 0 for e in store.info("big").extents)
        assert _same_bits(_read(store, "big"), big)
        store.write("small2", torch.ones(5000, dtype=torch.uint8)).result()
        assert store.info("small2").extents[0].offset < REGION_ALIGN_NBYTES  # the gap reused


def test_allocator_double_free_detected() -> None:
    a = RangeAllocator()
    x = a.allocate(8192)
    a.allocate(4096)
    a.free(x, 8192)
    with pytest.raises(RuntimeError, match="not allocated"):
        a.free(x, 4096)
    with pytest.raises(RuntimeError, match="not allocated"):
        a.free(0, 1 << 20)  # beyond the end


def test_empty_and_zero_dim_tensors(tmp_path: Path, engine: AioEngine) -> None:
    with NvmeStore(_dirs(tmp_path, 2), engine) as store:
        empty = torch.empty(0, 5, dtype=torch.bfloat16)
        scalar = torch.tensor(3.5, dtype=torch.float64)
        assert store.write("empty", empty).result() == 0
        store.write("scalar", scalar).result()
        assert store.info("empty").extents == ()
        assert store.info("scalar").extents[0].checksum == content_hash(scalar)
        assert _same_bits(_read(store, "empty"), empty)
        assert _same_bits(_read(store, "scalar"), scalar)
        assert store.verify("empty") and store.verify("scalar")


# -- concurrency --------------------------------------------------------------------------


def test_concurrent_threads_on_different_keys(tmp_path: Path, engine: AioEngine) -> None:
    with NvmeStore(_dirs(tmp_path, 2), engine, stripe_nbytes=STRIPE) as store:
        final: dict[str, torch.Tensor] = {}

        def work(thread: int) -> None:
            for step in range(8):
                key = f"t{thread}.{step % 3}"
                t = _make(torch.float32, (1000 + 9000 * (step % 3),), thread * 100 + step)
                store.write(key, t).result()
                assert _same_bits(_read(store, key), t)
                final[key] = t
                if step % 4 == 3:
                    store.delete(key)
                    del final[key]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for f in [pool.submit(work, i) for i in range(4)]:
                f.result(timeout=60)
        assert sorted(store.keys()) == sorted(final)
        for key, t in final.items():
            assert _same_bits(_read(store, key), t) and store.verify(key)
        # A delete's extents are freed once it is durable (the next group commit): the
        # last deletes may still be waiting for theirs, so count after a sync.
        store.sync()
        expected = sum(-(-t.numel() * 4 // 4096) * 4096 for t in final.values())
        assert sum(u.allocated_nbytes for u in store.dir_usage()) == expected


class _Gate:
    """Replaces an engine method: requests are held until ``open()``, then really issued."""

    def __init__(self, real: Callable[..., IOFuture], hold: Callable[[int], bool]) -> None:
        self.real, self.hold = real, hold
        self.calls = 0
        self.event = threading.Event()
        self.threads: list[threading.Thread] = []

    def __call__(
        self, buffer: Any, file: Any, offset: int = 0, nbytes: int | None = None
    ) -> IOFuture:
        call = self.calls
        self.calls += 1
        if not self.hold(call):
            return self.real(buffer, file, offset, nbytes)
        proxy = IOFuture(Op.READ, str(file.path), offset, buffer.numel())

        def later() -> None:
            self.event.wait(10)
            try:
                proxy.set_result(self.real(buffer, file, offset, nbytes).result())
            except BaseException as exc:
                proxy.set_exception(exc)

        thread = threading.Thread(target=later, daemon=True)
        thread.start()
        self.threads.append(thread)
        return proxy


def test_later_write_of_a_key_wins_even_if_it_finishes_first(
    tmp_path: Path, engine: AioEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with NvmeStore([tmp_path / "d"], engine) as store:
        gate = _Gate(engine.pwrite, hold=lambda call: call == 0)
        monkeypatch.setattr(engine, "pwrite", gate)
        old = store.write("k", torch.full((1000,), 1.0))  # held at the gate
        new = store.write("k", torch.full((1000,), 2.0))
        new.result(timeout=10)
        assert not old.done()
        gate.event.set()
        old.result(timeout=10)  # succeeded, but superseded
        assert torch.equal(_read(store, "k"), torch.full((1000,), 2.0))
        assert store.dir_usage()[0].allocated_nbytes == 4096  # the old copy was freed

        # A delete between issue and completion wins over the write too.
        gate.event.clear()
        gate.hold = lambda call: True
        pending = store.write("k", torch.full((1000,), 3.0))
        store.delete("k")
        gate.event.set()
        pending.result(timeout=10)
        assert "k" not in store and store.dir_usage()[0].allocated_nbytes == 0


def test_read_in_flight_keeps_its_version_allocated(
    tmp_path: Path, engine: AioEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with NvmeStore([tmp_path / "d"], engine) as store:
        v1 = torch.full((4096,), 1, dtype=torch.uint8)
        store.write("k", v1).result()
        gate = _Gate(engine.pread, hold=lambda call: True)
        monkeypatch.setattr(engine, "pread", gate)
        out = torch.empty(4096, dtype=torch.uint8)
        reading = store.read("k", out)
        store.write("k", torch.full((4096,), 2, dtype=torch.uint8)).result()
        store.delete("k")
        # Without the pin, this would land in v1's freed hole before the read runs.
        store.write("j", torch.full((4096,), 3, dtype=torch.uint8)).result()
        gate.event.set()
        reading.result(timeout=10)
        assert torch.equal(out, v1)
        assert store.dir_usage()[0].allocated_nbytes == 4096  # v1 freed once the read ended


def _mapped(address: int) -> bool:
    """Whether ``address`` lies in one of this process's mappings."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if start <= address < end:
            return True
    return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_a_finished_request_keeps_no_memory_mapped(tmp_path: Path, engine: AioEngine) -> None:
    # The manager keeps each tensor's latest request (to name a stuck one); a read's
    # checks kept slices of its destination through the engine's done futures, so every
    # buffer a tensor was last read into stayed mapped after the tier gave it back (the
    # 2 B run's 22 GB of RSS after training). Writes must not keep their source either.
    nbytes = 4 * 64 * KiB + 4096  # several pieces
    with NvmeStore([tmp_path / "d"], engine) as store:
        source = allocate(nbytes, huge=False, pin=False)
        source.tensor.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        expected = source.tensor.clone()
        writing = store.write("k", source.tensor)
        writing.result(timeout=10)
        dest = allocate(nbytes, huge=False, pin=False)
        reading = store.read("k", dest.tensor)
        reading.result(timeout=10)
        assert torch.equal(dest.tensor, expected)
        addresses = (source.address, dest.address)
        source.close()
        dest.close()
        gc.collect()
        # the futures are still held, as the manager holds them; the memory is not
        assert writing.done() and reading.done()
        assert [_mapped(a) for a in addresses] == [False, False]


# -- manifest -----------------------------------------------------------------------------


def _reference_tensors() -> dict[str, torch.Tensor]:
    return {
        "model.layers.0.weight": _make(torch.bfloat16, (300, 257), 1),  # striped
        "model.layers.0.bias": _make(torch.float16, (257,), 2),
        "opt.exp_avg.0": _make(torch.float32, (40_000,), 3),  # striped
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": _make(torch.bool, (33,), 4),
        "codes": _make(torch.int8, (5, 5), 5),
        "empty": torch.empty(0, dtype=torch.float32),
        "ünïcode key/with spaces": _make(torch.float64, (3,), 6),
    }


_REOPEN_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from tiers.aio import AioEngine
    from tiers.nvme import NvmeStore

    dirs, expected_path = sys.argv[1:3], sys.argv[3]
    expected = torch.load(expected_path)
    with AioEngine() as engine, NvmeStore.open(dirs, engine) as store:
        assert sorted(store.keys()) == sorted(expected), (store.keys(), list(expected))
        for key, want in expected.items():
            info = store.info(key)
            out = torch.empty(info.shape, dtype=info.dtype)
            store.read(key, out).result()
            assert out.dtype == want.dtype and out.shape == want.shape, key
            assert torch.equal(out.reshape(-1).view(torch.uint8),
                               want.reshape(-1).view(torch.uint8)), key
            assert store.verify(key) is True, key
    print("REOPEN-OK", len(expected))
    """
)


def test_manifest_reopen_in_a_new_process(tmp_path: Path, engine: AioEngine) -> None:
    dirs = _dirs(tmp_path, 2)
    expected = _reference_tensors()
    with NvmeStore(dirs, engine, stripe_nbytes=STRIPE) as store:
        for f in [store.write(k, t) for k, t in expected.items()]:
            f.result()
        store.write("deleted", torch.ones(10)).result()
        store.delete("deleted")
        store.save_manifest()
        assert len(store.info("opt.exp_avg.0").extents) > 1
    manifest = json.loads((dirs[0] / "swapper-store.json").read_text())
    assert manifest["version"] == MANIFEST_VERSION and manifest["stripe_nbytes"] == STRIPE
    assert manifest["dirs"] == [str(d) for d in dirs]
    assert manifest["tensors"]["model.layers.0.weight"]["dtype"] == "bfloat16"
    torch.save(expected, tmp_path / "expected.pt")
    script = tmp_path / "reopen.py"
    script.write_text(_REOPEN_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), *map(str, dirs), str(tmp_path / "expected.pt")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"REOPEN-OK {len(expected)}" in proc.stdout


def test_reopened_store_keeps_free_list_and_writes_on(tmp_path: Path, engine: AioEngine) -> None:
    dirs = _dirs(tmp_path, 2)
    with NvmeStore(dirs, engine, stripe_nbytes=STRIPE, checksum=False) as store:
        for key in "abc":
            store.write(key, torch.full((20_000,), float(ord(key)))).result()
        store.delete("b")
        store.save_manifest()
        usage = [(u.allocated_nbytes, u.end_nbytes) for u in store.dir_usage()]
    with NvmeStore.open(dirs, engine) as store:
        assert store.stripe_nbytes == STRIPE and store.checksum is False
        assert [(u.allocated_nbytes, u.end_nbytes) for u in store.dir_usage()] == usage
        assert store.verify("a") is False  # no checksum recorded
        store.write("d", torch.zeros(20_000)).result()  # goes into b's holes
        assert [u.end_nbytes for u in store.dir_usage()] == [end for _, end in usage]
        assert torch.equal(_read(store, "c"), torch.full((20_000,), float(ord("c"))))


def test_manifest_replace_failure_leaves_old_manifest_and_no_temp(
    tmp_path: Path, engine: AioEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    dirs = _dirs(tmp_path, 1)
    files = [
        "swapper-store.bin",
        "swapper-store.journal",
        "swapper-store.json",
        "swapper-store.lock",
    ]
    store = NvmeStore(dirs, engine)
    store.write("a", torch.arange(100.0)).result()
    store.save_manifest()
    old_text = store.manifest_path.read_text()
    store.write("b", torch.arange(50.0)).result()

    def crash(src: object, dst: object) -> None:
        raise OSError(errno.EIO, "simulated crash before rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(SwapIOError, match="manifest"):
        store.save_manifest()
    monkeypatch.undo()
    assert store.manifest_path.read_text() == old_text
    assert sorted(p.name for p in dirs[0].iterdir()) == files  # no temporary file left
    store.write("c", torch.arange(20.0)).result()  # the store still writes...
    store.close()  # ...and nothing the failed save held back is lost: the journal has it
    with NvmeStore.open(dirs, engine) as store:
        assert store.keys() == ["a", "b", "c"]
        assert torch.equal(_read(store, "b"), torch.arange(50.0))
        store.save_manifest()  # and saving works again
        assert sorted(p.name for p in dirs[0].iterdir()) == files
        for name in files:
            assert stat.S_IMODE(os.stat(dirs[0] / name).st_mode) == 0o600, name


def test_every_completed_write_is_found_without_a_save(tmp_path: Path, engine: AioEngine) -> None:
    """The manifest is not what makes writes durable: closing without save_manifest (as a
    crash would) reopens to the last completed write of every key, and the versions it
    superseded are freed as soon as that is durable."""
    dirs = _dirs(tmp_path, 1)
    v = {i: _make(torch.float32, (10_000,), i) for i in range(1, 5)}
    with NvmeStore(dirs, engine) as store:
        store.write("k", v[1]).result()
        store.save_manifest()
        store.write("k", v[2]).result()
        store.write("other", v[3]).result()
        store.delete("other")
        store.write("other", v[4]).result()
        assert store.dir_usage()[0].allocated_nbytes == 2 * 40960  # superseded ones freed
    with NvmeStore.open(dirs, engine) as store:
        assert store.keys() == ["k", "other"]
        assert _same_bits(_read(store, "k"), v[2]) and _same_bits(_read(store, "other"), v[4])
        assert store.verify("k") and store.verify("other")
        assert store.dir_usage()[0].allocated_nbytes == 2 * 40960


def test_open_errors(tmp_path: Path, engine: AioEngine) -> None:
    dirs = _dirs(tmp_path, 2)
    with pytest.raises(ManifestError, match="no store"):
        NvmeStore.open(dirs, engine)
    assert not dirs[0].exists()  # open creates nothing
    with NvmeStore(dirs, engine) as store:
        store.write("a", torch.ones(10)).result()
        store.save_manifest()
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(ManifestError, match="same directories in the same order"):
        NvmeStore.open([dirs[0], tmp_path / "elsewhere"], engine)
    with pytest.raises(ManifestError):
        NvmeStore.open([dirs[0]], engine)
    # A new store over an existing one is refused, not overwritten.
    with pytest.raises(StoreExistsError, match=r"NvmeStore\.open"):
        NvmeStore(dirs, engine)
    manifest = dirs[0] / "swapper-store.json"
    good = manifest.read_text()
    document = json.loads(good)
    document["version"] = 99
    manifest.write_text(json.dumps(document))
    with pytest.raises(ManifestError, match="version 99"):
        NvmeStore.open(dirs, engine)
    document = json.loads(good)
    document["tensors"]["a"]["extents"][0]["offset"] = 1 << 30
    manifest.write_text(json.dumps(document))
    with pytest.raises(ManifestError, match="which has only"):
        NvmeStore.open(dirs, engine)
    document = json.loads(good)
    document["tensors"]["a"]["dtype"] = "float99"
    manifest.write_text(json.dumps(document))
    with pytest.raises(ManifestError, match="float99"):
        NvmeStore.open(dirs, engine)
    manifest.write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        NvmeStore.open(dirs, engine)
    assert list((tmp_path / "elsewhere").iterdir()) == []  # failed opens leave nothing


def test_checksum_mismatch_is_reported(tmp_path: Path, engine: AioEngine) -> None:
    with NvmeStore([tmp_path / "d"], engine) as store:
        store.write("k", torch.arange(2048, dtype=torch.int32)).result()
        extent = store.info("k").extents[0]
        fd = os.open(tmp_path / "d" / "swapper-store.bin", os.O_WRONLY)
        try:
            os.pwrite(fd, b"\xff" * 16, extent.offset + 100)
            os.fsync(fd)
        finally:
            os.close(fd)
        with pytest.raises(ChecksumError, match="key='k'") as info:
            store.verify("k")
        assert info.value.key == "k" and info.value.expected != info.value.actual


# -- faults -------------------------------------------------------------------------------


def _failing_pwrite(
    real: Callable[..., IOFuture], fail: Callable[[int], bool]
) -> Callable[..., IOFuture]:
    calls = [0]

    def pwrite(buffer: Any, file: Any, offset: int = 0, nbytes: int | None = None) -> IOFuture:
        call = calls[0]
        calls[0] += 1
        if not fail(call):
            return real(buffer, file, offset, nbytes)
        future = IOFuture(Op.WRITE, str(file.path), offset, buffer.numel())
        future.set_exception(
            SwapIOError(errno.EIO, f"write at offset {offset} failed: injected", str(file.path))
        )
        return future

    return pwrite


@pytest.mark.parametrize("failing_piece", [0, 1, "all"])
def test_failed_pwrite_keeps_old_data_and_names_key_and_path(
    tmp_path: Path, engine: AioEngine, monkeypatch: pytest.MonkeyPatch, failing_piece: int | str
) -> None:
    with NvmeStore(_dirs(tmp_path, 2), engine, stripe_nbytes=STRIPE) as store:
        old = _make(torch.bfloat16, (100_000,), 1)
        store.write("layer.w", old).result()
        before = store.info("layer.w")
        usage = [u.allocated_nbytes for u in store.dir_usage()]
        fail = (
            (lambda call: True) if failing_piece == "all" else (lambda call: call == failing_piece)
        )
        monkeypatch.setattr(engine, "pwrite", _failing_pwrite(engine.pwrite, fail))
        new = _make(torch.bfloat16, (100_000,), 2)
        future = store.write("layer.w", new)
        with pytest.raises(SwapIOError) as info:
            future.result(timeout=10)
        message = str(info.value)
        assert "key='layer.w'" in message and "injected" in message
        assert "swapper-store.bin" in message and info.value.errno == errno.EIO
        assert isinstance(info.value.__cause__, SwapIOError)
        monkeypatch.undo()
        assert store.info("layer.w") == before
        assert [u.allocated_nbytes for u in store.dir_usage()] == usage  # new extents freed
        assert _same_bits(_read(store, "layer.w"), old) and store.verify("layer.w")
        # a new key that fails is not there at all
        monkeypatch.setattr(engine, "pwrite", _failing_pwrite(engine.pwrite, lambda c: True))
        with pytest.raises(SwapIOError, match="key='fresh'"):
            store.write("fresh", torch.ones(10)).result(timeout=10)
        monkeypatch.undo()
        assert "fresh" not in store
        store.write("layer.w", new).result()  # and a retry works
        assert _same_bits(_read(store, "layer.w"), new)


def test_failure_while_issuing_waits_and_undoes(
    tmp_path: Path, engine: AioEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine refusing the second piece at submit time (here: closed) raises at once."""
    with NvmeStore(_dirs(tmp_path, 2), engine, stripe_nbytes=STRIPE) as store:
        store.write("k", torch.zeros(50_000)).result()
        usage = [u.allocated_nbytes for u in store.dir_usage()]
        real = engine.pwrite
        calls = [0]

        def refuse_second(*args: Any, **kwargs: Any) -> IOFuture:
            calls[0] += 1
            if calls[0] == 2:
                raise SwapIOError(errno.EBADF, "injected submit failure", "somewhere")
            return real(*args, **kwargs)

        monkeypatch.setattr(engine, "pwrite", refuse_second)
        with pytest.raises(SwapIOError, match=r"key='k'.*injected submit failure"):
            store.write("k", torch.ones(50_000))
        monkeypatch.undo()
        assert [u.allocated_nbytes for u in store.dir_usage()] == usage
        assert torch.equal(_read(store, "k"), torch.zeros(50_000))


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_no_space_raises_at_once_and_keeps_old_data(small_tmpfs: Path, engine: AioEngine) -> None:
    with NvmeStore([small_tmpfs / "swap"], engine) as store:
        old = _make(torch.float32, (64 * KiB,), 1)  # 256 KiB
        store.write("k", old).result()
        usage = store.dir_usage()[0]
        with pytest.raises(SwapNoSpaceError) as info:
            store.write("k", torch.zeros(512 * KiB))  # 2 MiB > 1 MiB filesystem
        assert "key='k'" in str(info.value) and "swapper-store.bin" in str(info.value)
        assert isinstance(info.value, SwapError)
        after = store.dir_usage()[0]
        assert (after.allocated_nbytes, after.end_nbytes) == (
            usage.allocated_nbytes,
            usage.end_nbytes,
        )
        assert _same_bits(_read(store, "k"), old) and store.verify("k")
        store.write("small", torch.ones(1000)).result()  # the store still works
        store.close(remove=True)
    assert os.listdir(small_tmpfs) == []


# -- bad input, files, fds ----------------------------------------------------------------


def test_bad_tensors_name_the_key(tmp_path: Path, engine: AioEngine) -> None:
    with NvmeStore([tmp_path / "d"], engine) as store:
        with pytest.raises(ValueError, match=r"key='nc'.*not contiguous"):
            store.write("nc", torch.zeros(4, 5).T)
        with pytest.raises(TypeError, match=r"key='dev'.*meta"):
            store.write("dev", torch.zeros(4, device="meta"))
        with pytest.raises(TypeError, match=r"key='str'.*torch.Tensor"):
            store.write("str", "cuda:0")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="key"):
            store.write("", torch.zeros(1))
        with pytest.raises(TypeError, match="key"):
            store.write(123, torch.zeros(1))  # type: ignore[arg-type]
        assert len(store) == 0 and store.dir_usage()[0].allocated_nbytes == 0

        store.write("k", torch.zeros(6, 4, dtype=torch.bfloat16)).result()
        with pytest.raises(ValueError) as info:
            store.read("k", torch.empty(5, 4, dtype=torch.bfloat16))
        message = str(info.value)
        assert "key='k'" in message and "(5, 4)" in message and "(6, 4)" in message
        assert "bfloat16" in message
        with pytest.raises(ValueError, match="float32"):
            store.read("k", torch.empty(24, dtype=torch.float32))
        with pytest.raises(ValueError, match="not contiguous"):
            store.read("k", torch.empty(4, 6, dtype=torch.bfloat16).T)
        with pytest.raises(TypeError, match="meta"):
            store.read("k", torch.empty(6, 4, dtype=torch.bfloat16, device="meta"))
        with pytest.raises(StoreKeyError, match="key='missing'"):
            store.read("missing", torch.empty(1))
        with pytest.raises(StoreKeyError):
            store.verify("missing")
        assert "missing" not in store and 42 not in store


def test_bad_constructor_arguments(tmp_path: Path, engine: AioEngine) -> None:
    with pytest.raises(SwapConfigError, match="stripe_nbytes"):
        NvmeStore([tmp_path / "a"], engine, stripe_nbytes=1000)
    with pytest.raises(SwapConfigError, match="empty"):
        NvmeStore([], engine)
    with pytest.raises(SwapConfigError, match="twice"):
        NvmeStore([tmp_path / "a", tmp_path / "a"], engine)
    with pytest.raises(SwapConfigError, match="single path"):
        NvmeStore(str(tmp_path / "a"), engine)
    with pytest.raises(SwapConfigError, match="name"):
        NvmeStore([tmp_path / "a"], engine, name="../escape")
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    with pytest.raises(SwapIOError, match="symbolic link"):
        NvmeStore([tmp_path / "real", tmp_path / "alias"], engine)
    assert list((tmp_path / "real").iterdir()) == []  # nothing left behind
    assert not (tmp_path / "a").exists()


def test_modes_names_and_remove(tmp_path: Path, engine: AioEngine) -> None:
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o755)
    (existing / "someone-elses.txt").write_text("keep me")
    fresh = tmp_path / "new" / "swap"
    store = NvmeStore([existing, fresh], engine, name="rank0")
    store.write("k", torch.ones(100_000)).result()
    store.save_manifest()
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    for path in (
        existing / "rank0.bin",
        fresh / "rank0.bin",
        existing / "rank0.json",
        existing / "rank0.journal",
        existing / "rank0.lock",
        fresh / "rank0.lock",
    ):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    # Another store with another name shares the directories.
    with NvmeStore([existing, fresh], engine, name="rank1") as other:
        other.write("k", torch.zeros(10)).result()
        other.close(remove=True)
    assert not (existing / "rank1.bin").exists()
    store.close()
    store.close()  # idempotent
    assert (existing / "rank0.bin").exists() and (existing / "rank0.json").exists()
    with pytest.raises(StoreClosedError):
        store.write("k", torch.ones(1))
    with pytest.raises(StoreClosedError):
        store.read("k", torch.ones(100_000))
    with pytest.raises(StoreClosedError):
        store.save_manifest()
    store.close(remove=True)
    assert sorted(p.name for p in existing.iterdir()) == ["someone-elses.txt"]
    assert not fresh.exists()  # created by the store, empty: removed
    assert (tmp_path / "new").exists()  # a parent it did not name: kept


def test_no_leaked_fds(tmp_path: Path, engine: AioEngine) -> None:
    dirs = _dirs(tmp_path, 2)
    before = _fd_count()
    with NvmeStore(dirs, engine, stripe_nbytes=STRIPE) as store:
        store.write("a", torch.ones(50_000)).result()
        store.read("a", torch.empty(50_000)).result()
        store.verify("a")
        store.save_manifest()
    assert _fd_count() == before
    with NvmeStore.open(dirs, engine) as store:
        store.read("a", torch.empty(50_000)).result()
    assert _fd_count() == before
    with pytest.raises(StoreExistsError):
        NvmeStore(dirs, engine)
    (dirs[1] / "swapper-store.bin").unlink()
    with pytest.raises(ManifestError, match="missing"):
        NvmeStore.open(dirs, engine)
    assert _fd_count() == before


def test_store_future_and_close_waits(
    tmp_path: Path, engine: AioEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = NvmeStore([tmp_path / "d"], engine)
    gate = _Gate(engine.pwrite, hold=lambda call: True)
    monkeypatch.setattr(engine, "pwrite", gate)
    future = store.write("k", torch.ones(1000))
    assert not future.done() and not future.cancel()
    assert "key='k'" in repr(future) and "pending" in repr(future)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # close waits for the write in flight
    with pytest.raises(StoreClosedError):
        store.write("j", torch.ones(1))  # closing: no new requests
    gate.event.set()
    closer.join(10)
    assert not closer.is_alive()
    assert future.result() == 4000 and future.done()


class StoreMachine(RuleBasedStateMachine):
    """Random writes, overwrites, deletes, syncs, saves and reopens against a dict model:
    every key reads back bit-exact, live extents never overlap, and the only space held
    beyond the live extents is that of deletes not known to be durable yet."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="nvme-machine-"))
        self.dirs = _dirs(self.root, 2)
        self.engine = AioEngine(AioConfig(num_threads=2, block_size=16 * KiB))
        self.store = NvmeStore(self.dirs, self.engine, stripe_nbytes=16 * KiB)
        self.model: dict[str, torch.Tensor] = {}
        self.undurable_nbytes = 0  # extents of deletes whose record is not yet durable
        self.seed = 0

    @rule(key=st.sampled_from("abcdef"), n=st.integers(0, 40_000), dtype=st.sampled_from(DTYPES))
    def write(self, key: str, n: int, dtype: torch.dtype) -> None:
        self.seed += 1
        t = _make(dtype, (n // torch.empty(0, dtype=dtype).element_size(),), self.seed)
        self.store.write(key, t).result(timeout=10)
        self.model[key] = t
        self.undurable_nbytes = 0  # the write's commit made earlier deletes durable

    @rule(key=st.sampled_from("abcdef"))
    def delete(self, key: str) -> None:
        if key in self.model:
            self.undurable_nbytes += sum(e.allocated_nbytes for e in self.store.info(key).extents)
            self.store.delete(key)
            del self.model[key]
        else:
            with pytest.raises(StoreKeyError):
                self.store.delete(key)

    @rule()
    def sync(self) -> None:
        self.store.sync()
        self.undurable_nbytes = 0

    @rule()
    def save(self) -> None:
        self.store.save_manifest()
        self.undurable_nbytes = 0

    @rule()
    def close_and_reopen(self) -> None:
        self.store.close()
        self.store = NvmeStore.open(self.dirs, self.engine)
        self.undurable_nbytes = 0

    @invariant()
    def consistent(self) -> None:
        assert sorted(self.store.keys()) == sorted(self.model)
        for key, t in self.model.items():
            assert _same_bits(_read(self.store, key), t), key
        intervals: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
        for key in self.store:
            for e in self.store.info(key).extents:
                intervals[e.dir_index].append((e.offset, e.offset + e.allocated_nbytes))
        for spans in intervals.values():
            spans.sort()
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
        live = sum(e - s for spans in intervals.values() for s, e in spans)
        allocated = sum(u.allocated_nbytes for u in self.store.dir_usage())
        # A delete's record is committed in the background: its extents may be free already.
        assert live <= allocated <= live + self.undurable_nbytes

    def teardown(self) -> None:
        try:
            self.store.close(remove=True)
            self.engine.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(
    max_examples=15,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
