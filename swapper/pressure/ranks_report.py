"""What ``swapper-pressure --nproc N`` reports (:mod:`swapper.pressure.ranks` runs it):
per-rank figures, the comparison of the budgeted ranks with the unlimited ranks and with
one process, and the JSON of ``--json``. Bytes, seconds; fractions in 0..1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from swapper.distributed.balance import BalanceReport, balance_report
from swapper.pressure.export import export_json
from swapper.pressure.memory import rss_bound_nbytes
from swapper.pressure.model import GPTConfig
from swapper.pressure.runner import PressureSettings
from tiers.units import format_size

__all__ = ["MIN_EQUAL_FRACTION", "RankReport", "RanksResult", "compare_params"]

#: Parameter elements that must be bitwise equal to one process's (see the docstring of
#: :mod:`swapper.pressure.ranks`: why not all, and the tolerance for the rest).
MIN_EQUAL_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class RankReport:
    """What one rank of one run measured. Bytes, seconds."""

    rank: int
    losses: list[float]
    peak_bytes: dict[str, int]
    bytes_moved: int
    state_nbytes: dict[str, int]
    offload_nbytes: int  # written down a tier (device->host, host->NVMe) during backward
    stall_s: float
    seconds: float
    peak_rss_bytes: int
    digest: str
    param_hashes: dict[str, int]
    #: (module index, gradient shard bytes this rank handed to its tiers) per module
    #: window of the last step's backward, in the order they came
    offload_windows: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    #: the step the run resumed from (0: a fresh start); ``losses`` are the steps after it
    resumed_from: int = 0
    #: per step trained: forward + backward seconds, optimizer step seconds
    model_s: list[float] = dataclasses.field(default_factory=list)
    optimizer_s: list[float] = dataclasses.field(default_factory=list)
    #: the snapshots taken (name, step, seconds, written_bytes, state_bytes: this rank's)
    snapshots: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: seconds this rank spent in the export (``--export``; None: no export)
    export_seconds: float | None = None
    #: peak RSS of what follows the training (hashes, final digest, export), measured
    #: apart from ``peak_rss_bytes`` (the wrap and the steps), bytes
    final_phase_peak_rss_bytes: int = 0
    #: the most bytes autograd saved in one forward on this rank (activations)
    activation_bytes: int = 0
    #: whether this rank's process made glibc return freed tensors (else its peak RSS
    #: measures the allocator's cache: 1.0-1.6 GiB per rank at 400 M)
    freed_memory_returned: bool = False

    def rss_bound_bytes(self, budget_bytes: dict[str, int]) -> int:
        """This rank's peak RSS bound, in bytes, under its per-rank ``budget_bytes``:
        :func:`~swapper.pressure.memory.rss_bound_nbytes` (the one-process rule)."""
        return rss_bound_nbytes(budget_bytes, self.activation_bytes)

    def rss_within_bound(self, budget_bytes: dict[str, int]) -> bool:
        """Both the training's and the final phase's peak RSS within the bound."""
        peak = max(self.peak_rss_bytes, self.final_phase_peak_rss_bytes)
        return peak <= self.rss_bound_bytes(budget_bytes)

    def rss_json(self, budget_bytes: dict[str, int]) -> dict[str, Any]:
        """The memory figures of ``--json``'s per-rank entry (bytes)."""
        return {
            "peak_rss_bytes": self.peak_rss_bytes,
            "final_phase_peak_rss_bytes": self.final_phase_peak_rss_bytes,
            "activation_bytes": self.activation_bytes,
            "rss_bound_bytes": self.rss_bound_bytes(budget_bytes),
            "rss_within_bound": self.rss_within_bound(budget_bytes),
            "freed_memory_returned": self.freed_memory_returned,
        }

    def rss_line(self, budget_bytes: dict[str, int]) -> str:
        """The summary's words for the same figures."""
        return (
            f"peak RSS {format_size(self.peak_rss_bytes)} in training, "
            f"{format_size(self.final_phase_peak_rss_bytes)} after it; bound "
            f"{format_size(self.rss_bound_bytes(budget_bytes))} (budgets + 2 x activations "
            f"{format_size(self.activation_bytes)} + 1.5 GiB)"
            + ("" if self.rss_within_bound(budget_bytes) else " EXCEEDED")
        )

    @property
    def stall_fraction(self) -> float:
        """Time ``fetch`` waited for bytes / training time."""
        return self.stall_s / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class RanksResult:
    """What :func:`run_ranks` found; :meth:`to_json` is ``swapper-pressure --json``."""

    settings: PressureSettings
    world_size: int
    fetch_collective: str
    reduce_dtype: str  # the dtype gradients are summed in: "float32", or the model's
    model: GPTConfig
    num_params: int
    budget_bytes: dict[str, int]
    per_rank: list[RankReport]  # under the budgets
    reference_per_rank: list[RankReport]  # unlimited
    single_losses: list[float]
    identical: bool
    max_abs_diff_vs_single: float
    equal_fraction_vs_single: float
    tolerance: dict[str, Any]
    within_tolerance: bool

    @property
    def losses(self) -> list[float]:
        """The global batch's mean loss per step trained (after ``resumed_from_step``):
        the mean of the ranks' equal shares."""
        n = self.world_size
        steps = len(self.per_rank[0].losses)
        return [sum(r.losses[i] for r in self.per_rank) / n for i in range(steps)]

    @property
    def resumed_from_step(self) -> int:
        """The step the budgeted ranks resumed from (0: a fresh start)."""
        return self.per_rank[0].resumed_from

    @property
    def final_digest(self) -> str:
        """The budgeted ranks' :func:`~swapper.zero.checkpoint.snapshot.final_digest` (the same on
        every rank, and at any world size for the same training)."""
        return self.per_rank[0].digest

    @property
    def export_seconds(self) -> float | None:
        """The slowest rank's export seconds (None: no export)."""
        times = [r.export_seconds for r in self.per_rank if r.export_seconds is not None]
        return max(times) if times else None

    @property
    def offload_balance(self) -> BalanceReport:
        """How evenly the ranks shared the last backward's gradient offload, measured
        (:func:`~swapper.distributed.balance_report` of the ranks' windows)."""
        rows: dict[int, list[int]] = {}
        for r, report in enumerate(self.per_rank):
            for module, nbytes in report.offload_windows:
                rows.setdefault(module, [0] * self.world_size)[r] += nbytes
        return balance_report(list(rows.items()))

    @property
    def within_budgets(self) -> bool:
        """Every rank's every tier peak is within its (per-rank) budget."""
        return all(
            r.peak_bytes[tier] <= limit
            for r in self.per_rank
            for tier, limit in self.budget_bytes.items()
        )

    @property
    def rss_within_bound(self) -> bool:
        """Every budgeted rank's peak RSS (training and final phase) within its bound."""
        return all(r.rss_within_bound(self.budget_bytes) for r in self.per_rank)

    @property
    def ok(self) -> bool:
        """Identical, within budgets and RSS bounds, and within tolerance of one process."""
        return (
            self.identical
            and self.within_budgets
            and self.rss_within_bound
            and self.within_tolerance
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "params": self.num_params,
            "model": dataclasses.asdict(self.model),
            "steps": self.settings.steps,
            "seed": self.settings.seed,
            "dtype": self.settings.dtype,
            "world_size": self.world_size,
            "fetch_collective": self.fetch_collective,
            "reduce_dtype": self.reduce_dtype,
            "losses": self.losses,
            "single_losses": self.single_losses,
            "identical": self.identical,
            "within_budgets": self.within_budgets,
            "rss_within_bound": self.rss_within_bound,
            "max_abs_diff_vs_single": self.max_abs_diff_vs_single,
            "equal_fraction_vs_single": self.equal_fraction_vs_single,
            "tolerance": self.tolerance,
            "within_tolerance": self.within_tolerance,
            "budget_bytes": self.budget_bytes,
            "final_digest": self.final_digest,
            "reference_final_digest": self.reference_per_rank[0].digest,
            "resumed_from_step": self.resumed_from_step,
            # rank 0's, per step trained (the shape of the single-process runner's)
            "steps_detail": {
                "forward_backward_seconds": self.per_rank[0].model_s,
                "optimizer_seconds": self.per_rank[0].optimizer_s,
            },
            "snapshots": self.per_rank[0].snapshots,
            # the slowest rank's: the export is done when every rank's part is
            **export_json(self.settings.export_dir, self.export_seconds),
            "offload_balance": {
                "max_over_mean": self.offload_balance.max_over_mean,
                "worst_window": self.offload_balance.worst_window,
                "cumulative_worst": self.offload_balance.cumulative_worst,
            },
            "per_rank": [
                {
                    "rank": r.rank,
                    "losses": r.losses,
                    "reference_losses": ref.losses[r.resumed_from :],
                    "peak_bytes": r.peak_bytes,
                    "budget_bytes": self.budget_bytes,
                    "bytes_moved": r.bytes_moved,
                    "state_nbytes": r.state_nbytes,
                    "offload_nbytes": r.offload_nbytes,
                    "offload_windows": [list(w) for w in r.offload_windows],
                    "stall_fraction": r.stall_fraction,
                    "seconds": r.seconds,
                    "reference_seconds": ref.seconds,
                    **r.rss_json(self.budget_bytes),
                    "final_digest": r.digest,
                    "export_seconds": r.export_seconds,
                    "reference_final_digest": ref.digest,
                }
                for r, ref in zip(self.per_rank, self.reference_per_rank, strict=True)
            ],
        }


def compare_params(
    mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], bound: float, dtype: torch.dtype
) -> tuple[float, float, bool]:
    """(max |mine - ref| over all elements, the fraction of elements equal, whether every
    element is within ``bound`` + one ulp of ``dtype`` and more than MIN_EQUAL_FRACTION
    are equal)."""
    if mine.keys() != ref.keys():
        return float("inf"), 0.0, False
    worst, ok, equal, total = 0.0, True, 0, 0
    for name, value in ref.items():
        a, b = mine[name].float(), value.float()
        if a.shape != b.shape:
            return float("inf"), 0.0, False
        diff = (a - b).abs()
        if diff.numel():
            worst = max(worst, float(diff.max()))
            ulp = torch.maximum(a.abs(), b.abs()) * torch.finfo(dtype).eps
            ok = ok and bool((diff <= bound + ulp).all())
            equal += int((diff == 0).sum())
            total += diff.numel()
    fraction = equal / total if total else 1.0
    return worst, fraction, ok and fraction > MIN_EQUAL_FRACTION
