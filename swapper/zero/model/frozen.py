"""Frozen parameters (``requires_grad=False``) under :mod:`swapper.zero.local.offload`: released
after each module's backward, not at the end of the whole backward (issue 27).

Why. A module's backward fetches its parameters again (the hook on its outputs:
:func:`~swapper.zero.model.autograd.hook_outputs`); a trainable parameter is released when its
gradient has been accumulated (``register_post_accumulate_grad_hook``), but a frozen one
has no gradient, so no hook fired and it stayed fetched until the backward ended: a LoRA
model (frozen base, small adapters) held its whole base in the device tier by the end
of the backward, and a budget of a quarter of the model failed in the first backward.

How. For a module whose own parameters are *all* frozen (a LoRA ``base_layer``, a frozen
norm), its forward pre-hook passes the tensors it is given that require grad (positional
and keyword, at the top level) through one identity ``autograd.Function``
(:class:`~swapper.zero.model.autograd.BeforeBackward`, on inputs rather than outputs: call it
the module's AfterBackward) whose backward runs once every node between those inputs and
the module's outputs has run: the module's backward is over, nothing of it reads the
parameters any more, and the holds its backward took are released then
(``ModelLifecycle._frozen_after``). A frozen module whose input requires no grad has an output
that requires none: its backward never runs and fetches nothing.

A module with trainable and frozen parameters both (a ``Linear`` with a frozen weight and
a trainable bias) is left as before: its frozen parameters are released at the end of the
backward (the inputs' gradients may be complete before a node that reads the frozen
weight for a trainable parameter's gradient). So are the holds of a call whose inputs
were not marked (a tensor inside a list, a tensor the module reads from elsewhere): the
end of the backward releases what is left, as it always did; an early release is never
made without its own backward's hold (:attr:`FrozenUse.pending`).

Why a node per call rather than a tensor hook on the inputs: an input is often shared
(``q_proj``, ``k_proj`` and ``v_proj`` read the same hidden state); its hook fires only
when every consumer's backward is over, so the three would be held together. The node
costs ~75 µs a module and backward on the development VM (a Python ``autograd.Function``),
added only where the use tier cannot hold every parameter (``LocalCore.keep_held``
is False: with room for everything an early release saves nothing).

Under activation checkpointing: non-reentrant, the first forward's pre-hook marks the
inputs in the graph the backward runs; the recompute marks its own, never backpropagated
(harmless: no hold is counted for them). Reentrant, the first forward runs without grad
(nothing marked) and the recompute inside the backward marks the inputs of the graph its
nested backward runs.

The trainable set is fixed at wrap time: :func:`check_trainable` refuses a model whose
``requires_grad`` changed since (the optimizer was made for the set it was given, and
the hooks for the gradients were installed for it), naming the parameter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from swapper.zero.model.autograd import BeforeBackward
from tiers.errors import SwapConfigError


class _Param(Protocol):
    """A wrapped parameter's record (``swapper.zero.local.params.Slot``, or a sharded
    model's ``ShardSlot``): this room imports neither model."""

    name: str
    param: nn.Parameter
    trainable: bool


#: what one hold is of (one process: a parameter's slot; N ranks: a module state)
U = TypeVar("U")

__all__ = [
    "FrozenUse",
    "ParametersChanged",
    "TrainableSetChanged",
    "check_known",
    "check_not_nested",
    "check_trainable",
    "frozen_use",
    "mark_inputs",
]


class TrainableSetChanged(SwapConfigError):
    """A parameter's ``requires_grad`` changed after the model was wrapped."""


class ParametersChanged(SwapConfigError):
    """A parameter was added to the wrapped model after the wrap (adapters inserted into
    it: ``peft.get_peft_model`` after ``swapper.offload``)."""


def check_known(module: nn.Module, slots: Mapping[int, Any]) -> None:
    """Refuse a model holding a parameter the wrap did not place (``slots``: by
    ``id(param)``).

    Raises:
        ParametersChanged: naming the first such parameter, before anything moves.
    """
    for name, param in module.named_parameters():
        if id(param) not in slots:
            raise ParametersChanged(
                f"offload: parameter {name!r} (shape {list(param.shape)}) was added to the "
                "model after swapper.offload wrapped it (adapters inserted into a wrapped "
                "model: peft.get_peft_model after swapper.offload?); swapper places a "
                "model's parameters once: leave the block, add the adapters "
                "(get_peft_model) and wrap the PEFT model"
            )


def mark_inputs(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], hook: Callable[[], None]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """``args`` and ``kwargs`` with their top-level tensors that require grad passed
    through one identity node whose backward calls ``hook``
    (:class:`~swapper.zero.model.autograd.BeforeBackward`, here on a module's inputs); None
    when none requires grad (nothing to change: the module's backward, if any, does not
    reach its inputs)."""
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not positions and not names:
        return None
    # (BeforeBackward, on inputs: its backward runs once the module's backward is over)
    tensors = (*(args[i] for i in positions), *(kwargs[k] for k in names))
    marked = BeforeBackward.apply(hook, *tensors)
    marked = marked if isinstance(marked, tuple) else (marked,)
    new_args = list(args)
    for i, tensor in zip(positions, marked[: len(positions)], strict=True):
        new_args[i] = tensor
    new_kwargs = dict(kwargs)
    for k, tensor in zip(names, marked[len(positions) :], strict=True):
        new_kwargs[k] = tensor
    return tuple(new_args), new_kwargs


@dataclasses.dataclass(eq=False, slots=True)
class FrozenUse(Generic[U]):
    """A module whose own parameters are all frozen: the units its hooks hold (one
    process: its parameters' slots; N ranks: its module state), and how many holds its
    backward took that its AfterBackward (module docstring) has not released yet."""

    slots: list[U]
    #: backward holds taken (one per unit each) by this module's output hook and not yet
    #: released by an AfterBackward of it; 0 again at the end of every backward
    pending: int = 0


def frozen_use(units: list[U], records: Iterable[_Param]) -> FrozenUse[U] | None:
    """A :class:`FrozenUse` of ``units`` for a module whose parameters (``records``) are
    all frozen, else None."""
    records = list(records)
    if records and not any(record.trainable for record in records):
        return FrozenUse(units)
    return None


def check_trainable(slots: Iterable[_Param]) -> None:
    """Refuse a model whose trainable set changed since the wrap.

    Raises:
        TrainableSetChanged: naming the first parameter whose ``requires_grad`` is no
            longer what it was at wrap time, before anything is fetched.
    """
    for slot in slots:
        if slot.param.requires_grad is not slot.trainable:
            was, now = slot.trainable, slot.param.requires_grad
            raise TrainableSetChanged(
                f"offload: parameter {slot.name!r} had requires_grad={was} when the model "
                f"was wrapped and has requires_grad={now} now; the trainable set is fixed "
                "by swapper.offload (the optimizer and the gradient hooks are made for "
                f"it): set requires_grad_({was}) back, or leave the block and wrap the "
                "model again with the new set (and a new optimizer)"
            )


def check_not_nested(module: nn.Module, wrapped: Iterable[nn.Module]) -> None:
    """Refuse to wrap ``module`` when a module inside it is wrapped now, or it is inside
    a wrapped model (``wrapped``: the models wrapped now): its parameters would be placed
    twice, the second time as the first wrap's empty placeholders. Checked before
    anything moves; O(modules) once per wrap.

    Raises:
        SwapConfigError: naming the module already wrapped, or the wrapped model and
            where ``module`` is in it.
    """
    models = list(wrapped)
    inside = {id(sub): name for name, sub in module.named_modules()}
    for model in models:
        if id(model) in inside and model is not module:
            raise SwapConfigError(
                f"offload: module {inside[id(model)]!r} ({type(model).__name__}) of this "
                f"{type(module).__name__} is wrapped already: leave that block (or close "
                "it) and wrap the whole model once"
            )
    for model in models:
        if model is module:
            continue
        for name, sub in model.named_modules():
            if sub is module:
                raise SwapConfigError(
                    f"offload: this {type(module).__name__} is module {name!r} of a wrapped "
                    f"{type(model).__name__}: its parameters are in that model's tiers "
                    "already; wrap a model once, from its outermost module"
                )
