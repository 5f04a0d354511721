"""The gathered buffers of N > 1 ranks charged to the rank's device budget.

A module's gather (:func:`~swapper.distributed.start_fetch`) needs, on the device, at once:

- ``buffer``: the param-major buffer, ``layout.buffer_numel * itemsize`` bytes, alive
  while the module is held (forward, and again from its backward's start until its
  gradients are in);
- ``staging``: with ``fetch_collective="all_gather"``, the rank-major staging buffer,
  ``layout.segment_numel * N * itemsize`` bytes, alive until the gather is waited on
  (0 with ``"all_reduce"``, which gathers in place);
- ``shards``: when the parameters' first tier is the device tier, this rank's shards of
  the module, fetched (pinned) there while they are copied into the collective (the
  largest rank's, so every rank computes the same figure).

Floor (checked at wrap time by :func:`check_device_floor`, on every rank alike)::

    floor = max over modules M of  need(M) + sum of buffer(T) for the modules T != M
                                    that hold a tied parameter
    need(M) = buffer(M) + staging(M) + shards(M)

Tied parameters are held through a whole backward (their gradient is complete only after
their last use), so the modules that hold one may all be gathered while any other module
is. Read-ahead is *not* part of the floor: :class:`GatherBudget` starts a gather ahead
only when, with it, the gathers held and in flight still leave ``floor`` bytes free, so
the gather a module needs now always has room; a budget at the floor runs with fewer (or
no) gathers ahead. That decision is arithmetic on figures equal on every rank (never on
what this rank's manager happens to hold), so every rank starts the same gathers ahead
and the collectives stay paired; it assumes ``device_nbytes`` is equal on every rank.

Gathers on another device than the device tier's (gloo gathering on the CPU while the
tier is a GPU: :func:`charges_device`) are neither charged nor checked.

Not counted: a frozen module (no parameter that requires grad) is held until its
backward ends; full gradients and the reduce-scatter's input buffer
(:class:`~swapper.zero.sharded.grads.GradReducer`); buffers that autograd keeps alive
after a module is released (a saved weight).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Sequence

import torch

from swapper.distributed import DistGroup, ModuleLayout, PendingFetch, start_fetch
from swapper.manager import ManagerConfig, Tier, TierManager
from tiers.device import resolve_device
from tiers.errors import SwapConfigError
from tiers.protocols import MemoryBlock
from tiers.units import format_size

__all__ = [
    "GatherBudget",
    "GatherNeed",
    "charges_device",
    "check_device_floor",
    "device_floor",
    "gather_need",
]


@dataclasses.dataclass(frozen=True)
class GatherNeed:
    """Device bytes of one module's gather (see the module docstring)."""

    buffer: int
    staging: int
    shards: int

    @property
    def total(self) -> int:
        """Bytes needed at once while the gather starts."""
        return self.buffer + self.staging + self.shards


def gather_need(
    layout: ModuleLayout, world_size: int, method: str, shards_on_device: bool
) -> GatherNeed:
    """Device bytes one gather of ``layout`` needs (equal on every rank)."""
    size = layout.itemsize
    staging = layout.segment_numel * world_size * size if method == "all_gather" else 0
    shards = 0
    if shards_on_device:
        shards = max(
            sum(p.stored_numel for p in layout.rank_pieces(r)) * size for r in range(world_size)
        )
    return GatherNeed(layout.buffer_numel * size, staging, shards)


def device_floor(
    modules: Sequence[tuple[str, GatherNeed, bool]],
) -> tuple[int, str, int]:
    """``(floor, module, tied)``: the floor (bytes), the module that sets it, and the bytes
    of tied modules' buffers in it. ``modules``: (name, need, holds a tied parameter)."""
    tied_total = sum(need.buffer for _, need, tied in modules if tied)
    best = (0, "", 0)
    for name, need, tied in modules:
        others = tied_total - (need.buffer if tied else 0)
        if need.total + others > best[0]:
            best = (need.total + others, name, others)
    return best


def charges_device(manager: ManagerConfig, gather_device: torch.device) -> bool:
    """Whether gathers on ``gather_device`` use the device tier's memory (and are charged
    to its budget): not when, e.g., gloo gathers on the CPU while the tier is a GPU.

    Raises:
        SwapConfigError: ``manager.device`` is not usable.
    """
    return resolve_device(manager.device) == torch.device(gather_device)


def check_device_floor(
    modules: Sequence[tuple[str, GatherNeed, bool]], limit: int | None, method: str
) -> int:
    """The floor (0 when ``limit`` is None); raise when ``limit`` is below it.

    Raises:
        SwapConfigError: naming the module, the bytes it needs and the budget to set.
    """
    if limit is None:
        return 0
    floor, name, tied = device_floor(modules)
    if floor > limit:
        parts = "its gathered buffer"
        if method == "all_gather":
            parts += " and all_gather staging buffer"
        parts += ", this rank's shards of it" if any(n.shards for _, n, _ in modules) else ""
        if tied:
            parts += ", and the buffers of modules with tied parameters held through the backward"
        raise SwapConfigError(
            f"offload: module {name!r} needs {floor} bytes ({format_size(floor)}) of device "
            f"memory at once ({parts}), more than the device budget of {limit} bytes: raise "
            f"device_nbytes to at least {floor}"
            + (" (or use fetch_collective='all_reduce', which needs no staging)"
               if method == "all_gather" else "")
        )  # fmt: skip
    return floor


class GatherBudget:
    """Charges this rank's gathers to its manager's device budget (module docstring).

    Thread-safe (its counters under a lock; a reservation waits outside it).
    """

    def __init__(
        self,
        manager: TierManager,
        group: DistGroup,
        limit: int | None,
        floor: int,
        method: str,
        device: torch.device,
        *,
        charge: bool = True,
    ) -> None:
        self._manager = manager
        self._charge = charge  # False: the gathers are not in the device tier's memory
        self._group = group
        self._limit = limit
        self._floor = floor
        self._method = method
        self._device = device
        self._lock = threading.Lock()
        self._charged = 0  # bytes of the blocks held below (equal on every rank)
        # id(PendingFetch) → (it, its block, bytes): the buffer's, and the staging's until
        # it is waited on (the PendingFetch is kept so that its id is not reused).
        self._blocks: dict[int, tuple[PendingFetch, MemoryBlock, int]] = {}
        self._staging: dict[int, tuple[PendingFetch, MemoryBlock, int]] = {}

    @property
    def charged_nbytes(self) -> int:
        """Bytes of gathered (and in flight) buffers charged now."""
        return self._charged

    def may_start_ahead(self, need: GatherNeed) -> bool:
        """Whether a read-ahead gather of ``need`` leaves room for any module's gather."""
        if self._limit is None or not self._charge:
            return True
        with self._lock:
            return self._charged + need.buffer + need.staging + self._floor <= self._limit

    def start(
        self, layout: ModuleLayout, shards: dict[int, torch.Tensor], dtype: torch.dtype, what: str
    ) -> PendingFetch:
        """Start the gather into blocks reserved from the device budget (room made by
        evicting entries, waiting at most the manager's timeout).

        Raises:
            BudgetTimeout: no room in time; BudgetExceededError: it can never fit;
            CollectiveError, InvalidArgumentError: as :func:`start_fetch`.
        """
        if not self._charge:
            return start_fetch(
                layout, shards, self._group, dtype=dtype, device=self._device,
                method=self._method, what=what,
            )  # fmt: skip
        need = gather_need(layout, self._group.world_size, self._method, False)
        size = layout.itemsize
        blocks: list[MemoryBlock] = []
        try:
            buffer = self._reserve(need.buffer, f"gathered buffer of {what}", blocks)
            staging = None
            if need.staging and self._group.world_size > 1:
                staging = self._reserve(need.staging, f"all_gather staging of {what}", blocks)
            pending = start_fetch(
                layout,
                shards,
                self._group,
                dtype=dtype,
                device=self._device,
                method=self._method,
                what=what,
                out=self._view(buffer, dtype, need.buffer // size),
                staging_out=self._view(staging, dtype, need.staging // size),
            )
        except BaseException:
            for block in blocks:
                block.release()
            raise
        with self._lock:
            self._charged += need.buffer
            self._blocks[id(pending)] = (pending, buffer, need.buffer)
            if staging is not None:  # freed once the gather is waited on
                self._charged += need.staging
                self._staging[id(pending)] = (pending, staging, need.staging)
        return pending

    def waited(self, pending: PendingFetch) -> None:
        """``pending`` was waited on (or failed): its staging block goes back."""
        with self._lock:
            held = self._staging.pop(id(pending), None)
            if held is not None:
                self._charged -= held[2]
        if held is not None:
            held[1].release()

    def release(self, pending: PendingFetch | None) -> None:
        """The module of ``pending`` is released: its blocks go back. Idempotent."""
        if pending is None:
            return
        self.waited(pending)
        with self._lock:
            held = self._blocks.pop(id(pending), None)
            if held is not None:
                self._charged -= held[2]
        if held is not None:
            held[1].release()

    def _reserve(self, nbytes: int, what: str, blocks: list[MemoryBlock]) -> MemoryBlock:
        block = self._manager.reserve_room(Tier.DEVICE, nbytes, what=what)
        blocks.append(block)
        return block

    def _view(
        self, block: MemoryBlock | None, dtype: torch.dtype, numel: int
    ) -> torch.Tensor | None:
        """The block's memory as the buffer (on the gather's device: ``charge``)."""
        return None if block is None else block.view(dtype, (numel,))


def tied_modules(named: Iterable[tuple[str, Iterable[int]]]) -> set[str]:
    """Names of the modules that hold a parameter (by id) that several modules hold."""
    pairs = [(name, list(ids)) for name, ids in named]
    uses: dict[int, int] = {}
    for _, ids in pairs:
        for i in ids:
            uses[i] = uses.get(i, 0) + 1
    return {name for name, ids in pairs if any(uses[i] > 1 for i in ids)}
