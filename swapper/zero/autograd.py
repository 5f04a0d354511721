"""Autograd plumbing of :mod:`swapper.zero.offload`: how a module's backward is told to
fetch its parameters again before it runs (:class:`BeforeBackward` on the module's
outputs), and whether the calling thread is inside a backward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["BeforeBackward", "in_autograd", "mark_outputs"]


class BeforeBackward(torch.autograd.Function):
    """Identity on a module's outputs whose backward fetches the module's parameters."""

    @staticmethod
    def forward(ctx: Any, hook: Callable[[], None], *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.hook = hook
        outputs = tuple(t.detach() for t in tensors)
        return outputs[0] if len(outputs) == 1 else outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.hook()
        return (None, *grads)


def in_autograd() -> bool:
    """Whether the calling thread runs inside a backward pass (a recomputing forward
    of activation checkpointing, a hook)."""
    return torch._C._current_graph_task_id() != -1


def mark_outputs(output: Any, hook: Callable[[], None]) -> Any:
    """``output`` with its grad-requiring tensors passed through :class:`BeforeBackward`."""
    if isinstance(output, torch.Tensor):
        return BeforeBackward.apply(hook, output) if output.requires_grad else output
    if isinstance(output, (tuple, list)):
        tensors = [t for t in output if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return output
        marked = BeforeBackward.apply(hook, *tensors)
        marked = marked if isinstance(marked, tuple) else (marked,)
        it = iter(marked)
        items = [next(it) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in output]
        return type(output)(items) if isinstance(output, list) else tuple(items)
    if isinstance(output, Mapping):
        keys = [k for k, v in output.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not keys:
            return output
        marked = BeforeBackward.apply(hook, *(output[k] for k in keys))
        marked = marked if isinstance(marked, tuple) else (marked,)
        merged = {**output, **dict(zip(keys, marked, strict=True))}
        if type(output) is dict:
            return merged
        # Keep the container's type: Hugging Face's ModelOutput (outputs.loss) from a
        # module that owns parameters itself (CLIPModel's logit_scale, say).
        try:
            return type(output)(**merged)
        except TypeError:
            return merged
    return output
