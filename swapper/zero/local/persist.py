"""Persistent parameters of :class:`~swapper.zero.local.offload.OffloadedModel` (issue 14): with
budgets that hold everything, every parameter stays fetched between uses and the module
hooks are taken off, so a forward and backward run no Python hook of swapper's but the
gradients' (what DeepSpeed ZeRO-3 calls persistent parameters,
``stage3_param_persistence_threshold``, here for the whole model).

When: the use tier and the gradients' tier have no limit (nothing can ever have to make
room in them), no overlapped optimizer gates the parameters, persistence is allowed
(``OffloadedModel.set_persistent``, default on), no parameter is held, no forward or
backward is running, and every parameter is resident in the use tier now. The first
forward pre-hook that finds all of that (:func:`enter`, also after a :func:`leave`) fetches
every parameter in one manager call (:meth:`~swapper.manager.TierManager.fetch_resident_all`:
one hold each, all or none), points each ``.data`` at its bytes and takes the module pre-
and post-hooks off (their dict entries removed, kept to be put back where they were).
Nothing else changes: the gradient hooks still move each gradient into its retained
buffer; the optimizer's step fetches the parameters in place (a second hold each) and
writes the bytes the forward reads; a backward of a graph recorded before (whose output
hooks call ``fetch.acquire``) counts its holds without fetching (see ``TierFetch.acquire``).

Leaving (:func:`leave`): every hold released, ``.data`` back to the placeholder, the hooks
put back, before anything that moves parameters between tiers or reads them from the
manager on its own: a training snapshot, an overlapped optimizer's gate, ``close()``
(``unwrap()`` too; ``state_dict()`` and ``load_state_dict`` use the held bytes as they
are). A hold is released as modified when the parameter was written outside the step
(which releases its own hold as modified): in place on the parameter (its version
counter), or through ``.data``, which returns one alias made at :func:`enter` (its
version counter; ``GuardedParameter`` and ``PERSISTENT_DATA``), so a snapshot leaves
out the same parameters as with the hooks and never trusts a stale clean copy. The next
forward enters again.

Writes outside the hooks (``param.data.normal_()``, ``torch.nn.init.*``) land in the real
bytes while persistent (no ``OffloadedWriteError``: nothing is lost), and
``state_dict()`` / ``load_state_dict`` read and write those bytes (see
:func:`~swapper.zero.local.weights.fetch_copy`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from swapper.zero.local.params import LocalCore, ModuleHook, Persistence, Slot, retain_grad
from swapper.zero.local.weights import (
    _TENSOR_DATA as TENSOR_DATA,
)
from swapper.zero.local.weights import (
    NATIVE_GRADS,
    PERSISTENT_DATA,
    TENSOR_GRAD,
    GuardedParameter,
    check_unwritten,
)
from swapper.zero.model.autograd import in_autograd
from tiers import signals

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

# ModuleHook and Persistence (this module's state) are the core's: swapper.zero.local.params.
__all__ = [
    "ModuleHook",
    "Persistence",
    "collect",
    "collect_all",
    "drop_native",
    "enter",
    "leave",
    "record_hook",
    "remove_all",
    "retain_held",
]


def record_hook(core: LocalCore, owner: Any, kind: str, handle: RemovableHandle) -> None:
    """Keep a hook the lifecycle installed (``kind``: "pre" or "post", a module's; "grad",
    a parameter's) in ``core.persist``, to be taken off while persistent and put back."""
    persist = core.persist
    (persist.grad_hooks if kind == "grad" else persist.hooks).append(_record(owner, kind, handle))


def _record(owner: Any, kind: str, handle: RemovableHandle) -> ModuleHook:
    hook = ModuleHook(owner, kind, handle, None)
    hook.fn = hook.hooks()[handle.id]
    return hook


def remove_all(core: LocalCore) -> None:
    """Remove every hook for good (``close()``)."""
    for hook in core.persist.hooks + core.persist.grad_hooks:
        hook.handle.remove()
    core.persist.hooks.clear()
    core.persist.grad_hooks.clear()


def _take_off(hook: ModuleHook) -> None:
    hook.order = list(hook.hooks())
    hook.handle.remove()


def _put_back(hook: ModuleHook) -> None:
    hooks, key = hook.hooks(), hook.handle.id
    hooks[key] = hook.fn
    if hook.kind == "post":
        hook.owner._forward_hooks_always_called[key] = True
    elif hook.kind == "pre":
        hook.owner._forward_pre_hooks_with_kwargs[key] = True  # (install's)
    # Where it stood: the hooks that were there keep their order around it, hooks added
    # meanwhile come after them (as they would have).
    before = [k for k in hook.order if k in hooks]
    for k in before + [k for k in list(hooks) if k not in hook.order]:
        hooks.move_to_end(k)


def can_enter(core: LocalCore) -> bool:
    """The cheap conditions of :func:`enter` (module docstring)."""
    persist = core.persist
    return (
        persist.allowed
        and not persist.active
        and core.room_limit is None
        and core.lazy_norms
        and core.param_gate is None
        and not core.forward_holds
        and not core.holds.carried
        and not core.holds.in_backward
        and not in_autograd()
    )


def enter(core: LocalCore) -> bool:
    """Make every parameter persistent (module docstring) if it can be now; whether it
    did. Called by a forward pre-hook, before it takes anything.

    Raises:
        OffloadedWriteError: a parameter was written outside the hooks while in the
            tiers (as its fetch would: :func:`~swapper.zero.local.weights.check_unwritten`),
            before anything is fetched.
    """
    if not can_enter(core):
        return False
    slots = list(core.by_name.values())
    if any(slot.users for slot in slots):
        return False
    for slot in slots:
        check_unwritten(slot)
    with signals.held:  # all held, recorded and the hooks off, or nothing
        tensors = core.manager.fetch_resident_all([s.key for s in slots], core.use_tier)
        if tensors is None:
            return False
        persist = core.persist
        with core.lock:
            for slot, tensor in zip(slots, tensors, strict=True):
                param = slot.param
                param.data = tensor
                slot.version = param._version
                if type(param) is GuardedParameter:  # (its .data: this alias from now)
                    alias = TENSOR_DATA.__get__(param)
                    PERSISTENT_DATA[id(param)] = alias
                    persist.alias_versions[id(param)] = alias._version
            persist.active = True
        for hook in persist.hooks:
            _take_off(hook)
        # Gradients in autograd's own fields, no hook (see collect), where every
        # parameter reads its .grad through GuardedParameter (which hides them).
        persist.native = all(type(slot.param) is GuardedParameter for slot in slots)
        if persist.native:
            for slot in slots:
                NATIVE_GRADS[id(slot.param)] = _grad_setter(core, slot)
            for hook in persist.grad_hooks:
                _take_off(hook)
    return True


def collect_all(core: LocalCore, slots: Iterable[Slot]) -> None:
    """:func:`collect` of each slot, in one section and lock hold (the step's, once per
    step: ~52 calls of :func:`collect` cost ~0.5 ms at 1.9 M parameters). A gradient
    already held, or in a manager entry, is left to :func:`collect` (added to)."""
    if not core.persist.native:
        return
    rest = []
    with signals.held, core.lock:  # each moved and cleared, or neither
        for slot in slots:
            param = slot.param
            grad = TENSOR_GRAD.__get__(param)
            if grad is None:
                continue
            if slot.has_grad or not grad.is_contiguous():
                rest.append(slot)
                continue
            # (autograd's gradient has the parameter's shape: slot.shape while persistent)
            slot.grad_held = grad.detach() if grad.requires_grad else grad
            slot.has_grad, slot.grad_norm = True, None
            TENSOR_GRAD.__set__(param, None)
    for slot in rest:
        collect(core, slot)


def _grad_setter(core: LocalCore, slot: Slot) -> Callable[[torch.Tensor | None], None]:
    """What ``param.grad = value`` does while the gradient is native: None changes
    nothing (the retained gradient is not ``.grad``, as when the hooks moved it); a
    tensor is set after the gradient so far is collected, and is added to it at the next
    :func:`collect` (as a backward would have added it)."""

    def setter(value: torch.Tensor | None) -> None:
        if value is None:
            return
        collect(core, slot)
        TENSOR_GRAD.__set__(slot.param, value)

    return setter


def collect(core: LocalCore, slot: Slot) -> None:
    """Move the gradient autograd accumulated in the parameter's own field (native:
    :func:`enter`) into its retained form, as the gradient hook would have: kept by
    reference (``Slot.grad_held``) or added to the one kept (``add_`` in 16 bits, as
    ``retain_grad`` adds into its entry, and as autograd adds two micro-steps), or into
    a manager entry holding one from before. Every reader of the retained gradients calls
    it first (:class:`~swapper.zero.local.params.TieredParams`, ``zero_grad``, :func:`leave`).
    """
    if not core.persist.native:
        return
    grad = TENSOR_GRAD.__get__(slot.param)
    if grad is None:
        return
    with signals.held:  # moved and cleared, or neither
        if not retain_held(core, slot, grad):
            retain_grad(core.manager, slot, grad, core.lock, lazy_norm=core.lazy_norms)
        TENSOR_GRAD.__set__(slot.param, None)


def leave(core: LocalCore) -> None:
    """Release every persistent hold (as modified where written: module docstring) and
    put the module hooks back; nothing when not persistent. A parameter that a backward holds now (a
    graph recorded before) keeps its hold: the hooks' release gives it back."""
    persist = core.persist
    if not persist.active:
        return
    with signals.held:  # every hold released and the hooks back, or neither
        if persist.native:
            collect_all(core, core.by_name.values())
            for slot in core.by_name.values():
                NATIVE_GRADS.pop(id(slot.param), None)
            for hook in persist.grad_hooks:
                _put_back(hook)
            persist.native = False
        _give_back_grads(core)
        with core.lock:
            free = [slot for slot in core.by_name.values() if not slot.users]
            written, clean = [], []
            for slot in free:
                (written if _written(persist, slot) else clean).append(slot.key)
            for slot in core.by_name.values():
                PERSISTENT_DATA.pop(id(slot.param), None)
            persist.alias_versions.clear()
            for slot in free:
                slot.param.data = slot.placeholder
                slot.version = slot.param._version
            persist.active = False
        for hook in persist.hooks:
            _put_back(hook)
        core.manager.release_all(written, modified=True)
        core.manager.release_all(clean, modified=False)


def _written(persist: Persistence, slot: Slot) -> bool:
    """Whether the parameter was written while persistent other than by the optimizer's
    step (which releases its own hold as modified): in place on the parameter (its
    version counter), or through ``.data`` (the alias's: :func:`enter`). Unknown
    (an unguarded parameter class, ``.data`` set): written."""
    param = slot.param
    alias = PERSISTENT_DATA.get(id(param))
    if alias is None or param._version != slot.version:
        return True
    return alias._version != persist.alias_versions.get(id(param))


def retain_held(core: LocalCore, slot: Slot, grad: torch.Tensor) -> bool:
    """:func:`~swapper.zero.local.params.retain_grad` while persistent: autograd's gradient
    tensor is kept by reference (``Slot.grad_held``: moved, no copy; the norm left to
    the step), or added to the one kept (in 16 bits, as ``retain_grad`` adds into its
    entry), in one uninterrupted section. False (nothing done) when not persistent or
    when a manager entry holds the slot's gradient (kept from before persistence:
    ``retain_grad`` adds there).

    Why not a copy into a kept entry: on a narrow model that copy was most of what the
    backward cost beyond plain PyTorch (~1 ms of ~30 at 1.9 M parameters).
    """
    if not core.persist.active:
        return False
    held = slot.grad_held
    if held is None and slot.has_grad:
        return False
    with signals.held:
        if held is not None:
            held.add_(grad.view(slot.shape))
        else:
            tensor = grad.detach()
            if not tensor.is_contiguous():  # (the step reads it flattened)
                tensor = tensor.contiguous()
            with core.lock:
                slot.grad_held = tensor.view(slot.shape)
                slot.has_grad = True
        slot.grad_norm = None
    return True


def drop_native(core: LocalCore, slots: Iterable[Slot]) -> list[Slot]:
    """``zero_grad`` while the gradients are native (:func:`enter`): each gradient in
    autograd's field and each held by reference dropped, in one section; returns the
    slots whose gradient entry is in the manager (from before persistence), which the
    caller drops as always."""
    rest = []
    with signals.held, core.lock:
        for slot in slots:
            param = slot.param
            if TENSOR_GRAD.__get__(param) is not None:
                TENSOR_GRAD.__set__(param, None)
            if slot.grad_held is not None:
                slot.has_grad, slot.grad_norm, slot.grad_held = False, None, None
            elif slot.has_grad or slot.grad_kept:
                rest.append(slot)
    return rest


def _give_back_grads(core: LocalCore) -> None:
    """Move each gradient held by reference into its manager entry (the kept one, or a
    new one), as the hooks' path keeps it. Cut by an error, what is not moved stays
    held (the model stays persistent)."""
    for slot in core.by_name.values():
        held = slot.grad_held
        if held is None:
            continue
        with core.lock:
            slot.has_grad = False  # (retain_grad copies into the kept entry or registers)
        try:
            retain_grad(core.manager, slot, held, core.lock, lazy_norm=core.lazy_norms)
        except BaseException:
            with core.lock:
                slot.has_grad = True
            raise
        with core.lock:
            slot.grad_held = None
