"""The training state in PyTorch Distributed Checkpoint format, streamed, at any world size.

Job: :func:`export_dcp`, the portable form of an offloaded model (one process, or
sharded over N ranks) and its :class:`~swapper.step.OffloadAdamW`, which
``torch.distributed.checkpoint.load`` reads into ordinary tensors per parameter (no
sub-groups, no shards, no swapper needed), and :func:`import_dcp`, which reads it back
into a model and optimizer over M ranks, M independent of N (resharding).

Names (fully qualified, the model's own parameter names; a tied parameter once, under
the name it was registered by):

* ``model.<name>``: the 16-bit parameter (bf16/fp16, its shape);
* ``optim.<row>.<name>`` for each element-wise row the optimizer's update rule declares
  (``master`` first; AdamW: ``exp_avg``, ``exp_avg_sq``; ``torch.optim.SGD``:
  ``momentum_buffer``): the parameter's fp32 state, its shape;
* ``optim.<state>.<name>`` for each per-parameter state tensor the rule declares
  (Adafactor's ``row_var``, ``col_var``), in its own shape, written whole by the rank
  that holds the parameter (such a rule gets each parameter whole, on one rank);
* ``optim.memory.<name>`` (a JSON string) where the rule keeps state in memory per
  parameter (``OffloadOptimizer``: each piece's ``step`` and other 0-dim state, and
  whether it was stepped; ``{}`` for one never stepped);
* ``optim.step`` (int), ``optim.param_groups`` (the hyper-parameters, as the
  optimizer's ``state_dict`` has them) and ``optim.loss_scaler`` (when there is one),
  stored as pickled bytes.

Several ranks: each rank writes the part of every tensor it owns under its partition
(:mod:`swapper.distributed.partition`: a flat range of each parameter, or whole ones) as
DCP chunks (:func:`~swapper.zero.checkpoint.dcp_reshard.flat_boxes`: rectangular, offsets per
dimension, as a ``ShardedTensor`` with several local shards has them) through DCP's own
planner, writer and collectives; the metadata file records every chunk of every rank.
One file per rank (``__<rank>_0.distcp``) plus ``.metadata``.

Streamed, without copies: a chunk's values are fetched from the tiers only when the
writer asks for them, and written from the tier's memory (:mod:`swapper.zero.checkpoint.dcp_io`:
O_DIRECT, XXH3 checksums in a sidecar per file); a sub-group's optimizer state is read
once for the parameters in it that come in a row, and let go once its writes completed.
No rank ever holds more than a few parameters' local parts (those being written,
:data:`~swapper.zero.checkpoint.dcp_io.HELD_LEASES`) and two sub-groups (the one being written, the
one being read). The
import reads, per parameter, only the slices the rank owns under the new partition
(``M``'s), from whichever saved chunks overlap them, in batches of at most
:data:`LOAD_BATCH_NBYTES`.

Bad input is refused before anything is written (on every rank alike, with an
agreement): a missing, truncated (shorter than its metadata says) or undecodable file,
a missing tensor, another shape or dtype, parameters the model lacks
(:class:`~swapper.zero.checkpoint.dcp_reshard.DcpCheckpointError`, naming the file and what is
wrong). A file damaged where the metadata cannot see it is found when read: the load
stops there, and ``step()`` refuses until a load succeeds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swapper.distributed import DistGroup, agree
from swapper.step.layout import SubGroup
from swapper.zero.checkpoint.dcp_reshard import Box, DcpCheckpointError, flat_boxes
from swapper.zero.local.weights import _held, _rw_tier, check_unwritten, write_through
from swapper.zero.sharded.model import ShardedModel
from tiers import signals
from tiers.errors import SwapConfigError

if TYPE_CHECKING:
    from swapper.step.optimizer import StreamedOptimizer
    from swapper.zero.checkpoint.dcp_planners import BoxSource
    from swapper.zero.local.offload import OffloadedModel

__all__ = ["CHUNK_NUMEL", "LOAD_BATCH_NBYTES", "DcpCheckpointError", "export_dcp"]

#: Bytes of destination tensors one ``dcp.load`` call of :func:`import_dcp` fills at most
#: (one parameter's part may exceed it alone).
LOAD_BATCH_NBYTES = 64 << 20

#: Elements per written chunk at most (16 MiB of fp32): the planner stages two at a time.
CHUNK_NUMEL = 4 << 20

_IGNORED = "torch.distributed is disabled"


@dataclasses.dataclass(eq=False)
class _Owned:
    """A parameter and the flat range ``[start, end)`` of it this rank holds."""

    name: str
    param: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    start: int
    end: int
    read: Callable[[int, torch.Tensor], None]  # (local start, 1-D out): out filled
    write: Callable[[torch.Tensor], None]  # the whole local part, 1-D
    # (local start, numel): the values in the tier's memory, held until the returned
    # call; None where it cannot be held (then ``read`` copies them)
    hold: Callable[[int, int], tuple[torch.Tensor, Callable[[], None]] | None] | None = None


def _owned(model: OffloadedModel | ShardedModel) -> tuple[list[_Owned], DistGroup | None]:
    """Every parameter (in the model's order) with this rank's range of it."""
    if isinstance(model, ShardedModel):
        source = model.param_source()
        rank = model.group.rank
        out = []
        for slot in model.slots:
            start, end = slot.placement.real_range(rank)

            def read(at: int, out: torch.Tensor, p: torch.Tensor = slot.param) -> None:
                source.read_param(p, at, out)

            def write(flat: torch.Tensor, p: torch.Tensor = slot.param) -> None:
                source.write_param(p, 0, flat)  # the padding after it stays zero

            out.append(_Owned(slot.name, slot.param, slot.shape, slot.dtype, start, end, read,
                              write))  # fmt: skip
        return out, model.group
    core = model.core  # (one process: the records and the gate)
    out = []
    for slot in core.by_name.values():

        def read_one(at: int, out: torch.Tensor, s: Any = slot) -> None:
            with _held(core, s, write=False) as tensor:
                out.copy_(tensor.view(-1)[at : at + out.numel()])

        def write_one(flat: torch.Tensor, s: Any = slot) -> None:
            write_through(core, s, flat.view(s.shape))

        def hold_one(
            at: int, n: int, s: Any = slot
        ) -> tuple[torch.Tensor, Callable[[], None]] | None:
            # as _held, for a parameter no forward holds (else a copy: ``read``), kept
            # fetched until the writer is done with it (the export's own record)
            if core.closed or s.users or core.persist.active:
                return None
            if core.param_gate is not None:
                core.param_gate(s.param)
            check_unwritten(s)
            manager = core.manager
            with signals.at_waits:  # fetched and recorded in one section
                tensor = manager.fetch(s.key, _rw_tier(core))
                done = functools.partial(manager.release, s.key, modified=False)
            return tensor.view(-1)[at : at + n], done

        numel = slot.shape.numel()
        out.append(_Owned(slot.name, slot.param, slot.shape, slot.dtype, 0, numel, read_one,
                          write_one, hold_one))  # fmt: skip
    return out, None


def _boxes_of(o: _Owned) -> list[Box]:
    """The chunks this rank writes of ``o``; a parameter of no elements is named by
    every rank with one empty chunk (DCP keeps one of identical items), so that the
    checkpoint lists it."""
    if o.shape.numel() == 0:
        return [Box((0,) * len(o.shape), tuple(o.shape), 0)]
    # cut at CHUNK_NUMEL: an item is staged whole (two items' staging memory at most)
    return [
        box
        for at in range(o.start, o.end, CHUNK_NUMEL)
        for box in flat_boxes(o.shape, at, min(o.end, at + CHUNK_NUMEL))
    ]


def _agreed(group: DistGroup | None, what: str, work: Callable[[], Any]) -> Any:
    """``work()`` on every rank, then an agreement: a failure on one rank is an error on
    all (the failing rank raises its own, the others PeerFailedError)."""
    if group is None:
        return work()
    try:
        result = work()
    except BaseException:
        with contextlib.suppress(Exception):
            agree(group, False, what)
        raise
    agree(group, True, what)
    return result


class _SubGroupCache:
    """The sub-group being read, fetched (pinned in memory, not copied: the writer
    sends its rows to the disk from there) until another is needed; then let go once the
    writes reading it completed (``release_later``), so at most the one being written
    and the one being read are held; :meth:`release_all` at the end."""

    def __init__(self, optimizer: StreamedOptimizer) -> None:
        self._view = optimizer.stored_state
        self._index = -1
        self._state: torch.Tensor | None = None
        self._key: str | None = None
        # how a sub-group is let go: after the writer's requests reading it completed
        self.release_later: Callable[[Callable[[], None]], None] | None = None

    def get(self, index: int) -> torch.Tensor:
        if index != self._index or self._state is None:
            self.release_all()  # the old one goes before the new one is read
            kept = self._view.held().get(index)  # kept in memory by the pipeline
            if kept is not None:
                self._state = kept
            else:
                key = self._view.key(index)
                with signals.at_waits:  # fetched and recorded in one section
                    self._state = self._view.manager.fetch(key)
                    self._key = key
            self._index = index
            self._read_ahead(index + 1)
            codec = self._view.codec
            if codec.compressed:  # moments stored bf16/int8: export them decoded, fp32
                decoded = codec.decode(self._view.sub_groups[index], self._state)
                self.release_all()
                self._state, self._index = decoded, index
        return self._state

    def _read_ahead(self, index: int) -> None:
        """The next sub-group (the export visits them in order) starts coming from NVMe
        while this one is written, where the budget has room for it (else the request
        is dropped: the manager's prefetch never blocks)."""
        if index < len(self._view.sub_groups) and not self._view.is_held(index):
            self._view.manager.prefetch([self._view.key(index)])

    def release_all(self) -> None:
        key, self._key = self._key, None
        self._state, self._index = None, -1
        if key is None:  # (one the pipeline keeps, or decoded: nothing fetched)
            return
        release = functools.partial(self._view.manager.release, key, modified=False)
        if self.release_later is not None:  # views of it may be in flight (zero-copy)
            self.release_later(release)
        else:
            release()


def _pieces(optimizer: StreamedOptimizer) -> dict[int, list[tuple[SubGroup, int]]]:
    """``id(param)`` → its pieces ``(sub-group, position in it)``, in sub-group order."""
    out: dict[int, list[tuple[SubGroup, int]]] = {}
    for sg in optimizer.sub_groups:
        params = optimizer.param_groups[sg.group_index]["params"]
        for position, piece in enumerate(sg.pieces):
            out.setdefault(id(params[piece.param_index]), []).append((sg, position))
    return out


def _optimizer_sources(
    owned: list[_Owned], optimizer: StreamedOptimizer, cache: _SubGroupCache
) -> list[BoxSource]:
    """This rank's optimizer chunks: each element-wise row of each parameter's range it
    holds (``optim.<row>.<name>``, cut at the sub-group boundaries), and each
    per-parameter state tensor whole (``optim.<name>.<param>``, in the shape the rule
    declares: a parameter with such state is whole in one sub-group of one rank)."""
    from swapper.zero.checkpoint.dcp_planners import BoxSource

    pieces_of = _pieces(optimizer)
    stored = optimizer.stored_state
    rule = stored.rule
    mine = {id(o.param) for o in owned}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in mine:
                raise SwapConfigError("export_dcp: the optimizer's parameters are not the model's")
    out: list[BoxSource] = []
    for o in owned:
        pieces = pieces_of.get(id(o.param), [])
        if o.shape.numel() == 0:  # (named by every rank, as its parameter)
            spans = [(0, 0, 0, 0, _boxes_of(o))]
        else:  # cut at the sub-group boundaries: each chunk from one sub-group
            spans = []
            for sg, position in sorted(pieces, key=lambda q: q[0].pieces[q[1]].param_offset):
                piece = sg.pieces[position]
                at = piece.param_offset
                lo, hi = o.start + at, min(o.start + at + piece.numel, o.end)  # padding out
                boxes = [
                    box
                    for a in range(lo, hi, CHUNK_NUMEL)
                    for box in flat_boxes(o.shape, a, min(hi, a + CHUNK_NUMEL))
                ]
                spans.append((sg.index, sg.padded_numel, piece.offset, at, boxes))
        for index, padded, offset, at, boxes in spans:
            for box in boxes:
                for row, row_name in enumerate(stored.rows):

                    def view(
                        row: int = row, index: int = index, offset: int = offset,
                        at: int = at, box: Any = box, o: Any = o, padded: int = padded,
                    ) -> torch.Tensor:  # fmt: skip
                        # row ``row`` of the sub-group, flat (a state with per-parameter
                        # sections after its rows is one flat tensor)
                        start = row * padded + offset + box.flat_start - o.start - at
                        return cache.get(index).view(-1)[start : start + box.numel]

                    def gather(dest: torch.Tensor, view: Any = view, box: Any = box) -> None:
                        if box.numel:
                            dest.copy_(view())

                    out.append(BoxSource(f"optim.{row_name}.{o.name}", box, o.shape,
                                         torch.float32, gather, view))  # fmt: skip
        for sg, position in pieces:
            for name, shape in rule.parameter_shapes(sg, position).items():

                def section(sg: SubGroup = sg, position: int = position, name: str = name
                            ) -> torch.Tensor:  # fmt: skip
                    state = cache.get(sg.index)
                    return rule.piece_entries(sg, state, position)[name].reshape(-1)

                def copy(dest: torch.Tensor, section: Any = section) -> None:
                    dest.copy_(section())

                box = Box((0,) * len(shape), tuple(shape), 0)
                out.append(BoxSource(f"optim.{name}.{o.name}", box, torch.Size(shape),
                                     torch.float32, copy, section))  # fmt: skip
    return out


def _memory(owned: list[_Owned], optimizer: StreamedOptimizer) -> dict[str, Any]:
    """``optim.memory.<name>``: what the rule keeps in memory for each parameter this
    rank holds a piece of (a torch rule: the pieces' ``step`` and other 0-dim state, and
    whether they were stepped), from its first piece (alike for all of them); empty for
    a rule that keeps nothing (AdamW)."""
    rule = optimizer.stored_state.rule
    if not rule.keeps_piece_memory:
        return {}
    pieces_of = _pieces(optimizer)
    out: dict[str, Any] = {}
    for o in owned:
        pieces = pieces_of.get(id(o.param))
        if pieces:
            sg, position = pieces[0]
            # a JSON string: DCP would flatten a dict into keys of its own (an empty
            # one into none); a float's repr reads back exactly
            out[f"optim.memory.{o.name}"] = json.dumps(rule.piece_memory(sg, position))
    return out


def _meta(optimizer: StreamedOptimizer) -> dict[str, Any]:
    out: dict[str, Any] = {
        "optim.step": optimizer.step_count,
        "optim.param_groups": [
            {k: v for k, v in g.items() if k not in ("params", "param_names")}
            for g in optimizer.param_groups
        ],
    }
    if optimizer.loss_scaler is not None:
        out["optim.loss_scaler"] = optimizer.loss_scaler.state_dict()
    return out


def export_dcp(
    model: OffloadedModel | ShardedModel,
    directory: str | os.PathLike[str],
    optimizer: StreamedOptimizer | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write the model's parameters (and the optimizer's state) as a Distributed
    Checkpoint in ``directory`` (module docstring), streamed. With a sharded model, call
    it on every rank alike (DCP's collectives run over the model's process group).

    Args:
        progress: called as ``progress(bytes_done, bytes_total)`` (this rank's tensor
            bytes) after each chunk is handed to the writer.

    Returns:
        ``directory``.

    Raises:
        SwapConfigError: ``directory`` holds a checkpoint already (``.metadata``), or the
            optimizer is not the model's (on every rank).
        CheckpointException: (torch's) a rank's write failed; raised on every rank, with
            each rank's failure in ``failures``.
        and what the tiers raise.
    """
    with _no_gc():
        return _export(model, Path(directory), optimizer, progress)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """No cyclic garbage collection meanwhile: a full one walks the whole program's heap
    (0.25-0.8 s measured inside an export here, on a loaded VM), longer than the export's
    own work; the little cyclic garbage an export makes is collected afterwards."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _export(
    model: OffloadedModel | ShardedModel,
    out: Path,
    optimizer: StreamedOptimizer | None,
    progress: Callable[[int, int], None] | None,
) -> Path:
    # (imported here: torch.distributed.checkpoint is heavy, and only an export needs it)
    from torch.distributed.checkpoint.state_dict_saver import save

    from swapper.zero.checkpoint.dcp_io import AioStorageWriter
    from swapper.zero.checkpoint.dcp_planners import BoxSource, StreamingSavePlanner

    if isinstance(model, ShardedModel):  # an overlapped update's end, agreed over the ranks
        model.settle_update("export")
    owned, group = _owned(model)
    if optimizer is not None:
        optimizer.wait_pending()  # an overlapped update finished (or its failure raised)

    def plan() -> list[BoxSource]:
        if (out / ".metadata").exists():
            raise SwapConfigError(f"{out / '.metadata'} exists: export into an empty directory")
        sources: list[BoxSource] = []
        for o in owned:
            for box in _boxes_of(o):

                def fill(dest: torch.Tensor, o: _Owned = o, box: Any = box) -> None:
                    o.read(box.flat_start - o.start, dest)

                hold = None
                if o.hold is not None:
                    hold = functools.partial(o.hold, box.flat_start - o.start, box.numel)
                sources.append(BoxSource(f"model.{o.name}", box, o.shape, o.dtype, fill,
                                         hold=hold))  # fmt: skip
        if optimizer is not None and cache is not None:
            if optimizer.manager is not model.manager:
                raise SwapConfigError("export_dcp: the optimizer keeps its state elsewhere")
            sources += _optimizer_sources(owned, optimizer, cache)
        return sources

    cache = _SubGroupCache(optimizer) if optimizer is not None else None
    sources = _agreed(group, "export_dcp: checking what to write", plan)
    state_dict = {**_meta(optimizer), **_memory(owned, optimizer)} if optimizer is not None else {}
    out.mkdir(parents=True, exist_ok=True)
    # each rank's file through the AIO engine, the optimizer state straight from the
    # sub-group (dcp_io); a sub-group is let go only once its writes completed
    writer = AioStorageWriter(out)
    if cache is not None:
        cache.release_later = writer.after_writes
    planner = StreamingSavePlanner(sources, progress)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_IGNORED)
            save(
                state_dict,
                storage_writer=writer,
                planner=planner,
                process_group=group.group if group is not None else None,
                no_dist=group is None,
            )
    finally:
        try:
            if cache is not None:
                cache.release_all()  # (after the writer's requests ended)
        finally:
            writer.close()  # the engine first (requests in flight end), then the slots
    return out
