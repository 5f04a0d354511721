"""``swapper.offload(model, config)`` in one process: a module's 16-bit parameters live in
the tiers (:func:`swapper.zero.wrap.offload` builds an :class:`OffloadedModel`).

Every parameter is one tensor of kind ``param16`` in a :class:`~swapper.manager.TierManager`
(key ``param/<name>``); between uses its ``.data`` is an empty placeholder. Hooks on each
module that owns parameters (``recurse=False``) bring them in around the module's work:

- forward pre-hook: fetch them into the first tier of their placement (the device)
  and point ``.data`` at the fetched bytes; forward hook: release them again, and hook
  the outputs (:func:`~swapper.zero.model.autograd.hook_outputs`) so that the module's backward
  fetches them again first. When the use tier can hold every parameter at once, the
  forward's hold is kept for that backward instead (``Slot.carried``: nothing released
  and fetched again; released at the end of the backward, or before a step, if unused);
- when a parameter's gradient has been accumulated (``register_post_accumulate_grad_hook``:
  every use of it in the graph has contributed, tied weights included), the gradient is
  moved into its retained 16-bit buffer (kind ``grad16``, key ``grad/<name>``, host tier
  by default; added to it on later micro-steps; :func:`~swapper.zero.local.params.retain_grad`),
  ``.grad`` is dropped, and the backward holds on the parameter are released;
- at the end of each backward, holds left (parameters without gradients) are released.
  With budgets that hold everything none of these runs (:mod:`swapper.zero.local.persist`).

A parameter used by several modules (tied weights) is one entry; it is fetched once and
counted per user, so it is never released twice nor early.

The first forward and backward record the order in which parameters are fetched; from
then on every fetch reads ahead the next ones along it (up to
``config.manager.prefetch_window_nbytes`` of them), unless all are where they are used
(:class:`~swapper.zero.model.readahead.FetchPlan`). The manager records every fetch from
the first forward to the second (so the optimizer's step is in it too) and evicts by that
order (Belady).

Parameters are placed at wrap time, one module at a time: each goes to the fastest tier of
its placement with room (device, else pinned host, else written to NVMe), and a model
built on the meta device is materialised module by module (``materialize``), so a model
larger than host memory can be initialised.

Weights outside the step (``state_dict``/``load_state_dict`` of the model, ``unwrap()`` when
the block is left, in-place writes outside the hooks) are in :mod:`swapper.zero.local.weights`.
Activation checkpointing runs the hooks again inside the backward (a recompute); what it
holds is checked in :mod:`swapper.zero.model.recompute`, and the forward hooks run when a forward
raises (``always_call``), so a recompute stopped early releases what it fetched.

Layout: the lifecycle both models share (the module hooks, forward, a failed pass's
clean-up, backward start and end, ``zero_grad``, the manager's close) is
:mod:`swapper.zero.model.lifecycle`; its one-process unit (one parameter: persistence, the
resident fast path, carried holds, the room check) is
:mod:`swapper.zero.local.offload_hooks`, the fetch and release of one parameter
:mod:`swapper.zero.local.fetch`, an overlapped optimizer's gate
:mod:`swapper.zero.local.overlap`; the state they and the helpers share is ``self.core``
(:class:`~swapper.zero.local.params.LocalCore`); the parameter records are in
:mod:`swapper.zero.local.params`, the optimizer's view of them in
:mod:`swapper.zero.local.tiered`, the autograd plumbing in :mod:`swapper.zero.model.autograd`, the
read-ahead plan in :mod:`swapper.zero.model.readahead`, the checks before placement and the
undo of a failed meta wrap in :mod:`swapper.zero.local.placing`, real weights in
:mod:`swapper.zero.local.weights`, autograd's saved views of parameters (kept as positions
while a module's forward runs under budgets that cannot hold every parameter) in
:mod:`swapper.zero.model.saved`. What stays here is the wrap's set-up (and its undo), the
placement that registers the slots the hooks then move, and the surface the optimizer
and the user see.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import swapper.zero.checkpoint.resume as checkpoint
from swapper.manager import Kind, Tier
from swapper.zero.config.offload import OffloadConfig
from swapper.zero.config.settings import tiers_of
from swapper.zero.local.fetch import TierFetch
from swapper.zero.local.layout import WholeTensors
from swapper.zero.local.offload_hooks import ModuleHooks
from swapper.zero.local.overlap import LocalOverlap, keeps_held
from swapper.zero.local.params import LocalCore, Slot
from swapper.zero.local.persist import leave as unpersist
from swapper.zero.local.persist import remove_all
from swapper.zero.local.placing import (
    back_to_meta,
    check_fp32_grads,
    check_modules,
    positions,
)
from swapper.zero.local.weights import (
    NATIVE_GRADS,
    WeightHooks,
    guard,
    leave,
    unguard,
    unwrap,
)
from swapper.zero.model.frozen import check_known, check_trainable
from swapper.zero.model.model_buffers import BufferMoves, move_buffers, restore_buffers
from swapper.zero.model.module_apply import guard_apply, unguard_apply
from swapper.zero.model.readahead import FetchPlan
from swapper.zero.model.saved import SavedParams
from tiers import signals
from tiers.device import resolve_device
from tiers.errors import SwapConfigError

__all__ = ["Materialize", "OffloadedModel", "is_wrapped"]

log = logging.getLogger(__name__)

#: materialize(model, place): see :class:`OffloadedModel`.
Materialize = Callable[[nn.Module, Callable[[str, nn.Module], None]], None]

#: Modules wrapped so far (a module may be wrapped once).
_WRAPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def is_wrapped(module: nn.Module) -> bool:
    """Whether ``module`` is wrapped by an :class:`OffloadedModel` now."""
    return module in _WRAPPED


class OffloadedModel(ModuleHooks):
    """A module whose 16-bit parameters live in a :class:`TierManager`.

    Args:
        module: the model; its parameters are replaced by placeholders between uses.
        config: budgets, directories and placement.
        materialize: for a model built on the meta device: ``materialize(model, place)``
            gives the modules' parameters values one module at a time and calls
            ``place(name, module)`` after each, which moves that module's own parameters
            into the tiers before the next module is made (so the whole model is never in
            memory at once). A tied parameter must stay one Parameter object.
        resume: continue from a training snapshot (``True``: the newest usable one, or
            start afresh when there is none; a name: that one; see
            :mod:`swapper.zero.checkpoint.resume`); what was resumed is then in ``resumed``
            (None otherwise), e.g. ``resumed.step``, ``resumed.extra``.
    """

    layout: WholeTensors  # whole tensors in this process (swapper.zero.local.layout)
    overlap: LocalOverlap  # an overlapped optimizer's gate (swapper.zero.local.overlap)
    _registry = _WRAPPED
    _log = log

    def __init__(
        self,
        module: nn.Module,
        config: OffloadConfig,
        *,
        materialize: Materialize | None = None,
        resume: bool | str = False,
    ) -> None:
        super().__init__(module, config)  # (checked: wrappable, an OffloadConfig)
        use_tier = tiers_of(config.manager, Kind.PARAM16)[0]  # where params are used
        room_limit = (  # of the use tier: see _check_room
            config.manager.host_nbytes if use_tier is Tier.HOST else config.manager.device_nbytes
        )
        #: what the hooks and their helpers share (swapper.zero.model.core): the lock, the
        #: manager, the slots by id(param) and by name, the counters the hooks change, the
        #: holds of each forward running now (outermost first: the module and the slots
        #: its pre-hook fetched, released by its forward hook, which runs when the forward
        #: raises an Exception too, or, for a KeyboardInterrupt, by forward()), an
        #: overlapped optimizer's gate (set_param_gate) and persistence
        #: (swapper.zero.local.persist)
        self.core = LocalCore(use_tier, room_limit)
        #: a parameter's fetch from the tiers and release (swapper.zero.local.fetch)
        self.fetch = TierFetch(self.core)
        #: whole tensors: records, retained gradients, weights (swapper.zero.local.layout)
        self.layout = WholeTensors(self.core, module, self)
        #: an overlapped optimizer's gate (swapper.zero.local.overlap)
        self.overlap = LocalOverlap(self.core, module)
        manager_config = config.manager
        self._module_slots: dict[nn.Module, list[Slot]] = {}
        self._handles: list[Any] = []
        #: autograd's saved views of parameters, kept as where they are (swapper.zero.model.saved)
        self._saved = SavedParams(lambda slot: slot.users > 0)
        self._check_modules(module)
        #: until placed: each parameter emptied, its bytes (None: materialised), its slot
        self._originals: list[tuple[nn.Parameter, torch.Tensor | None, Slot]] = []
        self._had_values: dict[int, nn.Parameter] = {}
        #: where each parameter sat before materialize= ran (what a failed wrap puts back)
        before = positions(module) if materialize is not None else None
        self._buffer_moves: BufferMoves = []  # buffers moved to the use device (unwrap)
        self._apply_guarded: list[nn.Module] = []  # model.to() and the like (module_apply)
        opened = False
        try:
            # In a section ending inside this try: a Ctrl-C as the manager is returned
            # would leave it open (its store locked) with nobody to close it.
            with signals.at_waits:
                self.core.manager, self.resumed = checkpoint.open_manager(config.manager, resume)
                opened = True
            self.core.plan = FetchPlan(  # the fetch order and the read-ahead along it
                self.core.manager,
                self.core.use_tier,
                manager_config.prefetch_window_nbytes,
                lambda key: self.core.by_name[key.removeprefix("param/")].nbytes,
                self.core.lock,
            )
            self._place_all(module, materialize)
            # the first step reads ahead along the modules' order (no order recorded yet)
            self.core.plan.guess([[s.key for s in slots] for slots in self._module_slots.values()])
            self._buffer_moves = move_buffers(module, self._use_device())
            self._apply_guarded = guard_apply(module, self._use_device())
            # Whether a forward's holds are kept for its backward: the use tier holds
            # every parameter at once, so holding them costs no room that could be used.
            self.core.keep_held = keeps_held(self.core, 0)
            # Whether the backward leaves the gradients' norms to the step: the tier they
            # are retained in has no limit, so they are still in memory then (each norm
            # taken in the backward cost more than its module's work on a narrow model).
            limits = {
                Tier.DEVICE: manager_config.device_nbytes,
                Tier.HOST: manager_config.host_nbytes,
            }
            grad_tier = tiers_of(manager_config, Kind.GRAD16)[0]
            self.core.lazy_norms = grad_tier in limits and limits[grad_tier] is None
            if self.resumed is not None:
                own = {slot.key for slot in self.core.by_name.values()}
                checkpoint.finish_resume(self.core.manager, own, self.resumed)
            self._install_hooks()
            self.core.weights = WeightHooks(self.core, list(self._module_slots))
        except BaseException:
            for handle in self._handles:
                handle.remove()
            remove_all(self.core)
            if self.core.weights is not None:
                self.core.weights.remove()
            unguard_apply(self._apply_guarded)
            restore_buffers(self._buffer_moves)
            # Nothing lost: the parameters emptied so far get their own bytes back.
            unguard(self.core.by_name.values())
            for param, data, _ in self._originals:
                if data is not None:
                    param.data = data
            back_to_meta(module, [(p, slot) for p, d, slot in self._originals if d is None], before)
            if opened:
                self.core.manager.close(remove=self.resumed is None)  # snapshots are kept
            raise
        finally:
            self._originals, self._had_values = [], {}
        _WRAPPED.add(module)

    # -- what the optimizer and the user see ----------------------------------------------

    def set_persistent(self, allowed: bool) -> None:
        """Whether parameters may stay fetched between uses when the budgets hold
        everything (default True: :mod:`swapper.zero.local.persist`); False ends it now."""
        self.core.persist.allowed = bool(allowed)
        if not allowed:
            unpersist(self.core)

    def end_persistence(self) -> None:
        """Release the persistent holds and put the module hooks back (a snapshot, an
        unwrap); the next forward makes the parameters persistent again if it can."""
        unpersist(self.core)

    @property
    def persistent(self) -> bool:
        """Whether the parameters are persistent now (:mod:`swapper.zero.local.persist`)."""
        return self.core.persist.active

    def drop_kept_grads(self) -> None:
        """Unregister the gradient entries that ``zero_grad`` kept empty (a snapshot
        writes every entry it finds: none holds a gradient then)."""
        self.layout.drop_grads(self.core.by_name.values(), keep=False)

    def named_offloaded(self) -> Iterator[tuple[str, torch.Size, torch.dtype]]:
        """(name, shape, dtype) of every offloaded parameter."""
        for slot in self.core.by_name.values():
            yield slot.name, slot.shape, slot.dtype

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:  # type: ignore[override]
        """The wrapped model's ``load_state_dict`` (keys its own): each offloaded
        parameter's value is written through to the tiers, one at a time."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def unwrap(self) -> nn.Module:
        """Give the model back with real weights, then close (leaving ``with
        swapper.offload(...)`` calls it); see :func:`swapper.zero.local.weights.unwrap` for
        what it does and raises (a failure changes nothing and leaves it open)."""
        return unwrap(self)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        """:meth:`unwrap` (see :func:`swapper.zero.local.weights.leave`)."""
        leave(self, block_raised=exc_type is not None)

    # -- the lifecycle's strategy (swapper.zero.model.lifecycle): one process ------------

    def _before_close(self) -> None:
        with contextlib.suppress(Exception):  # (the tiers are dropped next anyway)
            unpersist(self.core)  # the parameters placeholders again, their holds released
        for slot in self.core.by_name.values() if self.core.persist.active else ():
            slot.param.data, slot.grad_held = slot.placeholder, None  # (leaving failed)
            NATIVE_GRADS.pop(id(slot.param), None)

    def _after_unhook(self) -> None:
        remove_all(self.core)
        unguard(self.core.by_name.values())

    def _forward_checks(self) -> None:
        check_known(self.module, self.core.slots)  # (before anything moves)
        check_trainable(self.core.by_name.values())
        self.release_stale_holds()

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.module(*args, **kwargs)

    def _after_backward(self) -> None:
        self.core.plan.backward_ended()

    # -- set-up ---------------------------------------------------------------------------

    def _use_device(self) -> torch.device:
        """The device the parameters are used on (the CPU when used from host memory)."""
        if self.core.use_tier is Tier.DEVICE:
            return resolve_device(self.config.manager.device)
        return torch.device("cpu")

    def _check_modules(self, module: nn.Module) -> None:
        first = self.core.use_tier
        limit = (
            self.config.manager.host_nbytes
            if first is Tier.HOST
            else (self.config.manager.device_nbytes)
        )
        check_modules(module, first, limit)
        manager = self.config.manager
        grad_tier = tiers_of(manager, Kind.GRAD32)[0]  # (memory only: never NVMe)
        grad_limit = manager.host_nbytes if grad_tier is Tier.HOST else manager.device_nbytes
        check_fp32_grads(module, grad_tier, grad_limit)

    def _place_all(self, module: nn.Module, materialize: Materialize | None) -> None:
        # Parameters with values before the wrap (the objects: their ids stay theirs).
        self._had_values = {id(p): p for p in module.parameters() if not p.is_meta}
        if materialize is not None:
            materialize(module, self._place_module)
            on_meta = [name for name, b in module.named_buffers() if b.is_meta]
            if on_meta:
                raise SwapConfigError(
                    f"offload: buffer(s) {on_meta[:5]} still on the meta device after "
                    "materialize=: it gives parameters values, and must give the "
                    "module's buffers values too (e.g. recompute them, as RoPE's inv_freq)"
                )
        for name, sub in module.named_modules():
            if sub not in self._module_slots:
                self._place_module(name, sub)

    def _place_module(self, name: str, module: nn.Module) -> None:
        """Move the module's own parameters into the tiers (once per module)."""
        if module in self._module_slots:
            return
        slots = []
        for p_name, param in module.named_parameters(recurse=False):
            slot = self.core.slots.get(id(param))
            if slot is None:
                slot = self._register(f"{name}.{p_name}" if name else p_name, param)
            slots.append(slot)
        if slots:
            self._module_slots[module] = slots

    def _register(self, name: str, param: nn.Parameter) -> Slot:
        if param.is_meta:
            raise SwapConfigError(
                f"offload: parameter {name!r} is on the meta device; pass materialize= to "
                "give the model's parameters values module by module"
            )
        if param.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            # (fp32 beside a 16-bit base: placing.check_dtypes; a materialised one here)
            raise SwapConfigError(
                f"offload: parameter {name!r} (shape {list(param.shape)}) is {param.dtype}; "
                "convert the model to bf16 or fp16 first (model.to(torch.bfloat16))"
            )
        slot = Slot(
            name=name,
            param=param,
            shape=param.shape,
            dtype=param.dtype,
            placeholder=torch.empty(0, dtype=param.dtype),
            trainable=param.requires_grad,
            home=param.device,
        )
        if self.resumed is not None:  # its bytes are the snapshot's
            checkpoint.adopt_param(self.core.manager, self.resumed, slot.key, param)
        else:
            self.core.manager.register(slot.key, param.detach(), Kind.PARAM16)
        # What a failed wrap gives back. A materialised parameter was on meta before the
        # wrap: it goes back there, and its bytes are not kept alive meanwhile (keeping
        # them held every module made so far: the whole model in memory at once).
        made = id(param) not in self._had_values  # by materialize= (it was on meta)
        self._originals.append((param, None if made else param.data, slot))
        param.data = slot.placeholder  # the tiers hold it now
        slot.version = param._version  # a write from now on would be lost: noticed
        guard(slot)  # (and one through .data)
        self.core.slots[id(param)] = slot
        self.core.by_name[name] = slot
        return slot
