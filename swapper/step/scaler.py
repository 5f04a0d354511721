"""Dynamic loss scaling for fp16 training, driven by :class:`~swapper.step.OffloadAdamW`.

The optimizer checks the 16-bit gradients for inf/NaN once per step (from the global
norm it computes anyway) and tells the scaler; a step with an overflow is skipped and
leaves every parameter and all optimizer state untouched.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tiers.errors import SwapConfigError

__all__ = ["DynamicLossScaler"]


class DynamicLossScaler:
    """The usual dynamic loss scale: halve on overflow, double after a run of good steps.

    Use ``scaler.scale(loss).backward()``; the optimizer unscales (it divides by
    :attr:`loss_scale` when it builds fp32 gradients) and calls :meth:`update`.

    Args:
        init_scale: the first scale (a power of two keeps scaling exact).
        growth_factor: the scale is multiplied by this after ``growth_interval`` steps
            in a row without overflow.
        backoff_factor: the scale is multiplied by this on an overflow.
        growth_interval: steps without overflow before the scale grows.
        min_scale: the scale never goes below this.

    Raises:
        SwapConfigError: a setting is out of range (named).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
    ) -> None:
        checks = (
            ("init_scale", init_scale, init_scale > 0),
            ("growth_factor", growth_factor, growth_factor > 1),
            ("backoff_factor", backoff_factor, 0 < backoff_factor < 1),
            ("min_scale", min_scale, min_scale > 0),
        )
        for name, value, ok in checks:
            if not isinstance(value, (int, float)) or not math.isfinite(value) or not ok:
                raise SwapConfigError(f"DynamicLossScaler: {name}={value!r} is out of range")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
            raise SwapConfigError(f"growth_interval={growth_interval!r} must be an int")
        if growth_interval < 1:
            raise SwapConfigError(f"growth_interval={growth_interval} must be >= 1")
        self.loss_scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.good_steps = 0
        self.skipped_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale (``torch.amp.GradScaler``'s spelling)."""
        return loss * self.loss_scale

    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step (``found_inf``: the step was skipped)."""
        if found_inf:
            self.loss_scale = max(self.loss_scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.loss_scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (plain numbers)."""
        return {
            "scale": self.loss_scale,
            "good_steps": self.good_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            SwapConfigError: a key is missing or the scale is not positive.
        """
        try:
            scale = float(state["scale"])
            good, skipped = int(state["good_steps"]), int(state["skipped_steps"])
        except (KeyError, TypeError, ValueError) as exc:
            raise SwapConfigError(f"loss scaler state {state!r} is not valid: {exc}") from None
        if not scale > 0:
            raise SwapConfigError(f"loss scaler state: scale={scale} must be > 0")
        self.loss_scale, self.good_steps, self.skipped_steps = scale, good, skipped

    def __repr__(self) -> str:
        return f"DynamicLossScaler(loss_scale={self.loss_scale:g}, good_steps={self.good_steps})"
