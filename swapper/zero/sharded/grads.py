"""Gradients of a sharded model: collected per group, reduce-scattered, retained.

Job of :class:`GradReducer`: hold each parameter's full gradient (handed over by the
post-accumulate hook, ``.grad`` dropped) until every gradient of its
:class:`~swapper.zero.sharded.state.GradGroup` is in, then average them over the ranks
with one reduce-scatter (:func:`~swapper.distributed.reduce_scatter_grads`) into this
rank's 16-bit gradient shards, which it keeps in the manager (kind ``grad16``, key
``grad/<name>``: registered the first time, added to on later micro-steps) with their
float64 sum of squares (for the global norm). The full gradients are freed after the
collective: at most one group's full gradients (and the collective's one transient
rank-major copy) are alive at a time.

At the end of a backward, :meth:`GradReducer.flush` reduces the groups left incomplete
(parameters unused in this pass) with zeros for the missing gradients, in group order,
so every rank issues the same collectives.

Measuring (:attr:`GradReducer.trace`, off by default): a list that, when set, gets one
:class:`ReduceRecord` per group reduced, i.e. per module window of backward: the bytes
this rank handed to its tiers as gradient shards (the backward offload, measured from
the tensors retained, not from the plan), the bytes its manager wrote down a tier in the
window (host->NVMe, device->host: evictions the offload caused), and the time of the
collective and of the offload. ``tools/offload_balance.py`` and
``tools/reduce_dtype_cost.py`` read it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

import torch

from swapper.distributed import DistGroup, local_sq_sum, reduce_scatter_grads
from swapper.manager import Kind, Tier, TierManager
from swapper.zero.local.params import add_into
from swapper.zero.sharded.state import GradGroup, ShardSlot
from tiers import signals

__all__ = ["GradReducer", "ReduceRecord"]


@dataclasses.dataclass(frozen=True)
class ReduceRecord:
    """One module window of backward on this rank (see the module docstring). Bytes,
    seconds.

    Attributes:
        module_index: the plan's index of the module whose gradients these are (the
            window of :func:`~swapper.distributed.plan_windows`).
        name: its first parameter's name.
        retained_nbytes: gradient shard bytes this rank handed to its tiers (padding
            included: it is written).
        nvme_nbytes: of which went straight to NVMe (no memory tier had room).
        down_nbytes: bytes the manager wrote down a tier during the window (device->host
            and host->NVMe: evictions to make room).
        collective: ``"reduce_scatter"``, or ``"all_reduce"`` where the backend lacks it.
        reduce_dtype: the dtype the sum was computed in.
        wire_nbytes: bytes each rank contributed to the collective (its rank-major
            buffer; a ring reduce-scatter sends ``(N - 1) / N`` of it).
        reduce_s: seconds of the collective (copy in, sum, average, copy out).
        offload_s: seconds handing the shards to the tiers.
    """

    module_index: int
    name: str
    retained_nbytes: int
    nvme_nbytes: int
    down_nbytes: int
    collective: str
    reduce_dtype: str
    wire_nbytes: int
    reduce_s: float
    offload_s: float


class GradReducer:
    """See the module docstring.

    Args:
        group: the ranks.
        manager: this rank's manager (the retained shards go there).
        slots: every parameter's record, by plan index.
        groups: the gradient groups, in plan order.
        group_of: plan index → its group.
        device: where gradients and the collective's buffers are.
        reduce_dtype: dtype of the sum (None: the gradients' own).
    """

    def __init__(
        self,
        group: DistGroup,
        manager: TierManager,
        slots: list[ShardSlot],
        groups: list[GradGroup],
        group_of: dict[int, GradGroup],
        device: torch.device,
        reduce_dtype: torch.dtype | None,
    ) -> None:
        self._dg = group
        self._manager = manager
        self._slots = slots
        self._groups = groups
        self._group_of = group_of
        self._device = device
        self._reduce_dtype = reduce_dtype
        #: one ReduceRecord per group reduced, when set to a list (measuring only)
        self.trace: list[ReduceRecord] | None = None

    def add(self, slot: ShardSlot, grad: torch.Tensor | None) -> None:
        """Take ``slot``'s full gradient (None counts as zeros); reduce its group once
        complete.

        Raises:
            CollectiveError: the reduce-scatter failed or timed out.
        """
        grad_group = self._group_of[slot.index]
        grad_group.grads[slot.index] = grad if grad is not None else self._zeros(slot)
        if grad_group.complete:
            self._reduce(grad_group)

    def flush(self) -> None:
        """Reduce every group that got some of its gradients, zeros for the rest."""
        for grad_group in self._groups:
            if grad_group.grads and not grad_group.complete:
                for slot in grad_group.slots:
                    if slot.index not in grad_group.grads:
                        grad_group.grads[slot.index] = self._zeros(slot)
                self._reduce(grad_group)

    def discard(self) -> None:
        """Forget gradients collected but not reduced (a backward that raised)."""
        for grad_group in self._groups:
            grad_group.grads.clear()

    def drop(self, slots: Iterable[ShardSlot]) -> None:
        """Unregister the retained gradient shards of ``slots`` (``zero_grad``)."""
        for slot in slots:
            # Unregistered first, then marked: cut in between, the slot still says what
            # the manager holds.
            with signals.at_waits:
                if slot.has_grad:
                    self._manager.unregister(slot.grad_key)
                    slot.has_grad, slot.grad_sq = False, 0.0

    def _zeros(self, slot: ShardSlot) -> torch.Tensor:
        return torch.zeros(slot.shape, dtype=slot.dtype, device=self._device)

    def _reduce(self, grad_group: GradGroup) -> None:
        """Average the group's full gradients over the ranks into this rank's retained
        shards, then free them."""
        grads, grad_group.grads = grad_group.grads, {}
        start = time.perf_counter()
        out = {
            p.index: torch.empty(
                p.stored_numel, dtype=self._slots[p.index].dtype, device=self._device
            )
            for p in grad_group.layout.rank_pieces(self._dg.rank)
        }
        stats = reduce_scatter_grads(
            grad_group.layout,
            grads,
            out,
            self._dg,
            reduce_dtype=self._reduce_dtype,
            what=f"the gradients of {grad_group.slots[0].name!r} and its module",
        )
        del grads  # the full gradients: freed here, before they are retained
        if self.trace is None:
            for index, shard in out.items():
                self._retain(self._slots[index], shard)
            return
        reduced = time.perf_counter()
        down = _down_nbytes(self._manager)
        nvme = 0
        for index, shard in out.items():
            self._retain(self._slots[index], shard)
            if self._manager.info(self._slots[index].grad_key).tier is None:
                nvme += shard.numel() * shard.element_size()
        first = grad_group.slots[0]
        self.trace.append(
            ReduceRecord(
                module_index=first.placement.info.module_index,
                name=first.name,
                retained_nbytes=sum(t.numel() * t.element_size() for t in out.values()),
                nvme_nbytes=nvme,
                down_nbytes=_down_nbytes(self._manager) - down,
                collective=stats.collective,
                reduce_dtype=str(stats.reduce_dtype).removeprefix("torch."),
                wire_nbytes=stats.input_nbytes,
                reduce_s=reduced - start,
                offload_s=time.perf_counter() - reduced,
            )
        )

    def _retain(self, slot: ShardSlot, shard: torch.Tensor) -> None:
        """Register ``shard`` as the slot's gradient, or add it to the one retained.
        Cut (Ctrl-C at a wait, an error), the retained shard is as before."""
        with signals.at_waits:
            if not slot.has_grad:
                # an fp32 parameter's gradient shard is fp32: in memory only, never on
                # NVMe (GRAD32's placement; checked at the wrap: setup.place_model)
                kind = Kind.GRAD32 if shard.dtype == torch.float32 else Kind.GRAD16
                self._manager.register(slot.grad_key, shard, kind)
                slot.has_grad, slot.grad_sq = True, local_sq_sum([shard])
                return
            retained = self._manager.fetch(slot.grad_key)
            with signals.held:
                try:
                    add_into(retained, shard)  # (from the GPU with NCCL)
                    slot.grad_sq = local_sq_sum([retained])
                finally:
                    self._manager.release(slot.grad_key, modified=True)


def _down_nbytes(manager: TierManager) -> int:
    """Bytes ``manager`` has written down a tier so far (device->host, host->NVMe)."""
    stats = manager.stats()
    return stats.moved(Tier.DEVICE, Tier.HOST).nbytes + stats.moved(Tier.HOST, Tier.NVME).nbytes
