"""How evenly the ranks share the offload traffic of backward: the balance figures.

During backward the gradients become complete a module at a time, in reverse forward
order, and each rank moves the bytes it owns of them to host/NVMe. A *window* is one
module's backward; ``bytes[w][r]`` is what rank r offloads in window w. If every window's
writes run in parallel on all ranks and the next window's wait for the slowest rank, the
backward offload takes ``sum_w max_r bytes[w][r]`` per unit of bandwidth; perfectly
balanced it would take ``sum_w mean_r bytes[w][r]``. Their ratio is the figure reported
(:attr:`BalanceReport.max_over_mean`): 1.0 is perfect, N means one rank at a time.

Also reported: the worst single window's max/mean (windows holding only a few small
tensors, e.g. a LayerNorm's weight and bias at N = 4, cannot do better than N / count;
their bytes are negligible, which is why the figure above weighs windows by bytes), and
the worst max/mean of the cumulative bytes over every prefix of backward (how far one
rank runs ahead of the others at any point).

Two layouts are compared: the plan's (:func:`plan_windows`) and the contiguous one
(:func:`contiguous_windows`: every parameter laid end to end in forward order, the flat
vector cut into N equal contiguous ranges, as in ZeRO-1/2's flat partitioning), in which
the gradients of backward all belong to one rank at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swapper.distributed.partition import ALIGN_NUMEL, ParamInfo, PartitionPlan, round_up

__all__ = ["BalanceReport", "balance_report", "contiguous_windows", "plan_windows"]


@dataclass(frozen=True)
class BalanceReport:
    """Balance of per-rank offload bytes over the windows of backward.

    Attributes:
        windows: ``(module_index, per-rank bytes)`` in backward order (empty windows left out).
        per_rank_nbytes: each rank's total over backward.
        max_over_mean: ``sum_w max_r / sum_w mean_r`` (the figure; 1.0 is perfect).
        worst_window: the largest max/mean of a single window.
        cumulative_worst: the largest max/mean of cumulative bytes over prefixes of backward.
    """

    windows: tuple[tuple[int, tuple[int, ...]], ...]
    per_rank_nbytes: tuple[int, ...]
    max_over_mean: float
    worst_window: float
    cumulative_worst: float


def plan_windows(plan: PartitionPlan) -> list[tuple[int, list[int]]]:
    """Per-window, per-rank offload bytes of ``plan`` (padding counted: it is written)."""
    windows: dict[int, list[int]] = {}
    for p in plan.params:
        row = windows.setdefault(p.info.module_index, [0] * plan.world_size)
        for r in range(plan.world_size):
            row[r] += p.local_numel(r) * p.info.itemsize
    return [(m, windows[m]) for m in sorted(windows, reverse=True)]


def contiguous_windows(
    params: Sequence[ParamInfo], world_size: int, *, align_numel: int = ALIGN_NUMEL
) -> list[tuple[int, list[int]]]:
    """Per-window, per-rank offload bytes of the contiguous layout of ``params``."""
    total = sum(p.numel for p in params)
    part = round_up(-(-total // world_size), align_numel) if total else align_numel
    windows: dict[int, list[int]] = {}
    offset = 0
    for p in params:
        row = windows.setdefault(p.module_index, [0] * world_size)
        start, end = offset, offset + p.numel
        for r in range(world_size):
            overlap = min(end, (r + 1) * part) - max(start, r * part)
            if overlap > 0:
                row[r] += overlap * p.itemsize
        offset = end
    return [(m, windows[m]) for m in sorted(windows, reverse=True)]


def balance_report(windows: Sequence[tuple[int, Sequence[int]]]) -> BalanceReport:
    """The figures of ``windows`` (as from :func:`plan_windows`); empty windows are skipped."""
    kept = tuple((m, tuple(row)) for m, row in windows if sum(row) > 0)
    if not kept:
        return BalanceReport((), (), 1.0, 1.0, 1.0)
    n = len(kept[0][1])
    per_rank = [0] * n
    sum_max = 0.0
    sum_mean = 0.0
    worst = 1.0
    cumulative_worst = 1.0
    for _, row in kept:
        mean = sum(row) / n
        sum_max += max(row)
        sum_mean += mean
        worst = max(worst, max(row) / mean)
        for r in range(n):
            per_rank[r] += row[r]
        cumulative_worst = max(cumulative_worst, max(per_rank) / (sum(per_rank) / n))
    return BalanceReport(kept, tuple(per_rank), sum_max / sum_mean, worst, cumulative_worst)
