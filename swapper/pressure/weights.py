"""Weights of the pressure model: deterministic init and meta-device materialisation.

Job: give a :class:`~swapper.pressure.model.GPT` the same weights for the same seed on
any device and dtype (``init_module_``, ``init_weights_``), and materialise one built on
``torch.device("meta")`` a module at a time on the CPU (``materialize_``), so a model
larger than memory never exists whole before the swap manager takes its parameters.

Invariant: the weights depend only on the seed and the module's names and shapes, never
on the order modules are visited in or on the device.

The functions take any ``nn.Module`` (they walk ``named_modules()``), so this module never
imports :mod:`swapper.pressure.model`, which builds on it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from tiers.errors import SwapConfigError

#: Standard deviation of the normal init of Linear and Embedding weights.
INIT_STD = 0.02
#: The largest fp32 draw (bytes) made in a :class:`DrawScratch` rather than a fresh tensor.
DRAW_SCRATCH_NBYTES = 128 << 20


class DrawScratch:
    """One fp32 buffer the random draws of several parameters are made in, in turn.

    A fresh ``torch.empty`` per draw is new memory each time (large allocations are
    mapped and unmapped), and its first touch — a page fault per 4 KiB, slow in a VM —
    took as long as the draw itself (an 80 MB draw: ~0.3 s fresh, ~0.14 s into memory
    already touched, the 2-vCPU VM under load; a 2.17 B model draws 8.7 GB). A draw
    larger than ``max_nbytes`` gets a fresh tensor (the embedding of a large vocabulary:
    the scratch would stay that large for the whole materialisation). The values are the
    same either way: the draw fills the tensor whole.
    """

    def __init__(self, max_nbytes: int = DRAW_SCRATCH_NBYTES) -> None:
        self.max_numel = max_nbytes // 4
        self._buffer = torch.empty(0, dtype=torch.float32)

    def empty(self, shape: torch.Size) -> torch.Tensor:
        """An fp32 tensor of ``shape`` (uninitialised), a view of the scratch when it fits
        ``max_nbytes``; valid until the next call."""
        numel = shape.numel()
        if numel > self.max_numel:
            return torch.empty(shape, dtype=torch.float32)
        if numel > self._buffer.numel():
            self._buffer = torch.empty(numel, dtype=torch.float32)
        return self._buffer[:numel].view(shape)


@torch.no_grad()
def init_module_(
    module: nn.Module,
    generator: torch.Generator,
    *,
    skip: Sequence[torch.Tensor] = (),
    scratch: DrawScratch | None = None,
) -> None:
    """Initialise ``module``'s own parameters (``recurse=False``) in place.

    Linear and Embedding weights: normal(0, 0.02); LayerNorm weight: ones; biases: zeros.
    Random values are drawn in fp32 from ``generator`` (a CPU generator) and then copied
    into the parameter, so the values and the generator's state afterwards do not depend
    on the parameter's dtype or device. A module without parameters of its own is a
    no-op.

    Args:
        module: the module whose own parameters to set.
        generator: CPU generator to draw from; advanced by the draws.
        skip: parameters (by identity) to leave untouched and draw nothing for, e.g. a
            tied weight another module has already initialised.
        scratch: where to draw (reused across calls); None: a fresh tensor per draw.

    Raises:
        TypeError: ``module`` has parameters of its own but is not an nn.Linear,
            nn.Embedding or nn.LayerNorm.
    """
    own = list(module.named_parameters(recurse=False))
    if not own:
        return
    if not isinstance(module, nn.Linear | nn.Embedding | nn.LayerNorm):
        raise TypeError(
            f"init_module_ knows nn.Linear, nn.Embedding and nn.LayerNorm; "
            f"{type(module).__name__} has parameters {[n for n, _ in own]}"
        )
    for name, param in own:
        if any(param is s for s in skip):
            continue
        if name == "bias":
            param.zero_()
        elif isinstance(module, nn.LayerNorm):
            param.fill_(1.0)
        else:
            values = (
                scratch.empty(param.shape)
                if scratch is not None
                else torch.empty(param.shape, dtype=torch.float32)
            )
            values.normal_(0.0, INIT_STD, generator=generator)
            param.copy_(values)


def init_weights_(model: nn.Module, seed: int) -> None:
    """Initialise every parameter of ``model`` deterministically from ``seed``.

    Walks ``model.named_modules()`` in order with one CPU generator seeded once and calls
    :func:`init_module_` on each; a parameter met a second time (the tied head weight) is
    skipped, so it is initialised exactly once, by the token embedding.

    Args:
        model: a GPT with materialised (non-meta) parameters, any dtype and device.
        seed: seed of the generator.

    Raises:
        SwapConfigError: ``model`` still has meta parameters (use :func:`materialize_`).
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    scratch = DrawScratch()
    seen: set[int] = set()  # id() of parameters already set; they stay alive in model
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if any(p.is_meta for p in own):
            raise SwapConfigError(f"{name} has meta parameters: use materialize_ to build them")
        init_module_(module, generator, skip=[p for p in own if id(p) in seen], scratch=scratch)
        seen.update(id(p) for p in own)


def materialize_(
    model: nn.Module,
    *,
    dtype: torch.dtype,
    seed: int,
    on_module: Callable[[str, nn.Module], None] | None = None,
) -> None:
    """Materialise a GPT built under ``torch.device("meta")`` on the CPU, one module at a time.

    Walks ``model.named_modules()`` in the order :func:`init_weights_` does. For each
    module with parameters of its own: each own meta parameter becomes a new CPU
    Parameter of ``dtype`` (what ``module.to_empty(device="cpu", recurse=False)`` followed
    by a cast does), except a parameter an earlier module already materialised (the tied
    head weight), which is replaced by that earlier module's Parameter object, so
    ``model.head.weight is model.tok_emb.weight`` holds again. The new parameters are
    initialised by :func:`init_module_` from one generator seeded once (values drawn in
    fp32, then cast to ``dtype``), then ``on_module(name, module)`` is called before the
    next module is materialised. The result is bit-identical to ``init_weights_(model,
    seed)`` on a model built normally and cast to ``dtype``.

    ``on_module`` may move or offload the parameters' data (e.g. set ``param.data``) but
    should keep the Parameter objects registered: a later module sharing one receives
    the object, not a copy.

    Args:
        model: a GPT whose parameters are all on the meta device.
        dtype: floating dtype of the parameters, e.g. torch.bfloat16.
        seed: seed of the generator.
        on_module: called with (qualified module name, module) once per module that has
            parameters of its own, right after they are ready.

    Raises:
        SwapConfigError: ``dtype`` is not a floating dtype, or a parameter is not on the
            meta device (the model was not built under ``torch.device("meta")`` or was
            already materialised).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise SwapConfigError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    scratch = DrawScratch()
    # id(meta Parameter) → (meta Parameter, its CPU replacement); the meta Parameter is
    # kept so its id cannot be reused while the map lives.
    done: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
    for name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        shared: list[torch.Tensor] = []
        for pname, param in own:
            if id(param) in done:
                new = done[id(param)][1]
                shared.append(new)
            elif not param.is_meta:
                raise SwapConfigError(
                    f"{name}.{pname} is on {param.device}, not meta: build the model under "
                    f'torch.device("meta") and materialise it once'
                )
            else:
                new = nn.Parameter(
                    torch.empty(param.shape, dtype=dtype, device="cpu"),
                    requires_grad=param.requires_grad,
                )
                done[id(param)] = (param, new)
            setattr(module, pname, new)
        init_module_(module, generator, skip=shared, scratch=scratch)
        if on_module is not None:
            on_module(name, module)
