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


def local_sq_sum(shards: Iterable[torch.Tensor]) -> float:
    """Sum of squares of ``shards`` (a rank's gradient shards), computed in fp32.

    Each element of the model is in exactly one rank's shards (padding is zero), so the
    ranks' sums add up to the full gradient's: pass the result to
    :func:`~swapper.distributed.collectives.reduce_norm_and_overflow`. inf or NaN
    anywhere gives a non-finite sum (which that function reports as an overflow).
    """
    total: torch.Tensor | None = None
    for t in shards:
        sq = t.float().pow(2).sum()  # on the shard's device: one sync at the end, not one each
        total = sq if total is None else total + sq.to(total.device)
    return 0.0 if total is None else float(total)
