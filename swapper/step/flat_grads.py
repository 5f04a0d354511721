"""The step's fp32 gradients converted once, when its source holds every parameter and
gradient for the step (budgets that hold everything: issue 14).

Otherwise the step converts each 16-bit gradient to fp32 twice: into a scratch for its
norm (clipping), and again piece by piece into each sub-group's gradient buffer. Here each
param group's gradients are converted once into one flat fp32 vector laid out as the
group's sub-groups cut it (``SubGroup.flat_offset``), as ``accumulate_fp32``'s
accumulators are: the norms are taken of its per-parameter views, and each sub-group's
gradient is a view of it (no copy). The values are the same: the conversion is exact, and
on the CPU a norm and the fused AdamW kernel do not depend on where a view starts
(``test_offload_unlimited`` checks the whole run bit for bit against tight budgets).

Memory: 4 bytes per parameter element, kept from step to step (what plain PyTorch's fp32
``.grad`` tensors take); used only on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swapper.step.clip import grad_norm32
from swapper.step.layout import SubGroup
from swapper.step.sources import ParamSource

__all__ = ["FlatGrads"]


class FlatGrads:
    """One flat fp32 gradient vector per param group, filled for one step at a time."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []  # kept: refilled each step
        self.filled = False
        #: the fp32 norm of each parameter's gradient that exists, in parameter order
        self.norms: list[torch.Tensor] = []
        #: (group index, param index) of the parameters without a gradient this step
        self._absent: set[tuple[int, int]] = set()

    def fill(self, param_groups: Sequence[dict[str, Any]], source: ParamSource) -> None:
        """Convert every parameter's gradient into its window (zeros where it has none)
        and take the norms of those that exist."""
        if len(self._buffers) != len(param_groups):
            self._buffers = [torch.empty(0) for _ in param_groups]
        present: list[torch.Tensor] = []
        self._absent = set()
        for index, group in enumerate(param_groups):
            numels = [source.shape(p).numel() for p in group["params"]]
            buffer = self._buffers[index]
            if buffer.numel() != sum(numels):
                buffer = torch.empty(sum(numels), dtype=torch.float32)
                self._buffers[index] = buffer
            offset = 0
            for param_index, (param, numel) in enumerate(zip(group["params"], numels, strict=True)):
                window = buffer[offset : offset + numel]
                if source.read_grad(param, 0, window):
                    present.append(window)
                else:
                    window.zero_()
                    self._absent.add((index, param_index))
                offset += numel
        self.norms = grad_norm32(present)
        self.filled = True

    def clear(self) -> None:
        """End of the step: the vectors are stale from here (kept for the next fill)."""
        self.filled = False
        self.norms = []
        self._absent = set()

    def absent(self, sg: SubGroup) -> frozenset[int]:
        """Positions in ``sg.pieces`` of the pieces whose parameter had no gradient."""
        return frozenset(
            position
            for position, piece in enumerate(sg.pieces)
            if (sg.group_index, piece.param_index) in self._absent
        )

    def grad(self, sg: SubGroup, device: torch.device) -> torch.Tensor | None:
        """``sg``'s fp32 gradient (a view: the caller may scale it in place), or None
        when not filled or the state computes on another device."""
        if not self.filled:
            return None
        buffer = self._buffers[sg.group_index]
        if buffer.device != device:
            return None
        return buffer[sg.flat_offset : sg.flat_offset + sg.numel]
