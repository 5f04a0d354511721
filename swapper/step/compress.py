"""Adam moments stored compressed in the tiers (``StepConfig.moments``): :class:`MomentCodec`.

The fp32 master weights are never compressed; only ``exp_avg`` and ``exp_avg_sq`` are,
in one of two forms (the byte layout is :class:`~swapper.step.layout.StoredLayout`):

- ``"bf16"``: each moment rounded to bfloat16, round-to-nearest-even (relative error at
  most 2^-9 for normal values). 8 B per element with the master weights.
- ``"int8"``: 8-bit blockwise, as bitsandbytes' blockwise 8-bit optimizers (Dettmers et
  al., "8-bit Optimizers via Block-wise Quantization", 2022): each block of
  :data:`~swapper.step.layout.INT8_BLOCK_NUMEL` elements is divided by its absolute
  maximum (its fp32 scale) and each value rounded to the nearest of 256 levels of a
  *dynamic* map (a sign, a decimal exponent of 0 to -6 and a linear fraction: fine steps
  near zero, coarse near the maximum), so that a block holding values of very different
  sizes keeps the small ones (the signed map differs from bitsandbytes' in one level, see
  :func:`dynamic_map`). ``exp_avg`` uses the signed map; ``exp_avg_sq`` is stored as
  ``sqrt(exp_avg_sq)`` with the unsigned map (every level non-negative, one more bit of
  fraction). Storing the square root halves the decades the map must span (the update
  divides by ``sqrt(exp_avg_sq)``, so that is also the quantity whose relative error
  matters); docs/benchmarks.md has the measurement that chose it. 6 B per element in
  the stored tensor; the 8 B per block of scales live apart, in one fp32 tensor for all
  sub-groups that the pipeline keeps in host memory (:meth:`MomentCodec.bind_scales`),
  so that a step moves 6 B per element through NVMe, not 6.008.

Encoding rounds to nearest (the 8-bit form: to the level nearest the value rounded to
bfloat16, ties to the lower level; see :func:`_nearest_codes`), with no randomness: the
same state always encodes to the same bytes, run to run.

Where the work happens: a step fetches the stored tensor into a staging buffer of the
manager (the pipeline's), runs the fused AdamW kernel on the fp32 master weights in place
there, with the moments decoded into one reused fp32 scratch of a sub-group's size per
device, and encodes them back into the staging buffer before it is written behind
(:meth:`MomentCodec.rows`). Encoding and decoding go :data:`CHUNK_NUMEL` elements at a
time, so their temporaries stay small whatever the sub-group size. No copy of the whole
state is ever made in fp32.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence

import torch

from swapper.step.layout import INT8_BLOCK_NUMEL, MOMENTS, SubGroup
from tiers.errors import SwapConfigError

__all__ = [
    "CHUNK_NUMEL",
    "MomentCodec",
    "decode_bf16",
    "decode_int8",
    "dynamic_map",
    "encode_bf16",
    "encode_int8",
]

#: Elements encoded or decoded at a time (a multiple of INT8_BLOCK_NUMEL): bounds the
#: temporaries to a few MiB.
CHUNK_NUMEL = 1 << 20


@functools.lru_cache(maxsize=8)
def _dynamic_map_cpu(signed: bool) -> torch.Tensor:
    # Exponent e = 0..6 selects the decade [10^(e-6) * 0.1, 10^(e-6)]; the decade is cut
    # into 2^e (signed) or 2^(e+1) (unsigned: the sign bit goes to the fraction) equal
    # parts, and each part's midpoint is a level. With 0 and 1.0 that is 256 levels
    # (bitsandbytes' create_dynamic_map). Signed, -1.0 is a level too, in place of the
    # negative level nearest zero (-5.5e-7): a block's largest value is then exact whatever
    # its sign, and a decoded block encodes to itself again (bitsandbytes has no -1.0: a
    # block whose largest value is negative would shrink a little at each re-encoding).
    levels: list[float] = [0.0, 1.0]
    for e in range(7):
        parts = 2**e if signed else 2 ** (e + 1)
        edges = torch.linspace(0.1, 1.0, parts + 1, dtype=torch.float64)
        mids = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (e - 6)).tolist()
        levels += mids
        if signed:
            levels += [-x for x in mids[1:]] if e == 0 else [-x for x in mids]
    if signed:
        levels.append(-1.0)
    if len(levels) != 256:  # pragma: no cover - the arithmetic above gives 256
        raise RuntimeError(f"dynamic map has {len(levels)} levels, not 256")
    return torch.tensor(sorted(levels), dtype=torch.float32)


def dynamic_map(signed: bool, device: torch.device | None = None) -> torch.Tensor:
    """The 256 levels of the dynamic 8-bit map, ascending, fp32: in [-1, 1] (signed, -1
    included) or [0, 1] (unsigned), both holding 0 and 1 exactly. Code ``c`` means
    level ``c``."""
    levels = _dynamic_map_cpu(signed)
    return levels if device is None or device.type == "cpu" else levels.to(device)


@functools.lru_cache(maxsize=8)
def _midpoints_cpu(signed: bool) -> torch.Tensor:
    levels = _dynamic_map_cpu(signed).double()
    return ((levels[:-1] + levels[1:]) / 2).float()


@functools.lru_cache(maxsize=8)
def _bf16_codes_cpu(signed: bool) -> torch.Tensor:
    """The code (uint8) of the level nearest each bfloat16 value, indexed by its bit
    pattern as an int16 plus 32768 (values outside [-1, 1], inf and NaN: code of 0)."""
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    values = patterns.view(torch.bfloat16).float()
    values = torch.where(values.isfinite(), values, torch.zeros_like(values))
    low = -1.0 if signed else 0.0
    values = torch.where((values >= low) & (values <= 1.0), values, torch.zeros_like(values))
    return torch.bucketize(values, _midpoints_cpu(signed)).to(torch.uint8)


def _nearest_codes(normalized: torch.Tensor, signed: bool, out: torch.Tensor) -> None:
    """Into ``out`` (uint8, flat): the code of the level nearest each element of
    ``normalized`` (in [-1, 1]; [0, 1] unsigned) once rounded to bfloat16.

    Three cheap passes and one 64K-entry table lookup instead of a binary search per
    element (``torch.bucketize`` over the midpoints is 5-15x slower on a CPU core). The
    rounding to bfloat16 (2^-9 relative) can move a value that lies within 2^-9 of a
    midpoint to the farther level: the error is then at most half a level's spacing
    plus 2^-9 of the value. A level itself maps to itself (levels are further than that
    from every midpoint), so decoded values encode to the same codes again.
    """
    table = _bf16_codes_cpu(signed)
    if normalized.device.type != "cpu":
        table = table.to(normalized.device)
    patterns = normalized.to(torch.bfloat16).view(torch.int16)
    index = patterns.to(torch.int32).add_(1 << 15).view(-1)
    torch.index_select(table, 0, index, out=out)


def encode_bf16(source: torch.Tensor, codes: torch.Tensor) -> None:
    """Round fp32 ``source`` to nearest-even bf16 into ``codes`` (bf16, same numel)."""
    codes.copy_(source)


def decode_bf16(codes: torch.Tensor, out: torch.Tensor) -> None:
    """``codes`` (bf16) into fp32 ``out``, exactly."""
    out.copy_(codes)


def encode_int8(
    source: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, *, signed: bool
) -> None:
    """Quantize fp32 ``source`` blockwise: ``scales[b]`` the absolute maximum of block b,
    ``codes[i]`` (uint8) the level of :func:`dynamic_map` nearest ``source[i] / scale``
    rounded to bfloat16 (see :func:`_nearest_codes`).

    ``source`` must hold a whole number of INT8_BLOCK_NUMEL blocks; it is not changed. A
    block of zeros gets scale 0. With ``signed=False`` negative values are clamped to 0
    (they cannot occur in ``sqrt(exp_avg_sq)``).

    Raises:
        SwapConfigError: the sizes do not match.
    """
    numel = source.numel()
    blocks = numel // INT8_BLOCK_NUMEL
    if numel % INT8_BLOCK_NUMEL or codes.numel() != numel or scales.numel() != blocks:
        raise SwapConfigError(
            f"encode_int8: {numel} elements, {codes.numel()} codes, {scales.numel()} scales; "
            f"needs whole blocks of {INT8_BLOCK_NUMEL} and one scale per block"
        )
    for start in range(0, numel, CHUNK_NUMEL):
        end = min(start + CHUNK_NUMEL, numel)
        block = source[start:end].view(-1, INT8_BLOCK_NUMEL)
        b0, b1 = start // INT8_BLOCK_NUMEL, end // INT8_BLOCK_NUMEL
        absmax = torch.linalg.vector_norm(block, ord=float("inf"), dim=1)  # one pass
        scales[b0:b1].copy_(absmax)
        # a zero block: any divisor gives zeros, which encode to the level 0
        divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
        normalized = block / divisor[:, None]  # (a division: x / x is exactly 1)
        if not signed:
            normalized.clamp_(min=0.0)
        _nearest_codes(normalized, signed, codes[start:end])


def decode_int8(
    codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, *, signed: bool
) -> None:
    """The inverse of :func:`encode_int8`: ``out[i] = level[codes[i]] * scales[block]``.

    Raises:
        SwapConfigError: the sizes do not match.
    """
    numel = out.numel()
    if (
        numel % INT8_BLOCK_NUMEL
        or codes.numel() != numel
        or scales.numel() * INT8_BLOCK_NUMEL != numel
    ):
        raise SwapConfigError(
            f"decode_int8: {numel} elements, {codes.numel()} codes, {scales.numel()} scales; "
            f"needs whole blocks of {INT8_BLOCK_NUMEL} and one scale per block"
        )
    levels = dynamic_map(signed, out.device)
    for start in range(0, numel, CHUNK_NUMEL):
        end = min(start + CHUNK_NUMEL, numel)
        b0, b1 = start // INT8_BLOCK_NUMEL, end // INT8_BLOCK_NUMEL
        window = out[start:end].view(-1, INT8_BLOCK_NUMEL)
        torch.index_select(levels, 0, codes[start:end].int(), out=out[start:end])
        window.mul_(scales[b0:b1, None])


class MomentCodec:
    """Moves one sub-group's state between its stored form and fp32 rows.

    With ``moments="fp32"`` the stored form *is* the fp32 ``(3, padded_numel)`` tensor
    and every method is the identity (a step stays bitwise torch's fused AdamW).

    Args:
        moments: one of :data:`~swapper.step.layout.MOMENTS`.

    Raises:
        SwapConfigError: ``moments`` is not one of them.
    """

    def __init__(self, moments: str) -> None:
        if moments not in MOMENTS:
            raise SwapConfigError(f"moments={moments!r} must be one of {', '.join(MOMENTS)}")
        self.moments = moments
        # per device: fp32 (2, n) decoded moments of the sub-group computing (reused)
        self._scratch: dict[torch.device, torch.Tensor] = {}
        #: int8: the fp32 block scales of every sub-group (see bind_scales)
        self.scales: torch.Tensor | None = None

    @classmethod
    def of(cls, sub_groups: Sequence[SubGroup]) -> MomentCodec:
        """The codec of ``sub_groups`` (fp32 when there are none).

        Raises:
            SwapConfigError: their ``moments`` differ (one pipeline, one format).
        """
        formats = {sg.moments for sg in sub_groups} or {"fp32"}
        if len(formats) != 1:
            raise SwapConfigError(
                f"the sub-groups of one pipeline store moments alike, not {formats}"
            )
        return cls(formats.pop())

    def bind_scales(self, scales: torch.Tensor | None) -> None:
        """Use ``scales`` (fp32, flat, :func:`~swapper.step.layout.scales_numel` of the
        sub-groups) as the 8-bit form's block scales: sub-group ``sg``'s are
        ``scales[sg.scales_offset : sg.scales_offset + sg.scales_numel]``, read by
        decoding and written by encoding, in place. ``None`` unbinds them.

        Raises:
            SwapConfigError: ``scales`` is not a flat fp32 tensor.
        """
        if scales is not None and (scales.dtype != torch.float32 or scales.dim() != 1):
            raise SwapConfigError(
                f"the 8-bit block scales must be a flat torch.float32 tensor, not "
                f"{scales.dtype} of shape {list(scales.shape)}"
            )
        self.scales = scales

    @property
    def compressed(self) -> bool:
        """Whether the moments are stored in another form than fp32."""
        return self.moments != "fp32"

    def master(self, sg: SubGroup, stored: torch.Tensor) -> torch.Tensor:
        """The fp32 master weights (``padded_numel``), a view into ``stored``."""
        if not self.compressed:  # (row 0; the state may be flat, see SubGroup.state_shape)
            return stored.view(-1)[: sg.padded_numel]
        return stored[: 4 * sg.padded_numel].view(torch.float32)

    def decode(self, sg: SubGroup, stored: torch.Tensor) -> torch.Tensor:
        """A new fp32 tensor of the state (``sg.state_shape``; compressed: ``(3,
        padded_numel)``, master, exp_avg, exp_avg_sq)."""
        if not self.compressed:
            return stored.clone()
        out = torch.empty((3, sg.padded_numel), dtype=torch.float32, device=stored.device)
        out[0].copy_(self.master(sg, stored))
        self._decode_moments(sg, stored, out[1], out[2])
        return out

    def encode(self, sg: SubGroup, state: torch.Tensor, stored: torch.Tensor) -> None:
        """Write the fp32 ``(3, padded_numel)`` ``state`` into ``stored`` (not changing
        ``state``); bytes of ``stored`` past its sections are left as they are."""
        if not self.compressed:
            stored.copy_(state)
            return
        self.master(sg, stored).copy_(state[0])
        self._encode_moments(sg, stored, state[1], state[2])

    def fill(
        self, sg: SubGroup, fill: Callable[[torch.Tensor], None], stored: torch.Tensor
    ) -> None:
        """``fill(state)`` on fp32 ``(3, padded_numel)`` state, into ``stored``: in place
        for fp32 moments, else on a zeroed fp32 copy that is then encoded."""
        if not self.compressed:
            fill(stored)
            return
        state = torch.zeros((3, sg.padded_numel), dtype=torch.float32, device=stored.device)
        fill(state)
        self.encode(sg, state, stored)

    def scratch(self, sub_groups: Sequence[SubGroup]) -> torch.Tensor | None:
        """A uint8 buffer for the stored form of the largest of ``sub_groups`` (None for
        fp32 moments: the fp32 state is the stored form)."""
        if not self.compressed:
            return None
        largest = max((sg.state_nbytes for sg in sub_groups), default=0)
        return torch.empty(largest, dtype=torch.uint8)

    def stored_form(
        self, sg: SubGroup, state: torch.Tensor, scratch: torch.Tensor | None
    ) -> torch.Tensor:
        """fp32 ``state`` as stored: ``state`` itself for fp32 moments, else encoded into
        the start of ``scratch`` (from :meth:`scratch`; zeroed first), which is returned."""
        if scratch is None:
            return state
        stored = scratch[: sg.state_nbytes]
        stored.zero_()
        self.encode(sg, state, stored)
        return stored

    @contextlib.contextmanager
    def rows(
        self, sg: SubGroup, stored: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Inside the block: (master, exp_avg, exp_avg_sq), fp32, ``sg.numel`` each, to
        update in place. The master weights are a view of ``stored``; compressed moments
        are decoded into a reused scratch and encoded back when the block ends without an
        exception (after one, the stored moments are left as they were)."""
        n = sg.numel
        if not self.compressed:
            yield stored[0, :n], stored[1, :n], stored[2, :n]
            return
        scratch = self._scratch_for(stored.device, sg.padded_numel)
        exp_avg, exp_avg_sq = scratch[0, : sg.padded_numel], scratch[1, : sg.padded_numel]
        self._decode_moments(sg, stored, exp_avg, exp_avg_sq)
        yield self.master(sg, stored)[:n], exp_avg[:n], exp_avg_sq[:n]
        self._encode_moments(sg, stored, exp_avg, exp_avg_sq)

    def _scratch_for(self, device: torch.device, numel: int) -> torch.Tensor:
        scratch = self._scratch.get(device)
        if scratch is None or scratch.shape[1] < numel:
            self._scratch.pop(device, None)  # the old one goes before the new one is made
            scratch = torch.empty((2, numel), dtype=torch.float32, device=device)
            self._scratch[device] = scratch
        return scratch

    def _sections(
        self, sg: SubGroup, stored: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        layout = sg.stored
        if stored.dtype != torch.uint8 or stored.numel() != layout.nbytes:
            raise SwapConfigError(
                f"sub-group {sg.index}: stored state is {stored.dtype} with {stored.numel()} "
                f"elements; {self.moments} moments need torch.uint8 with {layout.nbytes}"
            )
        p = layout.padded_numel
        if self.moments == "bf16":
            m = stored[layout.exp_avg_offset : layout.exp_avg_offset + 2 * p]
            v = stored[layout.exp_avg_sq_offset : layout.exp_avg_sq_offset + 2 * p]
            return m.view(torch.bfloat16), v.view(torch.bfloat16), None, None
        m = stored[layout.exp_avg_offset : layout.exp_avg_offset + p]
        v = stored[layout.exp_avg_sq_offset : layout.exp_avg_sq_offset + p]
        scales = self.scales
        end = sg.scales_offset + layout.scales_numel
        if scales is None or scales.numel() < end or scales.device != stored.device:
            what = "none" if scales is None else f"{scales.numel()} on {scales.device}"
            raise SwapConfigError(
                f"sub-group {sg.index}: int8 moments need the block scales bound "
                f"(bind_scales) with at least {end} elements on {stored.device}; bound: {what}"
            )
        own = scales[sg.scales_offset : end]
        return m, v, own[: layout.blocks], own[layout.blocks :]

    def _decode_moments(
        self, sg: SubGroup, stored: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
    ) -> None:
        m, v, m_scales, v_scales = self._sections(sg, stored)
        if m_scales is None or v_scales is None:
            decode_bf16(m, exp_avg)
            decode_bf16(v, exp_avg_sq)
            return
        decode_int8(m, m_scales, exp_avg, signed=True)
        decode_int8(v, v_scales, exp_avg_sq, signed=False)
        exp_avg_sq.square_()  # stored as its square root

    def _encode_moments(
        self, sg: SubGroup, stored: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
    ) -> None:
        m, v, m_scales, v_scales = self._sections(sg, stored)
        if m_scales is None or v_scales is None:
            encode_bf16(exp_avg, m)
            encode_bf16(exp_avg_sq, v)
            return
        encode_int8(exp_avg, m, m_scales, signed=True)
        # sqrt in chunks into a small temporary (exp_avg_sq itself is not changed)
        numel = exp_avg_sq.numel()
        for start in range(0, numel, CHUNK_NUMEL):
            end = min(start + CHUNK_NUMEL, numel)
            b0, b1 = start // INT8_BLOCK_NUMEL, end // INT8_BLOCK_NUMEL
            encode_int8(exp_avg_sq[start:end].sqrt(), v[start:end], v_scales[b0:b1], signed=False)
