"""The optimizer's parameters: the checks made when :class:`~swapper.step.OffloadAdamW`
is constructed, and the fp32 gradient accumulators of ``StepConfig(accumulate_fp32=True)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from swapper.step.layout import SIXTEEN_BIT
from swapper.step.sources import LocalParams, ParamSource
from tiers.errors import SwapConfigError

__all__ = ["check_params", "drop_frozen", "fp32_accumulators"]


def drop_frozen(param_groups: Sequence[dict[str, Any]]) -> int:
    """Take the frozen parameters (``requires_grad=False``) out of the groups (and their
    ``param_names``), in place; returns how many. Why: the step treats a parameter
    without a gradient as one with a zero gradient (weight decay applies), so a frozen
    parameter kept would change, and cost 12 B of optimizer state per element; users pass
    ``model.parameters()`` to ``torch.optim`` optimizers with frozen ones among them."""
    dropped = 0
    for group in param_groups:
        params = group["params"]
        keep = [i for i, p in enumerate(params) if p.requires_grad]
        if len(keep) == len(params):
            continue
        dropped += len(params) - len(keep)
        group["params"] = [params[i] for i in keep]
        names = group.get("param_names")
        if names is not None:
            group["param_names"] = [names[i] for i in keep]
    return dropped


def check_params(param_groups: Sequence[dict[str, Any]], source: ParamSource) -> None:
    """Check every parameter is 16-bit, contiguous and given once (``source`` answers for
    its shape and dtype: an offloaded parameter's ``.data`` is a placeholder), after
    taking the frozen ones of an offloaded model out of the groups (:func:`drop_frozen`;
    plain tensors keep ZeRO's flat-partition rule: no gradient steps as zeros).

    Raises:
        SwapConfigError: the first parameter at fault, named by group, index, name (when
            the group has ``param_names``) and shape.
    """
    if not isinstance(source, LocalParams):
        drop_frozen(param_groups)
    seen: dict[int, str] = {}
    for g_index, group in enumerate(param_groups):
        names = group.get("param_names")
        for p_index, param in enumerate(group["params"]):
            label = f"parameter {p_index} of group {g_index}"
            if names is not None:
                label += f" ({names[p_index]!r})"
            label += f", shape {list(source.shape(param))}"
            dtype = source.dtype(param)
            # fp32 parameters of an offloaded model (beside its 16-bit base: issue 27) are
            # stepped as the rest; their master row equals them (fp32 to fp32 is exact)
            offloaded_fp32 = dtype == torch.float32 and not isinstance(source, LocalParams)
            if dtype not in SIXTEEN_BIT and not offloaded_fp32:
                raise SwapConfigError(
                    f"{label} is {dtype}: OffloadAdamW takes 16-bit parameters "
                    "(torch.bfloat16 or torch.float16) and keeps the fp32 master copy "
                    "itself; convert the model with .to(torch.bfloat16)"
                )
            if not source.contiguous(param):
                raise SwapConfigError(f"{label} is not contiguous")
            if id(param) in seen:
                raise SwapConfigError(f"{label} is also {seen[id(param)]}: pass it once")
            seen[id(param)] = label


def fp32_accumulators(
    param_groups: Sequence[dict[str, Any]], hooks: list[Any]
) -> list[torch.Tensor]:
    """One flat fp32 accumulator per group (4 B per parameter element, on the group's
    device), and a post-accumulate-grad hook per parameter that adds its 16-bit gradient
    into its window and frees ``.grad``. Each hook's handle is appended to ``hooks`` as it
    is made, so that a caller that fails later can remove every one.

    Raises:
        SwapConfigError: a parameter does not require grad (it would never be accumulated).
    """
    accumulators: list[torch.Tensor] = []
    for group in param_groups:
        numel = sum(p.numel() for p in group["params"])
        for param in group["params"]:
            if not param.requires_grad:
                raise SwapConfigError(
                    f"accumulate_fp32: a parameter of shape {list(param.shape)} does not "
                    "require grad, so it never gets a gradient to accumulate"
                )
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        accumulator = torch.zeros(numel, dtype=torch.float32, device=device)
        accumulators.append(accumulator)
        offset = 0
        for param in group["params"]:
            target = accumulator[offset : offset + param.numel()]
            offset += param.numel()

            def add(param: torch.Tensor, target: torch.Tensor = target) -> None:
                # fp32 sum of the micro-steps' 16-bit gradients; the 16-bit one is freed.
                # The hook runs only after a gradient was accumulated into .grad.
                grad = param.grad
                if grad is not None:
                    target.add_(grad.reshape(-1))
                param.grad = None

            hooks.append(param.register_post_accumulate_grad_hook(add))
    return accumulators
