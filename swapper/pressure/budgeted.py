# Size: ~640 lines: four records (materialise, step, run, comparison) with their JSON and
# summaries, the compute floor and the two runs; the records could move to their own module.
"""Budgeted runs with no in-memory reference: models whose state is larger than memory.

``swapper-pressure --reference none`` (:func:`run_budgeted`) trains only the budgeted
model: built on the meta device and materialised module by module straight into the
tiers, so no step ever needs the whole model in memory. With no unlimited run to compare
with, it proves what it can without one and says where each second went:

- before the model exists: the swap directories' write and read rates, measured with the
  AIO engine ``swapper-bench`` uses (:func:`~swapper.pressure.timing.measure_disk`, a
  larger probe than the reference mode's), and the **compute floor** of the optimizer
  step: fused AdamW (as the step runs it: fp32 gradient from the 16-bit one, the update,
  the 16-bit parameters rounded from the masters, on the step's threads) timed on one
  in-memory sub-group, times the sub-groups (:func:`compute_floor`);
- the materialisation: seconds to wrap the model (of which the in-memory initialisation)
  and to create the optimizer's state, and the bytes they wrote, against the bound
  ``1.3 x bytes / write rate + in-memory init`` (:class:`MaterialiseFigures`);
- per step (:class:`StepFigures`): forward, backward and step seconds, the training
  thread's stall in each, NVMe bytes read and written by kind in each phase, the step's
  **I/O floor** (its bytes over the measured rates; reads and writes share one disk, so
  their times add), the optimizer's ratio to ``max(I/O floor, compute floor)`` and the
  disk's busy fraction inside it (its floor over its seconds: 1.0 is the bench's rate),
  and the peak RSS so far;
- the state's bytes beside the machine's memory, the peak RSS beside ``device budget +
  host budget + 2 x activations + 1.5 GiB``, and the final digest.

With ``--overlap`` the update runs after ``step()`` returns, beside the next forward: its
bytes and seconds land in that forward's figures, and the optimizer's ratios are not
measured.

:func:`compare_budgets` (``--compare-budgets``) is the parity proof where no in-memory run
fits: the same model twice, the second with the device and host budgets split otherwise,
half the sub-group and ``--overlap`` flipped; losses and final digests must be
bit-identical.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from swapper.manager import Tier
from swapper.pressure.export import export_json
from swapper.pressure.memory import reset_peak_rss, return_freed_memory, rss_bound_nbytes
from swapper.pressure.model import GPTConfig, batches
from swapper.pressure.runner import (
    DTYPES,
    Materialised,
    PressureSettings,
    baseline_rss,
    budgeted_config,
    default_budgets,
    snapshots_json,
    state_nbytes_per_param,
    store_dirs,
    train_once,
)
from swapper.pressure.timeline import PhaseRow, phase_rows
from swapper.pressure.timing import DiskRates, Phases, measure_disk
from swapper.zero.checkpoint import SnapshotReport
from tiers.errors import SwapConfigError
from tiers.units import format_size

__all__ = [
    "BudgetComparison",
    "BudgetedResult",
    "MaterialiseFigures",
    "StepFigures",
    "compare_budgets",
    "compute_floor",
    "other_split",
    "run_budgeted",
]

#: Bytes per swap directory of the disk probe taken before the model is built: larger
#: than the reference mode's 32 MiB, so the rates are the device's and not a cache's.
DISK_PROBE_NBYTES = 256 << 20
#: Materialisation may take this many times its bytes over the disk's write rate (plus
#: the in-memory initialisation).
MATERIALISE_FACTOR = 1.3
#: Bytes of training state per parameter beside the optimizer's: 16-bit param + grad.
_PARAM_GRAD_NBYTES = 4


def compute_floor(sub_group_numel: int, moments: str = "fp32", *, repeats: int = 3) -> float:
    """Seconds of the optimizer's compute on one in-memory sub-group of ``sub_group_numel``
    elements: the fp32 gradient built from a 16-bit one, ``torch._fused_adamw_`` on fp32
    master and moments, and the 16-bit parameters rounded from the masters, on the threads
    the step uses (one core left to the I/O threads, as ``SubGroupMath._run`` does, except
    with int8 moments); the median of ``repeats`` after one warm-up. The codec of
    compressed moments is not included: this is the fp32 update's floor.

    Raises:
        SwapConfigError: ``sub_group_numel`` < 1 or ``repeats`` < 1.
    """
    if sub_group_numel < 1 or repeats < 1:
        raise SwapConfigError(
            f"compute_floor needs sub_group_numel >= 1 and repeats >= 1, got "
            f"{sub_group_numel} and {repeats}"
        )
    n = sub_group_numel
    master, grad, exp_avg, exp_avg_sq = (torch.rand(n) for _ in range(4))
    grad16 = torch.rand(n).to(torch.bfloat16)
    param16 = torch.empty(n, dtype=torch.bfloat16)
    threads = torch.get_num_threads()
    times: list[float] = []
    try:
        if threads > 1 and moments != "int8":
            torch.set_num_threads(threads - 1)
        for i in range(repeats + 1):
            start = time.perf_counter()
            grad.copy_(grad16)
            torch._fused_adamw_(  # pyright: ignore[reportPrivateImportUsage]
                [master],
                [grad],
                [exp_avg],
                [exp_avg_sq],
                [],
                [torch.tensor(float(i + 1))],
                lr=1e-3,
                beta1=0.9,
                beta2=0.999,
                weight_decay=0.01,
                eps=1e-8,
                amsgrad=False,
                maximize=False,
            )
            param16.copy_(master)
            if i:
                times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times)


def _memory_total_nbytes() -> int:
    """The machine's memory (``MemTotal``), bytes; 0 where /proc/meminfo is absent."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclasses.dataclass(frozen=True)
class MaterialiseFigures:
    """The model built into the tiers: seconds and bytes, and the bound it should meet."""

    modules: int
    model_s: float
    init_s: float
    optimizer_s: float
    written_nbytes: int
    write_bytes_per_s: float

    @classmethod
    def of(cls, built: Materialised, disk: DiskRates) -> MaterialiseFigures:
        return cls(
            modules=built.modules,
            model_s=built.model_s,
            init_s=built.init_s,
            optimizer_s=built.optimizer_s,
            written_nbytes=built.model_written_nbytes + built.optimizer_written_nbytes,
            write_bytes_per_s=disk.write_bytes_per_s,
        )

    @property
    def seconds(self) -> float:
        """Wrap + optimizer creation."""
        return self.model_s + self.optimizer_s

    @property
    def bound_s(self) -> float:
        """``1.3 x written bytes / write rate + in-memory initialisation`` (issue 23)."""
        return MATERIALISE_FACTOR * self.written_nbytes / self.write_bytes_per_s + self.init_s

    def to_json(self) -> dict[str, Any]:
        return {
            "modules": self.modules,
            "model_seconds": self.model_s,
            "in_memory_init_seconds": self.init_s,
            "optimizer_seconds": self.optimizer_s,
            "seconds": self.seconds,
            "nvme_written_bytes": self.written_nbytes,
            "bound_seconds": self.bound_s,
            "within_bound": self.seconds <= self.bound_s,
        }


@dataclasses.dataclass(frozen=True)
class StepFigures:
    """One training step of a budgeted run (seconds, bytes); see the module docstring."""

    step: int
    loss: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    forward_stall_s: float
    backward_stall_s: float
    optimizer_stall_s: float
    #: {"model" | "optimizer": {"read" | "written": {kind: bytes}}}
    nvme_nbytes: dict[str, dict[str, dict[str, int]]]
    io_floor_s: float
    optimizer_io_floor_s: float
    compute_floor_s: float
    peak_rss_nbytes: int
    overlap: bool
    #: read-ahead counters over forward + backward (hits, misses, dropped, wasted)
    prefetch: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def forward_backward_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def forward_backward_stall_fraction(self) -> float:
        """Stall of forward + backward over their seconds."""
        total = self.forward_backward_s
        return (self.forward_stall_s + self.backward_stall_s) / total if total > 0 else 0.0

    @property
    def optimizer_over_floor(self) -> float | None:
        """Optimizer seconds over ``max(its I/O floor, compute floor)``; None with overlap."""
        floor = max(self.optimizer_io_floor_s, self.compute_floor_s)
        return None if self.overlap or floor <= 0 else self.optimizer_s / floor

    @property
    def optimizer_disk_busy(self) -> float | None:
        """The optimizer's I/O floor over its seconds: the disk's in-step throughput as a
        fraction of the bench's (1.0: it ran at the measured rates the whole step); None
        with overlap."""
        return (
            None
            if self.overlap or self.optimizer_s <= 0
            else (self.optimizer_io_floor_s / self.optimizer_s)
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "loss": self.loss,
            "forward_seconds": self.forward_s,
            "backward_seconds": self.backward_s,
            "forward_backward_seconds": self.forward_backward_s,
            "optimizer_seconds": self.optimizer_s,
            "forward_stall_seconds": self.forward_stall_s,
            "backward_stall_seconds": self.backward_stall_s,
            "optimizer_stall_seconds": self.optimizer_stall_s,
            "forward_backward_stall_fraction": self.forward_backward_stall_fraction,
            "nvme_bytes": self.nvme_nbytes,
            "io_floor_seconds": self.io_floor_s,
            "optimizer_io_floor_seconds": self.optimizer_io_floor_s,
            "compute_floor_seconds": self.compute_floor_s,
            "optimizer_over_floor": self.optimizer_over_floor,
            "optimizer_disk_busy_fraction": self.optimizer_disk_busy,
            "peak_rss_bytes": self.peak_rss_nbytes,
            "forward_backward_prefetch": self.prefetch,
        }


def _step_figures(
    phases: Phases,
    losses: list[float],
    first_step: int,
    disk: DiskRates,
    compute_floor_s: float,
    overlap: bool,
) -> list[StepFigures]:
    def floor(moved: dict[str, dict[str, int]]) -> float:
        return (
            sum(moved["read"].values()) / disk.read_bytes_per_s
            + sum(moved["written"].values()) / disk.write_bytes_per_s
        )

    out: list[StepFigures] = []
    for i, loss in enumerate(losses):
        kinds = phases.kind_nbytes[i]
        out.append(
            StepFigures(
                step=first_step + i,
                loss=loss,
                forward_s=phases.forward_s[i],
                backward_s=phases.model_s[i] - phases.forward_s[i],
                optimizer_s=phases.optimizer_s[i],
                forward_stall_s=phases.forward_stall_s[i],
                backward_stall_s=phases.model_stall_s[i] - phases.forward_stall_s[i],
                optimizer_stall_s=phases.optimizer_stall_s[i],
                nvme_nbytes=kinds,
                io_floor_s=floor(kinds["model"]) + floor(kinds["optimizer"]),
                optimizer_io_floor_s=floor(kinds["optimizer"]),
                compute_floor_s=compute_floor_s,
                peak_rss_nbytes=phases.peak_rss_nbytes[i],
                overlap=overlap,
                prefetch=phases.model_prefetch[i],
            )
        )
    return out


@dataclasses.dataclass(frozen=True)
class BudgetedResult:
    """What :func:`run_budgeted` found; :meth:`to_json` is its ``--json``."""

    settings: PressureSettings
    model: GPTConfig
    num_params: int
    budget_bytes: dict[str, int]
    peak_bytes: dict[str, int]
    sub_group_numel: int
    peak_rss_bytes: int
    baseline_rss_bytes: int
    activation_bytes: int
    #: peak RSS after training, while the final state was hashed, digested and exported
    final_peak_rss_bytes: int
    disk: DiskRates
    compute_floor_sub_group_s: float
    materialised: MaterialiseFigures
    steps: list[StepFigures]
    seconds: float
    final_digest: str
    resumed_from_step: int = 0
    snapshots: tuple[SnapshotReport, ...] = ()
    export_seconds: float | None = None
    #: each step's phases (``--timeline``; no plain run here, so no plain column)
    timeline: tuple[PhaseRow, ...] = ()

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    @property
    def sub_groups(self) -> int:
        """Sub-groups of the optimizer step (parameters over the sub-group size)."""
        return math.ceil(self.num_params / self.sub_group_numel)

    @property
    def state_nbytes(self) -> int:
        """Training state: 16-bit parameters and gradients and the optimizer's state."""
        per_param = _PARAM_GRAD_NBYTES + state_nbytes_per_param(self.settings)
        return round(per_param * self.num_params)

    @property
    def rss_bound_bytes(self) -> int:
        """Device + host budgets + 2 x activations (saved, and their gradients) + 1.5 GiB."""
        return rss_bound_nbytes(self.budget_bytes, self.activation_bytes)

    @property
    def within_budgets(self) -> bool:
        return all(self.peak_bytes[t] <= limit for t, limit in self.budget_bytes.items())

    @property
    def losses_finite(self) -> bool:
        return all(math.isfinite(x) for x in self.losses)

    @property
    def ok(self) -> bool:
        """Finite losses, every tier within budget, peak RSS within its bound."""
        return self.losses_finite and self.within_budgets and self.rss_within_bound

    @property
    def rss_within_bound(self) -> bool:
        """The training's peak RSS and the final phase's (digest, export) within the bound."""
        return max(self.peak_rss_bytes, self.final_peak_rss_bytes) <= self.rss_bound_bytes

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": "none",
            "params": self.num_params,
            "model": dataclasses.asdict(self.model),
            "steps": self.settings.steps,
            "seed": self.settings.seed,
            "dtype": self.settings.dtype,
            "batch": self.settings.batch,
            "seq": self.settings.seq,
            "overlap": self.settings.overlap,
            "moments": self.settings.moments,
            "losses": self.losses,
            "losses_finite": self.losses_finite,
            "state_bytes": self.state_nbytes,
            "memory_total_bytes": _memory_total_nbytes(),
            "budget_bytes": self.budget_bytes,
            "peak_bytes": self.peak_bytes,
            "within_budgets": self.within_budgets,
            "sub_group_numel": self.sub_group_numel,
            "sub_groups": self.sub_groups,
            "peak_rss_bytes": self.peak_rss_bytes,
            "final_phase_peak_rss_bytes": self.final_peak_rss_bytes,
            "baseline_rss_bytes": self.baseline_rss_bytes,
            "activation_bytes": self.activation_bytes,
            "rss_bound_bytes": self.rss_bound_bytes,
            "disk": self.disk.to_json(),
            "compute_floor_sub_group_seconds": self.compute_floor_sub_group_s,
            # (resumed: the wrap opened the snapshot; nothing was materialised)
            "materialise": None if self.resumed_from_step else self.materialised.to_json(),
            "open_seconds": self.materialised.seconds if self.resumed_from_step else None,
            "per_step": [s.to_json() for s in self.steps],
            "seconds": self.seconds,
            "final_digest": self.final_digest,
            "resumed_from_step": self.resumed_from_step,
            **export_json(self.settings.export_dir, self.export_seconds),
            "snapshots": snapshots_json(self.snapshots),
            "timeline": [row.to_json() for row in self.timeline],
            "ok": self.ok,
        }

    def summary(self) -> str:
        """The human summary: units labelled, one line per step and per figure."""
        m = self.materialised
        built = (
            f"resumed from step {self.resumed_from_step}: the model and optimizer opened from "
            f"the snapshot in {m.seconds:.1f} s (no materialisation to measure)"
            if self.resumed_from_step
            else f"materialised {m.modules} modules in {m.seconds:.1f} s (wrap {m.model_s:.1f} s, "
            f"of which in-memory init {m.init_s:.1f} s; optimizer {m.optimizer_s:.1f} s; "
            f"{format_size(m.written_nbytes)} written); bound {m.bound_s:.1f} s"
        )
        lines = [
            f"state {format_size(self.state_nbytes)} beside {format_size(_memory_total_nbytes())} "
            f"of memory; disk {self.disk.write_bytes_per_s / 2**30:.2f} GiB/s write (to fsync), "
            f"{self.disk.read_bytes_per_s / 2**30:.2f} GiB/s read",
            built,
            "step  loss           fwd+bwd s  stall %  step s  I/O floor  compute floor  "
            "ratio  disk busy",
        ]
        for s in self.steps:
            ratio = s.optimizer_over_floor
            busy = s.optimizer_disk_busy
            lines.append(
                f"{s.step:>4}  {s.loss:<13.9g}  {s.forward_backward_s:>9.2f}  "
                f"{100 * s.forward_backward_stall_fraction:>6.1f}  {s.optimizer_s:>6.2f}  "
                f"{s.optimizer_io_floor_s:>9.2f}  {s.compute_floor_s:>13.2f}  "
                + ("    -" if ratio is None else f"{ratio:>5.2f}")
                + ("          -" if busy is None else f"  {100 * busy:>8.1f}%")
            )
        for tier, limit in self.budget_bytes.items():
            lines.append(
                f"{tier} peak {format_size(self.peak_bytes[tier])} of budget {format_size(limit)}"
            )
        lines.append(
            f"peak RSS {format_size(self.peak_rss_bytes)} in training, "
            f"{format_size(self.final_peak_rss_bytes)} after it (final digest, export); "
            f"bound {format_size(self.rss_bound_bytes)}"
            f" (budgets + 2 x activations {format_size(self.activation_bytes)} + 1.5 GiB)"
        )
        for snap in self.snapshots:
            lines.append(
                f"snapshot {snap.name}: {format_size(snap.written_nbytes)} written of "
                f"{format_size(snap.nbytes)} of state in {snap.seconds:.2f} s"
            )
        if self.export_seconds is not None:
            lines.append(f"export: {self.settings.export_dir}, {self.export_seconds:.2f} s")
        lines.append(f"final digest {self.final_digest}")
        lines.append(
            "result (no reference): "
            + ("losses finite" if self.losses_finite else "NON-FINITE LOSS")
            + (", within budgets" if self.within_budgets else ", OVER BUDGET")
            + (", peak RSS within bound" if self.rss_within_bound else ", PEAK RSS OVER BOUND")
        )
        return "\n".join(lines)


def run_budgeted(
    settings: PressureSettings, *, say: Callable[[str], None] = lambda line: None
) -> BudgetedResult:
    """Train only the budgeted model (see the module docstring). ``say`` receives
    progress lines.

    Raises:
        SwapConfigError: a budget cannot work for this model (named).
        SwapError, OSError: the tiers failed.
    """
    model_config = GPTConfig.for_params(settings.params)
    num_params = model_config.num_params()
    dtype = DTYPES[settings.dtype]
    device, host, sub_group = default_budgets(settings, num_params)
    data = batches(
        model_config, batch=settings.batch, seq=settings.seq, steps=settings.steps,
        seed=settings.seed,
    )  # fmt: skip
    return_freed_memory()
    reset_peak_rss()  # (a run before this one in the process, e.g. compare_budgets' first)
    baseline = baseline_rss(settings, dtype)
    state = round((_PARAM_GRAD_NBYTES + state_nbytes_per_param(settings)) * num_params)
    say(
        f"swapper-pressure (no reference): GPT of {num_params:,} params "
        f"({model_config.n_layers} layers, d_model {model_config.d_model}), {settings.dtype}, "
        f"{settings.steps} steps; training state {format_size(state)} beside "
        f"{format_size(_memory_total_nbytes())} of memory; device budget {format_size(device)}, "
        f"host budget {format_size(host)}, sub-group {sub_group:,} elements"
    )
    floor_s = compute_floor(sub_group, settings.moments)
    say(f"  compute floor: {floor_s:.3f} s per sub-group in memory")
    with store_dirs(settings) as dirs:
        # the swap directories' disk, before the model fills it (their parents exist now)
        disk = measure_disk([d.parent for d in dirs], settings.aio, nbytes=DISK_PROBE_NBYTES)
        say(
            f"  disk: {disk.write_bytes_per_s / 2**30:.2f} GiB/s write (to fsync), "
            f"{disk.read_bytes_per_s / 2**30:.2f} GiB/s read"
        )
        config = budgeted_config(settings, device, host, sub_group, dirs)
        return_freed_memory()
        reset_peak_rss()
        run = train_once(
            model_config, config, data, settings, dtype, say, "budgeted", checkpoint=True
        )
    stats = run.stats
    peaks = {t.value: stats.tiers[t].peak_nbytes or 0 for t in (Tier.DEVICE, Tier.HOST)}
    sub_groups = math.ceil(num_params / sub_group)
    return BudgetedResult(
        settings=settings,
        model=model_config,
        num_params=num_params,
        budget_bytes={"device": device, "host": host},
        peak_bytes=peaks,
        sub_group_numel=sub_group,
        peak_rss_bytes=run.peak_rss_bytes,
        baseline_rss_bytes=baseline,
        activation_bytes=run.activation_bytes,
        final_peak_rss_bytes=run.final_peak_rss_bytes,
        disk=disk,
        compute_floor_sub_group_s=floor_s,
        materialised=MaterialiseFigures.of(run.materialised, disk),
        steps=_step_figures(
            run.phases,
            run.losses,
            run.resumed_from + 1,
            disk,
            floor_s * sub_groups,
            settings.overlap,
        ),
        seconds=run.seconds,
        final_digest=run.digest,
        resumed_from_step=run.resumed_from,
        snapshots=tuple(run.snapshots),
        export_seconds=run.export_seconds,
        timeline=tuple(phase_rows(run.phases, disk, first_step=run.resumed_from + 1)),
    )


def other_split(settings: PressureSettings, num_params: int) -> PressureSettings:
    """The second run of :func:`compare_budgets`: twice the device budget, taken from the
    host budget (the same total, split otherwise; the host keeps at least half its own),
    half the sub-group (at least 1024 elements) and ``overlap`` flipped; no snapshots,
    resume or export.

    Raises:
        SwapConfigError: the settings are invalid (see :class:`PressureSettings`).
    """
    device, host, sub_group = default_budgets(settings, num_params)
    return dataclasses.replace(
        settings,
        device_nbytes=2 * device,
        host_nbytes=max(host - device, host // 2),
        sub_group_numel=max(1024, sub_group // 2),
        overlap=not settings.overlap,
        checkpoint_every=None,
        resume=False,
        export_dir=None,
    )


@dataclasses.dataclass(frozen=True)
class BudgetComparison:
    """Two budgeted runs of one model under different budgets (:func:`compare_budgets`)."""

    first: BudgetedResult
    second: BudgetedResult

    @property
    def identical(self) -> bool:
        """Bit-identical losses (NaN equal to NaN) and final digests."""
        a, b = self.first.losses, self.second.losses
        same = len(a) == len(b) and all(
            x == y or (x != x and y != y) for x, y in zip(a, b, strict=True)
        )
        return same and self.first.final_digest == self.second.final_digest

    @property
    def ok(self) -> bool:
        return self.identical and self.first.ok and self.second.ok

    def to_json(self) -> dict[str, Any]:
        return {
            "compare_budgets": True,
            "identical": self.identical,
            "ok": self.ok,
            "runs": [self.first.to_json(), self.second.to_json()],
        }

    def summary(self) -> str:
        lines: list[str] = []
        for label, run in (("first", self.first), ("second", self.second)):
            s = run.settings
            lines.append(
                f"--- {label} run: device {format_size(run.budget_bytes['device'])}, host "
                f"{format_size(run.budget_bytes['host'])}, sub-group {run.sub_group_numel:,}, "
                f"overlap {'on' if s.overlap else 'off'}"
            )
            lines.append(run.summary())
        lines.append(
            "result (two budget splits): "
            + ("bit-identical losses and final digests" if self.identical else "DIFFERENT")
        )
        return "\n".join(lines)


def compare_budgets(
    settings: PressureSettings, *, say: Callable[[str], None] = lambda line: None
) -> BudgetComparison:
    """Train the model of ``settings`` twice with no reference: as given, then under
    :func:`other_split`; compare losses and final digests (:class:`BudgetComparison`).

    Raises:
        SwapConfigError: a budget cannot work for this model (named).
        SwapError, OSError: the tiers failed.
    """
    first = run_budgeted(settings, say=say)
    second = run_budgeted(other_split(settings, first.num_params), say=say)
    return BudgetComparison(first, second)
