"""The optimizer's doors: :class:`OptimizerState`, what checkpoints, exports, digests, the
DeepSpeed reader and the pressure tools read and write of a streamed optimizer's state,
instead of reaching into ``optimizer._pipeline`` and its counters; :class:`StepCounters`,
the counters the optimizer shares with its step modules; :class:`StepOwner`, what those
modules (the overlapped step :mod:`~swapper.step.deferred`, the state dict
:mod:`~swapper.step.state`, the resume :mod:`~swapper.step.resume`) need of the optimizer
that owns them.

Order of use (a reader): ``optimizer.wait_pending()``, then a check that no step and no
load is part-way (:attr:`OptimizerState.pending`, :attr:`~OptimizerState.load_incomplete`),
then :meth:`~OptimizerState.read` / :meth:`~OptimizerState.iter_states` (fp32 copies), or
the stored tensors through :attr:`~OptimizerState.manager` and :meth:`~OptimizerState.key`.
A writer (a loader):
:meth:`~OptimizerState.begin_load`, :meth:`~OptimizerState.write` per sub-group, then
:meth:`~OptimizerState.end_load` (the step count it reached); a load cut part-way leaves
the optimizer refusing to step until a load succeeds.

What is stored is what the update rule declares (:mod:`swapper.step.rules.base`):
:attr:`~OptimizerState.rows` names the element-wise rows of a decoded state (row 0 the
fp32 master weights); a rule with per-parameter state (Adafactor's factored moments) has
:attr:`~OptimizerState.parameter_rows` too, which the flat-row readers refuse by name.

Why a protocol (:class:`StepOwner`) and not the optimizer's class: the optimizer imports
the step modules, so a step module that named ``StreamedOptimizer`` (even under
``TYPE_CHECKING``) closed an import knot, and read its private fields. This module imports
none of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from swapper.manager import TierManager
from swapper.step.compress import MomentCodec
from swapper.step.layout import SubGroup
from swapper.step.rules.base import UpdateRule
from swapper.step.scaler import DynamicLossScaler
from tiers.errors import SwapConfigError

if TYPE_CHECKING:
    from swapper.step.pipeline import StepPipeline
    from swapper.step.sources import ParamSource

__all__ = ["OptimizerState", "StepCounters", "StepOwner", "Streamed"]


@dataclasses.dataclass
class StepCounters:
    """The counters of one streamed optimizer, one object shared by the optimizer, its
    overlapped steps, its state-dict load, its resume and :class:`OptimizerState`
    (``optimizer.counters``).

    Attributes:
        step: steps taken (skipped ones not counted).
        pending: the step that failed part-way (``step()`` again finishes it), or None.
        load_incomplete: a load stopped part-way (the state is part old, part new);
            ``step()`` refuses until a load succeeds.
        closed: the optimizer is closed.
    """

    step: int = 0
    pending: int | None = None
    load_incomplete: bool = False
    closed: bool = False


class _Forgets(Protocol):
    def forget_failed(self) -> None: ...


class Streamed(Protocol):
    """What the view reads of its optimizer itself (``StreamedOptimizer``; a protocol,
    so that this module does not import the optimizer that makes it)."""

    rule: UpdateRule
    param_groups: list[dict[str, Any]]

    @property
    def step_count(self) -> int: ...


class StepOwner(Protocol):
    """What the optimizer's step modules need of the optimizer that owns them
    (``StreamedOptimizer`` has it): its settings, its counters, its door to the stored
    state, and the parts of a step the overlapped step runs in its own order.

    Order of calls in an overlapped step (:mod:`swapper.step.deferred`):
    :meth:`check_open`, :meth:`grad_norm`, :meth:`grad_factor`, :meth:`check_open`, the
    counters moved (``counters.step``), :meth:`report_step`; then, in the update's thread,
    :meth:`run_update`, :meth:`zero_grad_now` if asked, :meth:`report_step`, and
    ``counters.pending`` set (failed) or cleared (done).
    """

    param_groups: list[dict[str, Any]]
    rule: UpdateRule
    loss_scaler: DynamicLossScaler | None
    sub_group_numel: int
    manager: TierManager
    counters: StepCounters

    @property
    def sub_groups(self) -> tuple[SubGroup, ...]: ...

    @property
    def step_count(self) -> int: ...

    @property
    def stored_state(self) -> OptimizerState: ...

    def numels(self) -> list[list[int]]:
        """Per group, the element count of each parameter."""
        ...

    def check_group(self, group: dict[str, Any]) -> None:
        """Check a param group's hyper-parameters (raises SwapConfigError, KeyError)."""
        ...

    def check_open(self) -> None:
        """Raise unless a step may run (closed: PipelineClosedError; a load part-way:
        StateDictError)."""
        ...

    def check_unconsumed(self) -> None:
        """Raise (before a new step) when a gradient a step consumed is gone and no
        ``zero_grad`` cleared it (:class:`~swapper.step.sources.ConsumingSource`)."""
        ...

    def grad_norm(self) -> tuple[torch.Tensor | None, bool]:
        """(unscaled global gradient norm or None, found inf/NaN)."""
        ...

    def grad_factor(self, grad_norm: torch.Tensor | None) -> float:
        """What the fp32 gradients are multiplied by (unscale, clip)."""
        ...

    def report_step(
        self, started: float, before: Any, stall_before: float, norm: float | None, *, skipped: bool
    ) -> None:
        """Record the report of a step (``optimizer.last_step``)."""
        ...

    def run_update(
        self,
        step: int,
        factor: float,
        *,
        groups: list[dict[str, Any]] | None = None,
        order: tuple[int, ...] | None = None,
    ) -> None:
        """Every sub-group's update through the pipeline, with ``groups``'
        hyper-parameters (default: the live ones) in ``order`` (default: by index)."""
        ...

    def zero_grad_now(self, set_to_none: bool = True) -> None:
        """Drop the gradients now (no overlapped update consulted)."""
        ...


class OptimizerState:
    """A view of one streamed optimizer's stored state (module docstring). Made by
    :attr:`~swapper.step.optimizer.StreamedOptimizer.stored_state`; holds nothing itself."""

    def __init__(
        self,
        optimizer: Streamed,
        pipeline: StepPipeline,
        counters: StepCounters,
        source: ParamSource,
        deferred: _Forgets | None,
    ) -> None:
        self._optimizer = optimizer
        self._pipeline = pipeline
        self._counters = counters
        self._source = source
        self._deferred = deferred

    # -- what is stored --------------------------------------------------------------------

    @property
    def rule(self) -> UpdateRule:
        """The update rule, whose declared rows are what is stored."""
        return self._optimizer.rule

    @property
    def rows(self) -> tuple[str, ...]:
        """Names of the element-wise rows of a decoded state, in row order (``master``
        first; AdamW: ``master``, ``exp_avg``, ``exp_avg_sq``)."""
        return tuple(r.name for r in self.rule.state_rows() if r.per == "element")

    @property
    def parameter_rows(self) -> tuple[str, ...]:
        """Names of per-parameter state (in shapes the optimizer makes); empty for an
        element-wise rule."""
        return tuple(r.name for r in self.rule.state_rows() if r.per == "parameter")

    def require_flat_rows(self, what: str) -> None:
        """Refuse ``what`` (a reader of element-wise rows) for a rule with per-parameter
        state.

        Raises:
            SwapConfigError: the rule keeps per-parameter state (named).
        """
        if self.parameter_rows:
            raise SwapConfigError(
                f"{what} reads the optimizer's state as element-wise rows; "
                f"{type(self._optimizer).__name__} ({self.rule.name}) keeps per-parameter "
                f"state {list(self.parameter_rows)}: use its state_dict() instead"
            )

    @property
    def sub_groups(self) -> tuple[SubGroup, ...]:
        """The sub-groups the state is cut into."""
        return self._pipeline.sub_groups

    @property
    def codec(self) -> MomentCodec:
        """How the moments are stored (fp32, bf16, int8)."""
        return self._pipeline.codec

    @property
    def manager(self) -> TierManager:
        """The manager holding the state."""
        return self._pipeline.manager

    @property
    def source(self) -> ParamSource:
        """Where the 16-bit parameters live (local tensors, an offloaded model)."""
        return self._source

    @property
    def scales_nbytes(self) -> int:
        """Bytes of the int8 block scales held in memory apart from the sub-groups."""
        return self._pipeline.scales.nbytes

    @property
    def name(self) -> str:
        """The state's name (``StepConfig.name``: the prefix of its manager keys)."""
        return self._pipeline.name

    def key(self, index: int) -> str:
        """The manager key of sub-group ``index``'s state."""
        return self._pipeline.key(index)

    def param(self, sg: SubGroup, param_index: int) -> torch.Tensor:
        """The parameter of ``sg``'s group at ``param_index``."""
        return self._optimizer.param_groups[sg.group_index]["params"][param_index]

    def held(self) -> dict[int, torch.Tensor]:
        """Sub-groups kept in memory for the optimizer's life: index → stored tensor."""
        return self._pipeline.held_states()

    def is_held(self, index: int) -> bool:
        """Whether sub-group ``index`` is kept in memory for the optimizer's life."""
        return self._pipeline.holds(index)

    # -- reading and writing -----------------------------------------------------------------

    def read(self, index: int) -> torch.Tensor:
        """A decoded fp32 copy of sub-group ``index``'s state."""
        return self._pipeline.read(index)

    def iter_states(self) -> Iterator[tuple[SubGroup, torch.Tensor]]:
        """Each sub-group with a decoded fp32 copy of its state, one at a time."""
        return self._pipeline.iter_states()

    def write(self, index: int, fill: Callable[[torch.Tensor], None], step: int) -> None:
        """Overwrite sub-group ``index`` with ``fill(state)`` (fp32, decoded) and make it
        durable (:meth:`~swapper.step.pipeline.StepPipeline.write`)."""
        self._pipeline.write(index, fill, step)

    def kept_released(self) -> AbstractContextManager[None]:
        """While the block runs, the sub-groups kept in memory are released (a snapshot
        writes them); fetched and kept again after (:func:`swapper.step.resume.kept_released`)."""
        return self._pipeline.kept_released()

    # -- the optimizer's counters ------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether the optimizer is closed."""
        return self._counters.closed

    @property
    def step_count(self) -> int:
        """Steps taken (skipped ones not counted)."""
        return self._optimizer.step_count

    @property
    def pending(self) -> int | None:
        """The step that failed part-way (``step()`` again finishes it), or None."""
        return self._counters.pending

    @property
    def load_incomplete(self) -> bool:
        """Whether a load stopped part-way (the state is part old, part new)."""
        return self._counters.load_incomplete

    def forget_failed(self) -> None:
        """Forget a failed overlapped update (a load replaces what it would finish)."""
        if self._deferred is not None:
            self._deferred.forget_failed()

    def begin_load(self) -> None:
        """Mark a load under way: from the first write on, ``step()`` refuses until
        :meth:`end_load`; a failed overlapped update is forgotten (the load replaces it)."""
        self.forget_failed()
        self._counters.load_incomplete = True

    def end_load(self, step: int) -> None:
        """The load finished: the optimizer is at ``step``, nothing pending."""
        counters = self._counters
        counters.step = step
        counters.pending = None
        counters.load_incomplete = False

    def describe(self) -> dict[str, Any]:
        """A summary for logs and tests: rule, rows, sub-groups, moments."""
        return {
            "rule": self.rule.name,
            "rows": list(self.rows),
            "parameter_rows": list(self.parameter_rows),
            "sub_groups": len(self.sub_groups),
            "moments": self.codec.moments,
        }
