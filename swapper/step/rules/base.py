"""The optimizer seam: an :class:`UpdateRule` says what state a sub-group keeps and how
one sub-group is updated; the step pipeline (:mod:`swapper.step.pipeline`) streams
whatever it declares.

A rule is asked, in this order:

1. :meth:`UpdateRule.plan`, once at construction: the sub-groups, with the number of fp32
   rows of each state (:attr:`~swapper.step.layout.SubGroup.rows`) and its per-parameter
   section (:attr:`~swapper.step.layout.SubGroup.extra_numel`);
2. :meth:`UpdateRule.initial`, once per sub-group at set-up, after the master weights
   (row 0) were read from the 16-bit parameters into a zeroed fp32 state;
3. :meth:`UpdateRule.update`, once per sub-group per step, on the state fetched into
   memory and the sub-group's fp32 gradient (already unscaled and clipped); it updates
   the state in place (row 0 holds the new master weights after it);
4. :meth:`UpdateRule.entries`, by checkpoints, exports and digests: the declared state of
   each parameter piece of a sub-group, by row name, as fp32 views.

What a rule declares (:meth:`UpdateRule.state_rows`) is what checkpoints, exports and
resume read: they never name a rule's rows themselves. A new optimizer is one module
with a rule and a registration (:func:`register`); see docs/optimizers.md.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

import torch

from swapper.step.compress import MomentCodec
from swapper.step.layout import SubGroup
from tiers.errors import SwapConfigError

__all__ = ["RULES", "StateRow", "UpdateRule", "register", "rule_named"]


@dataclasses.dataclass(frozen=True)
class StateRow:
    """One declared piece of an optimizer's per-parameter state.

    Attributes:
        name: its name in the optimizer's own state dict (``"exp_avg"``,
            ``"momentum_buffer"``); ``"master"`` is the fp32 master weights.
        dtype: as the optimizer keeps it (the tiers hold it in fp32: only fp32 state is
            accepted today).
        per: ``"element"``: one value per parameter element (a row of the sub-group's
            state, splittable with the parameter); ``"parameter"``: a tensor of its own
            shape per parameter (e.g. Adafactor's ``row_var``), kept whole.
    """

    name: str
    dtype: torch.dtype = torch.float32
    per: Literal["element", "parameter"] = "element"


class UpdateRule(abc.ABC):
    """How one optimizer's sub-groups are laid out and updated (module docstring).

    Attributes:
        name: short name, as in ``swapper-pressure --optimizer NAME``.
        elementwise: whether an element's update reads only that element (a parameter
            may then be split across sub-groups, and the step may run its kernels on
            fewer threads than the reference without changing a bit).
    """

    name: str = ""
    elementwise: bool = True

    @abc.abstractmethod
    def state_rows(self) -> tuple[StateRow, ...]:
        """The declared state, ``master`` first."""

    @abc.abstractmethod
    def plan(
        self, group_numels: Sequence[Sequence[int]], sub_group_numel: int, moments: str
    ) -> list[SubGroup]:
        """The sub-groups of parameters of ``group_numels`` (per group, per parameter).

        Raises:
            SwapConfigError: a setting the rule cannot honour (named).
        """

    def initial(self, sg: SubGroup, state: torch.Tensor, groups: Sequence[dict[str, Any]]) -> None:
        """Fill the state beside the master weights (row 0, already read) at set-up.
        Default: zeros, as the state arrives."""
        del sg, state, groups  # (zeros already)

    @abc.abstractmethod
    def update(
        self,
        sg: SubGroup,
        state: torch.Tensor,
        grad: torch.Tensor,
        group: dict[str, Any],
        step: int,
        codec: MomentCodec,
        *,
        absent: frozenset[int] = frozenset(),
    ) -> None:
        """One step of ``sg`` in place on ``state`` (as stored; ``codec`` decodes it),
        with ``grad`` its fp32 gradient (``sg.numel``) and ``group`` its param group's
        hyper-parameters at this step; ``step`` is the optimizer's step number (1-based).
        ``absent``: positions in ``sg.pieces`` of the pieces whose parameter has no
        gradient at this step (their ``grad`` is zeros): a rule steps them with a zero
        gradient (AdamW, as ZeRO's flat partitions) or leaves them as they are
        (``torch.optim``'s rule, as ``torch.optim`` does)."""

    @abc.abstractmethod
    def entries(
        self, sg: SubGroup, state: torch.Tensor
    ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """For each piece of ``sg`` (by position in ``sg.pieces``), its declared state by
        name as fp32 views into ``state`` (a decoded fp32 state, see
        :meth:`~swapper.step.pipeline.StepPipeline.read`): writing a view writes the state."""

    def parameter_shapes(self, sg: SubGroup, position: int) -> dict[str, tuple[int, ...]]:
        """The per-parameter state (rows declared ``per="parameter"``) of piece
        ``position`` of ``sg``, by name, in the shapes :meth:`entries` gives them (read by
        exports before any state is fetched). Default: none."""
        del sg, position
        return {}

    def piece_entries(
        self, sg: SubGroup, state: torch.Tensor, position: int
    ) -> dict[str, torch.Tensor]:
        """One piece's declared state, as :meth:`entries` gives it (a rule may find it
        without walking the pieces before it)."""
        for at, tensors in self.entries(sg, state):
            if at == position:
                return tensors
        raise IndexError(f"sub-group {sg.index} has no piece {position}")

    #: Whether the rule keeps per-piece state in memory (:meth:`piece_memory`) that an
    #: export must carry beside the state tensors.
    keeps_piece_memory: bool = False

    def piece_memory(self, sg: SubGroup, position: int) -> dict[str, Any]:
        """What the rule keeps in memory for piece ``position`` of ``sg`` (pickle-able,
        alike for every piece of one parameter): an export writes it per parameter and
        an import at any world size gives it back to every piece of the parameter
        (:meth:`set_piece_memory`). Default: nothing."""
        del sg, position
        return {}

    def set_piece_memory(self, sg: SubGroup, position: int, memory: dict[str, Any]) -> None:
        """Give piece ``position`` of ``sg`` what :meth:`piece_memory` returned for its
        parameter (an import, after the state tensors are written).

        Raises:
            ValueError: ``memory`` is not what this rule keeps (named).
        """
        del sg, position
        if memory:
            raise ValueError(f"the {self.name} rule keeps nothing per piece, given {memory!r}")

    def saved(self) -> object | None:
        """What the rule keeps in memory that a snapshot must record besides the state
        tensors (JSON-able; None: nothing). AdamW: nothing (its step is the optimizer's)."""
        return None

    def restore(self, saved: object | None) -> Callable[[], None]:
        """Check ``saved`` (what :meth:`saved` gave, from a snapshot) and return what
        applies it: a resume checks everything before it changes anything.

        Raises:
            ValueError: ``saved`` is not what this rule records (named).
        """
        if saved is not None:
            raise ValueError(f"the {self.name} rule records nothing, the snapshot {saved!r}")
        return lambda: None

    def bytes_per_element(self, moments: str) -> float:
        """Bytes of state per parameter element as stored (element-wise rows only)."""
        del moments
        return 4.0 * sum(1 for r in self.state_rows() if r.per == "element")


#: Registered rules by name: ``name → factory(**options)``.
RULES: dict[str, Callable[..., UpdateRule]] = {}


def register(name: str, factory: Callable[..., UpdateRule]) -> None:
    """Register a rule factory under ``name`` (used by the command-line tools and the
    DeepSpeed reader).

    Raises:
        SwapConfigError: ``name`` is registered already.
    """
    if name in RULES:
        raise SwapConfigError(f"an update rule named {name!r} is registered already")
    RULES[name] = factory


def rule_named(name: str, **options: Any) -> UpdateRule:
    """The registered rule ``name``, made with ``options``.

    Raises:
        SwapConfigError: no rule of that name (the registered ones are listed).
    """
    factory = RULES.get(name)
    if factory is None:
        raise SwapConfigError(
            f"no update rule named {name!r}; registered: {', '.join(sorted(RULES))}"
        )
    return factory(**options)
