"""The offloaded parameters' records, the one-process model's core, and moving bytes of
a record in and out of the manager.

:class:`Slot`: one offloaded parameter (its keys, real shape, hold counts);
:class:`LocalCore`: what :class:`~swapper.zero.local.offload.OffloadedModel` hands its
helpers (:mod:`swapper.zero.model.core`), with :class:`Persistence` and
:class:`ModuleHook` (:mod:`swapper.zero.local.persist`'s state); ``retain_grad``,
``copy_in``/``copy_out``. The optimizer's view of the records is
:class:`~swapper.zero.local.tiered.TieredParams`. The bottom of the ``local`` room: it
imports none of the room's other modules.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from swapper.manager import Kind, Tier
from swapper.step.clip import grad_norm32
from swapper.zero.model.core import Holds, ModelCore
from swapper.zero.model.readahead import FetchPlan
from tiers import signals
from tiers.errors import SwapError

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from swapper.manager import TierManager

__all__ = [
    "NORM_BATCH_NUMEL",
    "ConsumedGradError",
    "Holds",
    "LocalCore",
    "ModuleHook",
    "Persistence",
    "Slot",
    "copy_in",
    "copy_out",
    "retain_grad",
]

#: fp32 elements of the gradients whose norms the step takes in one call (64 MiB: their
#: fp32 copies share one scratch buffer of at most this size, or of the largest gradient).
NORM_BATCH_NUMEL = 16 << 20


class ConsumedGradError(SwapError, RuntimeError):
    """A retained gradient was needed after the optimizer step had read it whole and
    dropped it (budgeted runs drop a consumed gradient instead of writing it to NVMe:
    :meth:`~swapper.zero.local.tiered.TieredParams.consumed`)."""


def consumed_error(slot: Slot, what: str) -> ConsumedGradError:
    """The error for ``what`` (a read, an addition) of ``slot``'s dropped gradient."""
    return ConsumedGradError(
        f"{what} the gradient of parameter {slot.name!r}, which the last optimizer step "
        "read and then dropped (under a host budget a consumed gradient is not kept until "
        "zero_grad); call optimizer.zero_grad() after step() and run a backward before "
        "the next step()"
    )


def copy_out(
    manager: TierManager,
    key: str,
    tier: Tier | None,
    start: int,
    out: torch.Tensor,
    *,
    in_place: bool = False,
    cold: bool = False,
) -> None:
    """Copy ``out.numel()`` elements of ``key``'s flattened tensor, from element ``start``,
    into ``out``: fetched into ``tier`` (None: its home; ``in_place``: where it is, if it
    is in memory) and released unmodified (``cold``: as the first victim, for a scan:
    :meth:`TierManager.release`). The fetch and its release run in one section: no signal
    lands between the fetch and the ``try``.
    """
    with signals.at_waits:
        tensor = manager.fetch(key, tier, in_place=in_place)
        try:
            out.copy_(tensor.view(-1)[start : start + out.numel()])
        finally:
            manager.release(key, modified=False, cold=cold)


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
    in one section as :func:`copy_out`. The whole tensor (``start`` 0, every element) is
    assigned instead (:meth:`~swapper.manager.TierManager.assign`): its old value is not
    read from NVMe first, and it is copied into where it is in memory (``in_place`` or
    not), else into ``tier``."""
    if start == 0 and source.numel() == manager.numel(key):
        manager.assign(key, source, tier, convert=True)  # (rounded as copy_ rounds)
        return
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
            if slot.grad_dropped:
                raise consumed_error(slot, "a backward adds into")
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
    #: see ``LocalCore.keep_held``); a ``BeforeBackward`` takes one over instead of
    #: fetching, any release of them is safe (the backward then fetches again)
    carried: int = 0
    has_grad: bool = False  # its retained gradient is registered and holds a gradient
    #: its gradient entry is registered but holds none (dropped by a ``zero_grad`` with
    #: budgets that hold everything: see ``ModuleHooks.drop_grads``); the next
    #: gradient is copied into it, not added, and a snapshot unregisters it first
    grad_kept: bool = False
    #: its gradient was read whole by an optimizer step and unregistered before
    #: ``zero_grad`` (``TieredParams.consumed``: under a host budget, instead of being
    #: written to NVMe as the step's victim and read by nobody); ``has_grad`` and
    #: ``grad_norm`` stay as they were until ``zero_grad``, which clears all three
    grad_dropped: bool = False
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


@dataclasses.dataclass(slots=True)
class ModuleHook:
    """One hook of swapper's: whose it is (a module, or a parameter for ``kind``
    ``"grad"``), its kind (``"pre"``: forward pre-hook, ``"post"``: forward hook, always
    called, ``"grad"``: post-accumulate-grad hook), its handle and function, and where it
    stood among its owner's hooks when it was taken off (the dict's keys then), to be put
    back there."""

    owner: Any
    kind: str
    handle: RemovableHandle
    fn: Any
    order: list[int] = dataclasses.field(default_factory=list)

    def hooks(self) -> OrderedDict[int, Any]:
        """The owner's dict of hooks of this kind."""
        if self.kind == "pre":
            return self.owner._forward_pre_hooks
        if self.kind == "post":
            return self.owner._forward_hooks
        return self.owner._post_accumulate_grad_hooks


@dataclasses.dataclass(slots=True)
class Persistence:
    """Whether the model's parameters are persistent now, and whether they may be."""

    allowed: bool = True
    active: bool = False
    #: while active: autograd keeps the gradients in its own fields (every parameter a
    #: GuardedParameter: the gradient hooks are off too); else the hooks keep them
    native: bool = False
    hooks: list[ModuleHook] = dataclasses.field(default_factory=list)
    grad_hooks: list[ModuleHook] = dataclasses.field(default_factory=list)
    #: id(param) → the version of the alias its ``.data`` returns, when made (enter)
    alias_versions: dict[int, int] = dataclasses.field(default_factory=dict)


class WeightHooksLike(Protocol):
    """What the core keeps of the real-weights hooks
    (:class:`~swapper.zero.local.weights.WeightHooks`): their removal."""

    def remove(self) -> None:
        """Take the state-dict hooks off the model's modules."""
        ...


class LocalCore(ModelCore[Slot, tuple[nn.Module, list[Slot]]]):
    """The core of :class:`~swapper.zero.local.offload.OffloadedModel`
    (:class:`~swapper.zero.model.core.ModelCore`: lock, manager, records, counters, gate)
    with what only the one-process helpers read.

    Attributes:
        plan: the fetch order and the read-ahead along it.
        keep_held: (the core's) set True when the use tier holds every parameter at once
            (see :func:`~swapper.zero.local.overlap.keeps_held`).
        lazy_norms: the backward leaves the gradients' norms to the step (the tier the
            gradients are retained in has no limit).
        persist: persistent parameters (:mod:`swapper.zero.local.persist`).
        weights: the real-weights hooks (:mod:`swapper.zero.local.weights`), once made.
    """

    plan: FetchPlan

    def __init__(self, use_tier: Tier, room_limit: int | None) -> None:
        super().__init__(use_tier, room_limit)
        self.lazy_norms = False
        self.persist = Persistence()
        self.weights: WeightHooksLike | None = None
