"""The hooks of :class:`~swapper.zero.local.offload.OffloadedModel` around each module's work,
and the fetch and release of one parameter (:mod:`swapper.zero.local.offload`'s docstring says
what each hook does and when).

This is the one-process strategy of the shared lifecycle
(:class:`~swapper.zero.model.lifecycle.ModelLifecycle`: forward, release of a failed
pass's holds, backward start and end, ``zero_grad``, close of the manager): a hold is of
one parameter (``Slot``), fetched from the tiers by ``TierManager.fetch`` and given back by
``release``. ``OffloadedModel`` is the set-up and the surface the optimizer and the user
see; the hooks are the state machine the forward and backward drive, with the
lifecycle's invariants (a hold is counted once it is fetched, and released exactly once:
by the module's forward hook, its gradient hook, the end of the backward, or a failed
pass's clean-up). ``core`` is set by ``OffloadedModel.__init__``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from swapper.zero.local.params import LocalCore, Slot, retain_grad
from swapper.zero.local.persist import drop_native, enter, retain_held
from swapper.zero.local.resident import acquire_resident
from swapper.zero.local.weights import check_unwritten
from swapper.zero.model.autograd import hook_outputs, in_autograd
from swapper.zero.model.frozen import FrozenUse, mark_inputs
from swapper.zero.model.lifecycle import ModelLifecycle
from swapper.zero.model.recompute import no_room
from swapper.zero.model.saved import SavedParams
from tiers import signals

__all__ = ["ModuleHooks"]


class ModuleHooks(ModelLifecycle):
    """The module hooks and the per-parameter fetch and release (module docstring)."""

    core: LocalCore  # what the hooks and their helpers share (swapper.zero.model.core)
    _saved: SavedParams
    _frozen_uses: list[FrozenUse]  # modules whose parameters are all frozen

    def _pre_forward_hook(
        self, slots: list[Slot], frozen: FrozenUse | None = None
    ) -> Callable[..., Any]:
        after = None
        if frozen is not None:  # (recorded: the end of a backward resets its count)
            self._frozen_uses.append(frozen)
            after = self._frozen_after(frozen)

        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if enter(self.core):  # persistent from here: this hook is off (local.persist)
                return None
            self.core.plan.step_boundary()
            self._check_room(slots)
            taken: list[Slot] = []
            self.core.forward_holds.append((module, taken))
            with signals.at_waits:  # each one fetched and recorded, or neither
                if acquire_resident(self.core, slots):  # (budgets holding every parameter)
                    taken.extend(slots)
                else:
                    for slot in slots:
                        self._acquire(slot)
                        taken.append(slot)
                if self.core.room_limit is not None:
                    # Parameters can move before the backward (a limited use tier: even
                    # where all fit, a recompute's holds are not kept, and the tier holds
                    # other kinds): autograd must not keep views of their blocks
                    # (swapper.zero.model.saved). Decided by the budget alone, so the same in a
                    # recompute as in its forward (checkpointing counts saved tensors).
                    self._saved.push(len(self.core.forward_holds) - 1, taken)
            if after is not None and not self.core.keep_held and torch.is_grad_enabled():
                # all frozen: released when its backward is over (swapper.zero.model.frozen)
                return mark_inputs(args, kwargs, after)
            return None

        return hook

    def _frozen_after(self, frozen: FrozenUse) -> Callable[[], None]:
        """The AfterBackward hook (:mod:`swapper.zero.model.frozen`) of a module whose
        parameters are all frozen: release the holds one backward of it took."""

        def after() -> None:
            with signals.held:  # uncounted and released, or neither
                with self.core.lock:
                    if not frozen.pending:
                        return  # (its holds were released already: the backward ended)
                    frozen.pending -= 1
                    for slot in frozen.slots:
                        slot.backward_holds -= 1
                for slot in frozen.slots:
                    self._release(slot)

        return after

    def _post_forward_hook(
        self, slots: list[Slot], frozen: FrozenUse | None = None
    ) -> Callable[..., Any]:
        def before_backward() -> None:
            if self.core.param_gate is not None:
                # An overlapped update still running reads the gradients this backward is
                # about to add to (and drops them at its end): wait for it here, also
                # when every hold is carried over from the forward and nothing is fetched
                # (no fetch, no gate: the update dropped this backward's gradients).
                self.core.param_gate(None)
            self._backward_started()
            self._check_room(slots)
            with signals.at_waits:  # each one fetched and recorded, or neither
                for slot in slots:
                    if slot.carried:  # held since its forward: taken over, nothing fetched
                        with self.core.lock:
                            slot.carried -= 1
                            self.core.holds.carried -= 1
                            slot.backward_holds += 1
                        continue
                    self._acquire(slot)
                    with self.core.lock:
                        slot.backward_holds += 1
                if frozen is not None:
                    with self.core.lock:
                        frozen.pending += 1  # (what its AfterBackward releases)

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            with signals.held:
                # This module's entry, and above it those of forwards that began inside
                # it and never finished (abandoned: nothing else will release them).
                at = len(self.core.forward_holds) - 1
                while at >= 0 and self.core.forward_holds[at][0] is not module:
                    at -= 1
                own: list[Slot] = []
                if at >= 0:
                    self._saved.pop_from(at)
                    self._drop_forward_holds(at + 1)
                    own = self.core.forward_holds.pop()[1]
                carry = False
                try:
                    if output is not None and torch.is_grad_enabled():
                        hooked = hook_outputs(output, before_backward)
                        # Kept for the backward when the use tier holds every parameter
                        # anyway (the release and the fetch again cost more than a narrow
                        # module's work); never inside a backward (a recompute's holds
                        # end with it).
                        carry = hooked and self.core.keep_held and not in_autograd()
                    return output
                finally:
                    if carry:
                        with self.core.lock:
                            for slot in own:
                                slot.carried += 1
                            self.core.holds.carried += len(own)
                    else:
                        for slot in own:
                            self._release(slot)

        return hook

    def _grad_hook(self, slot: Slot) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if grad is not None:
                if not retain_held(self.core, slot, grad):
                    core = self.core
                    retain_grad(core.manager, slot, grad, core.lock, lazy_norm=core.lazy_norms)
                param.grad = None  # moved: the retained buffer holds it now
            if not slot.backward_holds:
                return  # (the common case, and the only one while persistent)
            with signals.held:
                with self.core.lock:
                    holds, slot.backward_holds = slot.backward_holds, 0
                for _ in range(holds):
                    self._release(slot)

        return hook

    def _release_backward_holds(self) -> tuple[int, int]:
        """Release every backward hold and every hold kept from a forward for its
        backward; returns how many of each. Signals held by the caller."""
        with self.core.lock:
            leftovers = [
                (s, s.backward_holds, s.carried)
                for s in self.core.by_name.values()
                if s.backward_holds or s.carried
            ]
            for slot, _, kept in leftovers:
                slot.backward_holds = 0
                slot.carried -= kept
                self.core.holds.carried -= kept
            for frozen in self._frozen_uses:
                frozen.pending = 0
        for slot, holds, kept in leftovers:
            for _ in range(holds + kept):
                self._release(slot)
        return sum(h for _, h, _ in leftovers), sum(k for _, _, k in leftovers)

    # -- retained gradients dropped ----------------------------------------------------------

    def drop_kept_grads(self) -> None:
        """Unregister the gradient entries that ``zero_grad`` kept empty (a snapshot
        writes every entry it finds: none holds a gradient then)."""
        self.drop_grads(self.core.by_name.values(), keep=False)

    def drop_grads(self, slots: Iterable[Slot], *, keep: bool | None = None) -> None:
        """Drop the slots' retained gradients. With budgets that hold everything (the
        gradients' tier has no limit: nothing would use the room; and no overlapped
        update, whose ``zero_grad`` runs on its thread) each entry is kept, marked empty
        (``Slot.grad_kept``): the next backward copies into it instead of registering a
        new entry (~20 µs a gradient and step for the pair). ``keep=False``: unregister."""
        if keep is None:
            keep = self.core.lazy_norms and self.core.param_gate is None
        if self.core.persist.active:  # persistent: those held by reference or by autograd
            slots = drop_native(self.core, slots)
        for slot in slots:
            # Unregistered first, then marked: cut in between (Ctrl-C at the wait for a
            # write of it), the slot still says what the manager holds.
            with signals.at_waits:
                if slot.has_grad and keep:
                    with self.core.lock:
                        slot.has_grad, slot.grad_norm, slot.grad_kept = False, None, True
                elif slot.has_grad or slot.grad_kept:
                    self.core.manager.unregister(slot.grad_key)
                    with self.core.lock:
                        slot.has_grad, slot.grad_norm, slot.grad_kept = False, None, False

    # -- fetching and releasing -------------------------------------------------------------

    def _acquire(self, slot: Slot) -> None:
        """Count a user of the slot, fetching it for the first. Cut (Ctrl-C at a wait of
        the fetch, an error), nothing is counted or held; a signal arriving after the fetch
        waits for the caller's section, which records the hold first."""
        with signals.at_waits:
            if self.core.param_gate is not None:
                self.core.param_gate(slot.param)  # an overlapped step's update of it first
            with self.core.lock:
                slot.users += 1
                if slot.users > 1:
                    return
                if self.core.persist.active:  # fetched already (swapper.zero.local.persist)
                    self.core.holds.held_nbytes += slot.nbytes
                    return
            try:
                check_unwritten(slot)  # a write to the placeholder: raised, not lost quietly
                tensor = self.core.manager.fetch(slot.key, self.core.use_tier)
            except BaseException:
                with self.core.lock:
                    slot.users -= 1
                raise
            with self.core.lock:
                slot.param.data = tensor
                slot.version = slot.param._version
                self.core.holds.held_nbytes += slot.nbytes
            self.core.plan.fetched(slot.key)

    def _release(self, slot: Slot) -> None:
        with signals.held:  # uncounted and released, or neither
            with self.core.lock:
                slot.users -= 1
                if slot.users > 0:
                    return
                if self.core.persist.active:  # stays fetched (swapper.zero.local.persist)
                    self.core.holds.held_nbytes -= slot.nbytes
                    return
                # an in-place write while fetched landed in the tiers' bytes: keep it
                modified = slot.param._version != slot.version
                slot.param.data = slot.placeholder
                slot.version = slot.param._version
                self.core.holds.held_nbytes -= slot.nbytes
            self.core.manager.release(slot.key, modified=modified)

    def _keeps_held(self, reserve: int) -> bool:
        """Whether a forward's holds are kept for its backward: the use tier holds every
        parameter at once (and ``reserve`` bytes beside them), so holding them costs no
        room that could be used."""
        total = sum(slot.nbytes for slot in self.core.by_name.values())
        return self.core.room_limit is None or total + reserve <= self.core.room_limit

    def _check_room(self, slots: list[Slot]) -> None:
        """Raise at once if the use tier cannot hold what is held now and the slots'
        parameters: held parameters are released only by the work that waits for this
        fetch, so it would wait for the budget's timeout and fail anyway.

        Raises:
            SwapConfigError: from :func:`~swapper.zero.model.recompute.no_room`.
        """
        limit = self.core.room_limit
        if limit is None:
            return
        need = sum(slot.nbytes for slot in slots if not slot.users)
        if need and self.core.holds.held_nbytes + need > limit:
            with self.core.lock:
                held = [(s.name, s.nbytes) for s in self.core.by_name.values() if s.users]
            module_name = slots[0].name.rpartition(".")[0] or "(the model)"
            raise no_room(module_name, need, held, limit, self.core.use_tier.value)
