"""The read side of :mod:`swapper.zero.checkpoint.dcp_export`: :func:`import_dcp`, the checks
of a checkpoint against the model, and the loads of each rank's slices, a batch of
parameters at a time, then the optimizer's sub-groups. See that module's docstring.

(``import_dcp`` lives here, not beside ``export_dcp``, so that the import builds on the
export and never the reverse: issue 25's knots.)
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swapper.step.layout import SubGroup
from swapper.zero.checkpoint.dcp_export import (
    _IGNORED,
    LOAD_BATCH_NBYTES,
    _agreed,
    _meta,
    _Owned,
    _owned,
    _pieces,
)
from swapper.zero.checkpoint.dcp_reshard import Box, DcpCheckpointError, flat_boxes
from swapper.zero.sharded.model import ShardedModel
from tiers.errors import SwapConfigError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

    from swapper.step.optimizer import StreamedOptimizer
    from swapper.zero.checkpoint.dcp_planners import CheckedReader
    from swapper.zero.local.offload import OffloadedModel

__all__ = ["check", "import_dcp", "load_all"]


def check(
    metadata: Metadata, where: Path, owned: list[_Owned], optimizer: StreamedOptimizer | None
) -> None:
    """Every tensor the model (and optimizer) needs is in the checkpoint, of its shape
    and dtype, and the checkpoint holds no parameter the model lacks.

    Optimizer rows are needed only for the parameters the optimizer holds: a frozen
    parameter (``requires_grad=False``, left out of it) is exported without them, and
    imported as a weight only; rows the checkpoint has for a parameter this optimizer
    does not hold are not read."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = metadata.state_dict_metadata
    needed = [(f"model.{o.name}", o.shape, o.dtype) for o in owned]
    if optimizer is not None:
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        rows = optimizer.stored_state.rows
        rule = optimizer.stored_state.rule
        pieces_of = _pieces(optimizer)
        for o in owned:
            if id(o.param) not in held:
                continue
            pieces = pieces_of.get(id(o.param), [])
            if pieces and rule.keeps_piece_memory and f"optim.memory.{o.name}" not in tensors:
                raise DcpCheckpointError(
                    where,
                    f"optim.memory.{o.name} is missing: {rule.name}'s state of {o.name} "
                    "(its step and what else it keeps in memory) was not exported; was it "
                    "another optimizer's checkpoint?",
                )
            for sg, position in pieces[:1]:  # (a parameter with such state is whole)
                for name, shape in rule.parameter_shapes(sg, position).items():
                    needed.append((f"optim.{name}.{o.name}", torch.Size(shape), torch.float32))
            missing = [r for r in rows if f"optim.{r}.{o.name}" not in tensors]
            if missing and f"model.{o.name}" in tensors:
                raise DcpCheckpointError(
                    where,
                    f"has no optimizer state for {o.name} (optim.{missing[0]}.{o.name} is "
                    "missing: was it frozen, left out of the optimizer, when exported?); "
                    "leave it out of this optimizer too, or import the weights alone "
                    "(optimizer=None)",
                )
            needed += [(f"optim.{r}.{o.name}", o.shape, torch.float32) for r in rows]
        if "optim.step" not in tensors:
            raise DcpCheckpointError(
                where, "optim.step is missing (exported without an optimizer?)"
            )
    for fqn, shape, dtype in needed:
        md = tensors.get(fqn)
        if not isinstance(md, TensorStorageMetadata):
            raise DcpCheckpointError(where, f"{fqn} is missing (another model?)")
        if md.size != shape or md.properties.dtype != dtype:
            raise DcpCheckpointError(
                where,
                f"{fqn} is {list(md.size)} {md.properties.dtype} there, this model's is "
                f"{list(shape)} {dtype} (another model's checkpoint?)",
            )
    mine = {f"model.{o.name}" for o in owned}
    extra = sorted(k for k in tensors if k.startswith("model.") and k not in mine)
    if extra:
        raise DcpCheckpointError(
            where, f"holds parameters this model lacks: {', '.join(extra[:5])} (another model?)"
        )


def _load(
    reader: CheckedReader,
    where: Path,
    targets: dict[str, list[tuple[Any, torch.Tensor]]],
    state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``dcp.load`` (this rank alone) filling ``targets`` and ``state``."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    from swapper.zero.checkpoint.dcp_planners import SliceLoadPlanner

    state = {} if state is None else state
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_IGNORED)
            load(state, storage_reader=reader, planner=SliceLoadPlanner(targets), no_dist=True)
    except CheckpointException as exc:  # (a BaseException) each rank's (error, traceback)
        inner = [pair[0] for pair in exc.failures.values()]
        for failure in inner:
            if isinstance(failure, DcpCheckpointError):
                raise failure from None
        names = ", ".join(sorted(targets))[:200]
        why = "; ".join(f"{type(e).__name__}: {e}" for e in inner)
        raise DcpCheckpointError(where, f"cannot load {names}: {why}") from None
    except (RuntimeError, ValueError, KeyError) as exc:
        raise DcpCheckpointError(where, f"cannot load: {exc}") from None
    return state


def _targets(o: _Owned, dtype: torch.dtype) -> tuple[torch.Tensor, list[tuple[Any, torch.Tensor]]]:
    """A flat buffer for this rank's range of ``o`` and its boxes' views into it."""
    flat = torch.empty(o.end - o.start, dtype=dtype)
    boxes = [
        (b, flat[b.flat_start - o.start : b.flat_start - o.start + b.numel].view(b.sizes))
        for b in flat_boxes(o.shape, o.start, o.end)
    ]
    return flat, boxes


def load_all(
    reader: CheckedReader, where: Path, owned: list[_Owned], optimizer: StreamedOptimizer | None
) -> None:
    if optimizer is not None:
        optimizer.stored_state.begin_load()  # from the first parameter written on
    batch: list[tuple[_Owned, torch.Tensor]] = []
    targets: dict[str, list[tuple[Any, torch.Tensor]]] = {}
    nbytes = 0
    for i, o in enumerate(owned):
        if o.end > o.start:
            flat, boxes = _targets(o, o.dtype)
            batch.append((o, flat))
            targets[f"model.{o.name}"] = boxes
            nbytes += flat.nbytes
        if batch and (nbytes >= LOAD_BATCH_NBYTES or i == len(owned) - 1):
            _load(reader, where, targets)
            for got, flat in batch:
                got.write(flat)
            batch, targets, nbytes = [], {}, 0
    if optimizer is not None:
        _import_optimizer(reader, where, owned, optimizer)


def _import_optimizer(
    reader: CheckedReader, where: Path, owned: list[_Owned], optimizer: StreamedOptimizer
) -> None:
    by_id = {id(o.param): o for o in owned}
    keys: dict[tuple[int, int], _Owned] = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            o = by_id.get(id(p))
            if o is None:
                raise SwapConfigError("import_dcp: the optimizer's parameters are not the model's")
            keys[(g, i)] = o
    view = optimizer.stored_state
    rule = view.rule
    pieces_of = _pieces(optimizer)
    memory = {  # what the rule keeps in memory per parameter (a torch rule's step, ...)
        f"optim.memory.{o.name}": None
        for o in owned
        if rule.keeps_piece_memory and pieces_of.get(id(o.param))
    }
    meta = _load(reader, where, {}, {**_meta(optimizer), **memory})
    step = meta["optim.step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise DcpCheckpointError(where, f"optim.step={step!r} is not an int >= 0")
    row_names = view.rows  # the declared element-wise rows (AdamW: master, exp_avg, exp_avg_sq)
    rows: dict[tuple[int, int], list[torch.Tensor]] = {}  # the parameters being spread
    given: list[tuple[SubGroup, int, dict[str, Any]]] = []  # each piece's memory, checked
    for sg in optimizer.sub_groups:
        needed = {(sg.group_index, piece.param_index) for piece in sg.pieces}
        for gone in set(rows) - needed:  # done with: dropped before more are read
            del rows[gone]
        for key in sorted(needed - set(rows)):
            o = keys[key]
            flats: list[torch.Tensor] = []
            targets: dict[str, list[tuple[Any, torch.Tensor]]] = {}
            for r in row_names:
                flat, boxes = _targets(o, torch.float32)
                flats.append(flat)
                if boxes:
                    targets[f"optim.{r}.{o.name}"] = boxes
            if targets:
                _load(reader, where, targets)
            rows[key] = flats
        sections: dict[tuple[int, str], torch.Tensor] = {}  # (position, name): whole
        targets = {}
        for position, piece in enumerate(sg.pieces):
            o = keys[(sg.group_index, piece.param_index)]
            for name, shape in rule.parameter_shapes(sg, position).items():
                whole = torch.empty(shape, dtype=torch.float32)
                sections[(position, name)] = whole
                targets[f"optim.{name}.{o.name}"] = [(Box((0,) * len(shape), shape, 0), whole)]
            if memory:
                text = meta[f"optim.memory.{o.name}"]
                try:
                    saved = json.loads(text) if isinstance(text, str) else None
                except ValueError:
                    saved = None
                if not isinstance(saved, dict):
                    raise DcpCheckpointError(
                        where, f"optim.memory.{o.name} is {text!r}, not a JSON object"
                    )
                given.append((sg, position, saved))
        if targets:
            _load(reader, where, targets)

        def fill(state: torch.Tensor, sg: SubGroup = sg, sections: Any = sections) -> None:
            state.zero_()  # the padding (of the rows, and of a shard past the parameter)
            flat_state = state.view(-1)  # (rows, then any per-parameter sections)
            p = sg.padded_numel
            for piece in sg.pieces:
                flat = rows[(sg.group_index, piece.param_index)]
                n = max(0, min(piece.numel, flat[0].numel() - piece.param_offset))
                for r in range(len(row_names)):
                    at = r * p + piece.offset
                    flat_state[at : at + n] = flat[r][piece.param_offset : piece.param_offset + n]
            for (position, name), whole in sections.items():
                rule.piece_entries(sg, state, position)[name].copy_(whole)

        view.write(sg.index, fill, step)
    for sg, position, saved in given:  # (after every write: the state they describe is in)
        try:
            rule.set_piece_memory(sg, position, saved)
        except ValueError as exc:
            raise DcpCheckpointError(where, f"optimizer state: {exc}") from None
    for group, saved in zip(optimizer.param_groups, meta["optim.param_groups"], strict=True):
        group.update(saved)
    if optimizer.loss_scaler is not None and "optim.loss_scaler" in meta:
        optimizer.loss_scaler.load_state_dict(meta["optim.loss_scaler"])
    view.end_load(step)


def import_dcp(
    model: OffloadedModel | ShardedModel,
    directory: str | os.PathLike[str],
    optimizer: StreamedOptimizer | None = None,
) -> None:
    """Load what :func:`export_dcp` wrote, at any world size, into ``model``'s parameters
    (and ``optimizer``'s state, step, hyper-parameters and loss scaler); the optimizer
    may cut its state into sub-groups of another size than the exporter's. With a
    sharded model, call it on every rank alike: each reads only its own slices.

    A parameter's three state rows are read once and kept while the sub-groups it spans
    are written; each sub-group is durable before the next is filled. Until the whole
    optimizer state is in, ``step()`` refuses (as after a failed ``load_state_dict``).

    Raises:
        DcpCheckpointError: (a StateDictError) a file is missing, truncated or corrupt,
            or a tensor is missing or of another shape or dtype (names the file or the
            directory, and the tensor); on every rank (the others: PeerFailedError).
        SwapConfigError: a parameter is in use (inside a forward or backward).
        DeferredStepError: a sharded model's overlapped update failed and no optimizer
            was given to forget it (PeerFailedError on the other ranks): ``step()``
            first, or pass the optimizer.
        and what the tiers raise.
    """
    from swapper.zero.checkpoint.dcp_planners import CheckedReader

    where = Path(directory)
    if optimizer is not None:
        optimizer.stored_state.forget_failed()  # the load replaces what it would finish
    if isinstance(model, ShardedModel):
        # An overlapped update still running would write its sub-groups' values over the
        # loaded ones (a sharded write does not wait at the gate): its end, agreed.
        model.settle_update("import_dcp")
    owned, group = _owned(model)
    reader = CheckedReader(where)

    def checked() -> None:
        reader.check_files()
        check(reader.read_metadata(), where, owned, optimizer)

    _agreed(group, "import_dcp: checking the checkpoint", checked)
    try:
        _agreed(group, "import_dcp: loading the checkpoint",
                lambda: load_all(reader, where, owned, optimizer))  # fmt: skip
    except BaseException:
        if optimizer is not None:  # on every rank: part old, part new (here or elsewhere)
            optimizer.stored_state.begin_load()
        raise
