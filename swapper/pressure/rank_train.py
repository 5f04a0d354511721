"""One rank of ``swapper-pressure --nproc N``: the training loop each spawned process runs
(:func:`_train`), with the plan it is given (:class:`_Plan`); :mod:`swapper.pressure.ranks`
starts the processes, gathers their reports and compares them.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from swapper.manager import Kind, Tier
from swapper.pressure.export import export_final
from swapper.pressure.memory import (
    SavedBytes,
    freed_memory_returned,
    peak_rss,
    reset_peak_rss,
    return_freed_memory,
)
from swapper.pressure.model import GPT, GPTConfig, batches, materialize_
from swapper.pressure.ranks_report import (
    RankReport,
)
from swapper.pressure.runner import DTYPES, PressureSettings
from swapper.step import DynamicLossScaler, StepConfig
from swapper.step.offload_optimizer import make_optimizer
from swapper.zero.config.distributed import DistributedConfig
from swapper.zero.config.offload import OffloadConfig
from tiers.errors import SwapConfigError
from tiers.nvme import content_hash
from tiers.units import format_size

__all__: list[str] = []  # internal to swapper.pressure.ranks


@dataclasses.dataclass(frozen=True)
class _Plan:
    settings: PressureSettings
    world: int
    device_nbytes: int
    host_nbytes: int
    sub_group_numel: int
    timeout_s: float
    #: For tests: (rank, "raise" | "exit") makes that rank fail once its budgeted model is
    #: wrapped, while the others go on into the first step's collectives.
    fault: tuple[int, str] | None = None
    #: fetch_collective and reduce_dtype (None: the defaults, with ``timeout_s``)
    distributed_config: DistributedConfig | None = None
    #: only the budgeted run on each rank (``--reference none``): no unlimited one
    budgeted_only: bool = False

    @property
    def distributed(self) -> DistributedConfig:
        if self.distributed_config is not None:
            return self.distributed_config
        return DistributedConfig(timeout_s=self.timeout_s)

    def config(self, dirs: list[str] | None) -> OffloadConfig:
        """Budgets and NVMe when ``dirs`` is given, else unlimited."""
        limits: dict[str, Any] = {"device_nbytes": None, "host_nbytes": None}
        if dirs is not None:
            limits = {
                "device_nbytes": self.device_nbytes,
                "host_nbytes": self.host_nbytes,
                "nvme_dirs": [Path(d) for d in dirs],
                "aio": self.settings.aio,
            }
        return OffloadConfig.create(
            **limits,
            step=StepConfig(sub_group_numel=self.sub_group_numel),
            device="cpu",
            distributed=self.distributed,
        )


@dataclasses.dataclass
class _Trained:
    report: RankReport
    params: dict[str, torch.Tensor]  # rank 0 with keep_params only

    @property
    def losses(self) -> list[float]:
        return self.report.losses

    @property
    def digest(self) -> str:
        return self.report.digest

    @property
    def param_hashes(self) -> dict[str, int]:
        return self.report.param_hashes


def _slowest(group: Any, model_s: float, optimizer_s: float) -> tuple[float, float]:
    """The largest forward+backward and optimizer seconds of this step over the ranks (one
    all_reduce of two numbers, under the group's timeout; the times themselves without a
    group). Progress only: nothing it returns reaches the training."""
    import torch.distributed as dist

    times = torch.tensor([model_s, optimizer_s], dtype=torch.float64)
    if group is not None:
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return float(times[0]), float(times[1])


def _train(
    plan: _Plan, *, rank: int, world: int, dirs: list[str] | None, keep_params: bool = False
) -> _Trained:
    """Train ``plan.settings.steps`` steps on this rank's share of every batch (the whole
    batch when ``world`` is 1, with no process group)."""
    import torch.distributed as dist

    import swapper
    from swapper.zero.checkpoint.snapshot import final_digest, save_snapshot

    # As the one-process run does: else glibc's mmap threshold climbs to 32 MiB and the
    # tensors freed each step stay resident in the heap (1.0-1.6 GiB of it per rank at 400 M)
    return_freed_memory()
    # this run's peak (the wrap and the steps), not a run before it in this process (the
    # budgeted ranks train before the unlimited ones)
    reset_peak_rss()
    settings = plan.settings
    dtype = DTYPES[settings.dtype]
    model_config = GPTConfig.for_params(settings.params)
    data = batches(
        model_config,
        batch=settings.batch,
        seq=settings.seq,
        steps=settings.steps,
        seed=settings.seed,
    )
    with torch.device("meta"):
        model = GPT(model_config)

    def materialize(module: torch.nn.Module, place: Callable[[str, torch.nn.Module], None]) -> None:
        materialize_(model, dtype=dtype, seed=settings.seed, on_module=place)

    group = dist.group.WORLD if world > 1 else None
    # the budgeted ranks (dirs given) snapshot and resume; the unlimited ones never do
    checkpoint = dirs is not None and settings.checkpointing
    wrapped = swapper.offload(
        model,
        plan.config(dirs),
        group,
        materialize=materialize,
        resume=checkpoint and settings.resume,
    )
    scaler = DynamicLossScaler(2.0**12) if dtype == torch.float16 else None
    optimizer = make_optimizer(
        settings.optimizer,  # (element-wise: each rank steps its shards; the CLI checks)
        wrapped.parameters(),
        lr=settings.lr,
        tiers=wrapped,
        # the budgeted ranks overlap when asked (--overlap); the unlimited reference never
        config=StepConfig(max_grad_norm=1.0, overlap=settings.overlap and dirs is not None),
        loss_scaler=scaler,
        **({"weight_decay": 0.01} if settings.optimizer == "adamw" else {}),
    )
    try:
        losses: list[float] = []
        state: dict[str, int] = {}
        offloaded = 0
        per = settings.batch // world
        # the last backward's gradient offload, module window by window (several ranks)
        reducer = getattr(wrapped, "_grads", None)
        windows: list[Any] = []
        if dirs is not None and plan.fault is not None and plan.fault[0] == rank:
            if plan.fault[1] == "exit":
                os._exit(3)  # dies without a word, as a killed process would
            raise SwapConfigError(f"injected fault on rank {rank}")
        resumed_from = optimizer.step_count
        every = settings.checkpoint_every if checkpoint else None
        # rank 0 speaks for every rank, a line per step (the lines tools/kill_bench.py
        # places its kills by start "  pressure step N:"), with the slowest rank's times
        say = print if rank == 0 else None
        label = "pressure" if dirs is not None else "unlimited" if world > 1 else "one process"
        if say is not None and resumed_from:
            say(f"  pressure: resumed from step {resumed_from}", flush=True)
        model_s: list[float] = []
        optimizer_s: list[float] = []
        snapshots: list[dict[str, Any]] = []
        activations = SavedBytes()
        start = time.perf_counter()
        for step, tokens in enumerate(data, 1):
            if step <= resumed_from:  # trained before the snapshot resumed from
                continue
            began = time.perf_counter()
            mine = tokens[rank * per : (rank + 1) * per]
            with activations.counting():
                logits = wrapped(mine[:, :-1]).float()
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), mine[:, 1:].reshape(-1)
                )
            before = _down(wrapped.stats())
            if reducer is not None and step == len(data):
                reducer.trace = windows
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if reducer is not None:
                reducer.trace = None
            offloaded += _down(wrapped.stats()) - before
            if not losses:  # gradients are held from backward until zero_grad
                state = _state_nbytes(wrapped, model_config)
            stepped = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
            model_s.append(stepped - began)
            optimizer_s.append(time.perf_counter() - stepped)
            slowest = _slowest(group, model_s[-1], optimizer_s[-1])  # every rank takes part
            if say is not None:
                say(
                    f"  {label} step {step}: rank 0 loss {losses[-1]:.6f}  (of {len(data)} "
                    f"steps; slowest of {world} rank{'s' * (world > 1)}: forward+backward "
                    f"{slowest[0]:.2f} s, optimizer {slowest[1]:.2f} s)",
                    flush=True,
                )
            if every is not None and step % every == 0:  # every rank alike
                snap = save_snapshot(wrapped, optimizer, keep_last=settings.keep_last)
                snapshots.append(
                    {
                        "name": snap.name,
                        "step": snap.step,
                        "seconds": snap.seconds,
                        "written_bytes": snap.written_nbytes,
                        "state_bytes": snap.nbytes,
                    }
                )
                if say is not None:
                    say(
                        f"  pressure snapshot {snap.name}: "
                        f"{format_size(snap.written_nbytes)} written "
                        f"of rank 0's {format_size(snap.nbytes)} of state, {snap.seconds:.3f} s",
                        flush=True,
                    )
        seconds = time.perf_counter() - start
        training_peak = peak_rss()
        # What reads the whole final state back (hashes, digest, export) must stream it
        # within the budgets: its own peak, measured apart from the training's.
        reset_peak_rss()
        stats = wrapped.stats()
        state[Kind.OPTIM_STATE.value] = (
            sum(sg.state_nbytes for sg in optimizer.sub_groups)
            + optimizer.stored_state.scales_nbytes  # (int8: the block scales, held apart)
        )
        hashes: dict[str, int] = {}
        params: dict[str, torch.Tensor] = {}
        for name, tensor in wrapped.iter_state_dict():  # a collective per parameter
            if rank == 0:
                hashes[name] = content_hash(tensor)
                if keep_params:
                    params[name] = tensor.clone()
        digest = final_digest(wrapped, optimizer)  # type: ignore[arg-type]  # duck-typed
        export_s = None
        if dirs is not None and settings.export_dir is not None:  # every rank alike
            shown = _say_flushed if rank == 0 else None
            export_s = export_final(wrapped, optimizer, settings.export_dir, shown)
            if shown is not None:
                shown(f"  pressure: exported to {settings.export_dir} in {export_s:.2f} s")
        report = RankReport(
            rank=rank,
            losses=losses,
            peak_bytes={t.value: stats.tiers[t].peak_nbytes or 0 for t in (Tier.DEVICE, Tier.HOST)},
            bytes_moved=sum(t.nbytes for t in stats.transfers.values()),
            state_nbytes=state,
            offload_nbytes=offloaded,
            stall_s=stats.stall_s,
            seconds=seconds,
            peak_rss_bytes=training_peak,
            digest=digest,
            param_hashes=hashes,
            offload_windows=[(w.module_index, w.retained_nbytes) for w in windows],
            resumed_from=resumed_from,
            model_s=model_s,
            optimizer_s=optimizer_s,
            snapshots=snapshots,
            export_seconds=export_s,
            final_phase_peak_rss_bytes=peak_rss(),
            activation_bytes=activations.peak_nbytes,
            freed_memory_returned=freed_memory_returned(),
        )
        return _Trained(report, params)
    finally:
        optimizer.close()
        wrapped.close()


def _say_flushed(line: str) -> None:
    print(line, flush=True)  # (a rank's stdout is a pipe: flushed per line)


def _state_nbytes(wrapped: Any, model_config: GPTConfig) -> dict[str, int]:
    """Bytes of 16-bit parameters and gradients this rank stores (padding included)."""
    local = getattr(wrapped, "local_nbytes", None)
    if local is not None:
        return dict(local())
    n16 = 2 * model_config.num_params()  # one process: all of them
    return {Kind.PARAM16.value: n16, Kind.GRAD16.value: n16}


def _down(stats: Any) -> int:
    """Bytes written down the tiers so far (device->host, host->NVMe)."""
    return stats.moved(Tier.DEVICE, Tier.HOST).nbytes + stats.moved(Tier.HOST, Tier.NVME).nbytes


# -- the ranks ------------------------------------------------------------------------
