"""The optimizer's door: :class:`OptimizerState`, what checkpoints, exports, digests, the
DeepSpeed reader and the pressure tools read and write of a streamed optimizer's state,
instead of reaching into ``optimizer._pipeline`` and its counters.

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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from swapper.manager import TierManager
from swapper.step.compress import MomentCodec
from swapper.step.layout import SubGroup
from swapper.step.rules.base import UpdateRule
from tiers.errors import SwapConfigError

if TYPE_CHECKING:
    from swapper.step.pipeline import StepPipeline
    from swapper.step.sources import ParamSource

__all__ = ["OptimizerState", "Streamed"]


class _Forgets(Protocol):
    def forget_failed(self) -> None: ...


class Streamed(Protocol):
    """What the view reads of its optimizer (``StreamedOptimizer``; a protocol, so that
    this module does not import the optimizer that makes it)."""

    rule: UpdateRule
    param_groups: list[dict[str, Any]]
    _source: ParamSource
    _closed: bool
    _pending: int | None
    _load_incomplete: bool
    _step_count: int

    @property
    def _deferred(self) -> _Forgets | None: ...  # (DeferredSteps)

    @property
    def step_count(self) -> int: ...


class OptimizerState:
    """A view of one streamed optimizer's stored state (module docstring). Made by
    :attr:`~swapper.step.optimizer.StreamedOptimizer.stored_state`; holds nothing itself."""

    def __init__(self, optimizer: Streamed, pipeline: StepPipeline) -> None:
        self._optimizer = optimizer
        self._pipeline = pipeline

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
        return self._optimizer._source  # (the door: one reach, here)

    @property
    def scales_nbytes(self) -> int:
        """Bytes of the int8 block scales held in memory apart from the sub-groups."""
        return self._pipeline.scales.nbytes

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
        return self._optimizer._closed  # (the door: one reach, here)

    @property
    def step_count(self) -> int:
        """Steps taken (skipped ones not counted)."""
        return self._optimizer.step_count

    @property
    def pending(self) -> int | None:
        """The step that failed part-way (``step()`` again finishes it), or None."""
        return self._optimizer._pending  # (the door: one reach, here)

    @property
    def load_incomplete(self) -> bool:
        """Whether a load stopped part-way (the state is part old, part new)."""
        return self._optimizer._load_incomplete  # (the door: one reach, here)

    def forget_failed(self) -> None:
        """Forget a failed overlapped update (a load replaces what it would finish)."""
        deferred = self._optimizer._deferred  # (the door: one reach, here)
        if deferred is not None:
            deferred.forget_failed()

    def begin_load(self) -> None:
        """Mark a load under way: from the first write on, ``step()`` refuses until
        :meth:`end_load`; a failed overlapped update is forgotten (the load replaces it)."""
        self.forget_failed()
        self._optimizer._load_incomplete = True  # (the door: one reach, here)

    def end_load(self, step: int) -> None:
        """The load finished: the optimizer is at ``step``, nothing pending."""
        optimizer = self._optimizer
        optimizer._step_count = step  # (the door: one reach, here)
        optimizer._pending = None  # (the door: one reach, here)
        optimizer._load_incomplete = False  # (the door: one reach, here)

    def describe(self) -> dict[str, Any]:
        """A summary for logs and tests: rule, rows, sub-groups, moments."""
        return {
            "rule": self.rule.name,
            "rows": list(self.rows),
            "parameter_rows": list(self.parameter_rows),
            "sub_groups": len(self.sub_groups),
            "moments": self.codec.moments,
        }
