"""Where a module's parameters go in its fetch buffer and in the collectives' segments.

Pure (no process group): every rank computes the same layout from the same
:class:`~swapper.distributed.partition.PartitionPlan` and list of parameters.

Two layouts of one module's parameters (``indices``, in the order given):

- **param-major buffer** (``buffer_numel`` elements): each parameter owns one region
  starting at ``region_offset``; its view is ``buffer[region_offset : + numel]``. A
  sharded parameter's region is ``N * shard_numel`` long and shard r sits at
  ``region_offset + r * shard_numel``, so its shards laid in place *are* the parameter; a
  whole-owned parameter's region is ``numel`` rounded up to the alignment. Every region
  starts on the alignment.
- **rank-major segments** (``N`` segments of ``segment_numel`` elements): segment r holds
  what rank r owns of the module: its shard of every sharded parameter (at the same
  ``segment_offset`` in every segment), then the parameters it owns whole, each padded to
  the alignment. ``segment_numel`` is the largest rank's need, so segments are equal, as
  ``all_gather`` and ``reduce_scatter`` require; the unused tail is padding.

A :class:`Piece` is one rank's part of one parameter, with its place in both layouts and
the real elements ``[start, end)`` of the flattened parameter it carries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swapper.distributed.partition import PartitionPlan, round_up
from tiers.errors import InvalidArgumentError

__all__ = ["ModuleLayout", "Piece", "module_layout"]


@dataclass(frozen=True)
class Piece:
    """Rank ``rank``'s part of parameter ``index`` (only parts of >= 1 element exist).

    Attributes:
        index: the parameter's index in the plan.
        rank: the rank storing it.
        segment_offset: where it starts in rank ``rank``'s segment, in elements.
        buffer_offset: where it starts in the param-major buffer, in elements.
        stored_numel: elements the rank stores (padding included).
        start: first element of the flattened parameter it holds.
        end: one past the last (``end - start`` real elements; the rest is padding).
    """

    index: int
    rank: int
    segment_offset: int
    buffer_offset: int
    stored_numel: int
    start: int
    end: int

    @property
    def real_numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ModuleLayout:
    """The layout of one module's parameters; see the module docstring.

    Attributes:
        plan: the partition plan.
        indices: the parameters, in buffer order.
        region_offsets: each parameter's region start in the buffer (same order).
        buffer_numel: length of the param-major buffer.
        segment_numel: length of each rank's segment.
        pieces: every rank's pieces, rank by rank, parameters in order within a rank.
        itemsize: bytes per element of the parameters (all equal).
    """

    plan: PartitionPlan
    indices: tuple[int, ...]
    region_offsets: tuple[int, ...]
    buffer_numel: int
    segment_numel: int
    pieces: tuple[Piece, ...]
    itemsize: int

    def rank_pieces(self, rank: int) -> tuple[Piece, ...]:
        """The pieces rank ``rank`` stores."""
        return tuple(p for p in self.pieces if p.rank == rank)

    def region(self, index: int) -> tuple[int, int]:
        """``(offset, numel)`` of parameter ``index``'s view in the buffer."""
        pos = self.indices.index(index)
        return self.region_offsets[pos], self.plan.params[index].numel

    @property
    def real_nbytes(self) -> int:
        """Bytes of the module's parameters (what a gather must deliver)."""
        return sum(self.plan.params[i].numel for i in self.indices) * self.itemsize


def module_layout(plan: PartitionPlan, indices: Sequence[int]) -> ModuleLayout:
    """The layout of parameters ``indices`` of ``plan`` (e.g. one module's own ones).

    Raises:
        InvalidArgumentError: an index is out of range or repeated, or the parameters'
            dtypes (itemsizes) differ: fetch them as one layout per dtype.
    """
    n = plan.world_size
    align = plan.align_numel
    indices = tuple(indices)
    if len(set(indices)) != len(indices):
        raise InvalidArgumentError(f"module_layout: repeated parameter index in {indices}")
    for i in indices:
        if not 0 <= i < len(plan.params):
            raise InvalidArgumentError(
                f"module_layout: parameter index {i} out of range (plan has "
                f"{len(plan.params)} parameters)"
            )
    infos = [plan.params[i].info for i in indices]
    kinds = {(p.itemsize, p.dtype) for p in infos}
    if len(kinds) > 1:
        names = ", ".join(f"{p.name} ({p.dtype or p.itemsize})" for p in infos)
        raise InvalidArgumentError(
            f"module_layout: parameters of different dtypes in one layout: {names}; "
            "make one layout per dtype"
        )
    itemsize = infos[0].itemsize if infos else 1

    region_offsets: list[int] = []
    offset = 0
    for i in indices:
        p = plan.params[i]
        region_offsets.append(offset)
        offset += p.shard_numel * n if p.sharded else round_up(p.numel, align)
    buffer_numel = offset

    pieces: list[Piece] = []
    sharded_numel = sum(plan.params[i].shard_numel for i in indices if plan.params[i].sharded)
    owned = [sharded_numel] * n  # next free element of each rank's segment
    for r in range(n):
        seg = 0
        for i, region in zip(indices, region_offsets, strict=True):
            p = plan.params[i]
            start, end = p.real_range(r)
            if p.sharded and p.shard_numel:
                pieces.append(
                    Piece(i, r, seg, region + r * p.shard_numel, p.shard_numel, start, end)
                )
                seg += p.shard_numel
            elif p.owner == r and p.numel:
                pieces.append(Piece(i, r, owned[r], region, p.numel, start, end))
                owned[r] += round_up(p.numel, align)
    segment_numel = max(owned) if owned else 0
    return ModuleLayout(
        plan, indices, tuple(region_offsets), buffer_numel, segment_numel, tuple(pieces), itemsize
    )
