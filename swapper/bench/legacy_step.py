"""The incumbent's way of stepping, for comparison only (``swapper-bench step
--legacy-grad-swap``): :class:`LegacyGradSwapAdamW`.

DeepSpeed ZeRO-Infinity writes every sub-group's fp32 gradient to NVMe at the
gradient-accumulation boundary and reads it back in its step, beside the state. This
subclass of :class:`~swapper.step.OffloadAdamW` does the same: same results, 4 B per
parameter more each way through the disk. The product never does this (fp32 gradients
are built from the retained 16-bit ones in memory), so it lives with the benchmark.
"""

from __future__ import annotations

import torch

from swapper.manager import Kind, Tier, TierManager
from swapper.step import OffloadAdamW, StepFailedError, SubGroup
from tiers.errors import SwapConfigError
from tiers.signals import wait_future

__all__ = ["LegacyGradSwapAdamW"]


class LegacyGradSwapAdamW(OffloadAdamW):
    """:class:`~swapper.step.OffloadAdamW` with fp32 gradients swapped through NVMe.

    Takes the same arguments. At each step every sub-group's fp32 gradient is registered
    as :attr:`~swapper.manager.Kind.GRAD32` and evicted to NVMe (all writes waited for),
    then each sub-group's step fetches it beside its state; the gradients are
    unregistered when the step ends, whether or not it succeeded.

    Raises:
        SwapConfigError: the manager has no NVMe tier (nothing to swap through), and what
            :class:`~swapper.step.OffloadAdamW` raises.
    """

    def _check_manager(self, manager: TierManager) -> None:
        if not manager.config.nvme_dirs:
            raise SwapConfigError("legacy_grad_swap needs an NVMe tier: give nvme_dirs")

    def _run_pipeline(self, target: int, factor: float) -> None:
        try:
            self._write_grads(target, factor)
            self._pipeline.run(
                target,
                lambda sg, state, extras: self._update(sg, state, extras, target, factor),
                self._publish,
                extra_keys=lambda sg: [self._grad_key(sg)],
            )
        finally:
            self._drop_grads()

    def _grad(
        self, sg: SubGroup, state: torch.Tensor, extras: list[torch.Tensor], factor: float
    ) -> torch.Tensor:
        return extras[0][: sg.numel]  # the fp32 gradient, back from disk (already scaled)

    def _grad_key(self, sg: SubGroup) -> str:
        return f"{self._pipeline.name}/grad32/{sg.index}"

    def _write_grads(self, target: int, factor: float) -> None:
        """Write every sub-group's fp32 gradient to NVMe and wait (DeepSpeed does this at
        the gradient-accumulation boundary, then reads them back in its step)."""
        largest = max(sg.padded_numel for sg in self.sub_groups)
        scratch = torch.zeros(largest, dtype=torch.float32)
        writes = []
        try:
            for sg in self.sub_groups:
                if self._pipeline.progress[sg.index].applied >= target:
                    continue  # a repeated step: this one is done
                grad = scratch[: sg.padded_numel]
                self._build_grad(sg, grad[: sg.numel], factor)
                key = self._grad_key(sg)
                self.manager.register(key, grad, Kind.GRAD32)
                writes.append(self.manager.evict(key, Tier.NVME))
        finally:
            for write in writes:
                wait_future(write, None, "step.write")
            errors = [w.exception() for w in writes]
        failed = [e for e in errors if e is not None]
        if failed:
            raise StepFailedError(
                f"step {target}: writing fp32 gradients (legacy_grad_swap) failed: {failed[0]}",
                step=target,
                undone=[sg.index for sg in self.sub_groups],
            ) from failed[0]

    def _drop_grads(self) -> None:
        keys = set(self.manager.keys())
        for sg in self.sub_groups:
            key = self._grad_key(sg)
            if key in keys:
                self.manager.unregister(key)
