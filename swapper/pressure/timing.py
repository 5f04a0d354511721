"""Timing figures of a pressure run: per-step phases, the disk's rates, and a plain run.

What ``swapper-pressure --json`` reports beside its bit-identity proof (:class:`Timing`):

- ``seconds_per_step`` / ``reference_seconds_per_step``: the median, over the steps after
  the first (the first warms caches, allocator and files), of forward + backward +
  optimizer step of the budgeted run and of its unlimited reference;
- ``plain_seconds_per_step``: the same median for plain PyTorch (:func:`plain_run`): the
  same model, seed and batches, bf16 (or fp16) parameters, fp32 master copies updated by
  ``torch.optim.AdamW(fused=True)``, everything in memory, no swapper, timed in the
  same process;
- ``io_floor_seconds``: the median over the same steps of NVMe bytes read / the disk's
  read rate + bytes written / its write rate, the rates measured in the same run
  (:func:`measure_disk`): reads and writes share one device, so their times add;
- ``stall_seconds``: per-step medians (same steps) of the time the training's thread
  waited for bytes during forward, during backward, and during the optimizer step: its
  ``fetch`` waits, and with an overlapped step (``--overlap``) its waits for the update
  running beside it (the hooks' gate, ``step()``); the update's own fetch waits hide
  behind the forward and are not counted (``ManagerStats.background_stall_s``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from swapper.interrupts import critical
from swapper.manager import Kind, ManagerStats, Tier
from swapper.pressure.memory import peak_rss
from swapper.pressure.model import GPT, GPTConfig, init_weights_
from swapper.step import DynamicLossScaler
from tiers.aio import AioEngine
from tiers.buffers import allocate
from tiers.config import AioConfig
from tiers.errors import SwapConfigError
from tiers.units import format_size

__all__ = [
    "DiskRates",
    "Phases",
    "PlainRun",
    "Timing",
    "measure_disk",
    "plain_run",
    "spin_wait_warning",
]

#: Bytes written then read per swap directory to measure the disk (a few tens of MiB:
#: long enough to see the device's rate, short beside a run).
DISK_PROBE_NBYTES = 32 << 20


@dataclasses.dataclass
class Phases:
    """Per step: seconds and stall (seconds ``fetch`` waited for bytes) of forward,
    backward and the optimizer step, and NVMe bytes read and written.

    ``model_s`` / ``model_stall_s`` are forward + backward together (kept: the JSON's
    ``steps_detail`` has always reported them so).
    """

    forward_s: list[float] = dataclasses.field(default_factory=list)
    forward_stall_s: list[float] = dataclasses.field(default_factory=list)
    model_s: list[float] = dataclasses.field(default_factory=list)
    model_stall_s: list[float] = dataclasses.field(default_factory=list)
    optimizer_s: list[float] = dataclasses.field(default_factory=list)
    optimizer_stall_s: list[float] = dataclasses.field(default_factory=list)
    nvme_read_nbytes: list[int] = dataclasses.field(default_factory=list)
    nvme_written_nbytes: list[int] = dataclasses.field(default_factory=list)
    #: per step, NVMe bytes by kind ("param", "grad", "optim_state", ...) read and written
    #: during forward + backward ("model") and during the optimizer step ("optimizer")
    kind_nbytes: list[dict[str, dict[str, dict[str, int]]]] = dataclasses.field(
        default_factory=list
    )
    #: per step, the manager's read-ahead counters' growth over forward + backward:
    #: {"hits", "misses", "dropped", "wasted"} (``ManagerStats.prefetch_*``)
    model_prefetch: list[dict[str, int]] = dataclasses.field(default_factory=list)
    #: the process's peak resident memory (VmHWM) when each step ended, bytes
    peak_rss_nbytes: list[int] = dataclasses.field(default_factory=list)
    #: per step, NVMe (read, written) bytes of each phase: "forward", "backward", "step"
    #: (``swapper-pressure --timeline``: :mod:`swapper.pressure.timeline`)
    phase_nbytes: list[dict[str, tuple[int, int]]] = dataclasses.field(default_factory=list)
    _t: float = 0.0
    _t0: float = 0.0
    _stall: float = 0.0
    _stall0: float = 0.0
    _read: int = 0
    _written: int = 0
    _moved: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    _kinds0: dict[tuple[Kind, Tier, Tier], int] = dataclasses.field(default_factory=dict)
    _kinds1: dict[tuple[Kind, Tier, Tier], int] = dataclasses.field(default_factory=dict)
    _prefetch0: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def nvme_nbytes(self) -> list[int]:
        """Bytes read plus written per step."""
        return [r + w for r, w in zip(self.nvme_read_nbytes, self.nvme_written_nbytes, strict=True)]

    @property
    def step_s(self) -> list[float]:
        """Seconds per step: forward + backward + optimizer step."""
        return [m + o for m, o in zip(self.model_s, self.optimizer_s, strict=True)]

    def begin(self, stats: ManagerStats, waited_s: float = 0.0) -> None:
        self._t0 = self._t = time.perf_counter()
        self._stall0 = self._stall = _stall(stats, waited_s)
        self._read, self._written = _nvme(stats)
        self._moved = [(self._read, self._written)]
        self._kinds0 = dict(stats.kind_nbytes)
        self._prefetch0 = _prefetch(stats)

    def forward_done(self, stats: ManagerStats, waited_s: float = 0.0) -> None:
        self.forward_s.append(time.perf_counter() - self._t0)
        self.forward_stall_s.append(_stall(stats, waited_s) - self._stall0)
        self._moved.append(_nvme(stats))

    def backward_done(self, stats: ManagerStats, waited_s: float = 0.0) -> None:
        now = time.perf_counter()
        stall = _stall(stats, waited_s)
        self.model_s.append(now - self._t0)
        self.model_stall_s.append(stall - self._stall0)
        self._t, self._stall = now, stall
        self._moved.append(_nvme(stats))
        self._kinds1 = dict(stats.kind_nbytes)
        now_prefetch = _prefetch(stats)
        self.model_prefetch.append({k: v - self._prefetch0[k] for k, v in now_prefetch.items()})

    def step_done(self, stats: ManagerStats, waited_s: float = 0.0) -> None:
        self.optimizer_s.append(time.perf_counter() - self._t)
        self.optimizer_stall_s.append(_stall(stats, waited_s) - self._stall)
        read, written = _nvme(stats)
        self.nvme_read_nbytes.append(read - self._read)
        self.nvme_written_nbytes.append(written - self._written)
        marks = [*self._moved, (read, written)]
        if len(marks) == 4:  # begin, forward, backward, step: each phase's bytes
            self.phase_nbytes.append(
                {
                    phase: (marks[i + 1][0] - marks[i][0], marks[i + 1][1] - marks[i][1])
                    for i, phase in enumerate(("forward", "backward", "step"))
                }
            )
        kinds = dict(stats.kind_nbytes)
        self.kind_nbytes.append(
            {
                "model": _kind_delta(self._kinds0, self._kinds1),
                "optimizer": _kind_delta(self._kinds1, kinds),
            }
        )
        self.peak_rss_nbytes.append(peak_rss())


def _prefetch(stats: ManagerStats) -> dict[str, int]:
    """The manager's read-ahead counters so far."""
    return {
        "hits": stats.prefetch_hits,
        "misses": stats.prefetch_misses,
        "dropped": stats.prefetch_dropped,
        "wasted": stats.prefetch_wasted,
    }


def _kind_delta(
    before: dict[tuple[Kind, Tier, Tier], int], after: dict[tuple[Kind, Tier, Tier], int]
) -> dict[str, dict[str, int]]:
    """NVMe bytes read and written between two ``kind_nbytes`` snapshots, by kind name:
    ``{"read": {kind: n}, "written": {kind: n}}`` (kinds that moved nothing left out)."""
    out: dict[str, dict[str, int]] = {"read": {}, "written": {}}
    for (kind, src, dst), nbytes in after.items():
        moved = nbytes - before.get((kind, src, dst), 0)
        if moved <= 0:
            continue
        if (src, dst) == (Tier.NVME, Tier.HOST):
            out["read"][kind.value] = out["read"].get(kind.value, 0) + moved
        elif (src, dst) == (Tier.HOST, Tier.NVME):
            out["written"][kind.value] = out["written"].get(kind.value, 0) + moved
    return out


def _stall(stats: ManagerStats, waited_s: float) -> float:
    """Seconds the training's thread has waited so far: its fetches' waits (not those of
    an overlapped update running beside it) plus ``waited_s``, its waits for that update
    (``OffloadAdamW.overlap_waited_s``)."""
    return stats.foreground_stall_s + waited_s


def _nvme(stats: ManagerStats) -> tuple[int, int]:
    """Bytes read from and written to NVMe so far."""
    return stats.moved(Tier.NVME, Tier.HOST).nbytes, stats.moved(Tier.HOST, Tier.NVME).nbytes


def median_after_first(values: Sequence[float]) -> float:
    """The median of ``values[1:]`` (the first step warms up); of ``values`` when there is
    only one; NaN when empty."""
    if not values:
        return math.nan
    return statistics.median(values[1:] if len(values) > 1 else values)


# ----------------------------------------------------------------------------------------
# The disk


@dataclasses.dataclass(frozen=True)
class DiskRates:
    """Write and read rates of the swap directories, bytes per second, measured with
    the swapper AIO engine (``tiers.aio``): one file of ``nbytes`` per directory, all in
    flight at once; writes timed up to ``fsync`` returning. ``direct``: every transfer
    went through O_DIRECT (else reads may have come from the page cache: the rate is
    then the memory's, and the floor too low)."""

    write_bytes_per_s: float
    read_bytes_per_s: float
    nbytes: int
    direct: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "write_bytes_per_second": self.write_bytes_per_s,
            "read_bytes_per_second": self.read_bytes_per_s,
            "probe_bytes": self.nbytes,
            "direct": self.direct,
            "method": "tiers.aio AioEngine: one file per swap dir, pwrite + fsync, then pread",
        }


def measure_disk(
    dirs: Sequence[Path], aio: AioConfig, nbytes: int = DISK_PROBE_NBYTES
) -> DiskRates:
    """Measure the write and read rates of ``dirs`` (see :class:`DiskRates`). A private
    directory is made in each and removed, with its file, however this ends.

    Raises:
        SwapConfigError: no directories, or ``nbytes`` < 4096.
        SwapError, OSError: the I/O failed.
    """
    if not dirs:
        raise SwapConfigError("measure_disk needs at least one directory")
    if nbytes < 4096:
        raise SwapConfigError(f"nbytes={nbytes} must be >= 4096 (one page)")
    made: list[Path] = []
    try:
        for d in dirs:
            with critical():  # made and recorded together: a signal never splits them
                made.append(Path(tempfile.mkdtemp(prefix="swapper-disk-probe-", dir=d)))
        # Order matters: the engine closes (the kernel is done with the buffer) before
        # the buffer is freed, and both before the files are removed.
        with allocate(nbytes * len(made)) as buffer:
            tensor = buffer.tensor
            tensor.copy_(torch.randint(0, 256, (tensor.numel(),), dtype=torch.uint8))
            views = [tensor[i * nbytes : (i + 1) * nbytes] for i in range(len(made))]
            with contextlib.ExitStack() as stack, AioEngine(aio) as engine:
                files = [stack.enter_context(engine.open(d / "probe", create=True)) for d in made]

                def one_pass(write: bool) -> float:
                    start = time.perf_counter()
                    op = engine.pwrite if write else engine.pread
                    with critical():  # every request handed to the engine, or none
                        futures = [op(v, f) for f, v in zip(files, views, strict=True)]
                    for fut in futures:
                        fut.result()
                    if write:
                        for f in files:
                            os.fsync(f.fd)
                    return time.perf_counter() - start

                one_pass(True)  # untimed: creates and allocates the files
                write_s = one_pass(True)
                read_s = one_pass(False)
                direct = all(f.direct_worked for f in files)
        total = nbytes * len(made)
        return DiskRates(total / write_s, total / read_s, total, direct)
    finally:
        with critical():  # a signal waits until every probe directory is gone
            for d in made:
                shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------------------
# Plain PyTorch


@dataclasses.dataclass(frozen=True)
class PlainRun:
    """What :func:`plain_run` measured: per-step losses and seconds (forward + backward +
    optimizer step), and each phase's seconds (the optimizer's: from the end of backward
    to the end of the update, the fp32 gradients made and the 16-bit weights copied)."""

    losses: list[float]
    step_s: list[float]
    forward_s: list[float] = dataclasses.field(default_factory=list)
    backward_s: list[float] = dataclasses.field(default_factory=list)
    optimizer_s: list[float] = dataclasses.field(default_factory=list)


def plain_run(
    model_config: GPTConfig,
    data: Sequence[torch.Tensor],
    *,
    dtype: torch.dtype,
    seed: int,
    lr: float,
    weight_decay: float = 0.01,
    max_grad_norm: float = 1.0,
) -> PlainRun:
    """Train ``model_config`` on ``data`` with plain PyTorch, as the pressure runner's
    runs do with swapper: 16-bit parameters initialised from ``seed``, fp32 master copies
    updated by ``torch.optim.AdamW(fused=True)`` after clipping the gradient norm to
    ``max_grad_norm``; fp16 scales the loss as the runner does (dynamic, from 2**12) and
    skips a step whose gradients overflow. Everything in memory on the CPU.

    The same math as the runner's reference, by a different code path (the norm is summed
    and the update applied in another order), so the losses agree closely, not bitwise.

    Raises:
        SwapConfigError: ``dtype`` is not bf16 or fp16.
    """
    if dtype not in (torch.bfloat16, torch.float16):
        raise SwapConfigError(f"dtype={dtype} must be torch.bfloat16 or torch.float16")
    model = GPT(model_config).to(dtype)
    init_weights_(model, seed)
    params = list(model.parameters())  # the tied weight once
    masters = [p.detach().float().requires_grad_(True) for p in params]
    optimizer = torch.optim.AdamW(masters, lr=lr, weight_decay=weight_decay, fused=True)
    scaler = DynamicLossScaler(2.0**12) if dtype == torch.float16 else None
    losses: list[float] = []
    step_s: list[float] = []
    run = PlainRun(losses, step_s)
    for tokens in data:
        start = time.perf_counter()
        loss = model.loss(tokens)
        forward = time.perf_counter()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        backward = time.perf_counter()
        scale = scaler.loss_scale if scaler is not None else 1.0
        grads: list[torch.Tensor] = []
        for p, m in zip(params, masters, strict=True):
            # a parameter that took no part in the loss has no gradient: zero, as swapper's
            m.grad = p.grad.float().div_(scale) if p.grad is not None else torch.zeros_like(m)
            grads.append(m.grad)
        found_inf = not all(bool(torch.isfinite(g).all()) for g in grads)
        if not found_inf:
            torch.nn.utils.clip_grad_norm_(masters, max_grad_norm)
            optimizer.step()
            with torch.no_grad():
                for p, m in zip(params, masters, strict=True):
                    p.copy_(m)
        if scaler is not None:
            scaler.update(found_inf)
        model.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        step_s.append(end - start)
        run.forward_s.append(forward - start)
        run.backward_s.append(backward - forward)
        run.optimizer_s.append(end - backward)
        losses.append(float(loss.detach()))
    return run


# ----------------------------------------------------------------------------------------
# The figures


@dataclasses.dataclass(frozen=True)
class Timing:
    """The timing figures of one pressure run (see the module docstring); seconds."""

    seconds_per_step: float
    reference_seconds_per_step: float
    plain_seconds_per_step: float
    io_floor_seconds: float
    stall_seconds: dict[str, float]
    disk: DiskRates
    plain_losses: list[float]
    #: why the seconds beside plain PyTorch may mislead here (:func:`spin_wait_warning`)
    warning: str | None = None

    @classmethod
    def of(cls, pressure: Phases, reference: Phases, plain: PlainRun, disk: DiskRates) -> Timing:
        floors = [
            r / disk.read_bytes_per_s + w / disk.write_bytes_per_s
            for r, w in zip(pressure.nvme_read_nbytes, pressure.nvme_written_nbytes, strict=True)
        ]
        backward_stall = [
            m - f for m, f in zip(pressure.model_stall_s, pressure.forward_stall_s, strict=True)
        ]
        return cls(
            seconds_per_step=median_after_first(pressure.step_s),
            reference_seconds_per_step=median_after_first(reference.step_s),
            plain_seconds_per_step=median_after_first(plain.step_s),
            io_floor_seconds=median_after_first(floors),
            stall_seconds={
                "forward": median_after_first(pressure.forward_stall_s),
                "backward": median_after_first(backward_stall),
                "step": median_after_first(pressure.optimizer_stall_s),
            },
            disk=disk,
            plain_losses=plain.losses,
            warning=spin_wait_warning(),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "seconds_per_step": self.seconds_per_step,
            "reference_seconds_per_step": self.reference_seconds_per_step,
            "plain_seconds_per_step": self.plain_seconds_per_step,
            "io_floor_seconds": self.io_floor_seconds,
            "stall_seconds": self.stall_seconds,
            "timing_notes": (
                "medians over the steps after the first; stall_seconds are per-step medians; "
                "io_floor_seconds = NVMe bytes read / read rate + written / write rate"
            ),
            "disk": self.disk.to_json(),
            "plain_losses": self.plain_losses,
            "timing_warning": self.warning,
        }

    def summary(self) -> str:
        """One line for the human summary, units labelled."""
        s = self.stall_seconds
        return (
            f"per step (median after the first): {self.seconds_per_step:.3f} s budgeted, "
            f"{self.reference_seconds_per_step:.3f} s unlimited, "
            f"{self.plain_seconds_per_step:.3f} s plain PyTorch, I/O floor "
            f"{self.io_floor_seconds:.3f} s (disk {format_size(self.disk.write_bytes_per_s)}/s "
            f"write, {format_size(self.disk.read_bytes_per_s)}/s read"
            f"{'' if self.disk.direct else ', not O_DIRECT'}); stalled {s['forward']:.3f} s "
            f"forward, {s['backward']:.3f} s backward, {s['step']:.3f} s step"
            + (f"\nnote: {self.warning}" if self.warning else "")
        )


def spin_wait_warning(
    *,
    load: float | None = None,
    cpus: int | None = None,
    threads: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """A warning when the machine is busier than its cores and OpenMP spin-waits, else None.

    With libgomp's default (active) wait policy, PyTorch's intra-op threads spin at every
    barrier; when other processes hold the cores, a team waits for a member that is not
    running. Measured on the 2-core VM at load 11-12 (docs/notes/2026-11-28-speed-3.md):
    plain PyTorch's forward + backward of the 20M GPT took 5-8x longer with 2 threads than
    with 1, and not with ``OMP_WAIT_POLICY=PASSIVE``; the offloaded run in the same process
    was not slowed alike, so its ratio to plain PyTorch meant nothing.

    Args (each ``None``: this process's): load: the 1-minute load average; cpus: the cores
    this process may use; threads: torch's intra-op threads; environ: the environment.
    """
    env = os.environ if environ is None else environ
    policy = env.get("OMP_WAIT_POLICY", "").strip().upper()
    if policy == "PASSIVE":
        return None
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not available here: nothing to say
            return None
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if threads is None:
        threads = torch.get_num_threads()
    if threads < 2 or load <= cpus:
        return None
    return (
        f"load average {load:.1f} on {cpus} core(s) with {threads} intra-op threads and "
        "OpenMP spin-waiting: plain PyTorch's seconds may be several times too long here; "
        "set OMP_WAIT_POLICY=PASSIVE for every run compared (docs/cli.md)"
    )
