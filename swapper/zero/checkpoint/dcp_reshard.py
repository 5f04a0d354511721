"""What a rank owns of each tensor, as Distributed Checkpoint chunks (used by
:mod:`swapper.zero.checkpoint.dcp_export`), and the error for a checkpoint that cannot be read.

A rank of a sharded model (:mod:`swapper.distributed.partition`) owns a *flat* range
``[start, end)`` of each parameter (row-major, padding excluded), or the whole of it, or
nothing. DCP describes a rank's part of a tensor as rectangular chunks
(:class:`~torch.distributed.checkpoint.metadata.ChunkStorageMetadata`: offsets and sizes
per dimension, as a ``ShardedTensor`` with several local shards or a ``DTensor`` has
them). :func:`flat_boxes` cuts a flat range into such boxes: at most ``2 * ndim - 1``
(a partial row at each end, whole rows between, recursively), each contiguous in the
flattened tensor, so each is one slice of the rank's flat shard. The boxes of all ranks
tile the tensor: DCP's own global-plan validation checks that (no overlap, full cover).

The DCP side lives in :mod:`swapper.zero.checkpoint.dcp_planners` (imported only by an export or
an import: ``torch.distributed.checkpoint`` is heavy). Write side: the plan's items are
made from the boxes (``WriteItemType.SHARD``, the tensor's global size), and a box's
values are fetched from the tiers only when the writer asks for them, so one box (at
most one parameter's local part) and one optimizer sub-group are in memory at a time.
Read side: the read items come from DCP's own ``create_read_items_for_chunk_list`` for
the boxes a rank owns under *its* partition (any world size), and land in slices of a
flat buffer of that rank's part; a missing, short, checksum-failing or undecodable file is a
:class:`DcpCheckpointError` naming it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from swapper.step.state import StateDictError

__all__ = ["Box", "DcpCheckpointError", "flat_boxes"]


class DcpCheckpointError(StateDictError):
    """A Distributed Checkpoint cannot be read into this model: a file is missing,
    truncated or corrupt, or a tensor is missing or of another shape or dtype.

    Attributes:
        path: the file (or checkpoint directory) at fault.
        reason: what is wrong with it.
    """

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"DCP checkpoint {self.path}: {reason}")


@dataclasses.dataclass(frozen=True)
class Box:
    """A rectangular chunk of a tensor that is contiguous in its flattened form.

    Attributes:
        offsets: first index per dimension.
        sizes: extent per dimension.
        flat_start: the flattened index of its first element.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def _prod(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def flat_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The boxes, in flat order, that tile elements ``[start, end)`` of a row-major
    tensor of ``shape`` (module docstring). An empty range gives ``[]``.

    Raises:
        ValueError: not ``0 <= start <= end <= numel``.
    """
    shape = tuple(int(s) for s in shape)
    if not 0 <= start <= end <= _prod(shape):
        raise ValueError(f"range [{start}, {end}) is not within a tensor of shape {shape}")
    out: list[Box] = []
    _boxes(shape, start, end, (), 0, out)
    return out


def _boxes(
    shape: tuple[int, ...], start: int, end: int, prefix: tuple[int, ...], base: int, out: list[Box]
) -> None:
    # prefix: fixed leading indices (size 1 each); base: flat index of (prefix, 0, ...)
    if start >= end:
        return
    ones = (1,) * len(prefix)
    if not shape:
        out.append(Box(prefix, ones, base))
        return
    if len(shape) == 1:
        out.append(Box((*prefix, start), (*ones, end - start), base + start))
        return
    row = _prod(shape[1:])
    first, last = start // row, (end - 1) // row
    if first == last:  # within one row: the rest of the dimensions decide
        _boxes(shape[1:], start - first * row, end - first * row, (*prefix, first),
               base + first * row, out)  # fmt: skip
        return
    if start % row:  # a partial first row
        _boxes(shape[1:], start % row, row, (*prefix, first), base + first * row, out)
        first += 1
    tail = end % row
    full_end = last if tail else last + 1
    if full_end > first:  # whole rows: one box
        zeros = (0,) * (len(shape) - 1)
        out.append(
            Box((*prefix, first, *zeros), (*ones, full_end - first, *shape[1:]), base + first * row)
        )
    if tail:  # a partial last row
        _boxes(shape[1:], 0, tail, (*prefix, last), base + last * row, out)
