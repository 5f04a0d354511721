"""Settings of :class:`~swapper.step.OffloadAdamW` besides AdamW's hyper-parameters:
:class:`StepConfig`, a keyword-only frozen dataclass validated on construction.

The hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay``) stay torch-style
constructor arguments: param groups and lr schedulers read and change them per group.
:class:`~swapper.zero.OffloadConfig` composes a :class:`StepConfig` (its ``step``), which
an optimizer over an offloaded model takes its unset fields from.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tiers.errors import SwapConfigError

__all__ = [
    "AUTO",
    "DEFAULT_SUB_GROUP_NUMEL",
    "MOMENTS",
    "StepConfig",
    "check_hyper",
    "check_readahead",
]

#: Elements per sub-group unless told (12 B each: 300 MB of state).
DEFAULT_SUB_GROUP_NUMEL = 25_000_000
#: How the Adam moments may be stored (``StepConfig.moments``): fp32 (exact, 12 B per
#: element with the master weights), bf16 (8 B) or 8-bit blockwise (6 B; the scales held).
MOMENTS = ("fp32", "bf16", "int8")
#: ``StepConfig.readahead`` value that sizes the read-ahead at every step
#: (:mod:`swapper.step.window`).
AUTO = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
    """How :class:`~swapper.step.OffloadAdamW` cuts, keeps and streams its state.

    A field left ``None`` is taken from the offloaded model's config
    (``OffloadConfig.step``) when the optimizer's ``tiers`` is such a model, else from the
    default named below.

    Attributes:
        sub_group_numel: elements per sub-group (rounded up to a multiple of 1024;
            default 25M). Each sub-group's state is 12 B per element; the host budget
            must hold the kept ones and one more, and holds the read-ahead and
            write-behind ones too (two or more let a step overlap I/O with compute).
        host_fraction: fraction of the sub-groups (the first ones) kept in memory for the
            optimizer's life instead of streamed, in [0, 1] (default 0).
        max_grad_norm: clip the global L2 norm of the (unscaled) gradients to this
            (``None``: no clipping).
        accumulate_fp32: accumulate gradients over micro-steps in fp32 accumulators in
            host memory (4 B per parameter element) instead of in the 16-bit ``.grad``.
        readahead: optimizer sub-groups read ahead while one computes: an int >= 0;
            ``"auto"``: sized at the start of every step from the host budget left
            besides what other keys (the 16-bit parameters and gradients) hold in host
            memory, at most 2 and at most what the manager's read-ahead window takes
            (see :mod:`swapper.step.window`); ``None``: what the host budget allows
            besides the kept sub-groups, fixed when the optimizer is made.
        overlap: run each step's sub-group updates in the background, in the forward
            order of their parameters, while the next forward runs; the forward's hooks
            wait for the update of a parameter they fetch (``None``: the model's setting,
            else False). The results are bit-identical either way. Only over a model
            wrapped by :func:`swapper.offload` in one process (see
            :mod:`swapper.step.deferred`).
        moments: how the Adam moments are kept in the tiers (``None``: ``"fp32"``).
            ``"fp32"``: exact, 12 B per element with the fp32 master weights, bitwise
            torch's fused AdamW. ``"bf16"``: both moments rounded to bf16 (8 B per
            element). ``"int8"``: 8-bit blockwise with an fp32 scale per block of 1024
            (6 B per element through NVMe; the scales, 8 B per 1024 elements, held in
            the host budget: see :mod:`swapper.step.compress`, :mod:`swapper.step.scales`).
            The master weights stay fp32 and the update itself runs in fp32; only the
            stored moments are rounded.
            A snapshot keeps the stored form (resuming it needs the same setting); a
            state dict and a DCP export hold the moments decoded to fp32.
        name: prefix of the optimizer's keys in the manager.

    Raises:
        SwapConfigError: a setting is invalid; the message names it and says what to fix.
    """

    sub_group_numel: int | None = None
    host_fraction: float | None = None
    max_grad_norm: float | None = None
    accumulate_fp32: bool = False
    readahead: int | str | None = None
    overlap: bool | None = None
    moments: str | None = None
    name: str = "adamw"

    def __post_init__(self) -> None:
        numel = self.sub_group_numel
        if numel is not None and (
            isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0
        ):
            raise SwapConfigError(
                f"sub_group_numel={numel!r} must be > 0, an int number of elements (e.g. "
                "25_000_000), or None for the default"
            )
        fraction = self.host_fraction
        if fraction is not None:
            if (
                isinstance(fraction, bool)
                or not isinstance(fraction, (int, float))
                or not 0.0 <= fraction <= 1.0  # also refuses NaN
            ):
                raise SwapConfigError(
                    f"host_fraction={fraction!r} must be between 0 and 1 (the fraction of "
                    "optimizer sub-groups kept in host memory), or None for the default"
                )
            object.__setattr__(self, "host_fraction", float(fraction))
        norm = self.max_grad_norm
        if norm is not None and (
            isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm > 0
        ):
            raise SwapConfigError(f"max_grad_norm={norm!r} must be > 0 or None")
        if norm is not None:
            object.__setattr__(self, "max_grad_norm", float(norm))
        if not isinstance(self.accumulate_fp32, bool):
            raise SwapConfigError(f"accumulate_fp32={self.accumulate_fp32!r} must be True or False")
        check_readahead(self.readahead)
        if self.overlap is not None and not isinstance(self.overlap, bool):
            raise SwapConfigError(
                f"overlap={self.overlap!r} must be True, False or None (the model's setting)"
            )
        if self.moments is not None and self.moments not in MOMENTS:
            raise SwapConfigError(
                f"moments={self.moments!r} must be one of {', '.join(map(repr, MOMENTS))} "
                "(how the Adam moments are stored), or None for 'fp32'"
            )
        if not isinstance(self.name, str) or not self.name:
            raise SwapConfigError(f"name={self.name!r} must be a non-empty key prefix")

    def merged(self, defaults: StepConfig) -> StepConfig:
        """This config with its ``None`` fields taken from ``defaults``."""
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(defaults, f.name)
                for f in dataclasses.fields(self)
                if getattr(self, f.name) is None
            },
        )


def check_readahead(value: object) -> None:
    """Check a ``readahead`` setting: an int >= 0, ``"auto"`` or ``None``.

    Raises:
        SwapConfigError: anything else; the message names the value.
    """
    if value is None or (isinstance(value, str) and value == AUTO):
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SwapConfigError(
            f"readahead={value!r} must be an int >= 0 (sub-groups read ahead), 'auto' "
            "(sized per step from the host budget left) or None"
        )


def check_hyper(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """Check AdamW's hyper-parameters (one param group's, or the defaults).

    Raises:
        SwapConfigError: one is out of range; the message names it.
    """

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if not number(lr) or not lr >= 0:
        raise SwapConfigError(f"lr={lr!r} must be a number >= 0")
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(number(b) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise SwapConfigError(f"betas={betas!r} must be two numbers in [0, 1)")
    if not number(eps) or not eps >= 0:
        raise SwapConfigError(f"eps={eps!r} must be a number >= 0")
    if not number(weight_decay) or not weight_decay >= 0:
        raise SwapConfigError(f"weight_decay={weight_decay!r} must be a number >= 0")
