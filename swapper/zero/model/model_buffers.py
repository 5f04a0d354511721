"""A wrapped model's buffers on the device its parameters are used on.

The tiers place the parameters; a module's buffers (RoPE's ``inv_freq``, GPT-2's
``position_ids``, a registered causal mask) are not parameters, and a model built or
loaded on the CPU keeps them there. With parameters used on the GPU the first forward
would then mix devices ("Expected all tensors to be on the same device"). So the wrap
moves every buffer to the use tier's device, as FSDP's ``device_id`` does, and
``unwrap()`` puts each back on the device it came from, with the parameters. A buffer
registered in several modules (the same tensor) stays one tensor.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BufferMoves", "move_buffers", "restore_buffers"]

#: (module, buffer name, the device it was on)
BufferMoves = list[tuple[nn.Module, str, torch.device]]


def move_buffers(module: nn.Module, device: torch.device) -> BufferMoves:
    """Move every buffer of ``module`` and its submodules that is on another device (and
    not on meta: a materialised model's buffers are checked elsewhere) to ``device``.

    Returns:
        what was moved, for :func:`restore_buffers`.

    Raises:
        torch.OutOfMemoryError, RuntimeError: a copy failed; the buffers moved so far
            are moved back first.
    """
    moved: BufferMoves = []
    copies: dict[int, torch.Tensor] = {}  # id of a shared buffer -> its one copy
    try:
        for sub in module.modules():
            for name, buf in list(sub._buffers.items()):
                if buf is None or buf.is_meta or buf.device == device:
                    continue
                copy = copies.get(id(buf))
                if copy is None:
                    copy = copies[id(buf)] = buf.to(device)
                sub._buffers[name] = copy
                moved.append((sub, name, buf.device))
    except BaseException:
        restore_buffers(moved)
        raise
    return moved


def restore_buffers(moved: BufferMoves) -> None:
    """Put each buffer :func:`move_buffers` moved back on the device it came from (its
    current values: a buffer the training changed, as BatchNorm's running mean, keeps the
    change)."""
    copies: dict[int, torch.Tensor] = {}
    for sub, name, home in moved:
        buf = sub._buffers.get(name)
        if buf is None or buf.device == home:
            continue
        copy = copies.get(id(buf))
        if copy is None:
            copy = copies[id(buf)] = buf.to(home)
        sub._buffers[name] = copy
