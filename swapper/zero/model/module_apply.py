"""``model.to(...)``, ``.cuda()``, ``.half()`` on a wrapped model.

While wrapped, a parameter's ``.data`` is an empty placeholder and its bytes are the
tiers'. ``nn.Module._apply`` (behind ``to``/``cuda``/``cpu``/``half``/``float``...) would
convert the placeholders: a later fetch sets ``.data`` back to the 16-bit bytes on the use
device, so a conversion of the dtype was silently lost (the forward then failed far away,
"mat1 and mat2 must have the same dtype"), and one of the device was silently undone.
The Hugging Face ``Trainer`` calls ``model.to(args.device)`` on the model it is given.

So while wrapped every module's ``_apply`` is this module's: for each parameter it asks
what the conversion would make of a tensor like it (an empty one), and

- the same dtype on the device the parameters are used on (``model.to("cuda")`` on a
  model used on the GPU, the Trainer's call): nothing to do, the tiers place them;
- anything else: :class:`~tiers.errors.SwapConfigError` naming the parameter, what was
  asked and what to do (convert before ``swapper.offload``, or set the config's device),
  before anything is changed;

and the module's buffers are converted as usual. As DeepSpeed's ZeRO-3 does
(``override_module_apply``). Leaving the block, ``close()`` or ``unwrap()`` gives the
modules their own ``_apply`` back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tiers.errors import SwapConfigError

__all__ = ["guard_apply", "unguard_apply"]

Convert = Callable[[torch.Tensor], torch.Tensor]


def _check(module: nn.Module, prefix: str, fn: Convert, device: torch.device) -> None:
    """Raise if ``fn`` would change a parameter of ``module`` or its submodules."""
    for name, param in module.named_parameters(prefix=prefix):
        probe = fn(torch.empty(0, dtype=param.dtype, device=device))
        if probe.dtype != param.dtype or probe.device != device:
            raise SwapConfigError(
                f"offload: a conversion of the wrapped model (to(), cuda(), half(), ...) "
                f"would make parameter {name!r} {probe.dtype} on {probe.device}; its "
                f"16-bit bytes ({param.dtype}) live in the tiers and are used on {device}. "
                "Convert the model before swapper.offload, or set OffloadConfig's device; "
                "a move to the device it is used on is accepted (and changes nothing)"
            )


def guard_apply(root: nn.Module, device: torch.device) -> list[nn.Module]:
    """Give every module of ``root`` the guarded ``_apply`` (see the module's docstring);
    ``device``: where the parameters are used. Returns the modules, for
    :func:`unguard_apply`."""
    guarded: list[nn.Module] = []
    try:
        for sub in root.modules():
            _guard(sub, device)
            guarded.append(sub)
    except BaseException:  # (a Ctrl-C part-way: no module left half the set guarded)
        unguard_apply(guarded)
        raise
    return guarded


def _guard(sub: nn.Module, device: torch.device) -> None:
    """Give ``sub`` the guarded ``_apply``."""

    def _apply(fn: Convert, recurse: bool = True) -> nn.Module:
        _check(sub, "", fn, device)  # all of it, before any buffer changes
        for module in sub.modules() if recurse else (sub,):
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = fn(buf)
        return sub

    sub._apply = _apply  # type: ignore[method-assign]


def unguard_apply(guarded: list[nn.Module]) -> None:
    """Give the modules their class's ``_apply`` back."""
    for sub in guarded:
        sub.__dict__.pop("_apply", None)
