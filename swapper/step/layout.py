"""How the parameters of an optimizer map onto flat fp32 sub-groups.

The parameters of each param group are laid end to end, in order, as one flat vector
(no gaps). That vector is cut into sub-groups of ``sub_group_numel`` elements (the last
one shorter); each sub-group has one state tensor of shape ``(3, padded_numel)``: row 0
the fp32 master weights, row 1 ``exp_avg``, row 2 ``exp_avg_sq``.

Two alignments, both of :data:`ALIGN_NUMEL` elements (4 KiB of fp32):

- sub-group boundaries fall on multiples of it, so that the fused AdamW kernel treats
  every element exactly as it would in one call over the whole flat vector. (PyTorch's
  CPU kernel rounds its vector body and its scalar tail differently; a boundary at an odd
  element would put different elements in the tail, and the results would differ in the
  last bit.)
- each row is padded to a multiple of it, so every row, and so every state tensor, is a
  whole number of 4 KiB blocks: O_DIRECT needs no bounce buffers. The padding is at most
  ``ALIGN_NUMEL - 1`` elements per sub-group, never computed on, and always zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiers.errors import SwapConfigError

__all__ = ["ALIGN_NUMEL", "STATE_ROWS", "Piece", "SubGroup", "plan_sub_groups"]

#: Sub-group boundaries and row lengths are multiples of this many elements.
ALIGN_NUMEL = 1024
#: Rows of a state tensor: master weights, exp_avg, exp_avg_sq.
STATE_ROWS = ("master", "exp_avg", "exp_avg_sq")

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Piece:
    """Part of one parameter inside a sub-group.

    Attributes:
        param_index: index of the parameter in its param group.
        param_offset: first element of the parameter (flattened) in this piece.
        offset: where the piece starts inside the sub-group, in elements.
        numel: elements in the piece.
    """

    param_index: int
    param_offset: int
    offset: int
    numel: int


@dataclass(frozen=True)
class SubGroup:
    """One unit of the step pipeline: a contiguous range of a param group's flat vector.

    Attributes:
        index: position among all sub-groups of the optimizer (0-based).
        group_index: the param group it belongs to.
        flat_offset: first element in the group's flat vector.
        numel: elements it covers.
        padded_numel: length of each state row (``numel`` rounded up to ALIGN_NUMEL).
        pieces: the parameter ranges it covers, in flat order.
    """

    index: int
    group_index: int
    flat_offset: int
    numel: int
    padded_numel: int
    pieces: tuple[Piece, ...]

    @property
    def state_shape(self) -> tuple[int, int]:
        """Shape of its fp32 state tensor."""
        return (len(STATE_ROWS), self.padded_numel)

    @property
    def state_nbytes(self) -> int:
        """Bytes of its state tensor (fp32, padding included)."""
        return len(STATE_ROWS) * self.padded_numel * 4


def round_up(numel: int, multiple: int = ALIGN_NUMEL) -> int:
    """``numel`` rounded up to a multiple of ``multiple``."""
    return -(-numel // multiple) * multiple


def plan_sub_groups(group_numels: Sequence[Sequence[int]], sub_group_numel: int) -> list[SubGroup]:
    """Cut every param group into sub-groups.

    Args:
        group_numels: per param group, the element count of each parameter, in order.
        sub_group_numel: elements per sub-group; rounded up to a multiple of
            :data:`ALIGN_NUMEL`.

    Returns:
        the sub-groups of all groups, group by group, numbered from 0. A group without
        elements has none.

    Raises:
        SwapConfigError: ``sub_group_numel`` is not a positive int.
    """
    if isinstance(sub_group_numel, bool) or not isinstance(sub_group_numel, int):
        raise SwapConfigError(
            f"sub_group_numel={sub_group_numel!r} must be an int number of elements"
        )
    if sub_group_numel <= 0:
        raise SwapConfigError(
            f"sub_group_numel={sub_group_numel} must be > 0 elements (e.g. 25_000_000)"
        )
    size = round_up(sub_group_numel)
    plan: list[SubGroup] = []
    for group_index, numels in enumerate(group_numels):
        # (param index, first flat element) of each non-empty parameter
        starts: list[tuple[int, int, int]] = []
        flat = 0
        for param_index, numel in enumerate(numels):
            if numel:
                starts.append((param_index, flat, numel))
            flat += numel
        total = flat
        cursor = 0  # index into starts
        for begin in range(0, total, size):
            end = min(begin + size, total)
            pieces: list[Piece] = []
            while cursor < len(starts):
                param_index, p_begin, p_numel = starts[cursor]
                p_end = p_begin + p_numel
                lo, hi = max(begin, p_begin), min(end, p_end)
                if lo < hi:
                    pieces.append(Piece(param_index, lo - p_begin, lo - begin, hi - lo))
                if p_end <= end:
                    cursor += 1
                    continue
                break
            numel = end - begin
            plan.append(
                SubGroup(len(plan), group_index, begin, numel, round_up(numel), tuple(pieces))
            )
    return plan
