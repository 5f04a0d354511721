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
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from swapper.bench.disk_workspace import (
    ENGINE_AIOFILES,
    ENGINE_SWAPPER,
    BenchError,
    CacheEvictor,
    DiskPlan,
    DiskRun,
    Measurement,
    Sentinels,
    Setting,
    Workspace,
    baseline_settings,
    cpu_seconds,
    describe_backing,
    fill_random,
    split_nbytes,
)
from swapper.interrupts import critical
from tiers.aio import AioEngine
from tiers.buffers import allocate
from tiers.config import AioConfig
from tiers.errors import SwapEOFError, SwapError, SwapIOError
from tiers.files import SwapFile

# The data and workspace of a run live in swapper.bench.disk_workspace; re-exported here,
# where the commands and the report have always imported them from.
__all__ = [
    "ENGINE_AIOFILES",
    "ENGINE_SWAPPER",
    "BenchError",
    "CacheEvictor",
    "DiskPlan",
    "DiskRun",
    "Measurement",
    "Sentinels",
    "Setting",
    "Workspace",
    "baseline_settings",
    "cpu_seconds",
    "describe_backing",
    "fill_random",
    "measure",
    "run_disk",
    "split_nbytes",
]

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
