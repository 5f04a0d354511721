"""The hooks of :class:`~swapper.zero.local.offload.OffloadedModel` around each module's work
(:mod:`swapper.zero.local.offload`'s docstring says what each hook does and when); the fetch
and release of one parameter is the model's fetch strategy,
:class:`~swapper.zero.local.fetch.TierFetch` (``self.fetch``).

This is the one-process strategy of the shared lifecycle
(:class:`~swapper.zero.model.lifecycle.ModelLifecycle`: forward, release of a failed
pass's holds, backward start and end, ``zero_grad``, close of the manager): a hold is of
one parameter (``Slot``), fetched from the tiers by ``TierManager.fetch`` and given back by
``release``. ``OffloadedModel`` is the set-up and the surface the optimizer and the user
see; the hooks are the state machine the forward and backward drive, with the
lifecycle's invariants (a hold is counted once it is fetched, and released exactly once:
by the module's forward hook, its gradient hook, the end of the backward, or a failed
pass's clean-up). ``core`` and ``fetch`` are set by ``OffloadedModel.__init__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from swapper.zero.local.fetch import TierFetch
from swapper.zero.local.params import LocalCore, Slot, retain_grad
from swapper.zero.local.persist import enter, retain_held
from swapper.zero.local.resident import acquire_resident
from swapper.zero.model.autograd import hook_outputs, in_autograd
from swapper.zero.model.frozen import FrozenUse, mark_inputs
from swapper.zero.model.lifecycle import ModelLifecycle
from swapper.zero.model.recompute import no_room
from swapper.zero.model.saved import SavedParams
from tiers import signals

__all__ = ["ModuleHooks"]


class ModuleHooks(ModelLifecycle):
    """The module hooks of the one-process model (module docstring)."""

    core: LocalCore  # what the hooks and their helpers share (swapper.zero.model.core)
    fetch: TierFetch  # a parameter's fetch and release (swapper.zero.local.fetch)
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
                        self.fetch.acquire(slot)
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
                    self.fetch.release(slot)

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
                    self.fetch.acquire(slot)
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
                            self.fetch.release(slot)

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
                    self.fetch.release(slot)

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
                self.fetch.release(slot)
        return sum(h for _, h, _ in leftovers), sum(k for _, _, k in leftovers)

    # -- room ---------------------------------------------------------------------------------

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
