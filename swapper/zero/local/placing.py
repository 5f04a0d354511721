"""Checks and undo of the wrap's placement: what must hold before any parameter moves
(:func:`check_modules`; :func:`check_overlap_room` for an overlapped optimizer), and
what a failed wrap of a meta model gives back (:func:`back_to_meta`). Used by
:class:`~swapper.zero.local.offload.OffloadedModel`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from swapper.manager import Tier
from swapper.zero.model.recompute import checkpointed_need
from tiers.errors import SwapConfigError
from tiers.extents import pad
from tiers.units import format_size

__all__ = [
    "back_to_meta",
    "check_dtypes",
    "check_fp32_grads",
    "check_modules",
    "check_overlap_room",
    "positions",
    "refuse_fp32_grads",
]


#: The dtypes a parameter may have: 16-bit, and fp32 beside a 16-bit base (PEFT keeps
#: its adapters in fp32 over a 16-bit base by default; issue 27)
_ACCEPTED = (torch.bfloat16, torch.float16, torch.float32)


def check_dtypes(module: nn.Module) -> None:
    """Refuse a parameter that is neither 16-bit nor fp32, and a model with no 16-bit
    parameter (converted to fp32 entirely: the tiers would hold twice its bytes and its
    optimizer a second fp32 copy), naming the parameter, before anything is moved.

    fp32 parameters beside a 16-bit base are accepted (issue 27): streamed like the rest,
    an fp32 trainable one is its own master in value (the step rounds fp32 to fp32, which
    is exact) and its gradient is retained in fp32 in memory, never on NVMe
    (``Kind.GRAD32``, whose offload placement has memory tiers only).

    Raises:
        SwapConfigError: naming the first parameter at fault and the fix.
    """
    first: tuple[str, nn.Parameter] | None = None
    sixteen = False
    for name, param in module.named_parameters():
        if param.is_meta or param.dtype in (torch.bfloat16, torch.float16):
            sixteen = True  # (a meta parameter becomes 16-bit when materialised)
            continue
        if param.dtype not in _ACCEPTED:
            raise SwapConfigError(
                f"offload: parameter {name!r} (shape {list(param.shape)}) is {param.dtype}; "
                "parameters must be bf16 or fp16 (fp32 is accepted beside a 16-bit base): "
                "convert the model first (model.to(torch.bfloat16))"
            )
        if first is None:
            first = (name, param)
    if first is not None and not sixteen:
        name, param = first
        raise SwapConfigError(
            f"offload: every parameter is torch.float32 (the first is {name!r}, shape "
            f"{list(param.shape)}); convert the model to bf16 or fp16 first "
            "(model.to(torch.bfloat16), or from_pretrained(..., dtype=torch.bfloat16)): "
            "fp32 parameters are accepted only beside a 16-bit base, such as PEFT's fp32 "
            "adapters"
        )


def check_fp32_grads(module: nn.Module, tier: Tier, limit: int | None) -> None:
    """Refuse fp32 trainable parameters whose gradients cannot all be retained in
    ``tier`` (the first memory tier of ``Kind.GRAD32``'s placement; ``limit`` its budget
    in bytes, None: unlimited): fp32 gradients are never written to NVMe, so they must fit
    in memory together (4 B per element).

    Raises:
        SwapConfigError: as :func:`refuse_fp32_grads`.
    """
    fp32 = [
        (name, p.shape, p.numel() * 4)
        for name, p in module.named_parameters()
        if p.requires_grad and not p.is_meta and p.dtype == torch.float32
    ]
    refuse_fp32_grads(fp32, tier, limit)


def _charged(tier: Tier, nbytes: int) -> int:
    """What ``tier``'s budget counts for a block of ``nbytes``: a host block is 4 KiB-
    aligned (:meth:`tiers.host.HostTier.charge`), a device block exact."""
    return pad(nbytes) if tier is Tier.HOST else nbytes


def refuse_fp32_grads(
    grads: Sequence[tuple[str, Sequence[int], int]], tier: Tier, limit: int | None
) -> None:
    """Refuse fp32 gradients (``(parameter name, its shape, bytes retained)`` each: a
    whole gradient in one process, this rank's shard of it with several) that do not fit
    together in ``tier``'s budget of ``limit`` bytes (None: unlimited); they stay in
    memory, never on NVMe. Each counts as the tier charges it (a host block: rounded up
    to 4 KiB, so many small adapters' gradients hold more than their bytes).

    Raises:
        SwapConfigError: naming the largest fp32 trainable parameter, the bytes they need
            and the two fixes.
    """
    need = sum(_charged(tier, nbytes) for _, _, nbytes in grads if nbytes)
    if limit is None or need <= limit:
        return
    name, shape, _ = max(grads, key=lambda item: item[2])
    raise SwapConfigError(
        f"offload: the fp32 trainable parameters (the largest {name!r}, shape "
        f"{list(shape)}) hold {need} bytes ({format_size(need)}, as the {tier.value} "
        f"tier charges them) of fp32 gradients, which stay in memory (never on NVMe), "
        f"above the {tier.value} budget of {limit} bytes ({format_size(limit)}); raise "
        "it, or make them 16-bit (for PEFT: autocast_adapter_dtype=False in peft.get_peft_model)"
    )


def check_modules(module: nn.Module, first: Tier, limit: int | None) -> None:
    """Refuse parameters that are neither 16-bit nor fp32 beside a 16-bit base
    (:func:`check_dtypes`), and a budget of ``first`` (the tier where
    parameters are used; ``limit`` bytes, None: unlimited) that cannot hold some module's
    parameters at once (or what an activation-checkpointing recompute holds), before
    anything is moved.

    Raises:
        SwapConfigError: naming the parameter, or the module and the bytes it needs.
    """
    check_dtypes(module)

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


class _Shaped(Protocol):
    """What :func:`back_to_meta` reads of a placed parameter's record (a :class:`Slot`,
    or a sharded wrap's ``ShardSlot``): the full parameter's shape and dtype."""

    @property
    def shape(self) -> torch.Size: ...

    @property
    def dtype(self) -> torch.dtype: ...


#: Where each parameter of a model sat before its wrap: (module, name, the Parameter).
Positions = list[tuple[nn.Module, str, nn.Parameter]]


def positions(module: nn.Module) -> Positions:
    """Every (module, attribute name, Parameter) of ``module``'s tree, tied weights once
    per module that holds them: what :func:`back_to_meta` puts back after a failed wrap."""
    return [
        (sub, name, param)
        for sub in module.modules()
        for name, param in sub.named_parameters(recurse=False, remove_duplicate=False)
    ]


def back_to_meta(
    module: nn.Module,
    placed: list[tuple[nn.Parameter, _Shaped]],
    before: Positions | None = None,
) -> None:
    """A failed wrap of a meta model: the parameters ``materialize=`` made become meta
    Parameters of their shapes again (their values only ever lived in the tiers, which
    the failure closes), one new Parameter per old one, so tied ones stay tied. Used by
    the one-process wrap (records: :class:`Slot`) and the sharded one (``ShardSlot``).

    ``before`` (:func:`positions` taken before ``materialize=`` ran): every position whose
    Parameter is still on meta gets that very Parameter back. Why: ``materialize=``
    replaces a module's meta Parameter by a new one (``to_empty`` does), so a weight tied
    to a module the failure came before (an output head tied to the embedding) would
    otherwise be left holding the old object, no longer the embedding's."""
    if placed:
        new = {
            id(param): nn.Parameter(
                torch.empty(slot.shape, dtype=slot.dtype, device="meta"),
                requires_grad=param.requires_grad,
            )
            for param, slot in placed
        }
        for sub in module.modules():
            for name, param in list(sub.named_parameters(recurse=False, remove_duplicate=False)):
                if id(param) in new:
                    setattr(sub, name, new[id(param)])
    for sub, name, param in before or ():
        if param.is_meta:  # (still meta: materialize= made a new Parameter in its place)
            setattr(sub, name, param)
