"""tiers.aio: the engine (AioEngine, IOFuture), backend choice, and the cffi thin layer.

Every test waits with ``result(timeout=TIMEOUT)`` / ``exception(timeout=TIMEOUT)``, so a
hung request fails the test instead of blocking the run. Round trips are checked twice:
the file's bytes are compared with an independent ``os.pread`` after the engine's write,
and the engine's read is compared with the source, so a symmetric mistake (both
directions at the same wrong offset) cannot pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import gc
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import tiers.aio.backend as backend_mod
import tiers.aio.engine as engine_mod
import tiers.aio.worker as worker_mod
from tiers import files
from tiers.aio import AioEngine, IOFuture, Op, probe_backend, resolve_backend
from tiers.aio._native import IOCB_CMD_PREAD, IOCB_CMD_PWRITE, KernelAio, LibAio, ffi
from tiers.config import AioConfig, Backend
from tiers.errors import (
    BackendUnavailableError,
    EngineClosedError,
    EngineCloseTimeout,
    InvalidArgumentError,
    SwapEOFError,
    SwapError,
    SwapIOError,
    SwapNoSpaceError,
)
from tiers.files import SwapFile, direct_refused

#: Seconds one request may take before the test calls it a hang.
TIMEOUT = 60.0
KiB, MiB = 1 << 10, 1 << 20
ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)
NATIVE = (Backend.LIBAIO, Backend.KERNEL)
E = TypeVar("E", bound=BaseException)


# ------------------------------------------------------------------------------------------
# Buffers of every kind the engine takes, at a chosen distance from a 4 KiB boundary.

_ITEMSIZE = {
    "bytearray": 1,
    "memoryview": 1,
    "np_u8": 1,
    "np_f32": 4,
    "np_f64": 8,
    "torch_u8": 1,
    "torch_bf16": 2,
    "torch_f16": 2,
    "torch_f32": 4,
    "torch_i64": 8,
}
BUFFER_KINDS = list(_ITEMSIZE)
_TORCH_DTYPES = {
    "torch_u8": torch.uint8,
    "torch_bf16": torch.bfloat16,
    "torch_f16": torch.float16,
    "torch_f32": torch.float32,
    "torch_i64": torch.int64,
}


@dataclass
class Buf:
    obj: Any  #: what the engine gets
    u8: np.ndarray  #: the same memory as uint8, for filling and comparing
    nbytes: int

    @property
    def address(self) -> int:
        return int(self.u8.ctypes.data)


def make_buffer(kind: str, nbytes: int, phase: int = 0) -> Buf:
    """A ``kind`` buffer of ``nbytes`` (rounded up to its item size) whose address lies
    ``phase`` bytes past a 4 KiB boundary (``bytearray`` takes what Python gives it)."""
    itemsize = _ITEMSIZE[kind]
    n = -(-nbytes // itemsize) * itemsize
    if kind == "bytearray":
        ba = bytearray(n)
        return Buf(ba, np.frombuffer(ba, np.uint8), n)
    if kind == "memoryview":
        ba = bytearray(n + 2 * ALIGN)
        whole = np.frombuffer(ba, np.uint8)
        start = (-whole.ctypes.data) % ALIGN + phase
        return Buf(memoryview(ba)[start : start + n], whole[start : start + n], n)
    raw = np.empty(n + 2 * ALIGN, np.uint8)
    start = (-raw.ctypes.data) % ALIGN + phase
    u8 = raw[start : start + n]
    assert u8.ctypes.data % ALIGN == phase
    if kind == "np_u8":
        obj: Any = u8
    elif kind == "np_f32":
        obj = u8.view(np.float32)
    elif kind == "np_f64":
        obj = u8.view(np.float64)
    else:
        obj = torch.from_numpy(u8).view(_TORCH_DTYPES[kind])
    return Buf(obj, u8, n)


def fill_random(u8: np.ndarray, seed: int) -> None:
    if u8.size:
        u8[:] = np.frombuffer(np.random.default_rng(seed).bytes(u8.size), np.uint8)


def random_bytes(n: int, seed: int) -> np.ndarray:
    out = np.empty(n, np.uint8)
    fill_random(out, seed)
    return out


def assert_same(got: np.ndarray, want: np.ndarray, what: str = "data") -> None:
    """Bit-exact comparison that reports where, never a megabyte-long diff."""
    assert got.shape == want.shape, f"{what}: {got.shape} != {want.shape}"
    if not np.array_equal(got, want):
        bad = np.flatnonzero(got != want)
        pytest.fail(
            f"{what}: {bad.size} of {want.size} bytes differ, first at {bad[0]}, last at {bad[-1]}"
        )


def file_bytes(path: Path, offset: int, nbytes: int) -> np.ndarray:
    """The file's bytes, read with plain buffered os.pread (independent of the engine)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        done = 0
        while done < nbytes:
            chunk = os.pread(fd, min(nbytes - done, 16 * MiB), offset + done)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
    finally:
        os.close(fd)
    return np.frombuffer(b"".join(chunks), np.uint8)


def raised(exc_type: type[E], fn: Callable[..., Any], *args: Any) -> E:
    """``fn(*args)`` must raise ``exc_type`` at once; returns it without tracebacks.

    Not ``with pytest.raises(...) as info``: that keeps the traceback, with the engine's
    frames, in a reference cycle with the test's frame; when those frames held a buffer
    exported to cffi, collecting the cycle crashed CPython, and a regression of that
    (test_error_kept_in_a_cycle_does_not_crash) must not take the whole session down.
    """
    try:
        fn(*args)
    except exc_type as exc:
        chained: BaseException | None = exc
        while chained is not None:  # the causes' tracebacks reach the engine's frames too
            chained.__traceback__ = None
            chained = chained.__cause__ or chained.__context__
        return exc
    pytest.fail(f"{fn.__name__} did not raise {exc_type.__name__}")


def write_file(path: Path, data: np.ndarray | bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(bytes(data))


# ------------------------------------------------------------------------------------------
# Engines shared by a module: creating contexts per example would dominate the run time.


class Engines:
    def __init__(self) -> None:
        self._engines: dict[tuple, AioEngine] = {}

    def get(self, backend: Backend, **settings_: Any) -> AioEngine:
        key = (backend, *sorted(settings_.items()))
        if key not in self._engines:
            self._engines[key] = AioEngine(AioConfig(backend=backend, **settings_))
        return self._engines[key]

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close(timeout_s=TIMEOUT)


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    cache = Engines()
    try:
        yield cache
    finally:
        cache.close()


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("aio")


@pytest.fixture
def fresh_direct_refusals(monkeypatch: pytest.MonkeyPatch) -> set[tuple[str, str]]:
    refused: set[tuple[str, str]] = set()
    monkeypatch.setattr(files, "_direct_refused", refused)
    return refused


def roundtrip(
    engine: AioEngine,
    target: SwapFile | Path,
    path: Path,
    offset: int,
    nbytes: int,
    *,
    seed: int,
    kind: str = "np_u8",
    src_phase: int = 0,
    dst_phase: int = 0,
) -> None:
    """pwrite random bytes at ``offset``, check the file independently, pread them back."""
    src = make_buffer(kind, nbytes, src_phase)
    fill_random(src.u8, seed)
    dst = make_buffer(kind, nbytes, dst_phase)
    np.invert(src.u8, out=dst.u8)  # every byte differs from what the read must deliver
    assert engine.pwrite(src.obj, target, offset).result(TIMEOUT) == src.nbytes
    assert_same(file_bytes(path, offset, src.nbytes), src.u8, "file after pwrite")
    assert engine.pread(dst.obj, target, offset).result(TIMEOUT) == src.nbytes
    assert_same(dst.u8, src.u8, "buffer after pread")


# ------------------------------------------------------------------------------------------
# Property: round trips of any size, offset, buffer kind and alignment, for every backend.

#: 1 B .. 64 MiB, about log-uniform: each power of two is as likely as any other.
SIZES = st.integers(0, 26).flatmap(lambda e: st.integers(max(1, (1 << e) >> 1), 1 << e))
OFFSETS = st.one_of(
    st.just(0),
    st.integers(0, 64).map(lambda k: k * ALIGN),  # aligned
    st.integers(0, 1 << 22),  # anywhere in the first 4 MiB
    st.integers(0, 1 << 28),  # far in
)
PHASES = st.one_of(st.just(0), st.integers(1, ALIGN - 1))


@pytest.mark.parametrize("threads", [1, 2, 4], ids=lambda t: f"t{t}")
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@example(  # the largest size, unaligned everywhere, into a SwapFile
    nbytes=64 * MiB,
    offset=4095,
    kind="torch_bf16",
    src_phase=2,
    dst_phase=6,
    via_path=False,
    seed=1,
)
@example(
    nbytes=1, offset=123_457, kind="bytearray", src_phase=0, dst_phase=0, via_path=True, seed=2
)
@example(  # aligned everywhere: the whole request may go O_DIRECT
    nbytes=8 * MiB, offset=ALIGN * 3, kind="np_u8", src_phase=0, dst_phase=0, via_path=True, seed=3
)
@given(
    nbytes=SIZES,
    offset=OFFSETS,
    kind=st.sampled_from(BUFFER_KINDS),
    src_phase=PHASES,
    dst_phase=PHASES,
    via_path=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_property(
    engines: Engines,
    module_dir: Path,
    backend: Backend,
    direct: bool,
    threads: int,
    nbytes: int,
    offset: int,
    kind: str,
    src_phase: int,
    dst_phase: int,
    via_path: bool,
    seed: int,
) -> None:
    engine = engines.get(backend, direct=direct, num_threads=threads, queue_depth=8)
    path = module_dir / f"rt-{backend.value}-{direct}-{threads}.bin"
    path.unlink(missing_ok=True)
    swap_file = None if via_path else engine.open(path, create=True)
    try:
        if swap_file is not None and direct:
            assert swap_file.direct_fd is not None
        target = path if swap_file is None else swap_file
        roundtrip(
            engine, target, path, offset, nbytes,
            seed=seed, kind=kind, src_phase=src_phase, dst_phase=dst_phase,
        )  # fmt: skip
        n = -(-nbytes // _ITEMSIZE[kind]) * _ITEMSIZE[kind]
        assert path.stat().st_size == offset + n
        lead = min(offset, ALIGN)
        assert not file_bytes(path, offset - lead, lead).any(), "bytes before the write"
    finally:
        if swap_file is not None:
            swap_file.close()
        path.unlink(missing_ok=True)
    assert engine.pending() == []


# ------------------------------------------------------------------------------------------
# Small blocks: one request becomes many pieces, several requests share one file.

SMALL = [
    {"block_size": 4096, "queue_depth": 2, "num_threads": 1},
    {"block_size": 8192, "queue_depth": 2, "num_threads": 3},
]
SMALL_IDS = ["bs4k-qd2-t1", "bs8k-qd2-t3"]


@pytest.fixture(params=SMALL, ids=SMALL_IDS)
def small(request: pytest.FixtureRequest) -> dict[str, int]:
    return request.param


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize(
    ("offset", "nbytes", "phase"),
    [(0, 300 * KiB, 0), (12345, 300 * KiB + 7, 12345 % ALIGN), (4096 * 3, 77777, 5), (1, 1, 1)],
    ids=["aligned", "same-phase", "mixed", "one-byte"],
)
def test_small_blocks_round_trip(
    engines: Engines,
    swap_dir: Path,
    backend: Backend,
    small: dict[str, int],
    direct: bool,
    offset: int,
    nbytes: int,
    phase: int,
) -> None:
    engine = engines.get(backend, direct=direct, **small)
    path = swap_dir / "x.bin"
    roundtrip(engine, path, path, offset, nbytes, seed=offset, src_phase=phase, dst_phase=phase)
    with engine.open(path) as f:
        roundtrip(engine, f, path, offset, nbytes, seed=offset + 1, src_phase=phase)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_writes_leaving_holes(
    engines: Engines, swap_dir: Path, backend: Backend, small: dict[str, int], direct: bool
) -> None:
    engine = engines.get(backend, direct=direct, **small)
    path = swap_dir / "holes.bin"
    a, b = random_bytes(10_000, 1), random_bytes(20_000, 2)
    a_at, b_at = 5_000, MiB + 123
    with engine.open(path, create=True) as f:
        futures = [engine.pwrite(b, f, b_at), engine.pwrite(a, f, a_at)]
        assert [fut.result(TIMEOUT) for fut in futures] == [20_000, 10_000]
        size = b_at + b.size
        assert f.size() == size
        expected = np.zeros(size, np.uint8)
        expected[a_at : a_at + a.size] = a
        expected[b_at : b_at + b.size] = b
        whole = make_buffer("np_u8", size)
        whole.u8[:] = 0xEE
        assert engine.pread(whole.obj, f).result(TIMEOUT) == size
    assert_same(whole.u8, expected, "file with holes")
    assert_same(file_bytes(path, 0, size), expected, "file with holes (os.pread)")


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_overwrite_in_the_middle(
    engines: Engines, swap_dir: Path, backend: Backend, small: dict[str, int], direct: bool
) -> None:
    engine = engines.get(backend, direct=direct, **small)
    path = swap_dir / "mid.bin"
    first = random_bytes(256 * KiB, 3)
    patch = random_bytes(50_000, 4)
    at = 70_001
    with engine.open(path, create=True) as f:
        assert engine.pwrite(first, f).result(TIMEOUT) == first.size
        assert engine.pwrite(patch, f, at).result(TIMEOUT) == patch.size
        assert f.size() == first.size, "an overwrite inside the file must not grow it"
        back = make_buffer("np_u8", first.size, 0)
        assert engine.pread(back.obj, f).result(TIMEOUT) == first.size
    expected = first.copy()
    expected[at : at + patch.size] = patch
    assert_same(back.u8, expected)
    assert_same(file_bytes(path, 0, first.size), expected, "os.pread")


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_many_requests_in_flight_on_one_file(
    engines: Engines, swap_dir: Path, backend: Backend, small: dict[str, int], direct: bool
) -> None:
    """Regions next to each other (sharing 4 KiB pages), in flight together."""
    engine = engines.get(backend, direct=direct, **small)
    rng = np.random.default_rng(5)
    lengths = [int(x) for x in rng.integers(1, 40_000, 24)]
    lengths[::5] = [ALIGN * 4] * len(lengths[::5])
    offsets = np.concatenate([[7], 7 + np.cumsum(lengths)[:-1]]).tolist()
    total = offsets[-1] + lengths[-1]
    data = random_bytes(total, 6)
    path = swap_dir / "many.bin"
    with engine.open(path, create=True) as f:
        srcs = [make_buffer("np_u8", n, i * 97 % ALIGN) for i, n in enumerate(lengths)]
        for buf, off in zip(srcs, offsets, strict=True):
            buf.u8[:] = data[off : off + buf.nbytes]
        writes = [engine.pwrite(b.obj, f, off) for b, off in zip(srcs, offsets, strict=True)]
        assert [w.result(TIMEOUT) for w in writes] == lengths
        assert_same(file_bytes(path, 7, total - 7), data[7:], "file")
        dsts = [make_buffer("np_u8", n, i * 13 % ALIGN) for i, n in enumerate(lengths)]
        reads = [engine.pread(b.obj, f, off) for b, off in zip(dsts, offsets, strict=True)]
        assert [r.result(TIMEOUT) for r in reads] == lengths
    for buf, off in zip(dsts, offsets, strict=True):
        assert_same(buf.u8, data[off : off + buf.nbytes], f"region at {off}")


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_reads_and_writes_mixed_in_flight(
    engines: Engines, swap_dir: Path, backend: Backend, small: dict[str, int], direct: bool
) -> None:
    engine = engines.get(backend, direct=direct, **small)
    path = swap_dir / "mixed.bin"
    old = random_bytes(512 * KiB, 7)
    new = random_bytes(512 * KiB, 8)
    write_file(path, old)
    with engine.open(path) as f:
        back = make_buffer("np_u8", old.size, 0)
        futs = [engine.pread(back.obj, f, 0), engine.pwrite(new, f, old.size)]
        assert [x.result(TIMEOUT) for x in futs] == [old.size, new.size]
    assert_same(back.u8, old)
    assert_same(file_bytes(path, 0, 2 * old.size), np.concatenate([old, new]))


def test_direct_descriptor_used_for_aligned_pieces(
    engines: Engines, swap_dir: Path, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """'direct on' really goes through O_DIRECT where the piece allows, and only there."""
    routed: list[tuple[bool, int, int, int]] = []
    real_route = worker_mod._route

    def spy(piece: Any) -> None:
        real_route(piece)
        flags = fcntl.fcntl(piece.fd, fcntl.F_GETFL)
        assert bool(flags & O_DIRECT) == piece.direct
        routed.append((piece.direct, piece.address, piece.offset, piece.nbytes))

    monkeypatch.setattr(worker_mod, "_route", spy)
    engine = engines.get(backend, direct=True, block_size=64 * KiB, queue_depth=4, num_threads=1)
    path = swap_dir / "x.bin"
    cases = [(8192, 256 * KiB, 0), (100, 200_000, 100), (100, 200_000, 200)]
    for offset, nbytes, phase in cases:
        routed.clear()
        roundtrip(engine, path, path, offset, nbytes, seed=9, src_phase=phase, dst_phase=phase)
        assert routed
        for is_direct, address, off, n in routed:
            aligned = not ((address | off | n) % ALIGN)
            assert is_direct == aligned, (is_direct, address % ALIGN, off, n)
        if phase == offset % ALIGN:
            assert any(d for d, *_ in routed), "the aligned body must go direct"
        else:
            assert not any(d for d, *_ in routed)


# ------------------------------------------------------------------------------------------
# Concurrency: several Python threads on one engine.


def test_python_threads_share_an_engine(engines: Engines, swap_dir: Path, backend: Backend) -> None:
    engine = engines.get(backend, direct=True, num_threads=2, block_size=64 * KiB, queue_depth=4)
    n_threads, region = 8, 512 * KiB
    shared_path = swap_dir / "shared.bin"
    shared = engine.open(shared_path, create=True)
    shared.reserve(n_threads * region)
    barrier = threading.Barrier(n_threads)
    errors: list[BaseException] = []
    last: dict[int, tuple[int, np.ndarray]] = {}

    def work(i: int) -> None:
        try:
            rng = np.random.default_rng(100 + i)
            own = swap_dir / f"own-{i}.bin"
            barrier.wait(TIMEOUT)
            for r in range(4):
                n = int(rng.integers(1, region // 2))
                off = i * region + int(rng.integers(0, region - n))
                kind = BUFFER_KINDS[(i + r) % len(BUFFER_KINDS)]
                phase = int(rng.integers(0, ALIGN))
                src = make_buffer(kind, n, phase)
                fill_random(src.u8, i * 10 + r)
                dst = make_buffer(kind, n, int(rng.integers(0, ALIGN)))
                np.invert(src.u8, out=dst.u8)
                assert engine.pwrite(src.obj, shared, off).result(TIMEOUT) == src.nbytes
                assert engine.pread(dst.obj, shared, off).result(TIMEOUT) == src.nbytes
                assert_same(dst.u8, src.u8, f"thread {i} round {r} (shared)")
                last[i] = (off, src.u8.copy())
                own_off = int(rng.integers(0, 3 * MiB))
                roundtrip(engine, own, own, own_off, n, seed=i * 1000 + r, kind=kind)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    try:
        for t in workers:
            t.start()
        for t in workers:
            t.join(4 * TIMEOUT)
        assert not any(t.is_alive() for t in workers), "a thread hung"
    finally:
        shared.close()
    if errors:
        raise errors[0]
    for off, data in last.values():
        assert_same(file_bytes(shared_path, off, data.size), data, f"region at {off}")


# ------------------------------------------------------------------------------------------
# Errors: clear, at once or through the future, never a hang.


def test_missing_file(engines: Engines, swap_dir: Path, backend: Backend) -> None:
    engine = engines.get(backend, direct=True)
    buf = np.zeros(4096, np.uint8)
    with pytest.raises(FileNotFoundError):
        engine.pread(buf, swap_dir / "missing.bin")
    assert not (swap_dir / "missing.bin").exists()
    with pytest.raises(FileNotFoundError):
        engine.pwrite(buf, swap_dir / "no-such-dir" / "x.bin")
    assert engine.pending() == []


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("via_path", [True, False], ids=["path", "swapfile"])
def test_read_past_eof(
    engines: Engines, swap_dir: Path, backend: Backend, direct: bool, via_path: bool
) -> None:
    engine = engines.get(backend, direct=direct, num_threads=2)
    path = swap_dir / "short.bin"
    write_file(path, random_bytes(6000, 1))
    f = None if via_path else engine.open(path)
    target = path if f is None else f
    try:
        # wholly beyond the end
        exc = engine.pread(np.zeros(4096, np.uint8), target, MiB).exception(TIMEOUT)
        assert isinstance(exc, SwapEOFError)
        assert isinstance(exc, SwapIOError)
        assert exc.filename == str(path)
        assert "offset 1048576" in str(exc)
        assert "file is 6000 bytes" in str(exc)
        # starts inside, runs past the end
        buf = make_buffer("np_u8", 8192, 0)
        exc = engine.pread(buf.obj, target, 0).exception(TIMEOUT)
        assert isinstance(exc, SwapEOFError)
        assert exc.filename == str(path)
        assert "2192 bytes missing at offset 6000" in str(exc)
        with pytest.raises(SwapEOFError):
            engine.pread(buf.obj, target, 100).result(TIMEOUT)
        # many pieces over several workers, most of them beyond the end
        big = make_buffer("np_u8", 3 * MiB, 0)
        exc = engine.pread(big.obj, target, 4096).exception(TIMEOUT)
        assert isinstance(exc, SwapEOFError)
        assert exc.filename == str(path)
        # exactly up to the end is fine, and the engine still works
        ok = make_buffer("np_u8", 6000, 0)
        assert engine.pread(ok.obj, target, 0).result(TIMEOUT) == 6000
        assert_same(ok.u8, random_bytes(6000, 1))
    finally:
        if f is not None:
            f.close()
    assert engine.pending() == []


def test_symlink_refused(engines: Engines, swap_dir: Path, backend: Backend) -> None:
    engine = engines.get(backend, direct=True)
    target = swap_dir / "target.bin"
    write_file(target, b"precious")
    link = swap_dir / "link.bin"
    link.symlink_to(target)
    dangling = swap_dir / "dangling.bin"
    dangling.symlink_to(swap_dir / "created.bin")
    for path in (link, dangling):
        exc = raised(SwapIOError, engine.pwrite, np.ones(4096, np.uint8), path)
        assert exc.errno == errno.ELOOP
        assert exc.filename == str(path)
    exc = raised(SwapIOError, engine.pread, np.zeros(8, np.uint8), link)
    assert exc.errno == errno.ELOOP
    assert target.read_bytes() == b"precious"
    assert not (swap_dir / "created.bin").exists()
    assert engine.pending() == []


_UNPRIVILEGED = r"""
import os, sys
import numpy as np
from tiers import AioConfig, AioEngine, SwapIOError

# Everything that reads files under root's home (python, libraries) happens first.
engine = AioEngine(AioConfig(backend=sys.argv[2]))
os.chdir(sys.argv[1])  # relative paths from here: the parents of tmp_path are root's
os.setgroups([])
os.setgid(65534)
os.setuid(65534)  # glibc applies it to every thread of the process
assert not os.access(".", os.W_OK)
try:
    engine.pwrite(np.zeros(16, np.uint8), "x.bin").result(30)
except SwapIOError as exc:
    print("SwapIOError", exc.errno, exc.filename)
except BaseException as exc:
    print("other", type(exc).__name__, exc)
else:
    print("no-error")
finally:
    engine.close()
print("exists", os.path.exists("x.bin"))
"""


def test_unwritable_directory(swap_dir: Path, backend: Backend) -> None:
    """chmod 0500: root bypasses the check, so as root the request runs as 'nobody'."""
    ro_dir = swap_dir / "ro"
    ro_dir.mkdir()
    if os.geteuid() == 0:
        os.chown(ro_dir, 65534, 65534)
        ro_dir.chmod(0o500)
        res = subprocess.run(
            [sys.executable, "-c", _UNPRIVILEGED, str(ro_dir), backend.value],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        assert res.returncode == 0, res.stderr
        lines = res.stdout.split("\n")
        assert lines[0] == f"SwapIOError {errno.EACCES} x.bin", res.stdout + res.stderr
        assert lines[1] == "exists False"
        return
    ro_dir.chmod(0o500)
    try:
        if os.access(ro_dir, os.W_OK):
            pytest.skip("this user can write to a 0500 directory (capabilities)")
        with AioEngine(AioConfig(backend=backend)) as engine:
            exc = raised(SwapIOError, engine.pwrite, np.zeros(16, np.uint8), ro_dir / "x.bin")
        assert exc.errno == errno.EACCES
        assert exc.filename == str(ro_dir / "x.bin")
    finally:
        ro_dir.chmod(0o700)


def test_readonly_filesystem(
    engines: Engines,
    backend: Backend,
    mount_tmpfs: Callable[..., Path | None],
    remount_readonly: Callable[[Path], bool],
) -> None:
    mnt = mount_tmpfs("rofs", "1m")
    if mnt is None:
        pytest.skip("cannot mount a tmpfs here (needs root); see test_unwritable_directory")
    existing = mnt / "existing.bin"
    write_file(existing, b"\x01" * 4096)
    if not remount_readonly(mnt):
        pytest.skip("cannot remount the tmpfs read-only")
    engine = engines.get(backend, direct=True)
    for path in (mnt / "new.bin", existing):
        exc = raised(SwapIOError, engine.pwrite, np.zeros(4096, np.uint8), path)
        assert exc.errno == errno.EROFS
        assert exc.filename == str(path)
    assert not (mnt / "new.bin").exists()
    assert existing.read_bytes() == b"\x01" * 4096
    assert engine.pending() == []


def _check_no_space(engine: AioEngine, path: Path, target: SwapFile | Path) -> None:
    first = random_bytes(256 * KiB, 11)
    assert engine.pwrite(first, target).result(TIMEOUT) == first.size
    size = path.stat().st_size
    exc = raised(SwapNoSpaceError, engine.pwrite, np.ones(4 * MiB, np.uint8), target, first.size)
    assert exc.errno == errno.ENOSPC
    assert exc.filename == str(path)
    assert f"{4 * MiB} bytes at offset {first.size}" in str(exc)
    assert path.stat().st_size == size, "the file must not be left grown"
    assert engine.pending() == []
    back = np.zeros(first.size, np.uint8)
    assert engine.pread(back, target).result(TIMEOUT) == first.size
    assert_same(back, first, "data written before ENOSPC")


@pytest.mark.parametrize("via_path", [True, False], ids=["path", "swapfile"])
def test_no_space_on_small_tmpfs(
    engines: Engines,
    backend: Backend,
    via_path: bool,
    mount_tmpfs: Callable[..., Path | None],
    fd_count: Callable[[], int],
) -> None:
    mnt = mount_tmpfs("small", "1m")
    if mnt is None:
        pytest.skip("cannot mount a tmpfs here (needs root); see test_no_space_fault_injected")
    engine = engines.get(backend, direct=True)
    path = mnt / "x.bin"
    before = fd_count()
    if via_path:
        _check_no_space(engine, path, path)
    else:
        with engine.open(path, create=True) as f:
            _check_no_space(engine, path, f)
    assert fd_count() == before


def test_no_space_fault_injected(
    engines: Engines, swap_dir: Path, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.posix_fallocate

    def enospc_beyond_1mib(fd: int, offset: int, length: int) -> None:
        if offset + length > MiB:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, length)

    monkeypatch.setattr(files.os, "posix_fallocate", enospc_beyond_1mib)
    engine = engines.get(backend, direct=True)
    path = swap_dir / "x.bin"
    _check_no_space(engine, path, path)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_no_space_while_writing(
    engines: Engines,
    backend: Backend,
    direct: bool,
    mount_tmpfs: Callable[..., Path | None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where space cannot be reserved first, ENOSPC from the write itself fails the future."""
    mnt = mount_tmpfs("nofalloc", "1m")
    if mnt is None:
        pytest.skip("cannot mount a tmpfs here (needs root)")

    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(files.os, "posix_fallocate", unsupported)
    engine = engines.get(backend, direct=direct, block_size=256 * KiB)
    exc = engine.pwrite(np.ones(2 * MiB, np.uint8), mnt / "x.bin").exception(TIMEOUT)
    assert isinstance(exc, SwapIOError)
    assert exc.errno == errno.ENOSPC
    assert exc.filename == str(mnt / "x.bin")
    assert engine.pending() == []


# -- close ---------------------------------------------------------------------------------


def test_close_waits_for_requests_in_flight(swap_dir: Path, backend: Backend) -> None:
    engine = AioEngine(AioConfig(backend=backend, num_threads=2, block_size=256 * KiB))
    datas = [random_bytes(2 * MiB, i) for i in range(6)]
    write_file(swap_dir / "r.bin", datas[0])
    back = make_buffer("np_u8", 2 * MiB, 0)
    futures = [engine.pwrite(d, swap_dir / f"w{i}.bin") for i, d in enumerate(datas)]
    futures.append(engine.pread(back.obj, swap_dir / "r.bin"))
    engine.close()
    assert all(f.done() for f in futures)
    assert [f.result(0) for f in futures] == [2 * MiB] * 7
    assert engine.pending() == []
    for i, d in enumerate(datas):
        assert_same(file_bytes(swap_dir / f"w{i}.bin", 0, d.size), d, f"w{i}")
    assert_same(back.u8, datas[0])
    with pytest.raises(EngineClosedError):
        engine.pread(back.obj, swap_dir / "r.bin")
    with pytest.raises(EngineClosedError):
        engine.pwrite(back.obj, swap_dir / "after-close.bin")
    assert not (swap_dir / "after-close.bin").exists()
    engine.close()  # idempotent
    assert "closed" in repr(engine)


def test_context_manager(swap_dir: Path, backend: Backend) -> None:
    with AioEngine(AioConfig(backend=backend)) as engine:
        assert engine.backend is backend
        assert "open" in repr(engine)
        fut = engine.pwrite(np.ones(MiB, np.uint8), swap_dir / "x.bin")
    assert fut.done()
    with pytest.raises(EngineClosedError):
        engine.pwrite(np.ones(8, np.uint8), swap_dir / "x.bin")


@pytest.fixture
def gated_preadv(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """The thread backend's reads wait until the returned event is set (a slow disk)."""
    gate = threading.Event()
    real = os.preadv

    def slow_preadv(fd: int, buffers: Any, offset: int, *args: Any) -> int:
        gate.wait(TIMEOUT)
        return real(fd, buffers, offset, *args)

    monkeypatch.setattr(os, "preadv", slow_preadv)
    try:
        yield gate
    finally:
        gate.set()


def test_close_timeout_names_unfinished(swap_dir: Path, gated_preadv: threading.Event) -> None:
    path = swap_dir / "x.bin"
    write_file(path, random_bytes(8192, 1))
    engine = AioEngine(AioConfig(backend=Backend.THREADS, direct=False))
    buf = make_buffer("np_u8", 8192, 0)
    fut = engine.pread(buf.obj, path, 0)
    assert engine.pending() == [fut]
    t0 = time.monotonic()
    with pytest.raises(EngineCloseTimeout) as info:
        engine.close(timeout_s=0.1)
    assert time.monotonic() - t0 < 5
    unfinished = info.value.unfinished
    assert unfinished == [f"read of 8192 bytes at offset 0 of {path}"]
    assert str(path) in str(info.value)
    assert isinstance(info.value, TimeoutError)
    assert not fut.done()
    with pytest.raises(EngineClosedError):
        engine.pread(buf.obj, path)
    gated_preadv.set()
    engine.close(timeout_s=TIMEOUT)
    assert fut.result(0) == 8192
    assert_same(buf.u8, random_bytes(8192, 1))
    assert engine.pending() == []


def test_close_blocks_until_requests_finish(swap_dir: Path, gated_preadv: threading.Event) -> None:
    path = swap_dir / "x.bin"
    write_file(path, random_bytes(4096, 1))
    engine = AioEngine(AioConfig(backend=Backend.THREADS, direct=False))
    fut = engine.pread(np.zeros(4096, np.uint8), path)
    closer = threading.Thread(target=engine.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive(), "close() returned with a request in flight"
    assert not fut.done()
    gated_preadv.set()
    closer.join(TIMEOUT)
    assert not closer.is_alive()
    assert fut.result(0) == 4096


def test_close_from_two_threads_at_once(
    swap_dir: Path,
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """close() is idempotent, also when two threads close while a request is in flight
    (regression: both used to stop the workers, and io_destroy failed with EINVAL)."""
    gate = threading.Event()
    cls = engine_mod._ThreadContext if backend is Backend.THREADS else engine_mod._NativeContext
    real_reap = cls.reap

    def slow_reap(self: Any, timeout_s: float) -> list[Any]:
        if not gate.is_set():  # a slow disk: nothing completes until the gate opens
            time.sleep(timeout_s)
            return []
        return real_reap(self, timeout_s)

    monkeypatch.setattr(cls, "reap", slow_reap)
    engine = AioEngine(AioConfig(backend=backend, num_threads=2))
    fut = engine.pwrite(np.ones(2 * MiB, np.uint8), swap_dir / "x.bin")
    errors: list[BaseException] = []

    def closer() -> None:
        try:
            engine.close(timeout_s=TIMEOUT)
        except BaseException as exc:
            errors.append(exc)

    closers = [threading.Thread(target=closer) for _ in range(2)]
    for t in closers:
        t.start()
    # Open the gate once both closers wait inside close() (the engine's idle condition).
    waiters = getattr(getattr(engine, "_idle", None), "_waiters", None)
    deadline = time.monotonic() + TIMEOUT
    while waiters is not None and len(waiters) < 2:
        assert time.monotonic() < deadline, "the closers never started waiting"
        time.sleep(0.01)
    if waiters is None:  # the engine's internals changed: give the closers time instead
        time.sleep(0.5)
    gate.set()
    for t in closers:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in closers)
    assert fut.result(0) == 2 * MiB
    assert errors == []


def test_swap_file_closed_under_a_request(
    swap_dir: Path, backend: Backend, monkeypatch: pytest.MonkeyPatch, fd_count: Callable[[], int]
) -> None:
    """Closing a SwapFile while a request still has pieces to submit keeps its descriptors
    until the request ends: closed at once, their numbers went to the next file opened,
    and the rest of the request was written into that file."""
    gate = threading.Event()
    cls = engine_mod._ThreadContext if backend is Backend.THREADS else engine_mod._NativeContext
    real_reap = cls.reap

    def slow_reap(self: Any, timeout_s: float) -> list[Any]:
        if not gate.is_set():  # the first piece stays in flight, the others wait for it
            time.sleep(timeout_s)
            return []
        return real_reap(self, timeout_s)

    monkeypatch.setattr(cls, "reap", slow_reap)
    config = AioConfig(backend=backend, queue_depth=1, block_size=64 * KiB)
    before = fd_count()
    with AioEngine(config) as engine:
        f = engine.open(swap_dir / "f.bin", create=True)
        f_fds = {f.fd, f.direct_fd}
        data = random_bytes(256 * KiB, 1)
        fut = engine.pwrite(data, f, 0)
        f.close()
        assert all(fd_is_open(fd) for fd in f_fds if fd is not None), "closed under a request"
        g = engine.open(swap_dir / "g.bin", create=True)
        assert not {g.fd, g.direct_fd} & f_fds
        exc = raised(SwapIOError, engine.pread, np.zeros(10, np.uint8), f)
        assert exc.errno == errno.EBADF
        assert "closed" in str(exc)
        gate.set()
        assert fut.result(TIMEOUT) == 256 * KiB
        assert not any(fd_is_open(fd) for fd in f_fds if fd is not None)
        assert_same(file_bytes(swap_dir / "f.bin", 0, 256 * KiB), data)
        assert (swap_dir / "g.bin").stat().st_size == 0
        g.close()
        raised(SwapIOError, engine.pwrite, data, g, 0)  # closed, nothing in flight
        raised(SwapIOError, g.reserve, 1)
        raised(SwapIOError, g.size)
        check_engine_works(engine, swap_dir, seed=1)
    assert fd_count() == before


def fd_is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


# -- O_DIRECT refused ----------------------------------------------------------------------


def test_direct_refused_at_open(
    tmp_path: Path,
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_direct_refusals: set[tuple[str, str]],
) -> None:
    caplog.set_level(logging.WARNING, logger="swapper.tiers.files")
    real_open = os.open

    def no_direct(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), os.fspath(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(files.os, "open", no_direct)
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    d1.mkdir()
    d2.mkdir()
    with AioEngine(AioConfig(backend=backend, direct=True, block_size=64 * KiB)) as engine:
        for i, path in enumerate([d1 / "a.bin", d1 / "b.bin", d2 / "c.bin"]):
            roundtrip(engine, path, path, ALIGN * i, 200 * KiB, seed=i)
        with engine.open(d1 / "a.bin") as f:
            assert f.direct_fd is None
            roundtrip(engine, f, d1 / "a.bin", 0, 300 * KiB, seed=7)
    warnings = [r.getMessage() for r in caplog.records if "O_DIRECT refused" in r.getMessage()]
    assert len(warnings) == 2, warnings  # once per directory
    assert str(d1) in warnings[0]
    assert str(d2) in warnings[1]
    assert direct_refused(d1)
    assert direct_refused(d2)


@dataclass
class EinvalInjector:
    """Fails chosen transfers with EINVAL, as a filesystem or device refusing them would.

    ``refuse(direct, offset)`` says which: ``direct`` tells whether the transfer went to
    the O_DIRECT descriptor. ``seen`` records ``(direct, offset)`` of every transfer,
    ``injected`` those failed.
    """

    refuse: Callable[[bool, int], bool] = lambda direct, offset: False
    seen: list[tuple[bool, int]] = dataclasses.field(default_factory=list)
    injected: list[tuple[bool, int]] = dataclasses.field(default_factory=list)

    def __call__(self, direct: bool, offset: int) -> bool:
        self.seen.append((direct, offset))
        if self.refuse(direct, offset):
            self.injected.append((direct, offset))
            return True
        return False


@pytest.fixture
def einval(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> EinvalInjector:
    """An :class:`EinvalInjector` hooked where ``backend`` sees a transfer end."""
    injector = EinvalInjector()
    if backend is Backend.THREADS:

        def refusing(real: Callable[..., int]) -> Callable[..., int]:
            def call(fd: int, buffers: Any, offset: int, *args: Any) -> int:
                if injector(bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT), offset):
                    raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
                return real(fd, buffers, offset, *args)

            return call

        monkeypatch.setattr(os, "preadv", refusing(os.preadv))
        monkeypatch.setattr(os, "pwritev", refusing(os.pwritev))
    else:
        real_reap = engine_mod._NativeContext.reap

        def reap(self: Any, timeout_s: float) -> list[Any]:
            return [
                (piece, -errno.EINVAL if injector(piece.direct, piece.offset) else res)
                for piece, res in real_reap(self, timeout_s)
            ]

        monkeypatch.setattr(engine_mod._NativeContext, "reap", reap)
    return injector


def _fallback_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if "O_DIRECT refused" in r.getMessage() and r.levelno >= logging.WARNING
    ]


def test_einval_from_aligned_direct_io(
    swap_dir: Path,
    backend: Backend,
    einval: EinvalInjector,
    caplog: pytest.LogCaptureFixture,
    fresh_direct_refusals: set[tuple[str, str]],
) -> None:
    """A file whose O_DIRECT transfers all fail with EINVAL (O_DIRECT opens but does not
    work there) is retried buffered and gives up O_DIRECT: that file only."""
    caplog.set_level(logging.WARNING, logger="swapper.tiers.files")
    path = swap_dir / "x.bin"
    einval.refuse = lambda direct, offset: direct
    with AioEngine(AioConfig(backend=backend, direct=True, block_size=64 * KiB)) as engine:
        f = engine.open(path, create=True)
        try:
            assert f.direct_fd is not None
            roundtrip(engine, f, path, 0, 512 * KiB, seed=1)
            assert einval.injected, "no aligned piece was sent to the O_DIRECT descriptor"
            assert f.direct_fd is None
            einval.seen.clear()
            roundtrip(engine, f, path, ALIGN, 256 * KiB, seed=2)
            assert einval.seen and not any(d for d, _ in einval.seen), "the file stays buffered"
        finally:
            f.close()
        # Another file in the same directory is not affected: it tries O_DIRECT, and gives
        # it up for itself when it fails there too.
        einval.refuse = lambda direct, offset: False
        other = swap_dir / "y.bin"
        with engine.open(other, create=True) as g:
            assert g.direct_fd is not None
            einval.seen.clear()
            roundtrip(engine, g, other, 0, 256 * KiB, seed=3)
            assert any(d for d, _ in einval.seen), "the other file must still go direct"
            assert g.direct_fd is not None
    assert direct_refused(swap_dir)  # reported, while it steers nothing
    warnings = _fallback_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert str(path) in warnings[0]
    assert "EINVAL" in warnings[0]


def test_einval_for_one_request_keeps_o_direct(
    swap_dir: Path,
    backend: Backend,
    einval: EinvalInjector,
    caplog: pytest.LogCaptureFixture,
    fresh_direct_refusals: set[tuple[str, str]],
) -> None:
    """Once O_DIRECT has worked on a file, an EINVAL on one request's aligned transfer is
    that request's: it goes buffered, and the file's other requests keep O_DIRECT."""
    caplog.set_level(logging.DEBUG, logger="swapper.tiers.files")
    path = swap_dir / "x.bin"
    bad_lo, bad_hi = 256 * KiB, 320 * KiB
    with AioEngine(AioConfig(backend=backend, direct=True, block_size=64 * KiB)) as engine:
        f = engine.open(path, create=True)
        try:
            roundtrip(engine, f, path, 0, 128 * KiB, seed=1)
            assert f.direct_worked
            einval.refuse = lambda direct, offset: direct and bad_lo <= offset < bad_hi
            roundtrip(engine, f, path, bad_lo - 64 * KiB, 192 * KiB, seed=2)
            assert {d for d, _ in einval.injected} == {True}
            assert f.direct_fd is not None, "one request's EINVAL turned O_DIRECT off"
            # The refused pieces were retried buffered; their neighbours went direct.
            retried = {o for d, o in einval.seen if not d}
            assert retried and all(bad_lo <= o < bad_hi for o in retried)
            einval.seen.clear()
            einval.injected.clear()
            roundtrip(engine, f, path, 1 * MiB, 128 * KiB, seed=3)
            assert einval.seen and all(d for d, _ in einval.seen), "later requests go direct"
        finally:
            f.close()
        with engine.open(swap_dir / "y.bin", create=True) as g:
            assert g.direct_fd is not None
    assert _fallback_warnings(caplog) == []
    assert not direct_refused(swap_dir)


def test_einval_that_is_not_o_direct_fails_the_request(
    swap_dir: Path,
    backend: Backend,
    einval: EinvalInjector,
    fresh_direct_refusals: set[tuple[str, str]],
) -> None:
    """EINVAL on the buffered retry too: the request fails, and O_DIRECT is kept."""
    path = swap_dir / "x.bin"
    write_file(path, random_bytes(256 * KiB, 1))
    einval.refuse = lambda direct, offset: offset == 64 * KiB
    config = AioConfig(backend=backend, direct=True, block_size=64 * KiB)
    with AioEngine(config) as engine, engine.open(path) as f:
        buf = make_buffer("np_u8", 256 * KiB)
        exc = engine.pread(buf.obj, f, 0).exception(TIMEOUT)
        assert isinstance(exc, SwapIOError)
        assert exc.errno == errno.EINVAL
        assert exc.filename == str(path)
        assert einval.injected == [(True, 64 * KiB), (False, 64 * KiB)]
        assert f.direct_fd is not None
        einval.refuse = lambda direct, offset: False
        roundtrip(engine, f, path, 0, 256 * KiB, seed=2)
    assert not direct_refused(swap_dir)


# -- construction --------------------------------------------------------------------------


def test_named_backend_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*args: Any) -> None:
        raise OSError(errno.ENOENT, "libaio.so.1: cannot open shared object file")

    monkeypatch.setattr(backend_mod, "LibAio", missing)
    with pytest.raises(BackendUnavailableError) as info:
        AioEngine(AioConfig(backend=Backend.LIBAIO))
    assert "'libaio' unavailable" in str(info.value)
    assert "apt-get install libaio1" in str(info.value)
    monkeypatch.setattr(backend_mod, "KernelAio", missing)
    with pytest.raises(BackendUnavailableError, match=r"'kernel' unavailable.*'threads'"):
        AioEngine(AioConfig(backend=Backend.KERNEL))
    assert probe_backend(Backend.THREADS) == (None, "asked for")


def test_failed_construction_is_undone(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    cls = engine_mod._ThreadContext if backend is Backend.THREADS else engine_mod._NativeContext
    real_init, real_close = cls.__init__, cls.close
    made: list[Any] = []
    closed: list[Any] = []

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if len(made) == 2:
            raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        real_init(self, *args, **kwargs)
        made.append(self)

    def close(self: Any) -> None:
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(cls, "__init__", init)
    monkeypatch.setattr(cls, "close", close)
    threads_before = {t.name for t in threading.enumerate()}
    with pytest.raises(BackendUnavailableError, match="aio-max-nr"):
        AioEngine(AioConfig(backend=backend, num_threads=4))
    assert closed == made
    leftover = {t.name for t in threading.enumerate()} - threads_before
    assert not [n for n in leftover if n.startswith("swapper-aio")]


# -- descriptors ---------------------------------------------------------------------------


def test_no_descriptor_leaks(
    swap_dir: Path,
    backend: Backend,
    fd_count: Callable[[], int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    link = swap_dir / "link.bin"
    link.symlink_to(swap_dir / "elsewhere.bin")
    real_fallocate = os.posix_fallocate

    def enospc_beyond_8mib(fd: int, offset: int, length: int) -> None:
        if offset + length > 8 * MiB:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fallocate(fd, offset, length)

    monkeypatch.setattr(files.os, "posix_fallocate", enospc_beyond_8mib)

    def cycle(i: int) -> None:
        with AioEngine(AioConfig(backend=backend, num_threads=2, block_size=64 * KiB)) as engine:
            path = swap_dir / f"p{i}.bin"
            roundtrip(engine, path, path, 100, 200 * KiB, seed=i)  # path-based
            with engine.open(path) as f:
                roundtrip(engine, f, path, 8192, 200 * KiB, seed=i + 1)  # SwapFile
            buf = np.zeros(4096, np.uint8)
            # failing requests, at once or through the future
            with pytest.raises(FileNotFoundError):
                engine.pread(buf, swap_dir / "missing.bin")
            with pytest.raises(SwapIOError):
                engine.pwrite(buf, link)
            with pytest.raises(SwapNoSpaceError):
                engine.pwrite(buf, path, 9 * MiB)
            with pytest.raises(TypeError):
                engine.pread(b"read-only", path)
            eof = engine.pread(np.zeros(MiB, np.uint8), path, 0)
            assert isinstance(eof.exception(TIMEOUT), SwapEOFError)
            # left in flight at close
            engine.pwrite(np.ones(MiB, np.uint8), swap_dir / f"q{i}.bin")

    cycle(0)  # warm up: lazily opened libraries and the like
    before = fd_count()
    for i in range(1, 5):
        cycle(i)
    assert fd_count() == before


# ------------------------------------------------------------------------------------------
# Backends by name, CI, the thin layer, AUTO.


def test_libaio_loads_in_ci() -> None:
    """CI must exercise libaio: there, a missing libaio is a failure, not a skip."""
    try:
        provider, _ = probe_backend(Backend.LIBAIO)
    except BackendUnavailableError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the libaio backend did not load: {exc}")
        pytest.skip(f"libaio backend unavailable here: {exc}")
    assert isinstance(provider, LibAio)


@pytest.mark.parametrize("name", ["libaio", "kernel", "threads"])
def test_backend_by_name(swap_dir: Path, name: str) -> None:
    backend = Backend(name)
    try:
        probe_backend(backend)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    chosen, provider = resolve_backend(backend)
    assert chosen is backend
    expected = {"libaio": LibAio, "kernel": KernelAio, "threads": type(None)}[name]
    assert isinstance(provider, expected)
    with AioEngine(AioConfig(backend=name, num_threads=2, block_size=64 * KiB)) as engine:  # type: ignore[arg-type]
        assert engine.backend is backend
        assert name in repr(engine)
        path = swap_dir / "x.bin"
        roundtrip(engine, path, path, 12345, 3 * MiB + 5, seed=3, src_phase=7, dst_phase=0)


@pytest.mark.parametrize("single_submit", [True, False], ids=["single", "batched"])
def test_submission_modes(swap_dir: Path, backend: Backend, single_submit: bool) -> None:
    """One iocb per io_submit (the default) and batched submission move the same bytes."""
    config = AioConfig(
        backend=backend, block_size=64 * KiB, queue_depth=8, single_submit=single_submit
    )
    with AioEngine(config) as engine:
        path = swap_dir / "x.bin"
        roundtrip(engine, path, path, 4096, 2 * MiB + 3, seed=5, src_phase=0, dst_phase=0)


def test_single_submit_stops_at_a_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal after the first single submit reports the count taken, not an error."""
    provider = _provider(LibAio)
    calls: list[int] = []
    refuse_at = 3

    def submit(ctx: int, nr: int, iocbpp: Any) -> int:
        calls.append(nr)
        if len(calls) == refuse_at:
            raise OSError(errno.EAGAIN, "io_submit")
        return 1

    context = engine_mod._NativeContext(provider, 8, single_submit=True)
    try:
        monkeypatch.setattr(provider, "submit", submit)
        assert context._submit_iocbs(5) == 2  # the third was refused: two taken
        assert calls == [1, 1, 1]
        calls.clear()
        refuse_at = 1
        with pytest.raises(OSError):  # the first refused: an error, nothing taken
            context._submit_iocbs(5)
    finally:
        monkeypatch.undo()
        context.close()


def _provider(cls: type) -> Any:
    try:
        return cls()
    except OSError as exc:
        pytest.skip(f"{cls.__name__} unavailable here: {exc}")


@pytest.mark.parametrize("cls", [LibAio, KernelAio], ids=["libaio", "kernel"])
def test_thin_layer_one_write_and_one_read(swap_dir: Path, cls: type) -> None:
    provider = _provider(cls)
    path = swap_dir / "thin.bin"
    data = random_bytes(8192, 5).tobytes()
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    ctx = provider.setup(4)
    try:
        assert ctx != 0
        src = ffi.from_buffer(data)
        dst = ffi.new("char[]", 8192)
        events = ffi.new("struct io_event[2]")
        for opcode, buf, tag in ((IOCB_CMD_PWRITE, src, 41), (IOCB_CMD_PREAD, dst, 42)):
            cb = ffi.new("struct iocb *")
            cb.aio_data = tag
            cb.aio_lio_opcode = opcode
            cb.aio_fildes = fd
            cb.aio_buf = int(ffi.cast("uintptr_t", buf))
            cb.aio_nbytes = 8192
            cb.aio_offset = 4096
            ptrs = ffi.new("struct iocb *[1]", [cb])
            assert provider.submit(ctx, 1, ptrs) == 1
            assert provider.getevents(ctx, 1, 2, events, TIMEOUT) == 1
            assert events[0].data == tag
            assert events[0].res == 8192
            assert events[0].obj == int(ffi.cast("uintptr_t", cb))
        assert ffi.buffer(dst, 8192)[:] == data
        assert os.pread(fd, 8192, 4096) == data
        # nothing in flight: a short wait returns no events
        assert provider.getevents(ctx, 1, 2, events, 0.01) == 0
    finally:
        provider.destroy(ctx)
        os.close(fd)


@pytest.mark.parametrize("cls", [LibAio, KernelAio], ids=["libaio", "kernel"])
def test_thin_layer_errors_are_oserrors(cls: type) -> None:
    provider = _provider(cls)
    with pytest.raises(OSError) as info:
        provider.destroy(0xDEADBEEF)
    assert info.value.errno == errno.EINVAL
    assert "io_destroy" in str(info.value)
    with pytest.raises(OSError) as info:
        provider.setup(-1)
    assert info.value.errno == errno.EINVAL
    assert "io_setup" in str(info.value)
    ctx = provider.setup(1)
    try:
        cb = ffi.new("struct iocb *")
        cb.aio_lio_opcode = IOCB_CMD_PREAD
        cb.aio_fildes = 0x7FFFFFF0  # not an open descriptor
        cb.aio_nbytes = 1
        ptrs = ffi.new("struct iocb *[1]", [cb])
        with pytest.raises(OSError) as info:
            provider.submit(ctx, 1, ptrs)
        assert info.value.errno == errno.EBADF
        assert "io_submit" in str(info.value)
    finally:
        provider.destroy(ctx)


def test_thin_layer_construction_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(OSError):
        LibAio("libswapper-no-such-library.so.0")
    monkeypatch.setattr("platform.machine", lambda: "pdp11")
    with pytest.raises(OSError) as info:
        KernelAio()
    assert info.value.errno == errno.ENOSYS
    assert "pdp11" in str(info.value)


def _auto_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "swapper.tiers.aio" and "aio backend auto" in r.getMessage()
    ]


def test_auto_logs_choice_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, available_backends: list
) -> None:
    monkeypatch.setattr(backend_mod, "_auto_choice", None)
    caplog.set_level(logging.INFO, logger="swapper.tiers.aio")
    expected = next((b for b in available_backends if b in NATIVE), Backend.THREADS)
    with AioEngine(AioConfig()) as a, AioEngine(AioConfig(backend=Backend.AUTO)) as b:
        assert a.backend is expected
        assert b.backend is expected
    assert resolve_backend(Backend.AUTO)[0] is expected
    records = _auto_records(caplog)
    assert len(records) == 1
    assert f"aio backend auto -> {expected.value}" in records[0].getMessage()
    if expected in NATIVE:
        assert "native Linux AIO" in records[0].getMessage()


def test_auto_falls_back_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, swap_dir: Path
) -> None:
    monkeypatch.setattr(backend_mod, "_auto_choice", None)
    caplog.set_level(logging.INFO, logger="swapper.tiers.aio")

    def no_libaio(*args: Any) -> None:
        raise OSError(errno.ENOENT, "libaio.so.1: cannot open shared object file")

    def no_kernel_aio(*args: Any) -> None:
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(backend_mod, "LibAio", no_libaio)
    if "kernel" in [b.value for b in probe_targets()]:
        assert resolve_backend(Backend.AUTO)[0] is Backend.KERNEL
        (record,) = _auto_records(caplog)
        assert record.levelno == logging.INFO
        assert "-> kernel" in record.getMessage()
        assert "libaio.so.1: cannot open shared object file" in record.getMessage()
        caplog.clear()
    monkeypatch.setattr(backend_mod, "KernelAio", no_kernel_aio)
    with AioEngine(AioConfig()) as engine:
        assert engine.backend is Backend.THREADS
        path = swap_dir / "x.bin"
        roundtrip(engine, path, path, 3, 100_000, seed=1)
    (record,) = _auto_records(caplog)
    assert record.levelno == logging.WARNING
    assert "-> threads" in record.getMessage()
    assert "libaio.so.1" in record.getMessage()
    assert "Function not implemented" in record.getMessage()


def probe_targets() -> list[Backend]:
    out = []
    for b in NATIVE:
        try:
            probe_backend(b)
        except BackendUnavailableError:
            continue
        out.append(b)
    return out


# ------------------------------------------------------------------------------------------
# Futures and request arguments.


def test_future_api(engines: Engines, swap_dir: Path, backend: Backend) -> None:
    engine = engines.get(backend, direct=True)
    path = swap_dir / "x.bin"
    data = random_bytes(3 * MiB, 1)
    fut = engine.pwrite(data, path, 4096)
    assert isinstance(fut, IOFuture)
    assert isinstance(fut, concurrent.futures.Future)
    assert (fut.op, fut.path, fut.offset, fut.nbytes) == (Op.WRITE, str(path), 4096, 3 * MiB)
    assert fut.describe() == f"write of {3 * MiB} bytes at offset 4096 of {path}"
    assert fut.result(timeout=TIMEOUT) == 3 * MiB
    assert fut.done()
    assert fut.exception(0) is None
    assert "(done)" in repr(fut)
    back = np.zeros(3 * MiB, np.uint8)
    rfut = engine.pread(back, path, 4096)
    assert rfut.op is Op.READ
    done, not_done = concurrent.futures.wait([rfut], timeout=TIMEOUT)
    assert rfut in done
    assert not not_done
    assert_same(back, data)
    callback_got: list[int] = []
    ev = threading.Event()

    def on_done(f: concurrent.futures.Future) -> None:
        callback_got.append(f.result())
        ev.set()

    engine.pread(back, path, 4096).add_done_callback(on_done)
    assert ev.wait(TIMEOUT)
    assert callback_got == [3 * MiB]


def test_asyncio_wrap_future(engines: Engines, swap_dir: Path, backend: Backend) -> None:
    engine = engines.get(backend, direct=True, num_threads=2)
    datas = [random_bytes(MiB + i * 1000, i) for i in range(6)]
    backs = [np.zeros(d.size, np.uint8) for d in datas]

    async def main() -> tuple[list[int], list[int]]:
        writes = [
            asyncio.wrap_future(engine.pwrite(d, swap_dir / f"a{i}.bin"))
            for i, d in enumerate(datas)
        ]
        written = await asyncio.wait_for(asyncio.gather(*writes), TIMEOUT)
        reads = [
            asyncio.wrap_future(engine.pread(b, swap_dir / f"a{i}.bin"))
            for i, b in enumerate(backs)
        ]
        read = await asyncio.wait_for(asyncio.gather(*reads), TIMEOUT)
        return written, read

    written, read = asyncio.run(main())
    assert written == read == [d.size for d in datas]
    for b, d in zip(backs, datas, strict=True):
        assert_same(b, d)

    async def failing() -> None:
        await asyncio.wrap_future(
            engine.pread(np.zeros(10, np.uint8), swap_dir / "a0.bin", 10 * MiB)
        )

    with pytest.raises(SwapEOFError):
        asyncio.run(asyncio.wait_for(failing(), TIMEOUT))


def test_partial_transfers_with_nbytes(engines: Engines, swap_dir: Path, backend: Backend) -> None:
    engine = engines.get(backend, direct=True)
    path = swap_dir / "x.bin"
    data = random_bytes(MiB, 1)
    assert engine.pwrite(data, path, 0, nbytes=100_000).result(TIMEOUT) == 100_000
    assert path.stat().st_size == 100_000
    assert_same(file_bytes(path, 0, 100_000), data[:100_000])
    back = np.full(MiB, 0xAB, np.uint8)
    fut = engine.pread(back, path, 10, nbytes=5000)
    assert fut.nbytes == 5000
    assert fut.result(TIMEOUT) == 5000
    assert_same(back[:5000], data[10:5010])
    assert (back[5000:] == 0xAB).all(), "bytes past nbytes must stay untouched"
    # nbytes with a typed tensor counts bytes, not elements
    t = torch.zeros(1000, dtype=torch.bfloat16)
    assert engine.pread(t, path, 0, nbytes=6).result(TIMEOUT) == 6
    assert_same(t.view(torch.uint8)[:6].numpy(), data[:6])
    assert (t[3:] == 0).all()


def test_zero_byte_requests(engines: Engines, swap_dir: Path, backend: Backend) -> None:
    engine = engines.get(backend, direct=True)
    path = swap_dir / "x.bin"
    write_file(path, b"abc")
    for buf in (np.zeros(0, np.uint8), bytearray(), torch.empty(0, dtype=torch.bfloat16)):
        assert engine.pread(buf, path, 0).result(TIMEOUT) == 0
        assert engine.pread(buf, path, 10 * MiB).result(TIMEOUT) == 0  # past EOF: nothing to read
        assert engine.pwrite(buf, path, 0).result(TIMEOUT) == 0
    assert engine.pread(np.zeros(100, np.uint8), path, 0, nbytes=0).result(TIMEOUT) == 0
    assert path.read_bytes() == b"abc"
    assert engine.pending() == []


def test_bad_arguments_fail_at_once(
    engines: Engines, swap_dir: Path, backend: Backend, fd_count: Callable[[], int]
) -> None:
    engine = engines.get(backend, direct=True)
    path = swap_dir / "x.bin"
    write_file(path, random_bytes(8192, 1))
    new = swap_dir / "never-created.bin"
    buf = np.zeros(4096, np.uint8)
    before = fd_count()
    with pytest.raises(ValueError, match="offset must be >= 0"):
        engine.pread(buf, path, -1)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        engine.pwrite(buf, new, -4096)
    with pytest.raises(ValueError, match="nbytes=4097 does not fit the 4096-byte buffer"):
        engine.pread(buf, path, 0, nbytes=4097)
    with pytest.raises(ValueError, match="nbytes=-1"):
        engine.pwrite(buf, new, 0, nbytes=-1)
    with pytest.raises(ValueError, match="not contiguous"):
        engine.pwrite(torch.zeros(64, 64).t(), new)
    with pytest.raises(ValueError, match="not contiguous"):
        engine.pread(torch.zeros(64)[::2], path)
    with pytest.raises(ValueError, match="contiguous"):
        engine.pwrite(np.zeros(64)[::2], new)
    with pytest.raises(TypeError, match="meta"):
        engine.pwrite(torch.zeros(16, device="meta"), new)  # any non-CPU device, like CUDA
    for readonly in (b"0123456789", memoryview(b"0123456789"), _readonly_array()):
        with pytest.raises(TypeError, match="read-only"):
            engine.pread(readonly, path)
    for junk in (object(), [1, 2, 3], "text", 42, None):
        with pytest.raises(TypeError, match="neither a tensor nor a buffer"):
            engine.pwrite(junk, new)
    assert not new.exists()
    assert engine.pending() == []
    assert fd_count() == before
    # writing from a read-only buffer is fine
    assert engine.pwrite(b"0123456789", path, 3).result(TIMEOUT) == 10
    assert file_bytes(path, 3, 10).tobytes() == b"0123456789"


def _readonly_array() -> np.ndarray:
    a = np.zeros(10, np.uint8)
    a.flags.writeable = False
    return a


@pytest.mark.gpu
def test_cuda_tensor_refused(engines: Engines, swap_dir: Path) -> None:
    engine = engines.get(Backend.THREADS, direct=False)
    with pytest.raises(TypeError, match="cuda"):
        engine.pwrite(torch.zeros(16, device="cuda"), swap_dir / "x.bin")
    assert not (swap_dir / "x.bin").exists()


def test_created_files_are_0600(engines: Engines, swap_dir: Path, backend: Backend) -> None:
    engine = engines.get(backend, direct=True)
    old = os.umask(0)
    try:
        engine.pwrite(np.ones(10, np.uint8), swap_dir / "a.bin").result(TIMEOUT)
        with engine.open(swap_dir / "b.bin", create=True):
            pass
    finally:
        os.umask(old)
    for name in ("a.bin", "b.bin"):
        assert (swap_dir / name).stat().st_mode & 0o777 == 0o600


def test_repr_and_describe(engines: Engines, backend: Backend) -> None:
    engine = engines.get(backend, direct=False, block_size=8192, queue_depth=2, num_threads=3)
    described = f"{backend.value}, bs 8 KiB, qd 2, threads 3, buffered"
    assert repr(engine) == f"<AioEngine {backend.value} {described} (open)>"


# ------------------------------------------------------------------------------------------
# Hostile requests and injected faults: each ends in a typed error (or, for a failed reap,
# in no error at all), and the engine keeps working: a good request right after, its
# bytes checked, and close() returns.

OFF_T_MAX = (1 << 63) - 1


def check_engine_works(engine: AioEngine, directory: Path, seed: int) -> None:
    """A write and a read through the engine, aligned and not, checked byte for byte."""
    path = directory / f"after-{seed}.bin"
    roundtrip(engine, path, path, ALIGN, 3 * 64 * KiB, seed=seed)
    roundtrip(engine, path, path, 100, 64 * KiB + 5, seed=seed + 1, src_phase=100, dst_phase=7)


@dataclass(frozen=True)
class Hostile:
    name: str
    offset: Any
    nbytes: Any  #: None: the buffer's size (4096)
    error: type[Exception]
    says: tuple[str, ...]


HOSTILE = [
    Hostile("offset=2**63", 1 << 63, None, InvalidArgumentError, ("past the largest", "2**63 - 1")),
    Hostile("offset=2**64", 1 << 64, None, InvalidArgumentError, ("past the largest", "2**63 - 1")),
    Hostile("offset=2**63-1", OFF_T_MAX, None, InvalidArgumentError, ("ends past", "2**63 - 1")),
    Hostile("end=2**63", (1 << 63) - ALIGN, None, InvalidArgumentError, ("ends past",)),
    Hostile("end=2**63+99", (1 << 63) - 1, 100, InvalidArgumentError, ("ends past",)),
    Hostile("offset=-1", -1, None, InvalidArgumentError, ("must be >= 0, got -1",)),
    Hostile("offset=-2**63", -(1 << 63), None, InvalidArgumentError, ("must be >= 0",)),
    Hostile("offset=-2**64", -(1 << 64), None, InvalidArgumentError, ("must be >= 0",)),
    Hostile("nbytes=2**64", 0, 1 << 64, InvalidArgumentError, ("does not fit the 4096-byte",)),
    Hostile("nbytes=2**63", 0, 1 << 63, InvalidArgumentError, ("does not fit the 4096-byte",)),
    Hostile("nbytes=size+1", 0, ALIGN + 1, InvalidArgumentError, ("nbytes=4097 does not fit",)),
    Hostile("nbytes=-1", 0, -1, InvalidArgumentError, ("nbytes=-1",)),
    Hostile("offset=0.0", 0.0, None, TypeError, ("offset must be an integer", "float")),
    Hostile("offset=nan", float("nan"), None, TypeError, ("offset must be an integer",)),
    Hostile("offset=True", True, None, TypeError, ("offset must be an integer", "bool")),
    Hostile("offset='0'", "0", None, TypeError, ("offset must be an integer", "str")),
    Hostile("nbytes=4096.0", 0, 4096.0, TypeError, ("nbytes must be an integer",)),
]


@pytest.mark.parametrize("op", [Op.READ, Op.WRITE], ids=["read", "write"])
@pytest.mark.parametrize("case", HOSTILE, ids=[c.name for c in HOSTILE])
def test_hostile_request_refused_at_submit(
    engines: Engines,
    swap_dir: Path,
    backend: Backend,
    op: Op,
    case: Hostile,
) -> None:
    """Refused at once, before anything is queued; the message names the bound and the
    file. (Offsets of 2**63 and up used to kill the worker inside cffi, hanging the
    engine for good.)"""
    engine = engines.get(backend, direct=True, block_size=64 * KiB)
    path = swap_dir / "x.bin"
    content = random_bytes(8192, 1)
    write_file(path, content)
    buf = make_buffer("np_u8", ALIGN)
    fill_random(buf.u8, 2)
    buf_before = buf.u8.copy()
    with engine.open(path, readonly=True) as f:
        if op is Op.READ:  # an open SwapFile
            target, exc = (
                path,
                raised(case.error, engine.pread, buf.obj, f, case.offset, case.nbytes),
            )
        else:  # a path, which must not be created
            target = swap_dir / "new.bin"
            exc = raised(case.error, engine.pwrite, buf.obj, target, case.offset, case.nbytes)
            assert not target.exists()
    message = str(exc)
    for words in (*case.says, str(target), op.value):
        assert words in message, f"{words!r} not in {message!r}"
    if case.error is InvalidArgumentError:
        assert isinstance(exc, ValueError)
        assert isinstance(exc, SwapError)
    assert engine.pending() == []
    assert_same(buf.u8, buf_before, "buffer of a refused request")
    assert_same(file_bytes(path, 0, 8192), content, "file of a refused request")
    check_engine_works(engine, swap_dir, seed=3)


_GOOD = st.tuples(
    st.integers(0, 1 << 20),  # offset
    st.integers(1, 300 * KiB),  # nbytes (0: test_edge_requests_the_filesystem_answers)
    st.sampled_from([0, 1, 100, ALIGN - 1]),  # buffer phase
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.one_of(st.sampled_from(HOSTILE), _GOOD), min_size=1, max_size=6))
def test_any_mix_of_hostile_and_good_requests(
    engines: Engines, module_dir: Path, backend: Backend, steps: list[Any]
) -> None:
    """Whatever came before on an engine, a refused request leaves nothing behind and a
    good one round-trips exactly."""
    engine = engines.get(backend, direct=True, block_size=64 * KiB, queue_depth=4)
    path = module_dir / f"mix-{backend.value}.bin"
    path.unlink(missing_ok=True)
    with engine.open(path, create=True) as f:
        for i, step in enumerate(steps):
            if isinstance(step, Hostile):
                buf = np.zeros(ALIGN, np.uint8)
                submit = engine.pread if i % 2 else engine.pwrite
                raised(step.error, submit, buf, f, step.offset, step.nbytes)
            else:
                offset, nbytes, phase = step
                roundtrip(engine, f, path, offset, nbytes, seed=i, src_phase=phase, dst_phase=phase)
    path.unlink()
    assert engine.pending() == []


def test_hostile_requests_leak_no_descriptors(
    engines: Engines, swap_dir: Path, backend: Backend, fd_count: Callable[[], int]
) -> None:
    engine = engines.get(backend, direct=True, block_size=64 * KiB)
    path = swap_dir / "x.bin"
    write_file(path, random_bytes(8192, 1))
    buf = np.zeros(ALIGN, np.uint8)
    before = fd_count()
    for case in HOSTILE:
        for submit, target in ((engine.pread, path), (engine.pwrite, swap_dir / "new.bin")):
            raised(case.error, submit, buf, target, case.offset, case.nbytes)
    assert fd_count() == before
    assert not (swap_dir / "new.bin").exists()


def test_edge_requests_the_filesystem_answers(
    engines: Engines, swap_dir: Path, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within off_t but beyond the file or the filesystem: typed errors from the kernel."""
    engine = engines.get(backend, direct=True, block_size=64 * KiB)
    path = swap_dir / "x.bin"
    content = random_bytes(8192, 1)
    write_file(path, content)
    buf = make_buffer("np_u8", ALIGN)
    with engine.open(path) as f:
        # Zero bytes: a request that succeeds at once, wherever it points.
        for offset in (0, 10 * MiB, 1 << 62, OFF_T_MAX):
            assert engine.pread(buf.obj, f, offset, 0).result(TIMEOUT) == 0
            assert engine.pwrite(buf.obj, f, offset, 0).result(TIMEOUT) == 0
        # The last bytes below 2**63 may be asked for: there is nothing there.
        for offset, nbytes in ((OFF_T_MAX - ALIGN, ALIGN), (OFF_T_MAX - 1, 1), (1 << 62, ALIGN)):
            exc = engine.pread(buf.obj, f, offset, nbytes).exception(TIMEOUT)
            assert isinstance(exc, SwapEOFError), exc
        # A write past the filesystem's largest file: refused when space is reserved...
        exc = raised(SwapIOError, engine.pwrite, buf.obj, f, 1 << 62)
        assert exc.errno == errno.EFBIG
        assert exc.filename == str(path)
        check_engine_works(engine, swap_dir, seed=2)

        # ... or, where fallocate is not supported, by the kernel, in the future.
        def unsupported(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

        monkeypatch.setattr(files.os, "posix_fallocate", unsupported)
        exc = engine.pwrite(buf.obj, f, 1 << 62).exception(TIMEOUT)
        assert isinstance(exc, SwapIOError)
        assert exc.errno in (errno.EFBIG, errno.EINVAL)
        assert f.direct_fd is not None, "a request's own error must not turn O_DIRECT off"
        # numpy integers are integers
        assert engine.pread(buf.obj, f, np.int64(ALIGN), np.uint16(100)).result(TIMEOUT) == 100
        assert_same(buf.u8[:100], content[ALIGN : ALIGN + 100])
    assert_same(file_bytes(path, 0, 1 << 20), content, "file after the edge requests")
    check_engine_works(engine, swap_dir, seed=4)


@pytest.mark.parametrize(
    ("offset", "nbytes", "phase"),
    [(1, ALIGN - 1, 1), (ALIGN - 1, 2, 0), (0, ALIGN + 1, 0), (ALIGN, 3 * ALIGN, 7), (5, 1, 0)],
    ids=["off1", "straddle", "len4097", "addr7", "one-byte"],
)
def test_unaligned_requests_with_o_direct_go_buffered(
    engines: Engines,
    swap_dir: Path,
    backend: Backend,
    monkeypatch: pytest.MonkeyPatch,
    offset: int,
    nbytes: int,
    phase: int,
) -> None:
    """Unaligned offset, length or address with O_DIRECT on: not refused; each unaligned
    piece goes through the buffered descriptor (O_DIRECT would fail it with EINVAL)."""
    to_direct: list[tuple[int, int, int]] = []
    real_route = worker_mod._route

    def spy(piece: Any) -> None:
        real_route(piece)
        if piece.direct:
            to_direct.append((piece.address, piece.offset, piece.nbytes))

    monkeypatch.setattr(worker_mod, "_route", spy)
    engine = engines.get(backend, direct=True, block_size=64 * KiB)
    path = swap_dir / "x.bin"
    with engine.open(path, create=True) as f:
        assert f.direct_fd is not None
        roundtrip(engine, f, path, offset, nbytes, seed=1, src_phase=phase, dst_phase=phase)
        assert all(not ((a | o | n) % ALIGN) for a, o, n in to_direct), to_direct
        assert f.direct_fd is not None
    check_engine_works(engine, swap_dir, seed=5)
    assert to_direct, "the aligned requests after it went direct"


# -- injected faults -----------------------------------------------------------------------


FAULTS = ["submit-oserror", "submit-error", "reap-oserror", "reap-error", "complete-error"]


def _once(exc: BaseException, real: Callable[..., Any], fired: list[BaseException]) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        if not fired:
            fired.append(exc)
            raise exc
        return real(*args, **kwargs)

    return call


def arm_fault(
    engine: AioEngine, backend: Backend, fault: str, monkeypatch: pytest.MonkeyPatch
) -> list[BaseException]:
    """Make the engine's (only) worker fail once at ``fault``; returns what was raised."""
    fired: list[BaseException] = []
    (worker,) = engine._workers
    context: Any = worker._context
    where, kind = fault.split("-")
    if kind == "oserror":
        exc: BaseException = OSError(errno.EBADF, f"injected {where} fault")
    else:
        exc = RuntimeError(f"injected {where} fault")
    if where == "submit":
        if backend is Backend.THREADS:  # the thread pool is the backend's submit
            monkeypatch.setattr(context._pool, "submit", _once(exc, context._pool.submit, fired))
        else:
            provider = context._provider
            monkeypatch.setattr(provider, "submit", _once(exc, provider.submit, fired))
    elif where == "reap":
        if backend is Backend.THREADS:
            monkeypatch.setattr(context, "reap", _once(exc, context.reap, fired))
        else:
            provider = context._provider
            monkeypatch.setattr(provider, "getevents", _once(exc, provider.getevents, fired))
    else:
        monkeypatch.setattr(worker, "_complete", _once(exc, worker._complete, fired))
    return fired


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("op", [Op.READ, Op.WRITE], ids=["read", "write"])
def test_injected_fault_fails_one_request_only(
    swap_dir: Path,
    backend: Backend,
    fault: str,
    op: Op,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failure while submitting, reaping or completing fails that request's future (a
    failed reap fails nothing: it is retried), the worker lives on, close() returns."""
    caplog.set_level(logging.ERROR, logger="swapper.tiers.aio")
    path = swap_dir / "x.bin"
    content = random_bytes(256 * KiB, 1)
    write_file(path, content)
    engine = AioEngine(AioConfig(backend=backend, direct=True, block_size=64 * KiB))
    try:
        buf = make_buffer("np_u8", 256 * KiB)
        fill_random(buf.u8, 2)
        fired = arm_fault(engine, backend, fault, monkeypatch)
        with engine.open(path) as f:
            submit = engine.pread if op is Op.READ else engine.pwrite
            exc = submit(buf.obj, f, 0).exception(TIMEOUT)
        assert fired, "the fault was never reached"
        if fault.startswith("reap"):
            assert exc is None, f"a failed reap must only delay completions: {exc!r}"
            want = content if op is Op.READ else buf.u8
            got = buf.u8 if op is Op.READ else file_bytes(path, 0, 256 * KiB)
            assert_same(got, want)
            assert any("reaping completions failed" in r.getMessage() for r in caplog.records)
        else:
            assert isinstance(exc, SwapIOError), exc
            assert exc.filename == str(path)
            if fault.endswith("oserror"):
                assert exc.errno == errno.EBADF
            else:
                assert exc.errno == errno.EIO
                assert isinstance(exc.__cause__, RuntimeError)
                assert "RuntimeError: injected" in str(exc)
        assert engine.pending() == []
        assert engine._workers[0]._thread.is_alive()
        check_engine_works(engine, swap_dir, seed=6)
    finally:
        engine.close(timeout_s=TIMEOUT)
    assert not engine._workers[0]._thread.is_alive()


def test_thread_backend_transfer_raising_fails_its_request(
    swap_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transfer raising something other than OSError in the thread pool used to be
    swallowed by the pool: the request never completed and close() timed out."""
    path = swap_dir / "x.bin"
    write_file(path, random_bytes(8192, 1))
    fired: list[BaseException] = []
    monkeypatch.setattr(os, "preadv", _once(OverflowError("injected"), os.preadv, fired))
    with AioEngine(AioConfig(backend=Backend.THREADS, direct=False)) as engine:
        exc = engine.pread(np.zeros(8192, np.uint8), path).exception(TIMEOUT)
        assert isinstance(exc, SwapIOError)
        assert isinstance(exc.__cause__, OverflowError)
        assert fired
        check_engine_works(engine, swap_dir, seed=7)


def test_raising_callbacks_and_close_failures(
    engines: Engines, swap_dir: Path, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A done-callback that raises, and a file whose close() fails, end no worker: the
    callback's error is logged by concurrent.futures; a failed close fails a write."""
    engine = engines.get(backend, direct=True, block_size=64 * KiB)
    path = swap_dir / "x.bin"
    write_file(path, random_bytes(64 * KiB, 1))

    def boom(fut: concurrent.futures.Future) -> None:
        raise RuntimeError("callback fault")

    for _ in range(3):
        fut = engine.pread(np.zeros(64 * KiB, np.uint8), path)
        fut.add_done_callback(boom)
        assert fut.result(TIMEOUT) == 64 * KiB
    real_close = SwapFile.close
    closes: list[str] = []

    def failing_close(self: SwapFile) -> None:
        real_close(self)
        closes.append(str(self.path))
        raise OSError(errno.EIO, "injected close fault")

    monkeypatch.setattr(SwapFile, "close", failing_close)
    exc = engine.pwrite(random_bytes(100, 2), path, 0).exception(TIMEOUT)
    assert isinstance(exc, SwapIOError)
    assert exc.errno == errno.EIO
    assert "closing the file after a write" in str(exc)
    # after a read the bytes are in the buffer: a failed close is only logged
    assert engine.pread(np.zeros(100, np.uint8), path).result(TIMEOUT) == 100
    assert closes == [str(path), str(path)]
    monkeypatch.undo()
    assert engine.pending() == []
    check_engine_works(engine, swap_dir, seed=8)


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), -1.0, 1e300, "5", True])
def test_close_timeout_argument_checked(swap_dir: Path, timeout_s: Any) -> None:
    """close(timeout_s=inf) used to raise OverflowError from Condition.wait."""
    engine = AioEngine(AioConfig(backend=Backend.THREADS))
    try:
        with pytest.raises(InvalidArgumentError, match="timeout_s="):
            engine.close(timeout_s=timeout_s)
        check_engine_works(engine, swap_dir, seed=9)  # still open, still working
    finally:
        engine.close(timeout_s=0)  # 0: do not wait; nothing is in flight
    assert engine._closed


# ------------------------------------------------------------------------------------------
# Regressions of bugs found while writing these tests.


def test_cancel_in_flight_request(swap_dir: Path, gated_preadv: threading.Event) -> None:
    """cancel() is refused once a request is queued (the kernel may own its buffer), and the
    worker survives it (asyncio.wait_for(asyncio.wrap_future(f), t) timing out cancels too)."""
    path = swap_dir / "x.bin"
    write_file(path, random_bytes(8192, 1))
    engine = AioEngine(AioConfig(backend=Backend.THREADS, direct=False, num_threads=1))
    try:
        fut = engine.pread(np.zeros(8192, np.uint8), path)
        cancelled = fut.cancel()
        gated_preadv.set()
        assert not cancelled, "cancel() succeeded while the request's buffer was in use"
        assert fut.result(TIMEOUT) == 8192
        again = np.zeros(8192, np.uint8)
        try:
            assert engine.pread(again, path).result(5) == 8192, "the worker must survive"
        except concurrent.futures.TimeoutError:
            pytest.fail("the next request hung: the worker thread died")
        assert_same(again, random_bytes(8192, 1))
    finally:
        gated_preadv.set()
        with contextlib.suppress(EngineCloseTimeout):
            engine.close(timeout_s=1)


def test_fortran_order_array(engines: Engines, swap_dir: Path) -> None:
    """Contiguous but Fortran-ordered: refused with a clear error, or written exactly."""
    engine = engines.get(Backend.THREADS, direct=False)
    a = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    try:
        fut = engine.pwrite(a, swap_dir / "f.bin")
    except (TypeError, ValueError):
        return  # refused clearly
    assert fut.result(TIMEOUT) == a.nbytes
    assert (swap_dir / "f.bin").read_bytes() == a.tobytes(order="A")


def test_gc_does_not_matter_for_buffers_in_flight(
    engines: Engines, swap_dir: Path, backend: Backend
) -> None:
    """The engine keeps the buffer alive: dropping the caller's last reference is safe."""
    engine = engines.get(backend, direct=True, num_threads=2, block_size=256 * KiB)
    data = random_bytes(4 * MiB, 1)
    fut = engine.pwrite(data.copy(), swap_dir / "x.bin")
    gc.collect()
    assert fut.result(TIMEOUT) == data.size
    assert_same(file_bytes(swap_dir / "x.bin", 0, data.size), data)


_CYCLE_CRASH = r"""
import gc
import numpy as np
from tiers import AioConfig, AioEngine

engine = AioEngine(AioConfig(backend="threads"))


def f():
    try:
        engine.pread(np.zeros(4096, np.uint8), "/nonexistent/x.bin")
    except FileNotFoundError as exc:
        err = exc  # frame -> err -> traceback -> frame: a cycle, as `pytest.raises() as info` makes
    return err is not None


f()
gc.collect()
engine.close()
print("survived")
"""


def _no_core_dumps() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def test_error_kept_in_a_cycle_does_not_crash(tmp_path: Path) -> None:
    """An error raised at once by pread/pwrite, kept in a reference cycle, is collected safely.

    Regression: the engine used to keep ``(memoryview, ffi.from_buffer(memoryview))`` in
    _submit's frame; the collector cleared the exported memoryview and CPython segfaulted.
    Run in a subprocess so that a regression fails this test and not the whole session.
    """
    res = subprocess.run(
        [sys.executable, "-c", _CYCLE_CRASH],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        cwd=tmp_path,  # a core file, if any, lands there
        preexec_fn=_no_core_dumps,
    )
    assert res.returncode == 0, f"exit status {res.returncode}: {res.stderr[-2000:]}"
    assert res.stdout.strip() == "survived"
