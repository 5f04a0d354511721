"""The disk-rate floor of an optimizer step: what ``swapper-bench step`` judges a step by.

A step over NVMe-resident state reads and writes every streamed sub-group once, so it can
take no less than the disk needs for those bytes, and no less than the update's compute.
Its own I/O-only pass is no reference (it goes through the same pipeline, so a slow
pipeline is slow twice); the disk measured in the same run, with the same engine
settings, is. Each round the :class:`DiskProbe` times, through one
:class:`~tiers.aio.AioEngine` built from the stores' :class:`~tiers.config.AioConfig`:

- **read**: one file per swap directory read whole (O_DIRECT where the engine has it);
- **write**: another file written whole, timed up to ``fsync`` returning (the step's
  writes are durable when it returns: README, "Durability"; docs/durability.md);
- **mixed**: the first read and the second written at once, up to the last request and
  the fsync: what a pipelined step, which reads k+1 while k-1 is written, can get.

:func:`step_floor` turns bytes and rates into seconds (pure arithmetic, tested apart)::

    separate  = read_nbytes / read_rate + written_nbytes / write_rate
    mixed     = (read_nbytes + written_nbytes) / mixed_rate   (read and write side by side)
    disk      = min(separate, mixed)   the disk's best way to move the step's bytes
    floor     = max(disk, compute_seconds)

``mixed`` counts only when the probe moved reads and writes in the step's proportion
(the probe moves equal amounts; a step's state moves the same bytes each way); otherwise
``disk`` is ``separate``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from swapper.interrupts import critical
from tiers.aio import AioEngine
from tiers.buffers import HostBuffer, allocate
from tiers.config import AioConfig
from tiers.errors import SwapConfigError
from tiers.files import SwapFile

__all__ = ["DiskFloor", "DiskProbe", "DiskRound", "floor_record", "median_round", "step_floor"]

#: Bytes each probe pass moves in all (split over the swap directories), at most: large
#: enough that a pass takes ~0.3-1 s on a 1-4 GB/s disk, small next to a step's state.
PROBE_NBYTES = 1 << 30
#: Reads and writes of the mixed pass count as the step's proportion when within this
#: relative difference of it.
MIXED_TOLERANCE = 0.25


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiskRound:
    """One round of the probe: bytes per second of each pass (bytes moved / seconds).

    ``mixed_bps`` counts the bytes read plus the bytes written, over the pass's seconds.
    """

    read_bps: float
    write_bps: float
    mixed_bps: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiskFloor:
    """The floor of one step (seconds) and how it was reached.

    Attributes:
        separate_seconds: reads, then writes, each at its own rate.
        mixed_seconds: reads and writes at once at the mixed rate; None when the step's
            proportion of reads to writes is not the probe's (the figure would not apply).
        disk_seconds: the smaller of the two.
        compute_seconds: the update's compute (the compute-only pass).
        seconds: ``max(disk_seconds, compute_seconds)``.
        bound: ``"disk-separate"``, ``"disk-mixed"`` or ``"compute"``: what sets it.
    """

    separate_seconds: float
    mixed_seconds: float | None
    disk_seconds: float
    compute_seconds: float
    seconds: float
    bound: str


def step_floor(
    *,
    read_nbytes: int,
    written_nbytes: int,
    rates: DiskRound,
    compute_seconds: float,
) -> DiskFloor:
    """The least time a step moving these bytes at these rates can take (seconds).

    Args:
        read_nbytes, written_nbytes: bytes the step reads from and writes to NVMe.
        rates: the disk's rates in bytes per second (:class:`DiskRound`).
        compute_seconds: the update's compute alone, seconds.

    Raises:
        SwapConfigError: a byte count or ``compute_seconds`` negative, or a rate not
            positive (a probe that moved nothing cannot judge anything).
    """
    if read_nbytes < 0 or written_nbytes < 0:
        raise SwapConfigError(
            f"step_floor: read_nbytes={read_nbytes}, written_nbytes={written_nbytes} must be >= 0"
        )
    if compute_seconds < 0:
        raise SwapConfigError(f"step_floor: compute_seconds={compute_seconds} must be >= 0")
    for name in ("read_bps", "write_bps", "mixed_bps"):
        if not getattr(rates, name) > 0:
            raise SwapConfigError(
                f"step_floor: the disk's {name}={getattr(rates, name)} must be > 0 "
                "(the probe moved nothing?)"
            )
    separate = read_nbytes / rates.read_bps + written_nbytes / rates.write_bps
    moved = read_nbytes + written_nbytes
    mixed: float | None = None
    if moved and abs(read_nbytes - written_nbytes) <= MIXED_TOLERANCE * max(
        read_nbytes, written_nbytes
    ):
        mixed = moved / rates.mixed_bps
    disk = separate if mixed is None else min(separate, mixed)
    if compute_seconds > disk:
        bound = "compute"
    elif mixed is not None and mixed < separate:
        bound = "disk-mixed"
    else:
        bound = "disk-separate"
    return DiskFloor(
        separate_seconds=separate,
        mixed_seconds=mixed,
        disk_seconds=disk,
        compute_seconds=compute_seconds,
        seconds=max(disk, compute_seconds),
        bound=bound,
    )


def median_round(rounds: Sequence[DiskRound]) -> DiskRound:
    """Each rate's median over ``rounds`` (not one round's: each rate drifts apart).

    Raises:
        SwapConfigError: no rounds.
    """
    if not rounds:
        raise SwapConfigError("median_round: no probe rounds were timed")
    return DiskRound(
        read_bps=statistics.median(r.read_bps for r in rounds),
        write_bps=statistics.median(r.write_bps for r in rounds),
        mixed_bps=statistics.median(r.mixed_bps for r in rounds),
    )


def floor_record(
    *,
    step_seconds: Sequence[float],
    read_nbytes: int,
    written_nbytes: int,
    compute_seconds: Sequence[float],
    disk_rounds: Sequence[DiskRound],
) -> dict[str, Any]:
    """The JSON part of ``swapper-bench step`` that judges the step by its floor: the
    probe's rates, the floor of the medians, and each round's step against that round's
    own floor (its disk rates and its compute-only pass; the lists pair round by round).

    Raises:
        SwapConfigError: no rounds, lists of different lengths, or what
            :func:`step_floor` raises.
    """
    if not len(step_seconds) == len(compute_seconds) == len(disk_rounds):
        raise SwapConfigError(
            f"floor_record: {len(step_seconds)} step, {len(compute_seconds)} compute-only "
            f"and {len(disk_rounds)} disk rounds: one of each per round is needed"
        )

    def floor(rates: DiskRound, compute_s: float) -> DiskFloor:
        return step_floor(
            read_nbytes=read_nbytes,
            written_nbytes=written_nbytes,
            rates=rates,
            compute_seconds=compute_s,
        )

    rates = median_round(disk_rounds)
    median = floor(rates, statistics.median(compute_seconds))
    per_round = [
        s_ / floor(r_, c_).seconds
        for s_, r_, c_ in zip(step_seconds, disk_rounds, compute_seconds, strict=True)
    ]
    return {
        "disk": {
            "read_bytes_per_second": rates.read_bps,
            "write_bytes_per_second": rates.write_bps,
            "mixed_bytes_per_second": rates.mixed_bps,
            "rounds": [dataclasses.asdict(r) for r in disk_rounds],
            "method": "tiers.aio AioEngine with the stores' settings; writes timed to fsync; "
            "mixed: the read and the write pass at once (bytes read + written / seconds)",
        },
        "floor": dataclasses.asdict(median),
        "step_over_floor": statistics.median(step_seconds) / median.seconds,
        "step_over_floor_per_round": per_round,
        "step_over_floor_median_per_round": statistics.median(per_round),
    }


class DiskProbe:
    """Two files per swap directory and one buffer, timed a round at a time (see the
    module docstring). A context manager: files closed after the engine (which may still
    have pieces of a request in flight when an interrupt unwinds), the buffer after both.

    Args:
        dirs: the swap directories (private temporary ones: the files are made there and
            left for the caller's workspace to remove).
        aio: the engine settings the step's stores use.
        nbytes: bytes per pass in all, split evenly over ``dirs`` (rounded down to 4 KiB).

    Raises (constructor, on enter):
        SwapConfigError: no directories, or fewer than 4 KiB per directory.
        SwapError, OSError, MemoryError: the files or the buffer could not be made.
    """

    def __init__(self, dirs: Sequence[Path], aio: AioConfig, nbytes: int = PROBE_NBYTES) -> None:
        if not dirs:
            raise SwapConfigError("DiskProbe needs at least one swap directory")
        per_dir = nbytes // len(dirs) // 4096 * 4096
        if per_dir < 4096:
            raise SwapConfigError(
                f"DiskProbe: {nbytes} bytes over {len(dirs)} directories is under 4 KiB each"
            )
        self.dirs = list(dirs)
        self.aio = aio
        self.per_dir = per_dir
        self._stack = contextlib.ExitStack()
        self._engine: AioEngine | None = None
        self._buffer: HostBuffer | None = None
        self._reads: list[SwapFile] = []
        self._writes: list[SwapFile] = []

    @property
    def nbytes(self) -> int:
        """Bytes each pass moves (read, or written; the mixed pass moves twice this)."""
        return self.per_dir * len(self.dirs)

    def __enter__(self) -> DiskProbe:
        try:
            # two halves: what the read passes land in, what the write passes send
            self._buffer = self._stack.enter_context(allocate(2 * self.nbytes))
            tensor = self._buffer.tensor
            tensor.copy_(torch.randint(0, 256, (tensor.numel(),), dtype=torch.uint8))
            engine = self._stack.enter_context(AioEngine(self.aio))
            self._engine = engine
            for d in self.dirs:
                self._reads.append(
                    self._stack.enter_context(engine.open(d / "probe-read", create=True))
                )
                self._writes.append(
                    self._stack.enter_context(engine.open(d / "probe-write", create=True))
                )
            # untimed: create and allocate both files with real data
            self._run(write=self._reads + self._writes, read=[])
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stack.close()

    @property
    def direct(self) -> bool:
        """Every probe file went through O_DIRECT (else reads may be the page cache's)."""
        return all(f.direct_fd is not None for f in self._reads + self._writes)

    def _views(self, half: int) -> list[torch.Tensor]:
        if self._buffer is None:
            raise SwapConfigError("DiskProbe used outside its 'with' block")
        base = half * self.nbytes
        tensor = self._buffer.tensor
        return [
            tensor[base + i * self.per_dir : base + (i + 1) * self.per_dir]
            for i in range(len(self.dirs))
        ]

    def _run(self, *, write: Sequence[SwapFile], read: Sequence[SwapFile]) -> float:
        """Issue every read and write at once; seconds until all ended and writes fsync'd."""
        engine = self._engine
        if engine is None:
            raise SwapConfigError("DiskProbe used outside its 'with' block")
        into = self._views(0)
        out = self._views(1)
        start = time.perf_counter()
        with critical():  # every request handed to the engine, or none
            futures = [engine.pread(into[i % len(into)], f) for i, f in enumerate(read)]
            futures += [engine.pwrite(out[i % len(out)], f) for i, f in enumerate(write)]
        for fut in futures:
            fut.result()
        for f in write:
            os.fsync(f.fd)
        return time.perf_counter() - start

    def round(self) -> DiskRound:
        """Time one read pass, one write pass and one mixed pass.

        Raises:
            SwapError: an I/O failed.
        """
        n = self.nbytes
        read_s = self._run(write=[], read=self._reads)
        write_s = self._run(write=self._writes, read=[])
        mixed_s = self._run(write=self._writes, read=self._reads)
        return DiskRound(read_bps=n / read_s, write_bps=n / write_s, mixed_bps=2 * n / mixed_s)
