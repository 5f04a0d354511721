"""Settings of multi-rank training (``OffloadConfig.distributed``).

Used only when :func:`swapper.offload` is given a process group of more than one rank;
a single process (or a group of one) ignores them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from swapper.distributed.collectives import FETCH_METHODS
from tiers.errors import SwapConfigError

__all__ = ["OWNERSHIPS", "REDUCE_DTYPES", "DistributedConfig"]

#: Values of :attr:`DistributedConfig.reduce_dtype`: ``None`` reduces gradients in their
#: own (16-bit) dtype; ``"float32"`` upcasts them for the sum (twice the bytes on the wire).
REDUCE_DTYPES: tuple[str, ...] = ("float32",)
#: Values of :attr:`DistributedConfig.ownership`.
OWNERSHIPS: tuple[str, ...] = ("balanced", "contiguous")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """How the ranks of a group share a model's training state.

    Every rank must use the same values (the read-ahead depth decides the order in which
    collectives are issued; ranks that differ would pair different collectives).

    Attributes:
        fetch_collective: how a module's parameters are gathered from every rank's
            shards: ``"all_gather"`` (the default: rank-major, then one copy into the
            parameters' views) or ``"all_reduce"`` (each rank writes its shard in place in
            a zeroed buffer and a sum fills the rest: no copy after, about twice the bytes
            on the wire). Both give bit-identical parameters. DeepSpeed's
            ``zero_optimization.stage3_use_all_reduce_for_fetch_params: true`` reads as
            ``"all_reduce"``.
        fetch_ahead: modules whose gather is started ahead of use, along the order
            recorded in the first step (0: every gather waits where the module runs).
        timeout_s: the longest any collective is waited on, in seconds (None: 600 s, as
            :data:`swapper.distributed.DEFAULT_TIMEOUT`); pass the same to
            ``init_process_group(timeout=...)``.
        reduce_dtype: ``None`` (gradients are summed in their own dtype) or
            ``"float32"`` (16-bit gradients are summed in fp32: one rounding instead of
            one per addition, twice the bytes on the wire).

    Raises:
        SwapConfigError: a value out of range (named, with what to write instead).
    """

    fetch_collective: str = "all_gather"
    fetch_ahead: int = 2
    timeout_s: float | None = None
    reduce_dtype: str | None = None
    ownership: str = "balanced"

    def __post_init__(self) -> None:
        if self.fetch_collective not in FETCH_METHODS:
            raise SwapConfigError(
                f"distributed.fetch_collective={self.fetch_collective!r} must be one of "
                f"{', '.join(repr(m) for m in FETCH_METHODS)}"
            )
        ahead = self.fetch_ahead
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise SwapConfigError(
                f"distributed.fetch_ahead={ahead!r} must be an int >= 0 (modules gathered "
                "ahead of use)"
            )
        timeout = self.timeout_s
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise SwapConfigError(
                f"distributed.timeout_s={timeout!r} must be a number of seconds > 0, or None"
            )
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPES:
            raise SwapConfigError(
                f"distributed.reduce_dtype={self.reduce_dtype!r} must be None (the "
                "gradients' dtype) or 'float32'"
            )
        if self.ownership not in OWNERSHIPS:
            raise SwapConfigError(
                f"distributed.ownership={self.ownership!r} must be one of "
                f"{', '.join(repr(o) for o in OWNERSHIPS)}"
            )

    def as_dict(self) -> dict[str, Any]:
        """The settings as JSON values (:meth:`from_dict` of it gives an equal config)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any]) -> DistributedConfig:
        """Build it from a mapping of its field names.

        Raises:
            SwapConfigError: a key is not a setting (all such keys named), or a value does
                not validate.
        """
        if isinstance(mapping, DistributedConfig):
            return mapping
        if not isinstance(mapping, Mapping):
            raise SwapConfigError(
                f"distributed must be a mapping of settings, got {type(mapping).__name__}"
            )
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(str(k) for k in mapping if k not in known)
        if unknown:
            raise SwapConfigError(
                f"unknown distributed setting(s): {', '.join(unknown)} (known: {', '.join(known)})"
            )
        return cls(**dict(mapping))
