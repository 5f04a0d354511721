"""``swapper-bench disk``: write and read throughput of swap files.

What one run does::

    private temp dir (0700) in each --dir ─▶ one host buffer of --size bytes, filled with
    random bytes (untimed) ─▶ one file (0600) per dir, written once (untimed: creates and
    allocates the file) ─▶ for each setting: [warm-up +] timed writes, [warm-up +] timed
    reads ─▶ everything removed (also on Ctrl-C, SIGTERM and SIGHUP)

A pass moves the whole buffer: one request per file, all files at once, so the engine's
own splitting (block_size pieces, queue_depth in flight per thread) is what is measured.

Honesty rules:

* writes are timed up to ``fsync`` returning (buffered writes would otherwise measure
  memory; with O_DIRECT the fsync commits the file's metadata and costs little);
* reads never come from the page cache: O_DIRECT bypasses it, and buffered reads are
  preceded by ``fsync`` + ``posix_fadvise(DONTNEED)`` and, where permitted,
  ``echo 1 > /proc/sys/vm/drop_caches``; each measurement records which was done;
* every read is checked: sample bytes of the buffer are overwritten before the read and
  must come back;
* CPU time is ``getrusage(RUSAGE_SELF)`` user + sys over the timed passes (all threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from swapper.interrupts import critical
from tiers import buffers as buffers_module
from tiers.aio import AioEngine
from tiers.buffers import allocate
from tiers.config import DIRECT_ALIGNMENT, AioConfig, Backend
from tiers.errors import SwapEOFError, SwapError, SwapIOError
from tiers.files import SwapFile

ENGINE_SWAPPER = "swapper"
ENGINE_AIOFILES = "aiofiles"

#: Random bytes generated once and repeated to fill the buffer: generating 1 GiB of
#: random bytes costs seconds, copying a 64 MiB pattern a fraction of that.
_PATTERN_NBYTES = 64 << 20
#: Bytes of the buffer checked after every read, per file (spread over the file).
_SENTINELS_PER_FILE = 16
_DROP_CACHES = "/proc/sys/vm/drop_caches"


class BenchError(SwapError):
    """The benchmark itself found something wrong (e.g. a read returned other bytes)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setting:
    """One way of moving the bytes: an engine and its I/O settings.

    ``role`` says why it is measured: ``"main"`` (asked for), ``"sweep"`` (a grid point)
    or ``"baseline"`` (for comparison).
    """

    engine: str
    backend: Backend
    block_size: int
    queue_depth: int
    threads: int
    direct: bool
    role: str = "main"
    label: str = ""

    def aio_config(self) -> AioConfig:
        """The engine config of this setting (raises SwapConfigError for bad values)."""
        return AioConfig(
            backend=self.backend,
            block_size=self.block_size,
            queue_depth=self.queue_depth,
            num_threads=self.threads,
            direct=self.direct,
        )


@dataclasses.dataclass(kw_only=True)
class Measurement:
    """The timed passes of one operation with one setting."""

    op: str
    setting: Setting
    backend: str  #: resolved backend name, or "aiofiles"
    direct: bool  #: whether O_DIRECT was really used (the filesystem may refuse it)
    nbytes: int  #: bytes moved per pass, all files together
    seconds: list[float]
    cpu_seconds: float  #: user + sys over all timed passes
    cache: str  #: how the page cache was kept out of the figure
    dirs: list[str]

    @property
    def gbps_each(self) -> list[float]:
        """Throughput of each pass in GB/s (GB = 10^9 bytes)."""
        return [self.nbytes / s / 1e9 for s in self.seconds]

    @property
    def gbps(self) -> float:
        return statistics.median(self.gbps_each)

    @property
    def gbps_min(self) -> float:
        return min(self.gbps_each)

    @property
    def gbps_max(self) -> float:
        return max(self.gbps_each)

    @property
    def cpu_seconds_per_gb(self) -> float:
        moved_gb = self.nbytes * len(self.seconds) / 1e9
        return self.cpu_seconds / moved_gb

    def to_record(self) -> dict[str, Any]:
        """The JSON record of ``--json`` (the first nine keys are the stable schema)."""
        s = self.setting
        return {
            "op": self.op,
            "backend": self.backend,
            "direct": self.direct,
            "block_size": s.block_size,
            "queue_depth": s.queue_depth,
            "threads": s.threads,
            "nbytes": self.nbytes,
            "seconds": list(self.seconds),
            "gbps": self.gbps,
            "gbps_min": self.gbps_min,
            "gbps_max": self.gbps_max,
            "cpu_seconds_per_gb": self.cpu_seconds_per_gb,
            "engine": s.engine,
            "role": s.role,
            "label": s.label,
            "cache": self.cache,
            "dirs": list(self.dirs),
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiskPlan:
    """Everything one ``disk`` run will do, checked before any file is made."""

    dirs: list[Path]
    file_nbytes: int  #: per file; one file per directory
    ops: tuple[str, ...]  #: ("write", "read"), ("write",) or ("read",)
    settings: list[Setting]
    loops: int
    warmup: int

    @property
    def total_nbytes(self) -> int:
        return self.file_nbytes * len(self.dirs)


@dataclasses.dataclass(kw_only=True)
class DiskRun:
    """What a run produced."""

    measurements: list[Measurement]
    buffer_backing: str
    seconds: float


# ----------------------------------------------------------------------------------------
# Planning


def split_nbytes(total_nbytes: int, ndirs: int) -> int:
    """Bytes per file when ``total_nbytes`` is split over ``ndirs`` files.

    Rounded down to a multiple of 4 KiB so that every file can be read with O_DIRECT.
    """
    return total_nbytes // ndirs // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT


def baseline_settings(main: Setting) -> list[Setting]:
    """The comparison settings for ``main``: thread backend, buffered I/O, aiofiles.

    A baseline equal to ``main`` (the thread backend when main already uses it, buffered
    I/O when main is buffered) is left out.
    """
    out = []
    if main.backend is not Backend.THREADS:
        out.append(
            dataclasses.replace(
                main, backend=Backend.THREADS, role="baseline", label="thread backend"
            )
        )
    if main.direct:
        out.append(dataclasses.replace(main, direct=False, role="baseline", label="buffered"))
    out.append(
        Setting(
            engine=ENGINE_AIOFILES,
            backend=Backend.THREADS,
            block_size=main.block_size,
            queue_depth=1,
            threads=1,
            direct=False,
            role="baseline",
            label="aiofiles",
        )
    )
    return out


# ----------------------------------------------------------------------------------------
# Workspace: temp dirs, buffer, files


class Workspace:
    """Private temp directories, one data file each; all removed by :meth:`close`.

    Use as a context manager. Directory creation and registration happen together inside
    :func:`critical`, so an interrupt never leaves a directory that nobody removes.
    """

    def __init__(self, dirs: Sequence[Path]) -> None:
        self._dirs = list(dirs)
        self.tmpdirs: list[Path] = []

    def __enter__(self) -> Workspace:
        try:
            for d in self._dirs:
                with critical():
                    # mkdtemp makes the directory 0700; SwapFile creates files 0600.
                    self.tmpdirs.append(Path(tempfile.mkdtemp(prefix="swapper-bench-", dir=d)))
        except BaseException:
            self.close()
            raise
        return self

    @property
    def paths(self) -> list[Path]:
        """The data file of each directory."""
        return [d / "data.bin" for d in self.tmpdirs]

    def close(self) -> None:
        """Remove every temp directory made (idempotent; errors are ignored)."""
        while self.tmpdirs:
            shutil.rmtree(self.tmpdirs.pop(), ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        self.close()


def fill_random(tensor: torch.Tensor) -> None:
    """Fill a uint8 tensor with random bytes: a random pattern repeated (untimed)."""
    nbytes = tensor.numel()
    pattern_nbytes = min(nbytes, _PATTERN_NBYTES)
    pattern = torch.frombuffer(bytearray(os.urandom(pattern_nbytes)), dtype=torch.uint8)
    for start in range(0, nbytes, pattern_nbytes):
        end = min(nbytes, start + pattern_nbytes)
        tensor[start:end].copy_(pattern[: end - start])


def describe_backing(buffer: Any, tensor: torch.Tensor) -> str:
    """``"hugetlb, 100% huge pages"``: what backs the buffer, as obtained and as measured.

    Huge pages decide the throughput on virtio disks (see MACHINE.md), and a ``thp``
    buffer can still end up partly in small pages when memory is fragmented.
    """
    backing = str(getattr(buffer, "backing", "unknown"))
    measure = getattr(buffers_module, "hugepage_bytes_at", None)  # optional helper
    nbytes = tensor.numel()
    if measure is None or not nbytes:
        return backing
    fraction = measure(tensor.data_ptr(), nbytes) / nbytes
    return f"{backing}, {fraction:.0%} huge pages"


class Sentinels:
    """Sample bytes of the buffer, poisoned before each read and checked after it.

    Catches a read that completed without delivering the file's bytes, at almost no cost.
    """

    def __init__(self, tensor: torch.Tensor, file_nbytes: int, nfiles: int) -> None:
        step = max(1, file_nbytes // _SENTINELS_PER_FILE)
        positions = sorted(
            {
                f * file_nbytes + min(file_nbytes - 1, i * step + (i * 977) % step)
                for f in range(nfiles)
                for i in range(_SENTINELS_PER_FILE)
            }
        )
        self._tensor = tensor
        self._file_nbytes = file_nbytes
        self._index = torch.tensor(positions, dtype=torch.long)
        self._expected = tensor[self._index].clone()

    def poison(self) -> None:
        """Overwrite the sample bytes with their complement."""
        self._tensor[self._index] = torch.bitwise_not(self._expected)

    def check(self, paths: Sequence[Path]) -> None:
        """Raise BenchError naming the first sample byte that did not come back."""
        got = self._tensor[self._index]
        bad = (got != self._expected).nonzero()
        if bad.numel():
            position = int(self._index[int(bad[0])])
            file_index, offset = divmod(position, self._file_nbytes)
            raise BenchError(
                f"read returned wrong data: byte at offset {offset} of "
                f"{paths[file_index]} differs from what was written"
            )


# ----------------------------------------------------------------------------------------
# Page cache


class CacheEvictor:
    """Keeps buffered reads honest: the file's pages leave the page cache before a read."""

    def __init__(self) -> None:
        self._drop_caches_ok: bool | None = None  # unknown until tried once

    def evict(self, fds: Sequence[int]) -> str:
        """Write back and drop the files' cached pages; returns the method used."""
        for fd in fds:
            os.fsync(fd)  # DONTNEED skips dirty pages: they must be clean first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        if self._drop_caches():
            return "fadvise+drop_caches"
        return "fadvise"

    def _drop_caches(self) -> bool:
        if self._drop_caches_ok is False:
            return False
        try:
            with open(_DROP_CACHES, "w") as f:
                f.write("1")
            self._drop_caches_ok = True
        except OSError:
            self._drop_caches_ok = False  # not root, or a container: fadvise alone
        return self._drop_caches_ok


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ----------------------------------------------------------------------------------------
# Passes: each moves every file once and returns the seconds it took.


def _engine_pass(
    engine: AioEngine, op: str, files: Sequence[SwapFile], views: Sequence[torch.Tensor]
) -> float:
    """One pass through the swapper engine: one request per file, all in flight at once."""
    start = time.perf_counter()
    with critical():  # a request is either fully handed to the engine or not at all
        if op == "write":
            futures = [engine.pwrite(v, f) for f, v in zip(files, views, strict=True)]
        else:
            futures = [engine.pread(v, f) for f, v in zip(files, views, strict=True)]
    for fut in futures:
        fut.result()
    if op == "write":
        for f in files:
            os.fsync(f.fd)
    return time.perf_counter() - start


async def _aiofiles_one(op: str, path: Path, view: memoryview, block_size: int) -> None:
    """What asyncio code gets from aiofiles: sequential block_size calls, unbuffered."""
    import aiofiles  # imported here: only the baseline needs it

    nbytes = len(view)
    mode = "r+b" if op == "write" else "rb"
    async with aiofiles.open(path, mode, buffering=0) as f:
        for start in range(0, nbytes, block_size):
            chunk = view[start : min(nbytes, start + block_size)]
            while len(chunk):  # raw FileIO may transfer less than asked
                if op == "write":
                    done = await f.write(chunk)
                else:
                    done = await f.readinto(chunk)
                    if not done:
                        raise SwapEOFError(errno.EIO, "file ended early", str(path))
                chunk = chunk[done:]
        if op == "write":
            await asyncio.get_running_loop().run_in_executor(None, os.fsync, f.fileno())


async def _aiofiles_all(
    op: str, paths: Sequence[Path], views: Sequence[memoryview], block_size: int
) -> float:
    start = time.perf_counter()
    await asyncio.gather(
        *(_aiofiles_one(op, p, v, block_size) for p, v in zip(paths, views, strict=True))
    )
    return time.perf_counter() - start


def _aiofiles_pass(
    op: str, paths: Sequence[Path], views: Sequence[memoryview], block_size: int
) -> float:
    try:
        return asyncio.run(_aiofiles_all(op, paths, views, block_size))
    except OSError as exc:
        if isinstance(exc, SwapError):
            raise
        raise SwapIOError(
            exc.errno or errno.EIO, f"aiofiles {op}: {exc.strerror}", exc.filename
        ) from exc


# ----------------------------------------------------------------------------------------
# Measuring one setting


@dataclasses.dataclass
class _Target:
    """The buffer and files of a run, shared by all settings."""

    paths: list[Path]
    tensors: list[torch.Tensor]  #: the buffer's slice of each file
    sentinels: Sentinels
    evictor: CacheEvictor
    dirs: list[str]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.tensors)


def _timed_passes(
    op: str,
    loops: int,
    warmup: int,
    run_pass: Callable[[], float],
    before_read: Callable[[], str],
    target: _Target,
) -> tuple[list[float], float, str]:
    """Run warm-up + timed passes of ``op``; returns (seconds each, cpu seconds, cache)."""
    seconds: list[float] = []
    cpu_total = 0.0
    cache = ""
    for i in range(warmup + loops):
        if op == "read":
            cache = before_read()  # untimed: the cache is emptied before the clock starts
            target.sentinels.poison()
        cpu_start = cpu_seconds()
        elapsed = run_pass()
        cpu_used = cpu_seconds() - cpu_start
        if op == "read":
            target.sentinels.check(target.paths)
        if i >= warmup:
            seconds.append(elapsed)
            cpu_total += cpu_used
    return seconds, cpu_total, cache


def _measure_engine(
    setting: Setting, ops: Sequence[str], loops: int, warmup: int, target: _Target
) -> list[Measurement]:
    """Time ``ops`` through an AioEngine built from ``setting``."""
    out = []
    # The files are closed after the engine: it may still have pieces of a request in
    # flight on them when an interrupt unwinds this block.
    with contextlib.ExitStack() as stack, AioEngine(setting.aio_config()) as engine:
        files = [stack.enter_context(engine.open(p)) for p in target.paths]

        def all_direct() -> bool:
            return all(f.direct_fd is not None for f in files)

        def before_read() -> str:
            if all_direct():
                return "O_DIRECT"
            return target.evictor.evict([f.fd for f in files])

        for op in ops:
            seconds, cpu, cache = _timed_passes(
                op,
                loops,
                warmup,
                lambda op=op: _engine_pass(engine, op, files, target.tensors),
                before_read,
                target,
            )
            direct = all_direct()  # after the passes: EINVAL may have turned it off
            if op == "write":
                cache = "O_DIRECT+fsync" if direct else "fsync"
            out.append(
                Measurement(
                    op=op,
                    setting=setting,
                    backend=engine.backend.value,
                    direct=direct,
                    nbytes=target.nbytes,
                    seconds=seconds,
                    cpu_seconds=cpu,
                    cache=cache,
                    dirs=target.dirs,
                )
            )
    return out


def _measure_aiofiles(
    setting: Setting, ops: Sequence[str], loops: int, warmup: int, target: _Target
) -> list[Measurement]:
    """Time ``ops`` through aiofiles (always buffered: it has no O_DIRECT path)."""
    views = [t.numpy().data for t in target.tensors]

    def before_read() -> str:
        fds = [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in target.paths]
        try:
            return target.evictor.evict(fds)
        finally:
            for fd in fds:
                os.close(fd)

    out = []
    for op in ops:
        seconds, cpu, cache = _timed_passes(
            op,
            loops,
            warmup,
            lambda op=op: _aiofiles_pass(op, target.paths, views, setting.block_size),
            before_read,
            target,
        )
        out.append(
            Measurement(
                op=op,
                setting=setting,
                backend=ENGINE_AIOFILES,
                direct=False,
                nbytes=target.nbytes,
                seconds=seconds,
                cpu_seconds=cpu,
                cache="fsync" if op == "write" else cache,
                dirs=target.dirs,
            )
        )
    return out


def measure(
    setting: Setting, ops: Sequence[str], loops: int, warmup: int, target: _Target
) -> list[Measurement]:
    """Measure one setting: writes first (when asked), then reads of the same bytes."""
    if setting.engine == ENGINE_AIOFILES:
        return _measure_aiofiles(setting, ops, loops, warmup, target)
    return _measure_engine(setting, ops, loops, warmup, target)


# ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _prepared_target(plan: DiskPlan, workspace: Workspace) -> Iterator[tuple[_Target, str]]:
    """Allocate and fill the buffer, write the files once; yield the target and backing."""
    with allocate(plan.total_nbytes) as buffer:
        tensor = buffer.tensor
        fill_random(tensor)
        size = plan.file_nbytes
        tensors = [tensor[i * size : (i + 1) * size] for i in range(len(plan.dirs))]
        target = _Target(
            paths=workspace.paths,
            tensors=tensors,
            sentinels=Sentinels(tensor, size, len(plan.dirs)),
            evictor=CacheEvictor(),
            dirs=[str(d) for d in plan.dirs],
        )
        # Create and allocate the files with real data, so that every setting (reads
        # included) starts from the same state.
        swapper_settings = [s for s in plan.settings if s.engine == ENGINE_SWAPPER]
        config = swapper_settings[0].aio_config() if swapper_settings else AioConfig()
        with contextlib.ExitStack() as stack, AioEngine(config) as engine:
            files = [stack.enter_context(engine.open(p, create=True)) for p in target.paths]
            _engine_pass(engine, "write", files, tensors)
        yield target, describe_backing(buffer, tensor)


def run_disk(
    plan: DiskPlan, *, on_setting_done: Callable[[list[Measurement]], None] | None = None
) -> DiskRun:
    """Run every setting of ``plan``; temp files are gone when this returns or raises.

    Raises:
        SwapError (SwapIOError, SwapNoSpaceError, BenchError...): the I/O failed.
        Interrupted: SIGINT, SIGTERM or SIGHUP (when
            :func:`~swapper.interrupts.interrupts_raise` is active).
    """
    start = time.perf_counter()
    measurements: list[Measurement] = []
    # Order matters: engines close (the kernel is done with the buffer) before the
    # buffer is freed, and the buffer before the files are removed.
    with Workspace(plan.dirs) as workspace, _prepared_target(plan, workspace) as prepared:
        target, backing = prepared
        for setting in plan.settings:
            done = measure(setting, plan.ops, plan.loops, plan.warmup, target)
            measurements.extend(done)
            if on_setting_done is not None:
                on_setting_done(done)
    return DiskRun(
        measurements=measurements,
        buffer_backing=backing,
        seconds=time.perf_counter() - start,
    )
