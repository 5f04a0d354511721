# Size: ~700 lines: settings, result record (its JSON) and the run; the record grew with
# issue 14 (overlap, compressed moments) and issue 29 (NVMe writes by kind, per day): split next.
"""Train a GPT under tight per-tier budgets, next to an unlimited run, and compare.

One run (:func:`run_pressure`):

1. measures the baseline: the process's resident memory with torch loaded and a tiny
   model trained for one step through the same code (allocator, thread pools warm), but
   without the model under test;
2. the **pressure run**: the model built on the meta device and materialised module by
   module straight into the tiers (:func:`swapper.offload`), trained for ``steps``
   steps with :class:`~swapper.OffloadAdamW` whose state is in the same tiers, under
   the given device and host budgets, spilling to NVMe in ``dirs``; its peak resident
   memory is taken from ``VmHWM`` (reset before it starts);
3. the **reference run**: the same seed, model, data and code with unlimited budgets
   (everything in memory);

and reports per-step losses of both, whether losses, final parameters and the
``final_digest`` of parameters and optimizer state are bit-identical, peak bytes per
tier against the budgets, the pressure run's peak RSS, bytes moved and stall fraction
(time the training's thread waited for bytes / training time: its fetches' waits, and
with an overlapped step its waits for the update beside it, not the update's own), and
the timing figures of :mod:`swapper.pressure.timing` (seconds per step beside a plain
PyTorch run, the I/O floor from the disk's rates measured in the swap directories, the
stall split).

With ``checkpoint_every`` the pressure run takes a training snapshot every that many steps
(:func:`swapper.zero.checkpoint.snapshot.save_snapshot`, the ``keep_last`` newest kept) in a store
that outlives the process (``<dir>/swapper-pressure-checkpoint``, not removed); with
``resume`` it continues from the newest usable snapshot there (or starts afresh), and the
comparison covers the steps it ran and the final state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from swapper.interrupts import critical
from swapper.manager import Kind, ManagerStats, Tier
from swapper.pressure.export import export_final, export_json
from swapper.pressure.memory import SavedBytes, peak_rss, reset_peak_rss, return_freed_memory
from swapper.pressure.model import GPT, GPTConfig, batches, materialize_
from swapper.pressure.timeline import PhaseRow, phase_rows
from swapper.pressure.timing import Phases, Timing, measure_disk, plain_run
from swapper.step import DynamicLossScaler, StepConfig
from swapper.step.offload_optimizer import NAMED, make_optimizer, state_nbytes_per_element
from swapper.zero.checkpoint.snapshot import SnapshotReport, final_digest, save_snapshot
from swapper.zero.config.offload import OffloadConfig
from swapper.zero.local.offload import OffloadedModel
from tiers.config import AioConfig
from tiers.errors import SwapConfigError
from tiers.nvme import content_hash
from tiers.units import format_size

__all__ = [
    "PressureResult",
    "PressureSettings",
    "baseline_rss",
    "budgeted_config",
    "default_budgets",
    "run_pressure",
    "snapshots_json",
    "state_nbytes_per_param",
    "store_dirs",
    "swap_dirs",
    "train_once",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PressureSettings:
    """What one pressure run does. Sizes in bytes.

    Attributes:
        params: target parameter count of the GPT (see ``GPTConfig.for_params``).
        steps: optimizer steps.
        seed: model initialisation and data.
        device_nbytes: device budget (``None``: a quarter of the 16-bit parameters).
        host_nbytes: host budget (``None``: a quarter of the optimizer state; AdamW's is
            12 B/param, see :func:`state_nbytes_per_param`).
        dirs: directories to swap to; a private directory is made in each and removed
            after (empty: one temporary directory).
        dtype: ``"bf16"`` or ``"fp16"`` (fp16 trains with a dynamic loss scaler).
        batch, seq: sequences per step and tokens per sequence.
        sub_group_numel: optimizer sub-group size (``None``: what lets the host budget
            hold 4 sub-groups).
        lr: AdamW learning rate.
        aio: the I/O settings of the NVMe tier (the command line's come from
            ``SWAPPER_AIO_*``).
        checkpoint_every: take a training snapshot every this many steps (None: never).
        resume: continue from the newest usable snapshot in the checkpoint store.
        keep_last: snapshots kept.
        export_dir: after the pressure run, export its final state there: safetensors of
            the weights and a Distributed Checkpoint (:mod:`swapper.pressure.export`).
        overlap: the budgeted run overlaps each optimizer step with the next forward
            (``StepConfig(overlap=True)``); the unlimited reference does not, so the
            comparison checks that it changes no result.
        moments: how the optimizer stores its Adam moments (``StepConfig.moments``), in
            both runs.
        optimizer: ``adamw`` (``OffloadAdamW``, weight decay 0.01) or a name of
            :data:`swapper.step.offload_optimizer.NAMED` (``OffloadOptimizer`` over that
            ``torch.optim`` class), in both runs.
    """

    params: int = 2_000_000
    steps: int = 5
    seed: int = 0
    device_nbytes: int | None = None
    host_nbytes: int | None = None
    dirs: tuple[Path, ...] = ()
    dtype: str = "bf16"
    batch: int = 4
    seq: int = 64
    #: the budgeted run's ManagerConfig.write_budget_bytes_per_day / _strict (issue 29)
    write_budget_bytes_per_day: float | None = None
    write_budget_strict: bool = False
    sub_group_numel: int | None = None
    lr: float = 1e-3
    aio: AioConfig = dataclasses.field(default_factory=AioConfig)
    checkpoint_every: int | None = None
    resume: bool = False
    keep_last: int = 2
    export_dir: Path | None = None
    overlap: bool = False
    moments: str = "fp32"
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        StepConfig(moments=self.moments)  # validates it (SwapConfigError naming it)
        if self.optimizer != "adamw" and self.optimizer not in NAMED:
            raise SwapConfigError(
                f"optimizer={self.optimizer!r} must be adamw or one of {', '.join(NAMED)}"
            )
        if self.optimizer != "adamw" and self.moments != "fp32":
            raise SwapConfigError(
                f"moments={self.moments!r} is AdamW's; optimizer={self.optimizer!r} stores fp32"
            )
        if not isinstance(self.aio, AioConfig):
            raise SwapConfigError(f"aio={self.aio!r} must be an AioConfig")
        if self.dtype not in DTYPES:
            raise SwapConfigError(f"dtype={self.dtype!r} must be one of {sorted(DTYPES)}")
        for name in ("params", "steps", "batch", "seq", "checkpoint_every", "keep_last"):
            value = getattr(self, name)
            if value is None and name == "checkpoint_every":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SwapConfigError(f"{name}={value!r} must be an int >= 1")
        if self.checkpointing and not self.dirs:
            raise SwapConfigError(
                "checkpoint_every and resume need swap directories (--dir): the snapshots "
                "must outlive the process"
            )

    @property
    def checkpointing(self) -> bool:
        """Snapshots are taken or resumed: the store outlives the run."""
        return self.checkpoint_every is not None or self.resume


@dataclasses.dataclass
class TrainedRun:
    losses: list[float]
    param_hashes: dict[str, int]
    stats: Any
    seconds: float
    peak_rss_bytes: int
    activation_bytes: int
    phases: Phases
    digest: str = ""
    resumed_from: int = 0
    snapshots: list[SnapshotReport] = dataclasses.field(default_factory=list)
    export_seconds: float | None = None
    #: optimizer state bytes read from / written to NVMe by the last step
    state_read_nbytes: int = 0
    state_written_nbytes: int = 0
    #: seconds the training's thread waited for bytes (see ``timing._stall``)
    stall_s: float = 0.0
    #: bytes written to NVMe over the steps run, by kind (``ManagerStats.nvme_written``)
    nvme_written: dict[str, int] = dataclasses.field(default_factory=dict)
    steps_run: int = 0
    materialised: Materialised = dataclasses.field(default_factory=lambda: Materialised())
    #: peak RSS while the final state was hashed, digested and exported (after training)
    final_peak_rss_bytes: int = 0


@dataclasses.dataclass
class Materialised:
    """How long building the model into the tiers took (seconds; bytes to NVMe).

    ``model_s``: the wrap (``OffloadedModel``: meta → memory → tiers, module by module),
    of which ``place_s`` was handing modules to the tiers and the rest the in-memory
    initialisation (allocation and draws, ``init_s``); ``optimizer_s``: the optimizer's
    creation (fp32 master weights and moments into the tiers).
    """

    modules: int = 0
    model_s: float = 0.0
    place_s: float = 0.0
    optimizer_s: float = 0.0
    model_written_nbytes: int = 0
    optimizer_written_nbytes: int = 0

    @property
    def init_s(self) -> float:
        """Seconds of in-memory initialisation over all modules."""
        return max(0.0, self.model_s - self.place_s)


@dataclasses.dataclass(frozen=True)
class PressureResult:
    """What :func:`run_pressure` found; :meth:`to_json` is ``swapper-pressure --json``."""

    settings: PressureSettings
    model: GPTConfig
    num_params: int
    losses: list[float]
    reference_losses: list[float]
    identical: bool
    peak_bytes: dict[str, int]
    budget_bytes: dict[str, int | None]
    peak_rss_bytes: int
    baseline_rss_bytes: int
    sub_group_numel: int
    activation_bytes: int
    bytes_moved: int
    phases: Phases
    reference_phases: Phases
    stall_fraction: float
    seconds: float
    reference_seconds: float
    final_digest: str = ""
    reference_final_digest: str = ""
    resumed_from_step: int = 0
    snapshots: tuple[SnapshotReport, ...] = ()
    export_seconds: float | None = None  # safetensors + DCP (swapper.pressure.export)
    timing: Timing | None = None  # seconds per step, I/O floor, stall split
    #: optimizer state bytes per parameter read from / written to NVMe by the last step
    state_read_bytes_per_param: float = 0.0
    state_written_bytes_per_param: float = 0.0
    #: bytes written to NVMe by the budgeted run's steps (snapshots included), by kind:
    #: tensor kinds and the store's metadata (``ManagerStats.nvme_written``)
    nvme_written_by_kind: dict[str, int] = dataclasses.field(default_factory=dict)
    steps_run: int = 0
    #: the budgeted run's phases step by step, beside plain PyTorch's (``--timeline``)
    timeline: tuple[PhaseRow, ...] = ()

    @property
    def nvme_written_bytes_per_step(self) -> float:
        """Bytes written to NVMe per step of the budgeted run (every kind, metadata too)."""
        return sum(self.nvme_written_by_kind.values()) / max(1, self.steps_run)

    @property
    def nvme_written_bytes_per_token(self) -> float:
        """The same per token trained (batch x sequence length tokens a step)."""
        return self.nvme_written_bytes_per_step / (self.settings.batch * self.settings.seq)

    @property
    def nvme_written_bytes_per_day(self) -> float:
        """What the drive would be asked to write in a day at this run's measured rate
        (its bytes written over its wall time, snapshots included)."""
        if self.seconds <= 0:
            return 0.0
        return sum(self.nvme_written_by_kind.values()) / self.seconds * 86400

    @property
    def within_budgets(self) -> bool:
        """Every tier's peak is within its budget."""
        return all(
            limit is None or self.peak_bytes[tier] <= limit
            for tier, limit in self.budget_bytes.items()
        )

    @property
    def rss_bound_bytes(self) -> int:
        """What the peak RSS should stay under: host budget + device budget + the
        baseline + what the run holds outside the budgets by design: the optimizer's
        buffers (:attr:`optimizer_buffer_bytes`) and the batch's activations, twice (the
        tensors saved for backward, and their gradients while backward runs)."""
        return (
            (self.budget_bytes["host"] or 0)
            + (self.budget_bytes["device"] or 0)
            + self.baseline_rss_bytes
            + self.optimizer_buffer_bytes
            + 2 * self.activation_bytes
        )

    @property
    def optimizer_buffer_bytes(self) -> int:
        """The optimizer's buffers outside the budgets, per sub-group element: 16 B (12 B
        of set-up scratch, then the 4 B fp32 gradient), 24 B with compressed moments (8 B
        more of set-up scratch, and the 8 B fp32 moments are decoded into)."""
        return (16 if self.settings.moments == "fp32" else 24) * self.sub_group_numel

    @property
    def ok(self) -> bool:
        """Identical results within budgets: the run proves what it should."""
        return self.identical and self.within_budgets

    def to_json(self) -> dict[str, Any]:
        return {
            "params": self.num_params,
            "model": dataclasses.asdict(self.model),
            "steps": self.settings.steps,
            "seed": self.settings.seed,
            "dtype": self.settings.dtype,
            "overlap": self.settings.overlap,
            "moments": self.settings.moments,
            # (None with overlap: the update's I/O runs after step() returns, unmeasured)
            "optimizer_read_bytes_per_param_per_step": None
            if self.settings.overlap
            else self.state_read_bytes_per_param,
            "optimizer_written_bytes_per_param_per_step": None
            if self.settings.overlap
            else self.state_written_bytes_per_param,
            "losses": self.losses,
            "reference_losses": self.reference_losses,
            "identical": self.identical,
            "peak_bytes": self.peak_bytes,
            "budget_bytes": self.budget_bytes,
            "within_budgets": self.within_budgets,
            "peak_rss_bytes": self.peak_rss_bytes,
            "baseline_rss_bytes": self.baseline_rss_bytes,
            "rss_bound_bytes": self.rss_bound_bytes,
            "sub_group_numel": self.sub_group_numel,
            "activation_bytes": self.activation_bytes,
            "bytes_moved": self.bytes_moved,
            "nvme_written_bytes_per_step": self.nvme_written_bytes_per_step,
            "nvme_written_bytes_per_token": self.nvme_written_bytes_per_token,
            "nvme_written_bytes_per_step_by_kind": {
                kind: nbytes / max(1, self.steps_run)
                for kind, nbytes in self.nvme_written_by_kind.items()
            },
            "nvme_written_bytes_per_day": self.nvme_written_bytes_per_day,
            "stall_fraction": self.stall_fraction,
            "steps_detail": {
                "forward_backward_seconds": self.phases.model_s,
                "forward_backward_stall_seconds": self.phases.model_stall_s,
                "optimizer_seconds": self.phases.optimizer_s,
                "optimizer_stall_seconds": self.phases.optimizer_stall_s,
                "nvme_bytes": self.phases.nvme_nbytes,
                "reference_forward_backward_seconds": self.reference_phases.model_s,
                "reference_optimizer_seconds": self.reference_phases.optimizer_s,
            },
            "seconds": self.seconds,
            "reference_seconds": self.reference_seconds,
            "final_digest": self.final_digest,
            "reference_final_digest": self.reference_final_digest,
            "resumed_from_step": self.resumed_from_step,
            **export_json(self.settings.export_dir, self.export_seconds),
            "snapshots": snapshots_json(self.snapshots),
            **(self.timing.to_json() if self.timing is not None else {}),
            "timeline": [row.to_json() for row in self.timeline],
        }


def snapshots_json(snapshots: Iterable[SnapshotReport]) -> list[dict[str, Any]]:
    """The ``--json`` records of a run's snapshots (seconds, bytes)."""
    return [
        {
            "name": s.name,
            "step": s.step,
            "seconds": s.seconds,
            "written_bytes": s.written_nbytes,
            "state_bytes": s.nbytes,
        }
        for s in snapshots
    ]


def run_pressure(
    settings: PressureSettings, *, say: Callable[[str], None] = lambda line: None
) -> PressureResult:
    """Run the pressure and reference trainings and compare them (see the module
    docstring). ``say`` receives progress lines.

    Raises:
        SwapConfigError: a budget cannot work for this model (named).
        SwapError, OSError: the tiers failed.
    """
    model_config = GPTConfig.for_params(settings.params)
    num_params = model_config.num_params()
    dtype = DTYPES[settings.dtype]
    param_nbytes = 2 * num_params
    state_nbytes = round(state_nbytes_per_param(settings) * num_params)
    device, host, sub_group = default_budgets(settings, num_params)
    data = batches(
        model_config,
        batch=settings.batch,
        seq=settings.seq,
        steps=settings.steps,
        seed=settings.seed,
    )
    return_freed_memory()
    reset_peak_rss()
    baseline = baseline_rss(settings, dtype)
    say(
        f"swapper-pressure: GPT of {num_params:,} params ({model_config.n_layers} layers, "
        f"d_model {model_config.d_model}), {settings.dtype}, {settings.steps} steps; "
        f"device budget {format_size(device)} (16-bit params {format_size(param_nbytes)}), "
        f"host budget {format_size(host)} (optimizer state {format_size(state_nbytes)})"
    )
    with store_dirs(settings) as dirs:
        config = budgeted_config(settings, device, host, sub_group, dirs)
        reset_peak_rss()
        pressure = train_once(
            model_config, config, data, settings, dtype, say, "pressure", checkpoint=True
        )
        disk = measure_disk([d.parent for d in dirs], settings.aio)  # the swap dirs' disk
    reference_config = OffloadConfig.create(
        device_nbytes=None,
        host_nbytes=None,
        step=StepConfig(sub_group_numel=sub_group, moments=settings.moments),
        device="cpu",
    )
    reference = train_once(model_config, reference_config, data, settings, dtype, say, "reference")
    plain = plain_run(model_config, data, dtype=dtype, seed=settings.seed, lr=settings.lr)
    identical = (
        _same_floats(pressure.losses, reference.losses[pressure.resumed_from :])
        and pressure.param_hashes == reference.param_hashes
        and pressure.digest == reference.digest
    )
    stats = pressure.stats
    peaks = {tier.value: stats.tiers[tier].peak_nbytes or 0 for tier in (Tier.DEVICE, Tier.HOST)}
    moved = sum(t.nbytes for t in stats.transfers.values())
    return PressureResult(
        settings=settings,
        model=model_config,
        num_params=num_params,
        losses=pressure.losses,
        reference_losses=reference.losses[pressure.resumed_from :],
        identical=identical,
        peak_bytes=peaks,
        budget_bytes={"device": device, "host": host},
        peak_rss_bytes=pressure.peak_rss_bytes,
        baseline_rss_bytes=baseline,
        sub_group_numel=sub_group,
        activation_bytes=pressure.activation_bytes,
        bytes_moved=moved,
        phases=pressure.phases,
        reference_phases=reference.phases,
        stall_fraction=pressure.stall_s / pressure.seconds if pressure.seconds > 0 else 0.0,
        seconds=pressure.seconds,
        reference_seconds=reference.seconds,
        final_digest=pressure.digest,
        reference_final_digest=reference.digest,
        resumed_from_step=pressure.resumed_from,
        snapshots=tuple(pressure.snapshots),
        export_seconds=pressure.export_seconds,
        nvme_written_by_kind=pressure.nvme_written,
        steps_run=pressure.steps_run,
        timing=Timing.of(pressure.phases, reference.phases, plain, disk),
        state_read_bytes_per_param=pressure.state_read_nbytes / num_params,
        state_written_bytes_per_param=pressure.state_written_nbytes / num_params,
        timeline=tuple(
            phase_rows(pressure.phases, disk, first_step=pressure.resumed_from + 1, plain=plain)
        ),
    )


def state_nbytes_per_param(settings: PressureSettings) -> float:
    """Bytes of optimizer state per parameter the run's optimizer keeps in the tiers
    (``adamw``: 12, 8 or 6 by moments; SGD with momentum and Adagrad 8; Adam 12; ...),
    from its update rule (:func:`~swapper.step.offload_optimizer.state_nbytes_per_element`)."""
    return state_nbytes_per_element(settings.optimizer, moments=settings.moments)


def default_budgets(settings: PressureSettings, num_params: int) -> tuple[int, int, int]:
    """(device bytes, host bytes, sub-group elements) of a run: the settings' or, where
    unset, a quarter of the 16-bit parameters, a quarter of the optimizer's state (its
    bytes per parameter: :func:`state_nbytes_per_param`), and what lets the host budget
    hold 4 sub-groups."""
    per_param = state_nbytes_per_param(settings)
    device = settings.device_nbytes if settings.device_nbytes is not None else 2 * num_params // 4
    host = settings.host_nbytes
    if host is None:
        host = int(per_param * num_params) // 4
    return device, host, settings.sub_group_numel or max(1024, int(host // 4 // per_param))


def budgeted_config(
    settings: PressureSettings, device: int, host: int, sub_group: int, dirs: list[Path]
) -> OffloadConfig:
    """The budgeted run's tiers: ``device`` and ``host`` bytes, NVMe in ``dirs``, the
    optimizer's sub-groups of ``sub_group`` elements, overlap and moments as set.

    Raises:
        SwapConfigError: a value cannot work (named).
    """
    return OffloadConfig.create(
        device_nbytes=device,
        host_nbytes=host,
        nvme_dirs=dirs,
        aio=settings.aio,
        step=StepConfig(
            sub_group_numel=sub_group, overlap=settings.overlap, moments=settings.moments
        ),
        device="cpu",
        write_budget_bytes_per_day=settings.write_budget_bytes_per_day,
        write_budget_strict=settings.write_budget_strict,
    )


def train_once(
    model_config: GPTConfig,
    config: OffloadConfig,
    data: list[torch.Tensor],
    settings: PressureSettings,
    dtype: torch.dtype,
    say: Callable[[str], None],
    label: str,
    *,
    checkpoint: bool = False,
) -> TrainedRun:
    """Build the GPT on the meta device, materialise it into ``config``'s tiers, train it
    on ``data`` (``checkpoint``: with the settings' snapshots, resume and export) and
    close it; what it measured. ``label`` names the run in the lines given to ``say``.

    Raises:
        SwapConfigError: a budget cannot work for this model (named).
        SwapError, OSError: the tiers failed.
    """
    with torch.device("meta"):
        model = GPT(model_config)
    built = Materialised()

    def materialize(module: torch.nn.Module, place: Callable[[str, torch.nn.Module], None]) -> None:
        def timed_place(name: str, module: torch.nn.Module) -> None:
            # what is not placing is the in-memory initialisation (allocation + draws)
            start = time.perf_counter()
            place(name, module)
            built.place_s += time.perf_counter() - start
            built.modules += 1

        materialize_(model, dtype=dtype, seed=settings.seed, on_module=timed_place)

    losses: list[float] = []
    scaler = DynamicLossScaler(2.0**12) if dtype == torch.float16 else None
    with contextlib.ExitStack() as stack:
        resume = checkpoint and settings.resume
        start = time.perf_counter()
        wrapped = stack.enter_context(
            OffloadedModel(model, config, materialize=materialize, resume=resume)
        )
        built.model_s = time.perf_counter() - start
        built.model_written_nbytes = _nvme_written(wrapped.stats())
        start = time.perf_counter()
        optimizer = stack.enter_context(
            make_optimizer(
                settings.optimizer,
                wrapped.parameters(),
                lr=settings.lr,
                tiers=wrapped,
                config=StepConfig(max_grad_norm=1.0),  # sub-groups: the model's config.step
                loss_scaler=scaler,
                **({"weight_decay": 0.01} if settings.optimizer == "adamw" else {}),
            )
        )
        built.optimizer_s = time.perf_counter() - start
        built.optimizer_written_nbytes = _nvme_written(wrapped.stats()) - built.model_written_nbytes
        start = time.perf_counter()
        activations = SavedBytes()
        phases = Phases()
        resumed_from = optimizer.step_count
        if resumed_from:
            say(f"  {label}: resumed from step {resumed_from}")
        every = settings.checkpoint_every if checkpoint else None
        snapshots: list[SnapshotReport] = []
        written_before: dict[str, int] | None = None  # at the first step run
        for step, tokens in enumerate(data, 1):
            if step <= resumed_from:
                continue
            if written_before is None:
                written_before = wrapped.stats().nvme_written()
            phases.begin(wrapped.stats(), optimizer.overlap_waited_s)
            with activations.counting():
                loss = model.loss(tokens)
            phases.forward_done(wrapped.stats(), optimizer.overlap_waited_s)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            phases.backward_done(wrapped.stats(), optimizer.overlap_waited_s)
            optimizer.step()
            phases.step_done(wrapped.stats(), optimizer.overlap_waited_s)
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
            say(
                f"  {label} step {step}: loss {losses[-1]:.6f}  "
                f"(forward+backward {phases.model_s[-1]:.2f} s, stalled "
                f"{phases.model_stall_s[-1]:.2f} s; optimizer {phases.optimizer_s[-1]:.2f} s, "
                f"stalled {phases.optimizer_stall_s[-1]:.2f} s)"
            )
            if every is not None and step % every == 0:
                report = save_snapshot(wrapped, optimizer, keep_last=settings.keep_last)
                snapshots.append(report)
                say(
                    f"  {label} snapshot {report.name}: "
                    f"{format_size(report.written_nbytes)} written "
                    f"of {format_size(report.nbytes)} of state, {report.seconds:.3f} s"
                )
        seconds = time.perf_counter() - start
        # (before final_digest, whose wait for the last overlapped update is no training's)
        stall_s = wrapped.stats().foreground_stall_s + optimizer.overlap_waited_s
        traffic = optimizer.last_step.traffic if optimizer.last_step is not None else None
        peak = peak_rss()
        stats = wrapped.stats()
        written = stats.nvme_written()
        written = {k: v - (written_before or written).get(k, 0) for k, v in written.items()}
        # What reads the whole final state back (hashes, digest, export) must stream it
        # within the budgets: its own peak, measured apart from the training's.
        reset_peak_rss()
        hashes = {name: content_hash(t) for name, t in wrapped.iter_state_dict()}
        digest = final_digest(wrapped, optimizer)
        export_s = None
        if checkpoint and settings.export_dir is not None:
            export_s = export_final(wrapped, optimizer, settings.export_dir, say)
            say(f"  {label}: exported to {settings.export_dir} in {export_s:.2f} s")
        final_peak = peak_rss()
        # close rather than give the whole model back into memory (leaving the block would)
        optimizer.close()
        wrapped.close()
    return TrainedRun(
        losses,
        hashes,
        stats,
        seconds,
        peak,
        activations.peak_nbytes,
        phases,
        digest,
        resumed_from,
        snapshots,
        export_s,
        state_read_nbytes=traffic.read_nbytes.get(Kind.OPTIM_STATE, 0) if traffic else 0,
        state_written_nbytes=traffic.written_nbytes.get(Kind.OPTIM_STATE, 0) if traffic else 0,
        stall_s=stall_s,
        nvme_written=written,
        steps_run=len(losses),
        materialised=built,
        final_peak_rss_bytes=final_peak,
    )


def _nvme_written(stats: ManagerStats) -> int:
    """Bytes written to NVMe so far."""
    return stats.moved(Tier.HOST, Tier.NVME).nbytes


def baseline_rss(settings: PressureSettings, dtype: torch.dtype) -> int:
    """Peak RSS with torch loaded and a tiny model trained one step through the same
    code, NVMe tier included (so the AIO engine, thread pools and allocator caches are
    up), without the model under test."""
    tiny = dataclasses.replace(settings, params=200_000, steps=1)
    model_config = GPTConfig.for_params(tiny.params)
    data = batches(model_config, batch=settings.batch, seq=settings.seq, steps=1, seed=0)
    with swap_dirs(settings.dirs) as dirs:
        config = OffloadConfig.create(nvme_dirs=dirs, aio=settings.aio, device="cpu")
        train_once(model_config, config, data, tiny, dtype, lambda line: None, "baseline")
    return peak_rss()


def store_dirs(settings: PressureSettings) -> contextlib.AbstractContextManager[list[Path]]:
    """The budgeted run's store directories: checkpointed, DIR/swapper-pressure-checkpoint
    in each ``--dir`` (kept for ``--resume``); otherwise :func:`swap_dirs` (removed after)."""
    if settings.checkpointing:
        return contextlib.nullcontext([d / "swapper-pressure-checkpoint" for d in settings.dirs])
    return swap_dirs(settings.dirs)


@contextlib.contextmanager
def swap_dirs(dirs: tuple[Path, ...]) -> Iterator[list[Path]]:
    """A private directory (0700) made in each of ``dirs`` (none given: one temporary
    directory), each removed with all in it when the block ends, however it ends.

    Yields a path inside each for the store to create: whatever the store leaves behind
    (an interrupt while it was being made, a close that failed) goes with the directory.
    """
    made: list[Path] = []
    try:
        for parent in dirs or (None,):
            with critical():  # made and recorded together: a signal never splits them
                made.append(Path(tempfile.mkdtemp(prefix="swapper-pressure-", dir=parent)))
        yield [d / "swap" for d in made]
    finally:
        with critical():  # a signal waits until every directory is gone
            for d in made:
                shutil.rmtree(d, ignore_errors=True)


def _same_floats(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        x == y or (x != x and y != y) for x, y in zip(a, b, strict=True)
    )
