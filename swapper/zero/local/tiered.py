"""The optimizer's view of an offloaded model's parameters: :class:`TieredParams`, the
:class:`~swapper.step.sources.ParamSource` through which :class:`~swapper.step.OffloadAdamW`
reads and writes the parameters and retained gradients in the manager.

It reads the model's :class:`~swapper.zero.local.params.LocalCore` and asks the model
through :class:`ModelDoors` (two public calls of the lifecycle) for the rest: it never
takes the model itself, so the ``local`` room's modules import each other one way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

import torch

from swapper.manager import Kind, Tier
from swapper.step.clip import grad_norm32
from swapper.zero.config.settings import tiers_of
from swapper.zero.local.params import (
    NORM_BATCH_NUMEL,
    LocalCore,
    Slot,
    consumed_error,
    copy_in,
    copy_out,
)
from swapper.zero.local.persist import collect, collect_all
from swapper.zero.model.core import not_the_models
from tiers import signals
from tiers.errors import SwapConfigError

__all__ = ["ModelDoors", "TieredParams"]


class ModelDoors(Protocol):
    """What :class:`TieredParams` asks of the model itself (the lifecycle's calls)."""

    def release_stale_holds(self, *, warn: bool = True) -> int:
        """Release what a forward or backward that raised left held."""
        ...

    def drop_grads(self, slots: Iterable[Slot], *, keep: bool | None = None) -> None:
        """Drop the slots' retained gradients (``zero_grad``)."""
        ...


class TieredParams:
    """:class:`~swapper.step.sources.ParamSource` over an offloaded model's records (its
    :class:`~swapper.zero.local.params.LocalCore`; the model hands over its doors, module
    docstring)."""

    def __init__(self, core: LocalCore, doors: ModelDoors) -> None:
        self._core = core
        self._doors = doors
        self._manager = core.manager
        # The optimizer reads and writes a parameter where it is when it is in memory
        # (in_place: nothing moved; with budgets that hold everything, a move to the host
        # and back to the device each step was the step's largest avoidable cost), else
        # on the host (where it computes), not in the device tier it is used from: no
        # device room taken, and between steps a parameter waits in host memory (or on
        # NVMe) anyway.
        tiers = tiers_of(core.manager.config, Kind.PARAM16)
        self._tier = Tier.HOST if Tier.HOST in tiers else tiers[0]
        self._scratch: torch.Tensor | None = None  # fp32, on the CPU: see _take_norms
        #: during a step whose parameters and gradients are all resident (see
        #: :meth:`resident`): each one's key → its tensor, fetched once for the step
        self._pinned: dict[str, torch.Tensor] | None = None

    def _slot(self, param: torch.Tensor) -> Slot:
        slot = self._core.slots.get(id(param))
        if slot is None:
            raise not_the_models(param)
        return slot

    def shape(self, param: torch.Tensor) -> torch.Size:
        return self._slot(param).shape

    def dtype(self, param: torch.Tensor) -> torch.dtype:
        return self._slot(param).dtype

    def contiguous(self, param: torch.Tensor) -> bool:
        self._slot(param)
        return True  # the tiers hold every parameter contiguous

    @contextlib.contextmanager
    def resident(self, params: Sequence[torch.Tensor]) -> Iterator[bool]:
        """Around one optimizer step: when the model's budgets hold every parameter and
        gradient (nothing can have to move: see ``LocalCore.keep_held`` and
        ``_lazy_norms``) and all are resident now, fetch them all at once and let the
        step's reads and writes use them where they are, instead of a fetch and a release
        per piece (~12 µs each, two per piece and step); released at the end (the
        parameters as modified). Otherwise (budgets that may have to move something, a
        parameter in use, anything not resident) the step fetches piece by piece, as it
        always did. Yields whether they are held (on the CPU: see
        :mod:`swapper.step.flat_grads`). Not reentrant; a step's gradients must not
        change meanwhile."""
        core = self._core
        if (
            self._pinned is not None
            or not (core.keep_held and core.lazy_norms and core.room_limit is None)
            or core.param_gate is not None  # an overlapped update: fetched per piece
        ):
            yield False
            return
        slots = [self._slot(param) for param in params]
        collect_all(core, slots)  # (autograd's own fields, while persistent)
        if any(slot.users for slot in slots):
            self._doors.release_stale_holds()  # a forward or backward that raised
        keys = [slot.key for slot in slots]
        grad_keys = [
            s.grad_key for s in slots if s.has_grad and s.grad_held is None and not s.grad_dropped
        ]
        if any(slot.users for slot in slots):
            tensors = None  # (write_param raises, as it always did)
        else:
            tensors = self._manager.fetch_resident_all(keys + grad_keys)
        if tensors is None:
            yield False
            return
        with signals.held:  # recorded with the pins: released below whatever happens
            self._pinned = dict(zip(keys + grad_keys, tensors, strict=True))
        try:
            yield all(tensor.device.type == "cpu" for tensor in tensors)
        finally:
            with signals.held:
                self._pinned = None
                self._manager.release_all(keys, modified=True)
                self._manager.release_all(grad_keys, modified=False)

    def read_ahead(self, params: Sequence[torch.Tensor], partial: Sequence[torch.Tensor]) -> None:
        """:class:`~swapper.step.sources.AheadSource`: the retained gradients of
        ``params`` that are on NVMe only, asked for as read-aheads to their home tier;
        nothing during a resident step (all held).

        Parameters are not read ahead, ``partial`` included: a parameter the step writes
        whole is placed without a read (:meth:`~swapper.manager.TierManager.assign`), and
        one written in pieces is read on demand. Reading the latter ahead took host room
        that the next sub-group's state then found by evicting such a parameter between
        its pieces' writes (written to NVMe twice a step: wt-peft3, 2026-11-28); holding
        it from its first piece to its last fixed that but left too little room at tight
        host budgets (tests/test_saved_params.py's steps failed for room), so both wait
        for a budget-aware hold."""
        del partial  # (see above)
        if self._pinned is not None:
            return
        grads: dict[str, None] = {}
        manager = self._manager
        for param in params:
            slot = self._slot(param)
            # Only what is on NVMe alone: a gradient in memory is read where it is.
            if (
                slot.has_grad
                and slot.grad_held is None
                and not slot.grad_dropped  # (read_grad raises for it)
                and manager.info(slot.grad_key).tier is None
            ):
                grads[slot.grad_key] = None
        if grads:
            manager.prefetch(grads)

    def consumed(self, params: Sequence[torch.Tensor]) -> None:
        """:class:`~swapper.step.sources.ConsumingSource`: the step has read these
        parameters' gradients whole; under budgets that may move them (those where
        ``zero_grad`` unregisters the entries anyway, see ``LocalLayout.drop_grads``)
        each one's entry is unregistered now (``Slot.grad_dropped``), so that the room
        it held goes to the step's next sub-groups without writing to NVMe a gradient
        nobody reads again (at 20M parameters under the pressure runner's budgets the
        gradients written to NVMe fell from 37.4 to 24.2 MiB a step:
        docs/notes/2026-11-29-iteration-5.md).
        Kept: gradients held for a resident step or by reference (persistent
        parameters), and those whose norm was not taken (a rerun of the step would need
        it)."""
        core = self._core
        if self._pinned is not None or (core.lazy_norms and core.param_gate is None):
            return
        for param in params:
            slot = self._slot(param)
            if (
                not slot.has_grad
                or slot.grad_dropped
                or slot.grad_held is not None
                or slot.grad_norm is None
            ):
                continue
            # Unregistered first, then marked (as drop_grads): cut at the wait for a
            # write of it, the slot still says what the manager holds.
            with signals.at_waits:
                self._manager.unregister(slot.grad_key)
                with core.lock:
                    slot.grad_dropped = True

    def check_unconsumed(self, params: Sequence[torch.Tensor]) -> None:
        """:class:`~swapper.step.sources.ConsumingSource`: raises ConsumedGradError for
        the first parameter whose gradient a step dropped and no ``zero_grad`` cleared."""
        for param in params:
            slot = self._slot(param)
            if slot.grad_dropped:
                raise consumed_error(slot, "step() would read")

    def read_param(self, param: torch.Tensor, start: int, out: torch.Tensor) -> None:
        # cold: its callers scan every parameter once (the optimizer's initial masters, an
        # export), and the scan must not evict the parameters it reads next
        key = self._slot(param).key
        copy_out(self._manager, key, self._tier, start, out, in_place=True, cold=True)

    def read_grad(self, param: torch.Tensor, start: int, out: torch.Tensor) -> bool:
        slot = self._slot(param)
        if self._pinned is None and self._core.persist.native:  # (else: by resident)
            collect(self._core, slot)
        if not slot.has_grad:
            return False
        if slot.grad_dropped:
            raise consumed_error(slot, "the optimizer reads")
        held = slot.grad_held  # (persistent parameters: swapper.zero.local.persist)
        if held is not None:
            out.copy_(held.view(-1)[start : start + out.numel()])
            return True
        pinned = self._pinned
        if pinned is not None and slot.grad_key in pinned:
            out.copy_(pinned[slot.grad_key].view(-1)[start : start + out.numel()])
            return True
        copy_out(self._manager, slot.grad_key, None, start, out)
        return True

    def write_param(self, param: torch.Tensor, start: int, source: torch.Tensor) -> None:
        slot = self._slot(param)
        if slot.users:
            self._doors.release_stale_holds()  # a forward or backward that raised
        if slot.users:
            raise SwapConfigError(
                f"optimizer step while parameter {slot.name!r} is in use (inside a forward "
                "or backward?)"
            )
        pinned = self._pinned
        if pinned is not None:
            pinned[slot.key].view(-1)[start : start + source.numel()].copy_(source)
            return
        copy_in(self._manager, slot.key, self._tier, start, source, in_place=True)

    def grad_norms(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        slots = [self._slot(param) for param in params]
        if self._pinned is None and self._core.persist.native:  # (else: by resident)
            for slot in slots:
                collect(self._core, slot)  # (autograd's own field)
        batch: list[Slot] = []
        numel = 0
        for slot in slots:
            if not slot.has_grad or slot.grad_norm is not None:
                continue
            size = _aligned(slot.shape.numel())
            if batch and numel + size > NORM_BATCH_NUMEL:
                self._take_norms(batch)
                batch, numel = [], 0
            batch.append(slot)
            numel += size
        if batch:
            self._take_norms(batch)
        return [slot.grad_norm for slot in slots if slot.has_grad and slot.grad_norm is not None]

    def _take_norms(self, slots: Sequence[Slot]) -> None:
        """The fp32 norms of the slots' retained gradients (the backward left them to the
        step: see ``LocalCore.lazy_norms``), each fetched where it is and released
        unmodified. Their fp32 copies go into one scratch buffer kept from step to step
        (fresh copies cost a page fault per 4 KiB, 10x the conversion), each at a
        512-byte-aligned offset as a fresh allocation would be; one ``_foreach_norm`` of
        them rounds each norm as ``grad_norm32`` of the gradient alone does."""
        fetched: list[torch.Tensor] = []
        own: list[Slot] = []  # those fetched here (to release)
        with signals.at_waits:  # each one fetched and recorded, or neither
            try:
                pinned = self._pinned or {}
                for slot in slots:
                    tensor = slot.grad_held  # (persistent parameters: no entry)
                    if tensor is None:
                        tensor = pinned.get(slot.grad_key)  # (held for the step: no fetch)
                    if tensor is None:
                        tensor = self._manager.fetch(slot.grad_key, in_place=True)
                        own.append(slot)
                    fetched.append(tensor)
                # on the CPU wherever the gradients are (grad_norm32 says why)
                need = sum(_aligned(t.numel()) for t in fetched)
                scratch = self._scratch
                if scratch is None or scratch.numel() < need:
                    scratch = self._scratch = torch.empty(need, dtype=torch.float32)
                copies, offset = [], 0
                for tensor in fetched:
                    copy = scratch[offset : offset + tensor.numel()]
                    copies.append(copy.copy_(tensor.view(-1)))
                    offset += _aligned(tensor.numel())
                norms = grad_norm32(copies)
            finally:
                for slot in own:
                    self._manager.release(slot.grad_key, modified=False)
        for slot, norm in zip(slots, norms, strict=True):
            slot.grad_norm = norm

    def zero_grad(self, params: Sequence[torch.Tensor]) -> None:
        self._doors.drop_grads([self._slot(param) for param in params])


def _aligned(numel: int) -> int:
    """``numel`` fp32 elements rounded up to 512 bytes."""
    return -(-numel // 128) * 128
