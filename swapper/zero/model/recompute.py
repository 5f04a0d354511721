"""Activation checkpointing under :mod:`swapper.zero.local.offload`: what a recompute holds.

A checkpointed block's forward runs again inside the backward (``torch.utils.checkpoint``,
reentrant or not; Hugging Face's ``gradient_checkpointing_enable()``), and the module hooks
run with it. While module A's backward runs, A's parameters are held (fetched by the
``BeforeBackward`` of A's outputs); its backward needs the block's saved activations, so
the block is recomputed, fetching each of its modules B in turn. The use tier must then
hold A's and B's parameters at once: up to the two largest modules of a checkpointed
block, where a model without checkpointing needs only the largest. (Reentrant
checkpointing recomputes the whole block before the backward of any of its modules, so
one module at a time is enough there; the wrap-time check cannot tell which kind a model
will use and counts two.)

Two checks keep that from becoming a 60 s :class:`~tiers.budget.BudgetTimeout`:

- :func:`checkpointed_need`: at wrap time, for a model whose layers say they are
  checkpointed (Hugging Face's ``gradient_checkpointing`` flag on a layer), the bytes two
  modules of one layer need at once; ``offload`` refuses a smaller budget up front;
- :func:`no_room`: at run time, before a module's parameters are fetched, if what is held
  now plus what the module still needs exceeds the budget, no fetch can ever succeed (held
  parameters are released only by the work that waits): a clear error now, naming what
  is held and the budget that would do.

Non-reentrant checkpointing with early stop (torch's default) abandons the recompute's
forward part-way by raising inside it; the forward hooks are installed with
``always_call=True`` so that the modules it leaves release what their pre-hooks fetched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from tiers.errors import SwapConfigError
from tiers.units import format_size

__all__ = ["checkpointed_need", "no_room"]


def _checkpointed_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers whose forward is recomputed in the backward, as far as the model says:
    Hugging Face sets ``gradient_checkpointing = True`` on every module that has the
    attribute. Those that checkpoint their own call (transformers 5's
    ``GradientCheckpointingLayer``, known by its class name: no import of transformers
    here) are the layers; else the innermost flagged modules are (with transformers 4.x,
    where only the stack is flagged, the stack: an over-estimate).

    Why not the innermost flagged modules always: T5's attention has the attribute too
    (flagged) inside its flagged block, so the innermost was the attention, whose two
    largest modules are smaller than the block's (the MLP's ``wi`` and ``wo``); a budget
    the wrap accepted failed in the first backward, fetching the block's first norm
    while its ``wo`` (and the tied ``shared.weight``) were held (issue 27)."""

    def flagged(sub: nn.Module) -> bool:
        return getattr(sub, "gradient_checkpointing", False) is True

    def checkpoints_itself(sub: nn.Module) -> bool:
        return any(c.__name__ == "GradientCheckpointingLayer" for c in type(sub).__mro__)

    layers = [(n, s) for n, s in model.named_modules() if flagged(s) and checkpoints_itself(s)]
    if layers:
        return layers
    for name, sub in model.named_modules():
        if flagged(sub) and not any(flagged(inner) for inner in list(sub.modules())[1:]):
            layers.append((name, sub))
    return layers


def checkpointed_need(
    model: nn.Module, nbytes_of: Callable[[torch.Tensor], int]
) -> tuple[int, str] | None:
    """The most bytes two modules of one checkpointed layer hold at once (one held for
    its backward while the other is recomputed), with a description; None if no layer of
    ``model`` says it is checkpointed. Tied parameters are counted by the caller."""
    best: tuple[int, str] | None = None
    for layer_name, layer in _checkpointed_layers(model):
        owned = []
        for name, sub in layer.named_modules(prefix=layer_name):
            nbytes = sum(nbytes_of(p) for p in sub.parameters(recurse=False))
            if nbytes:
                owned.append((nbytes, name))
        owned.sort(reverse=True)
        if len(owned) < 2:
            continue
        need = owned[0][0] + owned[1][0]
        if best is None or need > best[0]:
            best = (
                need,
                f"activation checkpointing: {owned[0][1]!r} held for its backward while "
                f"{owned[1][1]!r} is recomputed",
            )
    return best


def no_room(
    module_name: str,
    need_nbytes: int,
    held: Iterable[tuple[str, int]],
    limit_nbytes: int,
    tier_name: str,
) -> SwapConfigError:
    """The error for a module (``module_name``) whose parameters (``need_nbytes`` not
    held yet) cannot be fetched because what is held now (``held``: name and bytes of
    every held parameter) leaves too little of the budget (``limit_nbytes``)."""
    held = list(held)
    held_nbytes = sum(nbytes for _, nbytes in held)
    total = held_nbytes + need_nbytes
    names = ", ".join(repr(name) for name, _ in held[:6]) + (" ..." if len(held) > 6 else "")
    recompute = torch._C._current_graph_task_id() != -1
    return SwapConfigError(
        f"offload: module {module_name!r} needs {format_size(need_nbytes)} "
        f"({need_nbytes} bytes) of {tier_name} memory while {format_size(held_nbytes)} "
        f"({held_nbytes} bytes) is held there ({names})"
        + (
            ", inside a backward (an activation-checkpointing recompute holds the module "
            "being recomputed and the one whose backward waits for it)"
            if recompute
            else ""
        )
        + f": {total} bytes in all, more than the {tier_name} budget of {limit_nbytes} "
        f"bytes, and nothing held can be released until this fetch succeeds. Raise the "
        f"{tier_name} budget to at least {total}"
    )
