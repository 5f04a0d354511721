"""Checks and undo of the wrap's placement: what must hold before any parameter moves
(:func:`check_modules`; :func:`check_overlap_room` for an overlapped optimizer), and
what a failed wrap of a meta model gives back (:func:`back_to_meta`). Used by
:class:`~swapper.zero.local.offload.OffloadedModel`."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from swapper.manager import Tier
from swapper.zero.local.params import Slot
from swapper.zero.model.recompute import checkpointed_need
from tiers.errors import SwapConfigError
from tiers.units import format_size

__all__ = ["back_to_meta", "check_modules", "check_overlap_room"]


#: (PEFT keeps its adapters in fp32 over a 16-bit base by default; fp32 parameters are
#: not offloaded yet: issue 27's second item)
_PEFT_HINT = (
    "; for PEFT adapters (fp32 by default over a 16-bit base) pass "
    "autocast_adapter_dtype=False to peft.get_peft_model (and to "
    "PeftModel.from_pretrained) to keep them in the base's dtype"
)


def check_modules(module: nn.Module, first: Tier, limit: int | None) -> None:
    """Refuse parameters that are not 16-bit, and a budget of ``first`` (the tier where
    parameters are used; ``limit`` bytes, None: unlimited) that cannot hold some module's
    parameters at once (or what an activation-checkpointing recompute holds), before
    anything is moved.

    Raises:
        SwapConfigError: naming the parameter, or the module and the bytes it needs.
    """
    for name, param in module.named_parameters():
        if not param.is_meta and param.dtype not in (torch.bfloat16, torch.float16):
            raise SwapConfigError(
                f"offload: parameter {name!r} (shape {list(param.shape)}) is "
                f"{param.dtype}; convert the model to bf16 or fp16 first "
                "(model.to(torch.bfloat16))" + _PEFT_HINT * ("lora_" in name)
            )

    def nbytes_of(p: torch.Tensor) -> int:
        # a meta parameter becomes 16-bit when materialised (checked at registration)
        return p.numel() * (2 if p.is_meta else p.element_size())

    seen: set[int] = set()
    shared = 0  # tied parameters may be held through a whole backward
    uses: dict[int, int] = {}
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    for sub in module.modules():
        for p in sub.parameters(recurse=False):
            if uses[id(p)] > 1 and id(p) not in seen:
                shared += nbytes_of(p)
            seen.add(id(p))
    if limit is None:
        return
    # Every need is computed, then the largest is reported: one message gives the floor,
    # not the first module that does not fit (issue 28: four runs to find it).
    needs: list[tuple[int, str]] = []
    recompute = checkpointed_need(module, nbytes_of)
    if recompute is not None:
        needs.append(
            (
                recompute[0] + shared,
                f"{recompute[1]}"
                + (" (with tied parameters held through the backward)" if shared else ""),
            )
        )
    for name, sub in module.named_modules():
        own = [p for p in sub.parameters(recurse=False)]
        nbytes = sum(nbytes_of(p) for p in own)
        tied_elsewhere = shared - sum(nbytes_of(p) for p in own if uses[id(p)] > 1)
        if own:
            needs.append(
                (
                    nbytes + tied_elsewhere,
                    f"module {name or type(sub).__name__!r} ({type(sub).__name__}) (its "
                    "parameters"
                    + (", and tied parameters held through the backward" if tied_elsewhere else "")
                    + ")",
                )
            )
    if not needs:
        return
    need, what = max(needs, key=lambda n: n[0])  # (the first of equal needs)
    if need > limit:
        raise SwapConfigError(
            f"offload: the {first.value} budget of {limit} bytes ({format_size(limit)}) is "
            f"below this model's floor of {need} bytes ({format_size(need)}), the most any "
            f"module needs of {first.value} memory at once: {what}; raise it to at least "
            f"{need}"
        )


def forward_hold(module: nn.Module, nbytes_of: Callable[[nn.Parameter], int]) -> tuple[int, str]:
    """The most parameter bytes a forward holds at once (a module's own parameters and
    its ancestors', which stay fetched while it runs; each counted once), and that
    module's name. ``nbytes_of``: a parameter's size (a wrapped one's ``.data`` is a
    placeholder)."""
    best = (0, "")

    def walk(sub: nn.Module, name: str, held: dict[int, int]) -> None:
        nonlocal best
        own = {id(p): nbytes_of(p) for p in sub.parameters(recurse=False)}
        chain = {**held, **own}
        total = sum(chain.values())
        if own and total > best[0]:
            best = (total, name or type(sub).__name__)
        for child_name, child in sub.named_children():
            walk(child, f"{name}.{child_name}" if name else child_name, chain)

    walk(module, "", {})
    return best


def check_overlap_room(
    module: nn.Module, nbytes_of: Callable[[nn.Parameter], int], limit: int, update_nbytes: int
) -> None:
    """Refuse an overlapped optimizer (:mod:`swapper.step.deferred`) whose update cannot
    find its room in the host tier while the forward holds parameters there (the
    parameters' use tier is the host): the update would wait for room that only the
    forward frees, and the forward waits for the update, until the manager's timeout.

    Args:
        module: the wrapped model.
        nbytes_of: a parameter's size in bytes.
        limit: the host budget (bytes).
        update_nbytes: what the update holds there at once (bytes).

    Raises:
        SwapConfigError: naming both needs and the budget.
    """
    held, name = forward_hold(module, nbytes_of)
    if held + update_nbytes > limit:
        need = held + update_nbytes
        raise SwapConfigError(
            f"StepConfig(overlap=True): the forward holds up to {held} bytes of parameters "
            f"in the host tier (module {name!r} and the modules around it) while the "
            f"overlapped update holds up to {update_nbytes} bytes there (its sub-group's "
            f"state in flight, the sub-groups kept in memory, one parameter or gradient); "
            f"host_nbytes={limit} cannot hold both ({need} bytes, {format_size(need)}): "
            f"raise host_nbytes to at least {need}, lower sub_group_numel, or use "
            "overlap=False"
        )


def back_to_meta(module: nn.Module, placed: list[tuple[nn.Parameter, Slot]]) -> None:
    """A failed wrap of a meta model: the parameters ``materialize=`` made become meta
    Parameters of their shapes again (their values only ever lived in the tiers, which
    the failure closes), one new Parameter per old one, so tied ones stay tied."""
    if not placed:
        return
    new = {
        id(param): nn.Parameter(
            torch.empty(slot.shape, dtype=slot.dtype, device="meta"),
            requires_grad=param.requires_grad,
        )
        for param, slot in placed
    }
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and id(param) in new:
                sub._parameters[name] = new[id(param)]
