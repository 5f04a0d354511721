"""The one-process :class:`~swapper.zero.model.lifecycle.StateLayout`: every parameter a
whole tensor in this process's tiers (a :class:`~swapper.zero.local.params.Slot` each), its
retained 16-bit gradient a whole tensor beside it.

What the lifecycle asks of it (``model.layout``): every record (``zero_grad`` drops their
gradients), the drop of retained gradients, the weights as ordinary tensors one at a time
(``iter_state_dict``) and the model's ``state_dict``. The N-rank layout is
:class:`~swapper.zero.sharded.layout.Shards` (this rank's shards; full tensors gathered).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from swapper.zero.local.params import LocalCore, Slot
from swapper.zero.local.persist import drop_native
from swapper.zero.local.tiered import ModelDoors, TieredParams
from swapper.zero.local.weights import fetch_copy
from swapper.zero.model.strategy import StateDictCall
from tiers import signals

__all__ = ["WholeTensors"]


class WholeTensors:
    """Whole tensors in one process's tiers (module docstring). ``core``: the model's;
    ``module``: the wrapped model (its ``state_dict`` hooks put the real weights in);
    ``doors``: what the optimizer's view asks of the model (its lifecycle's calls)."""

    def __init__(self, core: LocalCore, module: nn.Module, doors: ModelDoors) -> None:
        self._core = core
        self._module = module
        self._doors = doors

    def param_source(self) -> TieredParams:
        """The optimizer's view of the parameters and their retained gradients."""
        return TieredParams(self._core, self._doors)

    def records(self) -> Iterable[Slot]:
        """Every parameter's record, by name (the wrapped model's order)."""
        return self._core.by_name.values()

    def iter_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, an ordinary CPU copy of the parameter), one at a time (see
        :meth:`~swapper.zero.model.lifecycle.ModelLifecycle.iter_state_dict`). Raises
        what :func:`~swapper.zero.local.weights.fetch_copy` raises."""
        for name, slot in self._core.by_name.items():
            yield name, fetch_copy(self._core, slot)

    def state_dict(self, call: StateDictCall) -> dict[str, Any]:
        """The wrapped model's ``state_dict(**kwargs)`` (its hooks put in real weights,
        fetched one at a time: :mod:`swapper.zero.local.weights`); called by a parent
        module's ``state_dict`` (``destination=`` given, or positional arguments), it is
        ``call.as_submodule`` (``nn.Module.state_dict`` of the wrapper: keys under
        ``module.``)."""
        if call.from_parent:
            return call.as_submodule(*call.args, **call.kwargs)
        return self._module.state_dict(**call.kwargs)

    def drop_grads(self, slots: Iterable[Slot], *, keep: bool | None = None) -> None:
        """Drop the slots' retained gradients. With budgets that hold everything (the
        gradients' tier has no limit: nothing would use the room; and no overlapped
        update, whose ``zero_grad`` runs on its thread) each entry is kept, marked empty
        (``Slot.grad_kept``): the next backward copies into it instead of registering a
        new entry (~20 µs a gradient and step for the pair). ``keep=False``: unregister."""
        if keep is None:
            keep = self._core.lazy_norms and self._core.param_gate is None
        if self._core.persist.active:  # persistent: those held by reference or by autograd
            slots = drop_native(self._core, slots)
        for slot in slots:
            # Unregistered first, then marked: cut in between (Ctrl-C at the wait for a
            # write of it), the slot still says what the manager holds.
            with signals.at_waits:
                if slot.grad_dropped:  # (unregistered by the step that read it)
                    with self._core.lock:
                        slot.has_grad, slot.grad_norm, slot.grad_dropped = False, None, False
                elif slot.has_grad and keep:
                    with self._core.lock:
                        slot.has_grad, slot.grad_norm, slot.grad_kept = False, None, True
                elif slot.has_grad or slot.grad_kept:
                    self._core.manager.unregister(slot.grad_key)
                    with self._core.lock:
                        slot.has_grad, slot.grad_norm, slot.grad_kept = False, None, False
