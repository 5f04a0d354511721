"""The records of a sharded (multi-rank) offloaded model, and the optimizer's view of it.

:class:`ShardSlot`: one parameter, of which this rank stores a shard (or nothing);
:class:`ModuleState`: one module's gather (its layout, the fetch in flight or done, its
hold counts); :class:`GradGroup`: the parameters whose gradients are reduce-scattered
together; :class:`ShardedParams`: the :class:`~swapper.step.sources.ParamSource` through
which :class:`~swapper.step.OffloadAdamW` steps this rank's shards only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from swapper.distributed import ModuleLayout, ParamPlacement, PendingFetch, agree
from swapper.distributed.collectives import reduce_norm_and_overflow
from swapper.manager import Kind, Tier
from swapper.zero.config.settings import tiers_of
from swapper.zero.local.params import copy_in, copy_out
from swapper.zero.model.core import not_the_models
from tiers.errors import SwapConfigError

if TYPE_CHECKING:
    from swapper.distributed import DistGroup, PartitionPlan
    from swapper.manager import TierManager

__all__ = ["GradGroup", "ModuleState", "ShardSlot", "ShardedParams"]


@dataclasses.dataclass(eq=False)
class ShardSlot:
    """One parameter of a sharded model: its placement and this rank's part of it.

    ``local_numel`` elements (padding included; 0 when another rank owns it whole) are
    registered in this rank's manager as ``param/<name>`` (kind ``param16``) and, once a
    gradient was reduced into it, ``grad/<name>`` (kind ``grad16``).
    """

    name: str
    param: nn.Parameter
    placement: ParamPlacement
    shape: torch.Size
    dtype: torch.dtype
    placeholder: torch.Tensor
    local_numel: int
    #: ``requires_grad`` when wrapped (fixed from then: swapper.zero.model.frozen)
    trainable: bool = True
    modules: list[ModuleState] = dataclasses.field(default_factory=list)
    has_grad: bool = False
    #: float64 sum of squares of the retained gradient shard, taken when it is reduced
    #: into (in memory then), so that the global norm reads nothing back from NVMe
    grad_sq: float = 0.0

    @property
    def index(self) -> int:
        return self.placement.index

    @property
    def key(self) -> str:
        return f"param/{self.name}"

    @property
    def grad_key(self) -> str:
        return f"grad/{self.name}"


@dataclasses.dataclass(eq=False)
class ModuleState:
    """One module's parameters as gathered from every rank: one collective per fetch."""

    name: str
    module: nn.Module
    slots: list[ShardSlot]
    layout: ModuleLayout
    users: int = 0  # holds outstanding (forward and backward)
    backward_holds: int = 0  # of which taken for a backward
    #: slots (plan indices) whose gradient has not yet been accumulated in this backward;
    #: when it empties, the backward holds are released
    waiting: set[int] = dataclasses.field(default_factory=set)
    carried: int = 0  # (a forward's holds are never kept for the backward on N ranks)
    pending: PendingFetch | None = None  # started by read-ahead, not yet waited on
    gathered: PendingFetch | None = None  # waited on: the parameters' views are live

    def view(self, slot: ShardSlot) -> torch.Tensor:
        """The slot's parameter in the gathered buffer (its real shape)."""
        if self.gathered is None:
            raise SwapConfigError(f"module {self.name!r} is not gathered")  # a bug if seen
        return self.gathered.views[slot.index].view(slot.shape)


@dataclasses.dataclass(eq=False)
class GradGroup:
    """Parameters whose gradients are reduce-scattered in one collective: those whose
    first use is one module (a tied parameter with its first user: its gradient is
    complete only after that module's backward)."""

    layout: ModuleLayout
    slots: list[ShardSlot]  # those that require grad
    grads: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.grads) == len(self.slots)


class ShardedDoors(Protocol):
    """What the sharded model's helpers (:class:`ShardedParams`, the state dicts of
    :mod:`swapper.zero.sharded.state_dicts`, the exports) use of it: public calls of
    :class:`~swapper.zero.sharded.model.ShardedModel` only, named here so that they take
    this interface, not the model (whose module imports them)."""

    group: DistGroup
    module: nn.Module
    plan: PartitionPlan

    @property
    def manager(self) -> TierManager:
        """This rank's tier manager."""
        ...

    @property
    def slots(self) -> tuple[ShardSlot, ...]:
        """Every parameter's record, in plan (forward) order."""
        ...

    def slot_of(self, param: torch.Tensor) -> ShardSlot | None:
        """The record of one of the model's parameters (None for another tensor)."""
        ...

    def before_param_write(self, slot: ShardSlot) -> None:
        """Called before a shard is written: no gather in flight may deliver old values."""
        ...

    def drop_grads(self, slots: Iterable[ShardSlot]) -> None:
        """Unregister the retained gradient shards of ``slots``."""
        ...

    def drain(self) -> None:
        """Wait for every gather started ahead of use and drop it."""
        ...

    def start_gather(self, layout: ModuleLayout, slots: list[ShardSlot], what: str) -> PendingFetch:
        """Start the gather of ``slots`` (a collective: every rank alike)."""
        ...

    def end_gather(self, pending: PendingFetch) -> None:
        """A gather from :meth:`start_gather` is no longer used: its buffers go back."""
        ...


class ShardedParams:
    """:class:`~swapper.step.sources.ParamSource` over this rank's shards.

    The optimizer sees each parameter as its local shard: a 1-D tensor of
    ``local_numel`` elements (zero for a parameter another rank owns whole, which the
    optimizer then has no state for). Padding is zero in parameter and gradient, and
    stays zero under AdamW. :meth:`grad_norms` returns one norm, the global one, reduced
    over the ranks (one small collective).
    """

    def __init__(self, model: ShardedDoors) -> None:
        self._model = model
        self._manager = model.manager
        tiers = tiers_of(model.manager.config, Kind.PARAM16)
        # The optimizer computes on the host: parameters read and written there.
        self._tier = Tier.HOST if Tier.HOST in tiers else tiers[0]

    def _slot(self, param: torch.Tensor) -> ShardSlot:
        slot = self._model.slot_of(param)
        if slot is None:
            raise not_the_models(param)
        return slot

    def shape(self, param: torch.Tensor) -> torch.Size:
        return torch.Size([self._slot(param).local_numel])

    def dtype(self, param: torch.Tensor) -> torch.dtype:
        return self._slot(param).dtype

    def whole_shape(self, param: torch.Tensor) -> torch.Size | None:
        """The real shape where this rank owns the parameter whole, ``[0]`` where another
        rank does, None where it is sharded (:class:`~swapper.step.sources.WholeSource`)."""
        slot = self._slot(param)
        if slot.placement.sharded:
            return None
        return slot.shape if slot.local_numel else torch.Size([0])

    def contiguous(self, param: torch.Tensor) -> bool:
        self._slot(param)
        return True

    def read_param(self, param: torch.Tensor, start: int, out: torch.Tensor) -> None:
        # cold: a scan of every shard once (initial masters, export): see the local source
        copy_out(self._manager, self._slot(param).key, self._tier, start, out, cold=True)

    def read_grad(self, param: torch.Tensor, start: int, out: torch.Tensor) -> bool:
        slot = self._slot(param)
        if not slot.has_grad:
            return False
        copy_out(self._manager, slot.grad_key, None, start, out)
        return True

    def write_param(self, param: torch.Tensor, start: int, source: torch.Tensor) -> None:
        slot = self._slot(param)
        self._model.before_param_write(slot)
        copy_in(self._manager, slot.key, self._tier, start, source)

    def grad_norms(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``[global norm]`` (fp32): every rank's sum of squares of its gradient shards
        (float64; each element of the model is in one rank's shards) and overflow flag,
        reduced in one all_reduce; ``[inf]`` when any rank found inf/NaN. Called by the
        optimizer on every rank alike (when clipping or a loss scaler asks for a norm),
        so every rank clips by the same factor and skips the same steps.

        Raises:
            CollectiveError: the all_reduce failed or timed out.
        """
        local = 0.0
        for param in params:
            slot = self._slot(param)
            if slot.has_grad:
                local += slot.grad_sq
        overflow = local != local or local == float("inf")
        norm, overflow = reduce_norm_and_overflow(
            self._model.group, 0.0 if overflow else local, overflow, what="the optimizer step"
        )
        return [torch.tensor(float("inf") if overflow else norm, dtype=torch.float32)]

    def zero_grad(self, params: Sequence[torch.Tensor]) -> None:
        self._model.drop_grads([self._slot(param) for param in params])

    def agree_step(self, ok: bool) -> None:
        """Every rank says whether its part of the step succeeded (one small collective).

        Raises:
            PeerFailedError: some rank's part failed (on every rank).
            CollectiveError: the agreement failed or timed out.
        """
        agree(self._model.group, ok, "the optimizer step")
