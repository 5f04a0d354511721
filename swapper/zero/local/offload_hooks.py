"""The one-process unit of the hooks (:class:`~swapper.zero.model.lifecycle.ModelLifecycle`
writes the hooks once: forward pre-hook, forward hook, gradient hook, the end of a
backward): a hold is of one parameter (``Slot``), fetched from the tiers by
``TierManager.fetch`` and given back by ``release`` (the model's fetch strategy,
:class:`~swapper.zero.local.fetch.TierFetch`, ``self.fetch``). What this model supplies:
the persistent hooks taken off (:mod:`swapper.zero.local.persist`), the resident fast path
(:mod:`swapper.zero.local.resident`), the room check, the holds carried from a forward to
its backward (``core.keep_held``), and each gradient moved into its retained 16-bit
buffer. ``core`` and ``fetch`` are set by ``OffloadedModel.__init__``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from swapper.zero.local.fetch import TierFetch
from swapper.zero.local.params import LocalCore, Slot, retain_grad
from swapper.zero.local.persist import enter, record_hook, retain_held
from swapper.zero.local.resident import acquire_resident
from swapper.zero.model.autograd import hook_outputs
from swapper.zero.model.lifecycle import ModelLifecycle
from swapper.zero.model.recompute import no_room
from swapper.zero.model.saved import SavedParams

__all__ = ["ModuleHooks"]


class ModuleHooks(ModelLifecycle):
    """The one-process unit of the shared hooks (module docstring)."""

    core: LocalCore  # what the hooks and their helpers share (swapper.zero.model.core)
    fetch: TierFetch  # a parameter's fetch and release (swapper.zero.local.fetch)
    _saved: SavedParams
    _module_slots: dict[nn.Module, list[Slot]]  # each module's own parameters

    # -- the unit (swapper.zero.model.lifecycle): one parameter ---------------------------

    def _module_units(self) -> Iterable[tuple[nn.Module, list[Any]]]:
        return self._module_slots.items()

    def _all_units(self) -> Iterable[Slot]:
        return self.core.by_name.values()

    def _records_of(self, units: list[Any]) -> list[Any]:
        return units  # (a slot is its own record)

    def _hooked(self, owner: Any, kind: str, handle: Any) -> None:
        record_hook(self.core, owner, kind, handle)  # (taken off while persistent)

    def _hooks_off(self) -> bool:
        return enter(self.core)  # persistent from here: the hooks off (local.persist)

    def _step_boundary(self) -> None:
        self.core.plan.step_boundary()

    def _acquire_resident(self, units: list[Any]) -> bool:
        return acquire_resident(self.core, units)  # (budgets holding every parameter)

    def _saves_views(self) -> bool:
        # Parameters can move before the backward (a limited use tier: even where all
        # fit, a recompute's holds are not kept, and the tier holds other kinds):
        # autograd must not keep views of their blocks (swapper.zero.model.saved). Decided
        # by the budget alone, so the same in a recompute as in its forward
        # (checkpointing counts saved tensors).
        return self.core.room_limit is not None

    def _settle_for_backward(self) -> None:
        if self.core.param_gate is not None:
            # An overlapped update still running reads the gradients this backward is
            # about to add to (and drops them at its end): wait for it here, also when
            # every hold is carried over from the forward and nothing is fetched (no
            # fetch, no gate: the update dropped this backward's gradients).
            self.core.param_gate(None)

    def _mark_outputs(self, output: Any, before_backward: Callable[[], None]) -> tuple[Any, bool]:
        return output, hook_outputs(output, before_backward)  # (tensor hooks: no node)

    def _take_grad(self, record: Slot, grad: torch.Tensor | None) -> None:
        if grad is not None and not retain_held(self.core, record, grad):
            core = self.core
            retain_grad(core.manager, record, grad, core.lock, lazy_norm=core.lazy_norms)

    def _grad_may_end(self, record: Slot) -> bool:
        return record.backward_holds != 0  # (0: the common case, the only one persistent)

    def _ended_units(self, record: Slot) -> Iterable[Slot]:
        return (record,)  # a parameter's backward holds end with its gradient

    # -- room ---------------------------------------------------------------------------------

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
