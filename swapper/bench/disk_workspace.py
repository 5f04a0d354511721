"""The data and the files of a disk run: settings, measurements, the workspace.

Job: what ``swapper-bench disk`` measures and reports (``Setting``, ``Measurement``,
``DiskPlan``, ``DiskRun``), the scratch directory and its buffer (``Workspace``), the
sentinel bytes that prove every read returned what was written (``Sentinels``), and page
cache eviction between passes (``CacheEvictor``). The passes themselves are in
:mod:`swapper.bench.disk`.

Invariants: a workspace removes only what it created; a wrong byte read back is a
:class:`BenchError`, never a number in the report.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from swapper.interrupts import critical
from tiers import buffers as buffers_module
from tiers.config import DIRECT_ALIGNMENT, AioConfig, Backend
from tiers.errors import SwapError

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
    #: Not flags: from ``SWAPPER_AIO_SINGLE_SUBMIT`` / ``SWAPPER_AIO_CLOSE_TIMEOUT``.
    single_submit: bool = AioConfig.single_submit
    close_timeout_s: float = AioConfig.close_timeout_s

    def aio_config(self) -> AioConfig:
        """The engine config of this setting (raises SwapConfigError for bad values)."""
        return AioConfig(
            backend=self.backend,
            block_size=self.block_size,
            queue_depth=self.queue_depth,
            num_threads=self.threads,
            direct=self.direct,
            single_submit=self.single_submit,
            close_timeout_s=self.close_timeout_s,
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
