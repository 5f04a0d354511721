"""The streamed form of :meth:`OffloadAdamW.state_dict` and the checks of a state dict
being loaded: :class:`SubGroupStates` (sub-group index → state, read from the tiers on
each lookup), :class:`StateDictError`, and the validation :meth:`load_state_dict` runs
before it writes anything.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from swapper.step.config import check_hyper
from swapper.step.layout import ALIGN_NUMEL, SubGroup
from swapper.step.pipeline import PipelineClosedError
from swapper.step.scaler import DynamicLossScaler
from tiers.errors import SwapConfigError, SwapError

if TYPE_CHECKING:
    from swapper.step.optimizer import StreamedOptimizer

__all__ = [
    "STATE_FORMAT",
    "MomentsMismatchError",
    "StateDictError",
    "SubGroupStates",
    "check_same_layout",
    "load_groups",
    "load_state",
    "saved_groups",
    "saved_state",
    "state_meta",
    "state_tensor",
]

#: Version of the layout written by :meth:`OffloadAdamW.state_dict`.
STATE_FORMAT = 1


class StateDictError(SwapError, ValueError):
    """A state dict does not fit this optimizer (other parameters, shapes or layout)."""


class MomentsMismatchError(StateDictError, SwapConfigError):
    """A snapshot's optimizer state is stored with other moments (``StepConfig.moments``)
    than the optimizer resuming it asks for: a setting to fix, so a SwapConfigError too."""


class SubGroupStates(Mapping[int, dict[str, torch.Tensor]]):
    """The ``"state"`` of :meth:`OffloadAdamW.state_dict`: sub-group index → its state,
    read from the tiers on each lookup (a copy; the caller may keep or drop it)."""

    def __init__(self, optimizer: StreamedOptimizer) -> None:
        self._optimizer = optimizer
        self._step = optimizer.step_count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        optimizer = self._optimizer
        if optimizer.step_count != self._step or optimizer._pending is not None:
            raise StateDictError(
                f"this state dict was taken at step {self._step}; the optimizer has moved "
                f"on (step {optimizer.step_count}): take a new one"
            )
        if not isinstance(index, int) or not 0 <= index < len(optimizer.sub_groups):
            raise KeyError(index)
        sg = optimizer.sub_groups[index]
        state = optimizer._pipeline.read(index)
        return {row: state[i, : sg.numel] for i, row in enumerate(row_names(optimizer))}

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self._optimizer.sub_groups)))

    def __len__(self) -> int:
        return len(self._optimizer.sub_groups)

    def __reduce__(self) -> tuple[Any, ...]:
        # torch.save / pickle: every sub-group read (all in memory at once). An
        # OrderedDict, because torch.load(weights_only=True) refuses builtins.dict here.
        return (collections.OrderedDict, (list(self.items()),))


def state_meta(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The ``"swapper"`` section of an OffloadAdamW state dict.

    Raises:
        StateDictError: it is not one (no such section, or another format).
    """
    if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
        raise StateDictError("not an optimizer state dict (needs 'state' and 'param_groups')")
    meta = state_dict.get("swapper")
    if not isinstance(meta, Mapping) or meta.get("format") != STATE_FORMAT:
        raise StateDictError(
            "not an OffloadAdamW state dict (no 'swapper' section of format "
            f"{STATE_FORMAT}); a torch.optim state dict keeps state per parameter, this one "
            "per sub-group"
        )
    return dict(meta)


def check_same_layout(meta: Mapping[str, Any], numels: list[list[int]], sub: int) -> None:
    """Check that the state in ``meta`` was laid out as this optimizer's: the same element
    counts per parameter per group (``numels``) and sub-groups of ``sub`` elements.

    Raises:
        StateDictError: the first difference, named.
    """
    theirs = meta.get("numels")
    if not isinstance(theirs, list) or len(theirs) != len(numels):
        count = len(theirs) if isinstance(theirs, list) else "?"
        raise StateDictError(f"state dict has {count} param group(s), this optimizer {len(numels)}")
    for g, (a, b) in enumerate(zip(theirs, numels, strict=True)):
        if len(a) != len(b):
            raise StateDictError(
                f"state dict: group {g} has {len(a)} parameter(s), this optimizer {len(b)}"
            )
        for p, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                raise StateDictError(
                    f"state dict: parameter {p} of group {g} has {x} elements there, {y} "
                    "here: the state is of another model"
                )
    theirs_sub = meta.get("sub_group_numel")
    if isinstance(theirs_sub, bool) or not isinstance(theirs_sub, int):
        raise StateDictError(f"state dict: sub_group_numel={theirs_sub!r} is not an int")
    if -(-theirs_sub // ALIGN_NUMEL) != -(-sub // ALIGN_NUMEL):
        raise StateDictError(
            f"state dict was cut into sub-groups of {meta.get('sub_group_numel')} elements, "
            f"this optimizer into {sub}: create it with the same sub_group_numel"
        )


def state_tensor(entry: Any, row: str, sg: SubGroup) -> torch.Tensor:
    """Row ``row`` of sub-group ``sg``'s saved state, flat.

    Raises:
        StateDictError: it is missing, not fp32, or of another element count.
    """
    tensor = entry.get(row) if isinstance(entry, Mapping) else None
    if not isinstance(tensor, torch.Tensor):
        raise StateDictError(f"state dict: sub-group {sg.index} has no tensor {row!r}")
    if tensor.numel() != sg.numel or tensor.dtype != torch.float32:
        raise StateDictError(
            f"state dict: sub-group {sg.index} {row!r} is {tensor.dtype} with "
            f"{tensor.numel()} elements; expected torch.float32 with {sg.numel}"
        )
    return tensor.reshape(-1)


def row_names(optimizer: StreamedOptimizer) -> list[str]:
    """The names of the element-wise rows ``optimizer``'s update rule declares (the
    sub-group format holds those; AdamW: :data:`~swapper.step.layout.STATE_ROWS`)."""
    return [row.name for row in optimizer.rule.state_rows() if row.per == "element"]


#: Keys of a param group a state dict never carries as settings (its own numbering
#: stands for the parameters).
_NOT_SETTINGS = ("params", "param_names")


def saved_groups(
    param_groups: list[dict[str, Any]], skip: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """``param_groups`` as a state dict holds them (as ``torch.optim``'s): each group's
    settings but ``skip`` (and the parameters and their names), with ``"params"`` the
    parameters' indices, numbered over all groups in order."""
    groups = []
    index = 0
    for group in param_groups:
        saved = {k: v for k, v in group.items() if k not in _NOT_SETTINGS + skip}
        saved["params"] = list(range(index, index + len(group["params"])))
        index += len(group["params"])
        groups.append(saved)
    return groups


def load_groups(param_groups: list[dict[str, Any]], saved: Sequence[Mapping[str, Any]]) -> None:
    """Set each group's settings from its saved form (checked by the caller; the
    parameters stay)."""
    for group, entry in zip(param_groups, saved, strict=True):
        for key, value in entry.items():
            if key not in _NOT_SETTINGS:
                group[key] = value


def saved_state(optimizer: StreamedOptimizer) -> dict[str, Any]:
    """What :meth:`OffloadAdamW.state_dict` returns (its docstring says what it holds)."""
    scaler = optimizer.loss_scaler
    return {
        "state": SubGroupStates(optimizer),
        "param_groups": saved_groups(optimizer.param_groups),
        "swapper": {
            "format": STATE_FORMAT,
            "step": optimizer._step_count,
            "sub_group_numel": optimizer.sub_group_numel,
            "numels": optimizer._numels(),
            "loss_scaler": None if scaler is None else scaler.state_dict(),
            # what the tensors were decoded from (informative: they are fp32 whatever it
            # is, and load into an optimizer of any moments)
            "moments": optimizer._pipeline.codec.moments,
        },
    }


def load_state(optimizer: StreamedOptimizer, state_dict: Mapping[str, Any]) -> None:
    """:meth:`OffloadAdamW.load_state_dict`: everything but the tensors checked before
    anything is written, then one sub-group at a time (its docstring says what is raised).
    """
    meta = state_meta(state_dict)
    check_same_layout(meta, optimizer._numels(), optimizer.sub_group_numel)
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise StateDictError(f"state dict: step={step!r} must be an int >= 0")
    groups = state_dict["param_groups"]
    if not isinstance(groups, (list, tuple)) or len(groups) != len(optimizer.param_groups):
        raise StateDictError(
            f"state dict has {len(groups) if isinstance(groups, (list, tuple)) else '?'} "
            f"param group(s), this optimizer {len(optimizer.param_groups)}"
        )
    hyper = ("lr", "betas", "eps", "weight_decay")
    for g, saved in enumerate(groups):
        if not isinstance(saved, Mapping) or not set(hyper) <= set(saved):
            raise StateDictError(f"state dict: param group {g} lacks one of {hyper}")
        try:
            check_hyper(*(saved[k] for k in hyper))
        except SwapConfigError as exc:
            raise StateDictError(f"state dict: param group {g}: {exc}") from None
    scaler = meta.get("loss_scaler")
    if optimizer.loss_scaler is not None and scaler is not None:
        DynamicLossScaler().load_state_dict(scaler)  # validates, changes nothing here
    states = state_dict["state"]
    if not isinstance(states, Mapping):
        raise StateDictError("state dict: 'state' must map sub-group index to tensors")
    if optimizer._closed:  # (a load left incomplete is what a new load repairs)
        raise PipelineClosedError("the optimizer is closed")
    # From the first write until the last, the state is part old, part new.
    optimizer._load_incomplete = True
    for sg in optimizer.sub_groups:
        try:
            entry = states[sg.index]
        except KeyError:
            raise StateDictError(f"state dict: sub-group {sg.index} is missing") from None
        tensors = [state_tensor(entry, row, sg) for row in row_names(optimizer)]

        def fill(state: torch.Tensor, tensors: list[torch.Tensor] = tensors) -> None:
            state.zero_()
            for row, tensor in enumerate(tensors):
                state[row, : tensor.numel()].copy_(tensor)

        optimizer._pipeline.write(sg.index, fill, step)
        del entry, tensors
    load_groups(optimizer.param_groups, groups)
    optimizer._step_count = step
    optimizer._pending = None
    if optimizer.loss_scaler is not None and scaler is not None:
        optimizer.loss_scaler.load_state_dict(scaler)
    optimizer._load_incomplete = False
