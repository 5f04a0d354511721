"""How the parameters of an optimizer map onto flat fp32 sub-groups.

The parameters of each param group are laid end to end, in order, as one flat vector
(no gaps). That vector is cut into sub-groups of ``sub_group_numel`` elements (the last
one shorter); each sub-group has one state tensor. With fp32 moments (the default) it
has shape ``(3, padded_numel)``: row 0 the fp32 master weights, row 1 ``exp_avg``, row 2
``exp_avg_sq``. With compressed moments (``StepConfig.moments``, see
:mod:`swapper.step.compress`) it is one flat ``uint8`` tensor of the sections
:class:`StoredLayout` names: the fp32 master weights first, then the encoded moments.

Two alignments, both of :data:`ALIGN_NUMEL` elements (4 KiB of fp32):

- sub-group boundaries fall on multiples of it, so that the fused AdamW kernel treats
  every element exactly as it would in one call over the whole flat vector. (PyTorch's
  CPU kernel rounds its vector body and its scalar tail differently; a boundary at an odd
  element would put different elements in the tail, and the results would differ in the
  last bit.)
- each row is padded to a multiple of it, so every row, and so every state tensor, is a
  whole number of 4 KiB blocks: O_DIRECT needs no bounce buffers. The padding is at most
  ``ALIGN_NUMEL - 1`` elements per sub-group, never computed on, and always zero. A
  compressed state is padded at its end to a multiple of :data:`STORED_ALIGN_NBYTES`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swapper.step.config import MOMENTS
from tiers.errors import SwapConfigError

__all__ = [
    "ALIGN_NUMEL",
    "INT8_BLOCK_NUMEL",
    "MOMENTS",
    "STATE_ROWS",
    "STORED_ALIGN_NBYTES",
    "Piece",
    "StoredLayout",
    "SubGroup",
    "plan_sub_groups",
    "plan_whole_sub_groups",
    "scales_numel",
    "stored_layout",
]

#: Sub-group boundaries and row lengths are multiples of this many elements.
ALIGN_NUMEL = 1024
#: Rows of a state tensor: master weights, exp_avg, exp_avg_sq.
STATE_ROWS = ("master", "exp_avg", "exp_avg_sq")

SIXTEEN_BIT = (torch.bfloat16, torch.float16)

#: Elements per block of the 8-bit form, each block with one fp32 scale per moment.
#: Equal to ALIGN_NUMEL: sub-group boundaries and padding fall on block boundaries, so a
#: block never spans two sub-groups and the scales cost 8 B per 1024 elements (of host
#: memory: they are kept out of the state tensors, see :attr:`SubGroup.scales_offset`).
INT8_BLOCK_NUMEL = ALIGN_NUMEL
#: A compressed state tensor's size is a multiple of this (O_DIRECT, no bounce buffer).
STORED_ALIGN_NBYTES = 4096


@dataclass(frozen=True)
class StoredLayout:
    """Byte offsets of the sections of one compressed state tensor (``uint8``, flat).

    Attributes:
        moments: ``"bf16"`` or ``"int8"``.
        padded_numel: elements per section (the sub-group's padded length).
        exp_avg_offset, exp_avg_sq_offset: where each moment's codes start, in bytes
            (bf16: 2 B per element; int8: 1 B per element). The master weights (fp32) are
            bytes ``[0, 4 * padded_numel)``; the codes end at ``end``.
        nbytes: the whole tensor, padded to a multiple of STORED_ALIGN_NBYTES (one
            round-up per sub-group: at most 2 KiB, as ``padded_numel`` is a multiple of
            1024 and the sections 6 or 8 B per element).

    The 8-bit form's scales (``2 * blocks`` fp32: exp_avg's blocks, then exp_avg_sq's)
    are not in this tensor: see :attr:`SubGroup.scales_offset`.
    """

    moments: str
    padded_numel: int
    exp_avg_offset: int
    exp_avg_sq_offset: int
    end: int
    nbytes: int

    @property
    def blocks(self) -> int:
        """8-bit blocks per moment (0 for bf16)."""
        return self.padded_numel // INT8_BLOCK_NUMEL if self.moments == "int8" else 0

    @property
    def scales_numel(self) -> int:
        """fp32 scales of the sub-group, both moments (0 for bf16), kept out of band."""
        return 2 * self.blocks


def stored_layout(moments: str, padded_numel: int) -> StoredLayout:
    """The sections of a compressed state of ``padded_numel`` elements per row.

    Raises:
        SwapConfigError: ``moments`` is not ``"bf16"`` or ``"int8"`` (fp32 state is not
            flat; see :attr:`SubGroup.state_shape`), or ``padded_numel`` is not a
            multiple of ALIGN_NUMEL.
    """
    if padded_numel % ALIGN_NUMEL:
        raise SwapConfigError(f"padded_numel={padded_numel} is not a multiple of {ALIGN_NUMEL}")
    master = 4 * padded_numel
    if moments == "bf16":
        end = master + 4 * padded_numel
        return StoredLayout(
            moments,
            padded_numel,
            master,
            master + 2 * padded_numel,
            end,
            round_up(end, STORED_ALIGN_NBYTES),
        )
    if moments == "int8":
        end = master + 2 * padded_numel  # (the scales are out of band)
        return StoredLayout(
            moments,
            padded_numel,
            master,
            master + padded_numel,
            end,
            round_up(end, STORED_ALIGN_NBYTES),
        )
    raise SwapConfigError(f"moments={moments!r} has no compressed layout (one of 'bf16', 'int8')")


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
        moments: how its Adam moments are stored (one of :data:`MOMENTS`).
        scales_offset: int8 moments: where its ``stored.scales_numel`` fp32 block scales
            start in the optimizer's one scales tensor (the sub-groups' scales end to
            end, in index order); 0 otherwise.
        rows: fp32 rows of ``padded_numel`` in its state (fp32 moments): the master
            weights, then one per element-wise state row its update rule declares
            (:mod:`swapper.step.rules.base`; AdamW: 3, :data:`STATE_ROWS`).
        extra_numel: fp32 elements of per-parameter state (shapes the update rule makes,
            e.g. Adafactor's factored moments) after the rows; 0 for element-wise rules.
    """

    index: int
    group_index: int
    flat_offset: int
    numel: int
    padded_numel: int
    pieces: tuple[Piece, ...]
    moments: str = "fp32"
    scales_offset: int = 0
    rows: int = len(STATE_ROWS)
    extra_numel: int = 0

    @property
    def state_numel(self) -> int:
        """fp32 elements of its state tensor (fp32 moments): ``rows`` rows of
        ``padded_numel``, then the per-parameter section rounded up to ALIGN_NUMEL."""
        return self.rows * self.padded_numel + round_up(self.extra_numel)

    @property
    def state_shape(self) -> tuple[int, ...]:
        """Shape of its state tensor as stored: ``(rows, padded_numel)`` fp32 (flat
        ``(state_numel,)`` when an update rule keeps per-parameter state, see
        :attr:`extra_numel`), or ``(nbytes,)`` uint8 with compressed moments."""
        if self.moments == "fp32":
            if self.extra_numel:
                return (self.state_numel,)
            return (self.rows, self.padded_numel)
        return (self.stored.nbytes,)

    @property
    def state_dtype(self) -> torch.dtype:
        """dtype of its state tensor as stored."""
        return torch.float32 if self.moments == "fp32" else torch.uint8

    @property
    def state_nbytes(self) -> int:
        """Bytes of its state tensor as stored (padding included): what a step reads and
        writes for it."""
        if self.moments == "fp32":
            return self.state_numel * 4
        return self.stored.nbytes

    @property
    def scales_numel(self) -> int:
        """fp32 block scales it keeps out of band (int8 moments; else 0)."""
        return 2 * (self.padded_numel // INT8_BLOCK_NUMEL) if self.moments == "int8" else 0

    @property
    def stored(self) -> StoredLayout:
        """The sections of its compressed state.

        Raises:
            SwapConfigError: its moments are fp32 (not compressed).
        """
        return stored_layout(self.moments, self.padded_numel)


def scales_numel(sub_groups: Sequence[SubGroup]) -> int:
    """fp32 elements of the scales tensor of ``sub_groups`` (0 unless int8 moments)."""
    return sum(sg.scales_numel for sg in sub_groups)


def round_up(numel: int, multiple: int = ALIGN_NUMEL) -> int:
    """``numel`` rounded up to a multiple of ``multiple``."""
    return -(-numel // multiple) * multiple


def plan_sub_groups(
    group_numels: Sequence[Sequence[int]],
    sub_group_numel: int,
    moments: str = "fp32",
    *,
    rows: int = len(STATE_ROWS),
) -> list[SubGroup]:
    """Cut every param group into sub-groups.

    Args:
        group_numels: per param group, the element count of each parameter, in order.
        sub_group_numel: elements per sub-group; rounded up to a multiple of
            :data:`ALIGN_NUMEL`.
        moments: how the sub-groups' moments are stored (one of :data:`MOMENTS`).
        rows: fp32 rows of each sub-group's state (master weights included).

    Returns:
        the sub-groups of all groups, group by group, numbered from 0. A group without
        elements has none.

    Raises:
        SwapConfigError: ``sub_group_numel`` is not a positive int, or ``moments`` is not
            one of :data:`MOMENTS`.
    """
    if moments not in MOMENTS:
        raise SwapConfigError(f"moments={moments!r} must be one of {', '.join(MOMENTS)}")
    size = _check_size(sub_group_numel)
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
            scales = plan[-1].scales_offset + plan[-1].scales_numel if plan else 0
            plan.append(
                SubGroup(
                    len(plan),
                    group_index,
                    begin,
                    numel,
                    round_up(numel),
                    tuple(pieces),
                    moments,
                    scales if moments == "int8" else 0,
                    rows,
                )
            )
    return plan


def _check_size(sub_group_numel: int) -> int:
    if isinstance(sub_group_numel, bool) or not isinstance(sub_group_numel, int):
        raise SwapConfigError(
            f"sub_group_numel={sub_group_numel!r} must be an int number of elements"
        )
    if sub_group_numel <= 0:
        raise SwapConfigError(
            f"sub_group_numel={sub_group_numel} must be > 0 elements (e.g. 25_000_000)"
        )
    return round_up(sub_group_numel)


def plan_whole_sub_groups(
    group_numels: Sequence[Sequence[int]],
    sub_group_numel: int,
    *,
    rows: int,
    extra_numels: Sequence[Sequence[int]],
) -> list[SubGroup]:
    """Cut every param group into sub-groups that hold whole parameters: for an update
    rule that is not element-wise (it needs all of a parameter at once, e.g. Adafactor's
    row and column means). Parameters are taken in order while they fit in
    ``sub_group_numel`` elements; one larger than that gets a sub-group of its own.

    Args:
        group_numels: per param group, the element count of each parameter, in order.
        sub_group_numel: elements per sub-group (a bound, not a cut).
        rows: fp32 rows of ``padded_numel`` in each state (master weights included).
        extra_numels: per param group, the fp32 elements of each parameter's
            per-parameter state (laid after the rows, in piece order).

    Raises:
        SwapConfigError: ``sub_group_numel`` is not a positive int.
    """
    size = _check_size(sub_group_numel)
    plan: list[SubGroup] = []
    for group_index, (numels, extras) in enumerate(zip(group_numels, extra_numels, strict=True)):
        batches: list[list[tuple[int, int, int]]] = []  # (param index, flat start, numel)
        flat = 0
        for param_index, numel in enumerate(numels):
            if numel:
                last = batches[-1] if batches else None
                if last is None or flat + numel - last[0][1] > size:
                    batches.append([])
                batches[-1].append((param_index, flat, numel))
            flat += numel
        for batch in batches:
            begin = batch[0][1]
            numel = batch[-1][1] + batch[-1][2] - begin
            plan.append(
                SubGroup(
                    len(plan),
                    group_index,
                    begin,
                    numel,
                    round_up(numel),
                    tuple(Piece(i, 0, start - begin, n) for i, start, n in batch),
                    rows=rows,
                    extra_numel=sum(extras[i] for i, _, _ in batch),
                )
            )
    return plan
