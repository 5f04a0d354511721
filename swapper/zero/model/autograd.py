"""Autograd plumbing of :mod:`swapper.zero.local.offload`: how a module's backward is told to
fetch its parameters again before it runs, and whether the calling thread is inside a
backward pass.

Two ways to run a callback just before a module's backward, given its outputs:

- :func:`hook_outputs` (:mod:`swapper.zero.local.offload`): a tensor hook on each output that
  requires grad (``Tensor.register_hook``: it runs when that output's gradient is ready,
  before the node that made it, hence before every node of the module), called once per
  forward call and backward pass (the first of the outputs to get its gradient calls it;
  a second backward through a retained graph calls it again). No node is added to the
  graph: a Python ``autograd.Function`` around the outputs cost ~20 µs in the forward and
  ~75 µs in the backward per module on the development VM (2 cores), the hook ~2 µs;
- :class:`BeforeBackward` / :func:`mark_outputs` (:mod:`swapper.zero.sharded.model`): an identity
  ``autograd.Function`` on the outputs whose backward runs the callback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["BeforeBackward", "hook_outputs", "in_autograd", "mark_outputs"]


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


class _OncePerBackward:
    """A tensor hook calling ``callback`` the first time it runs in each backward pass
    (graph task), whichever of the tensors it is on runs it."""

    __slots__ = ("_callback", "_task")

    def __init__(self, callback: Callable[[], None]) -> None:
        self._callback = callback
        self._task = -1  # (the id outside any backward: never a running one)

    def __call__(self, grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task = task
            self._callback()


def hook_outputs(output: Any, callback: Callable[[], None]) -> bool:
    """Have ``callback`` run before the backward of the work that made ``output`` (a
    tensor, or a tuple, list or mapping holding tensors, as a module returns them): once
    per backward pass that reaches any of its grad-requiring tensors, as the first of
    their gradients arrives. ``output`` itself is left as it is. Returns whether any
    tensor was hooked (none requires grad: ``callback`` will never run)."""
    if isinstance(output, torch.Tensor):
        tensors = [output] if output.requires_grad else []
    elif isinstance(output, (tuple, list)):
        tensors = [t for t in output if isinstance(t, torch.Tensor) and t.requires_grad]
    elif isinstance(output, Mapping):
        tensors = [t for t in output.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    else:
        tensors = []
    if not tensors:
        return False
    hook = _OncePerBackward(callback)
    for tensor in tensors:
        tensor.register_hook(hook)
    return True
