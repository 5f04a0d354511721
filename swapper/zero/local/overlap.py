"""The one-process side of an overlapped optimizer (:mod:`swapper.step.deferred`): its gate
on the model's parameters, and whether a forward's holds may be kept for the backward
beside the update's host room. The model's
:class:`~swapper.zero.model.lifecycle.UpdateOverlap` (``model.overlap``), as
:class:`~swapper.zero.sharded.overlap.ShardOverlap` is over N ranks; the lifecycle's
``set_param_gate``, ``step_started``, ``zero_grad`` and ``close`` ask it.
"""

from __future__ import annotations

from torch import nn

from swapper.manager import Tier
from swapper.step.sources import ParamGate
from swapper.zero.local.params import LocalCore
from swapper.zero.local.persist import leave as unpersist
from swapper.zero.local.placing import check_overlap_room
from tiers.errors import SwapConfigError

__all__ = ["LocalOverlap", "keeps_held"]


def keeps_held(core: LocalCore, reserve: int) -> bool:
    """Whether a forward's holds are kept for its backward: the use tier holds every
    parameter at once (and ``reserve`` bytes beside them), so holding them costs no room
    that could be used."""
    total = sum(slot.nbytes for slot in core.by_name.values())
    return core.room_limit is None or total + reserve <= core.room_limit


class LocalOverlap:
    """An overlapped optimizer's gate in a one-process model (module docstring): the
    gate itself is ``core.param_gate`` (the fetch strategy and the hooks read it there).

    Args:
        core: the model's core.
        module: the wrapped model (named in a refused install).
    """

    def __init__(self, core: LocalCore, module: nn.Module) -> None:
        self._core = core
        self._module = module

    @property
    def gate(self) -> ParamGate | None:
        """The gate installed now (None: none)."""
        return self._core.param_gate

    def install(self, gate: ParamGate | None, update_nbytes: int) -> None:
        """Install the gate of an overlapped optimizer, called before a parameter is
        fetched or its weight read or written; None removes it.

        ``update_nbytes``: the host memory its update holds at once (bytes). Where
        parameters are used in the host tier, the forward's holds and it must fit the
        host budget together, and a forward keeps its holds for the backward only if
        every parameter fits beside it (kept, they starved the update until the
        manager's timeout).

        Raises:
            SwapConfigError: another optimizer's gate is installed, or the host budget
                cannot hold the forward's parameters and the update at once (both named:
                :func:`~swapper.zero.local.placing.check_overlap_room`).
        """
        core = self._core
        if gate is not None and core.param_gate is not None:
            raise SwapConfigError("offload: one overlapped optimizer per model (a gate is set)")
        if gate is not None:
            unpersist(core)  # the update fetches parameters per piece, gated
        reserve = update_nbytes if gate is not None and core.use_tier is Tier.HOST else 0
        keep = keeps_held(core, reserve)
        if reserve and not keep and core.room_limit is not None:
            check_overlap_room(
                self._module, lambda p: core.slots[id(p)].nbytes, core.room_limit, reserve
            )
        core.param_gate = gate
        core.keep_held = keep
        if gate is not None:
            core.plan.overlapped()  # the eviction order then covers a whole overlapped cycle

    def step_started(self) -> None:
        """The update of a step starts: see
        :meth:`~swapper.zero.model.readahead.FetchPlan.step_started`."""
        self._core.plan.step_started()

    def settle(self, what: str) -> None:
        """Wait for an update still running before ``what`` changes what it reads (the
        retained gradients)."""
        gate = self._core.param_gate
        if gate is not None:
            gate(None)
