"""Gradient norm and clip coefficient computed exactly as ``torch.nn.utils.clip_grad_norm_``.

The reference a user compares against is plain PyTorch with fp32 master copies: the
16-bit gradients are turned into fp32 ones (``grad16.float()``) and
``clip_grad_norm_(masters, max_norm)`` runs on those. For the offloaded step to be
bit-identical to it, every rounding step must be the same:

1. per-tensor norms: ``torch._foreach_norm`` of the fp32 gradients (the foreach path
   ``clip_grad_norm_`` takes on CPU and CUDA tensors; its reduction order differs from
   ``torch.linalg.vector_norm`` on CUDA, and a norm taken on the 16-bit tensor with
   ``dtype=float32`` is not promised to round like one taken on its fp32 copy);
2. the total: ``torch.linalg.vector_norm(torch.stack(norms))``, in fp32;
3. the coefficient: ``max_norm / (total + 1e-6)`` as tensor arithmetic in fp32
   (``Tensor.__rtruediv__`` is ``reciprocal() * max_norm``), clamped to at most 1.0;
4. the gradients multiplied by that fp32 tensor.

Computing the coefficient in Python floats (double) instead rounds differently in the
last bit often enough that runs drift apart within a few steps (issue 15).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["CLIP_EPS", "clip_coefficient", "grad_norm32", "total_norm"]

#: What ``clip_grad_norm_`` adds to the total norm before dividing by it.
CLIP_EPS = 1e-6


def grad_norm32(grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The fp32 L2 norm of each gradient (any float dtype), one 0-dim fp32 tensor each,
    on the CPU, rounded as ``clip_grad_norm_`` rounds the norms of the gradients' fp32
    copies on the CPU.

    Always on the CPU, wherever the gradient is: a CUDA reduction sums in another order
    than the CPU's, so a norm taken where the gradient happens to be (on the GPU when the
    budgets keep it there, in host memory when they move it) would make the clip
    coefficient, and every parameter after it, depend on the budgets. Seen on an H200:
    a tight and an unlimited run differed in the last bits of their parameters until
    every norm was taken here. A gradient on the GPU is copied to the host in its own
    dtype first (the conversion to fp32 is exact wherever it runs).

    Memory: a transient fp32 copy of each 16-bit gradient (4 B per element), one list at
    a time; pass one gradient per call to keep that to one tensor.
    """
    if not grads:
        return []
    as32: list[torch.Tensor] = []
    for grad in grads:
        host = grad.detach() if grad.device.type == "cpu" else grad.detach().cpu()
        as32.append(host if host.dtype == torch.float32 else host.float())
    return list(torch._foreach_norm(as32, 2.0))  # pyright: ignore[reportPrivateImportUsage]


def total_norm(norms: Sequence[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm from per-tensor norms, a 0-dim fp32 tensor on the first norm's
    device (``torch.tensor(0.0)`` for none), as ``torch.nn.utils.get_total_norm`` does."""
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), 2.0)


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clamp(max_norm / (total + 1e-6), max=1.0)`` in fp32, as ``clip_grad_norm_``
    computes it (a 0-dim tensor on ``total``'s device)."""
    clip_coef = float(max_norm) / (total + CLIP_EPS)
    return torch.clamp(clip_coef, max=1.0)
