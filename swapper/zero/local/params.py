"""The offloaded parameters' records and the optimizer's view of them.

:class:`Slot`: one offloaded parameter (its keys, real shape, hold counts);
:class:`TieredParams`: the :class:`~swapper.step.sources.ParamSource` through which
:class:`~swapper.step.OffloadAdamW` reads and writes an offloaded model's parameters and
retained gradients in the manager.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from swapper.manager import Kind, Tier
from swapper.step.clip import grad_norm32
from swapper.zero.config.settings import tiers_of
from tiers import signals
from tiers.errors import SwapConfigError

if TYPE_CHECKING:
    from swapper.manager import TierManager
    from swapper.zero.local.offload import OffloadedModel

__all__ = [
    "NORM_BATCH_NUMEL",
    "Holds",
    "Slot",
    "TieredParams",
    "copy_in",
    "copy_out",
    "retain_grad",
]

#: fp32 elements of the gradients whose norms the step takes in one call (64 MiB: their
#: fp32 copies share one scratch buffer of at most this size, or of the largest gradient).
NORM_BATCH_NUMEL = 16 << 20


def copy_out(
    manager: TierManager,
    key: str,
    tier: Tier | None,
    start: int,
    out: torch.Tensor,
    *,
    in_place: bool = False,
) -> None:
    """Copy ``out.numel()`` elements of ``key``'s flattened tensor, from element ``start``,
    into ``out``: fetched into ``tier`` (None: its home; ``in_place``: where it is, if it
    is in memory) and released unmodified. The fetch and its release run in one section:
    no signal lands between the fetch and the ``try``.
    """
    with signals.at_waits:
        tensor = manager.fetch(key, tier, in_place=in_place)
        try:
            out.copy_(tensor.view(-1)[start : start + out.numel()])
        finally:
            manager.release(key, modified=False)


def copy_in(
    manager: TierManager,
    key: str,
    tier: Tier | None,
    start: int,
    source: torch.Tensor,
    *,
    in_place: bool = False,
) -> None:
    """Write ``source`` into ``key``'s flattened tensor from element ``start``: fetched into
    ``tier`` (None: its home; ``in_place`` as for :func:`copy_out`) and released modified,
    in one section as :func:`copy_out`."""
    with signals.at_waits:
        tensor = manager.fetch(key, tier, in_place=in_place)
        try:
            tensor.view(-1)[start : start + source.numel()].copy_(source)
        finally:
            manager.release(key, modified=True)


def add_into(retained: torch.Tensor, grad: torch.Tensor) -> None:
    """``retained += grad`` in ``retained``'s (16-bit) dtype, as autograd adds into a plain
    model's ``.grad``. A gradient made on the GPU is first copied to the retained buffer's
    device (pinned host memory): both add in fp32 and round once to the 16-bit dtype, so
    where the addition runs changes no bit."""
    if grad.device != retained.device:
        grad = grad.to(retained.device)
    retained.add_(grad)


def retain_grad(
    manager: TierManager, slot: Slot, grad: torch.Tensor, lock: threading.RLock, *, lazy_norm: bool
) -> None:
    """Move ``grad`` into the slot's retained buffer (one copy; added on later
    micro-steps), with its fp32 norm (``lazy_norm``: left to the step, which computes the
    norms it needs in batches: see :meth:`TieredParams.grad_norms`).

    Cut (Ctrl-C at a wait, an error), the retained buffer is as before: registered and
    marked, or neither; added to, or not (the addition and its release are one
    uninterrupted step)."""
    with signals.at_waits:
        with lock:
            first = not slot.has_grad
            refill = first and slot.grad_kept  # registered, empty: copied into
        if first and not refill:
            # (a GPU gradient crosses to the host once, for its entry and its norm alike)
            source = grad.detach()
            if not lazy_norm and source.device.type != "cpu":
                source = source.cpu()
            # an fp32 parameter's gradient is fp32: in memory only, never on NVMe (GRAD32's
            # offload placement; swapper.zero.local.placing.check_fp32_grads)
            kind = Kind.GRAD32 if source.dtype == torch.float32 else Kind.GRAD16
            manager.register(slot.grad_key, source, kind)
            norm = None if lazy_norm else grad_norm32([source])[0]  # as clip_grad_norm_ does
            with lock:
                slot.has_grad, slot.grad_norm = True, norm
            return
        retained = manager.fetch(slot.grad_key)
        with signals.held:
            try:
                if refill:
                    retained.copy_(grad.view(slot.shape))  # the bytes register would copy
                    with lock:
                        slot.has_grad, slot.grad_kept = True, False
                else:
                    add_into(retained, grad.view(slot.shape))
                slot.grad_norm = None if lazy_norm else grad_norm32([retained])[0]
            finally:
                manager.release(slot.grad_key, modified=True)


@dataclasses.dataclass(slots=True)
class Holds:
    """What an offloaded model's hooks count, kept off the module: every attribute write
    on an ``nn.Module`` goes through ``Module.__setattr__`` (isinstance checks, ~3 µs),
    several per hook call."""

    held_nbytes: int = 0  # parameters with users, in the use tier
    forward_depth: int = 0  # calls of forward() running
    carried: int = 0  # holds kept from a forward for its backward (Slot.carried)
    in_backward: bool = False


@dataclasses.dataclass(eq=False)
class Slot:
    """One offloaded parameter: its keys, real shape, and who holds it now."""

    name: str
    param: nn.Parameter
    shape: torch.Size
    dtype: torch.dtype
    placeholder: torch.Tensor
    #: ``requires_grad`` when wrapped (fixed from then: swapper.zero.model.frozen); a frozen
    #: parameter has no gradient hook, no retained gradient and no optimizer state
    trainable: bool = True
    users: int = 0  # fetches outstanding (forward and backward holds)
    backward_holds: int = 0  # of which taken for a backward
    #: of which kept from a forward for its backward (budgets that hold every parameter:
    #: see ``OffloadedModel._keep_held``); a ``BeforeBackward`` takes one over instead of
    #: fetching, any release of them is safe (the backward then fetches again)
    carried: int = 0
    has_grad: bool = False  # its retained gradient is registered and holds a gradient
    #: its gradient entry is registered but holds none (dropped by a ``zero_grad`` with
    #: budgets that hold everything: see ``OffloadedModel._drop_grads``); the next
    #: gradient is copied into it, not added, and a snapshot unregisters it first
    grad_kept: bool = False
    #: while the parameters are persistent (:mod:`swapper.zero.local.persist`): the retained
    #: gradient itself, autograd's tensor kept by reference (moved, not copied; added
    #: to on later micro-steps), in no manager entry; ``has_grad`` is True then
    grad_held: torch.Tensor | None = None
    #: fp32 L2 norm of the retained gradient, taken when it is moved in (while it is in
    #: memory anyway), so that the optimizer's global norm reads nothing back from NVMe
    grad_norm: torch.Tensor | None = None
    #: the device the parameter was on when wrapped (where unwrap() puts it back)
    home: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    #: ``param._version`` when swapper last set ``.data``: a different value means an
    #: in-place write on the parameter since (see :mod:`swapper.zero.local.weights`)
    version: int = 0
    #: ``placeholder._version`` then: ``param.data`` of a guarded parameter between uses
    #: is the placeholder itself, so a write through ``.data`` shows here
    placeholder_version: int = 0

    #: the manager keys of the parameter and of its retained gradient, and its size in
    #: bytes: made once (the hooks read them at every fetch)
    key: str = dataclasses.field(init=False)
    grad_key: str = dataclasses.field(init=False)
    nbytes: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.key = f"param/{self.name}"
        self.grad_key = f"grad/{self.name}"
        self.nbytes = self.shape.numel() * self.dtype.itemsize


class TieredParams:
    """:class:`~swapper.step.sources.ParamSource` over an :class:`OffloadedModel`."""

    def __init__(self, model: OffloadedModel) -> None:
        self._model = model
        self._manager = model.manager
        # The optimizer reads and writes a parameter where it is when it is in memory
        # (in_place: nothing moved; with budgets that hold everything, a move to the host
        # and back to the device each step was the step's largest avoidable cost), else
        # on the host (where it computes), not in the device tier it is used from: no
        # device room taken, and between steps a parameter waits in host memory (or on
        # NVMe) anyway.
        tiers = tiers_of(model.config.manager, Kind.PARAM16)
        self._tier = Tier.HOST if Tier.HOST in tiers else tiers[0]
        self._scratch: torch.Tensor | None = None  # fp32, on the CPU: see _take_norms
        #: during a step whose parameters and gradients are all resident (see
        #: :meth:`resident`): each one's key → its tensor, fetched once for the step
        self._pinned: dict[str, torch.Tensor] | None = None
        # (a late import: swapper.zero.local.persist builds on this module)
        from swapper.zero.local.persist import collect, collect_all

        #: move gradients autograd kept in its own fields into their retained form
        self._collect, self._collect_all = collect, collect_all

    def _slot(self, param: torch.Tensor) -> Slot:
        slot = self._model._slots.get(id(param))
        if slot is None:
            raise SwapConfigError(
                f"a parameter of shape {list(param.shape)} given to the optimizer is not one "
                "of the offloaded model's: pass wrapped.parameters()"
            )
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
        gradient (nothing can have to move: see ``OffloadedModel._keep_held`` and
        ``_lazy_norms``) and all are resident now, fetch them all at once and let the
        step's reads and writes use them where they are, instead of a fetch and a release
        per piece (~12 µs each, two per piece and step); released at the end (the
        parameters as modified). Otherwise (budgets that may have to move something, a
        parameter in use, anything not resident) the step fetches piece by piece, as it
        always did. Yields whether they are held (on the CPU: see
        :mod:`swapper.step.flat_grads`). Not reentrant; a step's gradients must not
        change meanwhile."""
        model = self._model
        if (
            self._pinned is not None
            or not (model._keep_held and model._lazy_norms and model._room_limit is None)
            or model._param_gate is not None  # an overlapped update: fetched per piece
        ):
            yield False
            return
        slots = [self._slot(param) for param in params]
        self._collect_all(model, slots)  # (autograd's own fields, while persistent)
        if any(slot.users for slot in slots):
            model.release_stale_holds()  # a forward or backward that raised
        keys = [slot.key for slot in slots]
        grad_keys = [s.grad_key for s in slots if s.has_grad and s.grad_held is None]
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

    def read_ahead(self, params: Sequence[torch.Tensor]) -> None:
        """:class:`~swapper.step.sources.AheadSource`: the retained gradients (to their
        home tier) and the parameters (to the tier the step writes them in) of
        ``params`` that are on NVMe only, asked for as read-aheads; nothing during a
        resident step (all held)."""
        if self._pinned is not None:
            return
        grads: dict[str, None] = {}
        keys: dict[str, None] = {}
        manager = self._manager
        for param in params:
            slot = self._slot(param)
            # Only what is on NVMe alone: a gradient in memory is read where it is, a
            # parameter written where it is (in_place); a read-ahead would move them.
            if (
                slot.has_grad
                and slot.grad_held is None
                and manager.info(slot.grad_key).tier is None
            ):
                grads[slot.grad_key] = None
            if manager.info(slot.key).tier is None:
                keys[slot.key] = None
        if grads:
            manager.prefetch(grads)
        if keys:
            manager.prefetch(keys, self._tier)

    def read_param(self, param: torch.Tensor, start: int, out: torch.Tensor) -> None:
        copy_out(self._manager, self._slot(param).key, self._tier, start, out, in_place=True)

    def read_grad(self, param: torch.Tensor, start: int, out: torch.Tensor) -> bool:
        slot = self._slot(param)
        if self._pinned is None and self._model._persist.native:  # (else: by resident)
            self._collect(self._model, slot)
        if not slot.has_grad:
            return False
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
            self._model.release_stale_holds()  # a forward or backward that raised
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
        if self._pinned is None and self._model._persist.native:  # (else: by resident)
            for slot in slots:
                self._collect(self._model, slot)  # (autograd's own field)
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
        step: see ``OffloadedModel._lazy_norms``), each fetched where it is and released
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
        self._model._drop_grads([self._slot(param) for param in params])


def _aligned(numel: int) -> int:
    """``numel`` fp32 elements rounded up to 512 bytes."""
    return -(-numel // 128) * 128
