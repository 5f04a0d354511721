"""An :class:`~swapper.step.OffloadAdamW` in a training snapshot, and picked up from one.

Job: the optimizer's part of a checkpoint. :func:`optimizer_meta` is what a snapshot
records of the optimizer besides its state tensors (step counters, hyper-parameters,
layout, loss scaler), as plain JSON. :func:`adopt` makes a new optimizer take over the
state tensors a resumed manager already holds (instead of building them from the
parameters) and the counters from the record. :func:`kept_released` lets the sub-groups
kept in memory (and the int8 block scales) be written into a snapshot like the others.

Int8 state from before the block scales moved out of the state tensors (a snapshot whose
record has no ``"scales"``: each sub-group's tensor ended with its scales) is converted as
it is adopted (:func:`_convert_inband`): the scales are copied out into the scales entry
and each sub-group is registered again without them. The snapshot itself is not changed.

The snapshot itself (which tensors, the file, RNG) is :mod:`swapper.zero.checkpoint`'s;
the optimizer finds what it resumes from in its model's ``resumed`` attribute
(:func:`resumed_of`), a :class:`ResumedState`.
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swapper.manager import Kind, TierManager, UnknownKeyError
from swapper.step.layout import INT8_BLOCK_NUMEL, STORED_ALIGN_NBYTES, round_up
from swapper.step.pipeline import StepPipeline
from swapper.step.scaler import DynamicLossScaler
from swapper.step.state import MomentsMismatchError, StateDictError, check_same_layout
from tiers import signals
from tiers.errors import SwapConfigError

if TYPE_CHECKING:
    from swapper.step.view import StepOwner

__all__ = [
    "SCALES_APART",
    "ResumedState",
    "adopt",
    "kept_released",
    "optimizer_meta",
    "resumed_of",
    "unadopt",
]


log = logging.getLogger(__name__)

#: ``optimizer_meta(...)["scales"]``: the int8 block scales are in their own entry
#: (``<name>/scales``), not at the end of each sub-group's state tensor.
SCALES_APART = "apart"


@dataclasses.dataclass
class ResumedState:
    """What a resumed model carries for its optimizer (set by ``swapper.offload(...,
    resume=...)``).

    Attributes:
        name: the snapshot resumed from.
        path: its file (named in every error about it).
        step: the optimizer steps taken when it was taken.
        optimizer: what :func:`optimizer_meta` recorded, or None (no optimizer then).
        extra: the user's ``extra`` given to the snapshot.
        rng: the RNG states it recorded (restored by the model at resume).
        taken: an optimizer has adopted the state (a second one starts afresh).
        rebuilt: the 16-bit parameters the snapshot left out, rebuilt from its fp32
            masters and checked (:mod:`swapper.zero.checkpoint.rebuild`), until they are registered.
    """

    name: str
    path: Path
    step: int
    optimizer: dict[str, Any] | None
    extra: Any = None
    rng: Any = None
    taken: bool = False
    rebuilt: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def resumed_of(tiers: object) -> ResumedState | None:
    """The resume state a model passed as ``tiers=`` carries and no optimizer took yet."""
    resumed = getattr(tiers, "resumed", None)
    if isinstance(resumed, ResumedState) and not resumed.taken:
        return resumed
    return None


def _encode_value(key: str, value: object) -> dict[str, Any]:
    if isinstance(value, tuple) and all(
        isinstance(v, (bool, int, float, str)) or v is None for v in value
    ):
        return {"tuple": list(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(
        f"param group setting {key}={value!r} cannot go into a snapshot: only numbers, "
        "str, None and tuples of them are kept"
    )


def _decode_value(raw: object, where: str) -> Any:
    if isinstance(raw, dict) and raw.keys() == {"tuple"} and isinstance(raw["tuple"], list):
        return tuple(raw["tuple"])
    if isinstance(raw, dict) and raw.keys() == {"value"}:
        return raw["value"]
    raise StateDictError(f"{where}: {raw!r} is not a recorded param group setting")


def optimizer_meta(optimizer: StepOwner) -> dict[str, Any]:
    """What a snapshot records of ``optimizer`` besides its state tensors (JSON-able).

    Raises:
        TypeError: a param group setting is not a number, str, None or tuple of them
            (named).
    """
    scaler = optimizer.loss_scaler
    stored = optimizer.stored_state
    return {
        "name": stored.name,
        "step": optimizer.step_count,
        "sub_group_numel": optimizer.sub_group_numel,
        "numels": optimizer.numels(),
        # how the state tensors are stored: a resume takes them as they are
        "moments": stored.codec.moments,
        # where the int8 block scales are (records without it: in each state tensor)
        "scales": SCALES_APART,
        "groups": [
            {k: _encode_value(k, v) for k, v in g.items() if k not in ("params", "param_names")}
            for g in optimizer.param_groups
        ],
        "loss_scaler": None if scaler is None else scaler.state_dict(),
        # the update rule, and what it keeps in memory (scalars such as each piece's step)
        "rule": optimizer.rule.name,
        "rule_state": optimizer.rule.saved(),
    }


def adopt(optimizer: StepOwner, pipeline: StepPipeline, resumed: ResumedState) -> None:
    """Make ``optimizer`` take over the state tensors its manager holds under
    ``pipeline``'s keys and the counters ``resumed`` recorded.

    Everything is checked before anything changes.

    Int8 state of the layout before :data:`SCALES_APART` is converted (module
    docstring).

    Raises:
        MomentsMismatchError: its state is stored with other moments than
            ``StepConfig.moments`` here (a StateDictError and a SwapConfigError).
        StateDictError: the snapshot (named by its file) holds no optimizer, or one of
            other parameters, layout, sub-group size or name, or lacks a state tensor or
            holds one of the wrong shape (the first difference named, with the layout
            expected), or records an unknown place for the block scales.
        and what the manager raises reading or registering state while int8 state of the
            old layout is converted (the snapshot is unchanged: resume from it again).
    """
    where = f"snapshot file {resumed.path}"
    meta = resumed.optimizer
    if meta is None:
        raise StateDictError(
            f"{where} was taken without an optimizer: resume the model alone, or take "
            "snapshots with the optimizer"
        )
    try:
        check_same_layout(meta, optimizer.numels(), optimizer.sub_group_numel)
    except StateDictError as exc:
        raise StateDictError(f"{where}: {exc}") from None
    if meta.get("name") != pipeline.name:
        raise StateDictError(
            f"{where}: its optimizer state is named {meta.get('name')!r}, this optimizer's "
            f"{pipeline.name!r}: give StepConfig(name=...) as when it was taken"
        )
    theirs = meta.get("moments", "fp32")  # (snapshots from before the setting: fp32)
    if theirs != pipeline.codec.moments:
        raise MomentsMismatchError(
            f"{where}: its optimizer state is stored with moments={theirs!r}, this "
            f"optimizer's StepConfig.moments={pipeline.codec.moments!r}: resume with "
            f"moments={theirs!r} (a snapshot keeps the stored form; to change it, "
            "export_dcp and import_dcp, or state_dict and load_state_dict, which go through "
            "fp32)"
        )
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise StateDictError(f"{where}: optimizer step={step!r} is not an int >= 0")
    raw_groups = meta.get("groups")
    if not isinstance(raw_groups, list) or len(raw_groups) != len(optimizer.param_groups):
        raise StateDictError(f"{where}: param groups do not match this optimizer's")
    groups: list[dict[str, Any]] = []
    for g, raw in enumerate(raw_groups):
        at = f"{where}: param group {g}"
        if not isinstance(raw, dict):
            raise StateDictError(f"{at} is not an object")
        group = {k: _decode_value(v, f"{at}.{k}") for k, v in raw.items()}
        try:
            optimizer.check_group(group)
        except (KeyError, TypeError, SwapConfigError) as exc:
            raise StateDictError(f"{at}: {exc}") from None
        groups.append(group)
    rule = meta.get("rule", "adamw")  # (snapshots from before the seam: AdamW)
    if rule != optimizer.rule.name:
        raise StateDictError(
            f"{where}: its optimizer state is of the {rule!r} rule, this optimizer's "
            f"{optimizer.rule.name!r}: resume with the optimizer it was taken with"
        )
    try:
        restore_rule = optimizer.rule.restore(meta.get("rule_state"))
    except ValueError as exc:
        raise StateDictError(f"{where}: {exc}") from None
    scaler = meta.get("loss_scaler")
    if optimizer.loss_scaler is not None and scaler is not None:
        try:
            DynamicLossScaler().load_state_dict(scaler)  # validates, changes nothing
        except (SwapConfigError, TypeError) as exc:
            raise StateDictError(f"{where}: loss scaler: {exc}") from None
    scales = meta.get("scales")
    inband = scales is None and pipeline.scales.numel > 0  # int8 of the layout before
    if scales not in (None, SCALES_APART):
        raise StateDictError(
            f"{where}: the optimizer's block scales are recorded {scales!r}; this swapper "
            f"reads {SCALES_APART!r} (and records without it)"
        )
    manager = pipeline.manager
    for sg in pipeline.sub_groups:
        shape = (_inband_nbytes(sg.padded_numel),) if inband else sg.state_shape
        layout = "int8, block scales in each state tensor" if inband else sg.moments
        _check_entry(manager, where, pipeline.key(sg.index), sg.state_dtype, shape, layout)
    if pipeline.scales.numel and not inband:
        _check_entry(
            manager,
            where,
            pipeline.scales.key,
            torch.float32,
            (pipeline.scales.numel,),
            "int8, block scales apart",
        )
    with signals.at_waits:  # each fetch and its record go together
        pipeline.take_registered()
        if inband:
            try:
                _convert_inband(pipeline)
            except Exception:
                log.error(
                    "converting the int8 state of %s (block scales in each state tensor) "
                    "to the current layout failed; the snapshot is unchanged: resume from "
                    "it again",
                    where,
                )
                raise
            # The manager holds the current layout now: an optimizer made after this one
            # failed (holding the scales, fetching a kept sub-group) adopts it as such.
            meta["scales"] = SCALES_APART
        pipeline.hold_registered()
    for progress in pipeline.progress:
        progress.applied = progress.published = progress.durable = step
    for group, saved in zip(optimizer.param_groups, groups, strict=True):
        group.update(saved)
    optimizer.counters.step = step
    restore_rule()
    if optimizer.loss_scaler is not None and scaler is not None:
        optimizer.loss_scaler.load_state_dict(scaler)
    resumed.taken = True


def _check_entry(
    manager: TierManager,
    where: str,
    key: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    layout: str,
) -> None:
    try:
        info = manager.info(key)
    except UnknownKeyError:
        raise StateDictError(f"{where} holds no optimizer state {key!r} ({layout})") from None
    if info.kind is not Kind.OPTIM_STATE or info.dtype != dtype or tuple(info.shape) != shape:
        raise StateDictError(
            f"{where}: {key!r} is {info.kind.value} {info.dtype} {list(info.shape)}; "
            f"expected optim_state {dtype} {list(shape)} (moments {layout})"
        )


def _inband_nbytes(padded_numel: int) -> int:
    """Bytes of an int8 state tensor of the layout before :data:`SCALES_APART`: master
    weights, codes, then the scales, padded to 4 KiB."""
    end = 6 * padded_numel + 8 * (padded_numel // INT8_BLOCK_NUMEL)
    return round_up(end, STORED_ALIGN_NBYTES)


def _convert_inband(pipeline: StepPipeline) -> None:
    """Int8 state tensors of the layout before :data:`SCALES_APART` (their shapes
    checked), one at a time: the scales copied out into one tensor, each sub-group
    registered again without them; then the scales registered (not held).

    A sub-group's old tensor is read (the manager verifies its bytes as it reads them),
    released unmodified and unregistered (the snapshot keeps its own copy) before its
    new one is registered: one old and one new tensor in memory at a time, besides the
    manager's budgets. An error part-way leaves some keys converted: the optimizer's
    construction fails, and resuming again from the (unchanged) snapshot starts over.
    """
    manager = pipeline.manager
    scales = torch.zeros(pipeline.scales.numel, dtype=torch.float32)
    for sg in pipeline.sub_groups:
        layout = sg.stored
        key = pipeline.key(sg.index)
        old = manager.fetch(key)
        try:
            inband = old[layout.end : layout.end + 4 * layout.scales_numel]
            end = sg.scales_offset + layout.scales_numel
            scales[sg.scales_offset : end].copy_(inband.cpu().view(torch.float32))
            new = torch.zeros(layout.nbytes, dtype=torch.uint8)
            new[: layout.end].copy_(old[: layout.end])
        finally:
            manager.release(key, modified=False)
        del old
        manager.unregister(key)
        manager.register(key, new, Kind.OPTIM_STATE)
        del new
    manager.register(pipeline.scales.key, scales, Kind.OPTIM_STATE)


def unadopt(pipeline: StepPipeline, resumed: ResumedState) -> None:
    """Undo :func:`adopt` (wholly or in part) for an optimizer whose construction failed:
    the kept sub-groups it fetched are released unmodified and the pipeline forgets the
    state tensors without deleting them, so the next optimizer adopts them as they are
    (closing the pipeline would delete them, and a resume marked taken would make the
    next optimizer start afresh)."""
    pipeline.disown()
    resumed.taken = False


def kept_released(pipeline: StepPipeline) -> AbstractContextManager[None]:
    """:meth:`StepPipeline.kept_released` (its docstring)."""
    return pipeline.kept_released()
