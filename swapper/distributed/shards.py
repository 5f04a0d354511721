"""A rank's shards of full tensors, and the local sums the step's reductions need.

Job: cut this rank's part out of a full parameter (at wrap/materialize time each rank
keeps only its own portion: :func:`shard_of`), and sum the squares of its gradient shards
for the global norm (:func:`local_sq_sum`), counting each element of the model once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from swapper.distributed.partition import ParamPlacement
from tiers.errors import InvalidArgumentError

__all__ = ["local_sq_sum", "shard_of"]


def shard_of(placement: ParamPlacement, full: torch.Tensor, rank: int) -> torch.Tensor | None:
    """Rank ``rank``'s 1-D shard of ``full`` (``placement.local_numel(rank)`` elements,
    ``full``'s dtype and device, padding zero), or None when it stores nothing of it.

    A new tensor (a copy): ``full`` can be freed afterwards.

    Raises:
        InvalidArgumentError: ``full`` does not have the parameter's number of elements.
    """
    if full.numel() != placement.numel:
        raise InvalidArgumentError(
            f"shard_of: {placement.info.name!r} has {placement.numel} elements, the tensor "
            f"given {full.numel()}"
        )
    n = placement.local_numel(rank)
    if n == 0:
        return None
    start, end = placement.real_range(rank)
    out = torch.zeros(n, dtype=full.dtype, device=full.device)
    out[: end - start].copy_(full.reshape(-1)[start:end])
    return out


#: Elements squared per step of :func:`local_sq_sum`: bounds its transient fp64 copy (32 MiB).
_SQ_CHUNK = 1 << 22


def local_sq_sum(shards: Iterable[torch.Tensor]) -> float:
    """Sum of squares of ``shards`` (a rank's gradient shards), accumulated in float64.

    Each element of the model is in exactly one rank's shards (padding is zero), so the
    ranks' sums add up to the full gradient's: pass the result to
    :func:`~swapper.distributed.collectives.reduce_norm_and_overflow`. inf or NaN
    anywhere gives a non-finite sum (which that function reports as an overflow). Float64
    because a finite bf16 gradient above about 1.8e19 squares past fp32's range: an fp32
    sum would call it an overflow and skip the step on every rank. Squared a chunk at a
    time (``_SQ_CHUNK`` elements), so the transient copy stays small.
    """
    total: torch.Tensor | None = None
    for t in shards:
        for part in t.reshape(-1).split(_SQ_CHUNK):
            d = part.double()
            sq = torch.dot(d, d)  # on the shard's device: one sync at the end, not one each
            total = sq if total is None else total + sq.to(total.device)
    return 0.0 if total is None else float(total)
