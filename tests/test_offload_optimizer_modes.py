"""``OffloadOptimizer`` in the modes ``X`` itself has: ``fused=True`` (Adam, AdamW, SGD,
Adagrad: PyTorch's fused CPU kernels), lr schedulers driving its param groups, and the
overlapped step (``StepConfig(overlap=True)`` over an offloaded model); each bit-identical
to ``X`` over fp32 master copies in memory (issue 26).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_offload_optimizer import (
    Reference,
    _assert_states_equal,
    _gpt,
    _loss,
    _split_params,
    _tight_optimizer,
)
from torch import nn

import swapper
from swapper import Kind, OffloadConfig, OffloadOptimizer, StepConfig, Tier

FUSED: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 1e-2, "fused": True}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "fused": True}),
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "fused": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05, "fused": True}),
}


def _run(
    cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    tmp_path: Path,
    *,
    steps: int,
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
) -> None:
    """``steps`` steps of the tiny GPT (state on NVMe, parameters split across
    sub-groups) and of X beside it, compared bitwise at every step (parameters, lr) and
    at the end (every state tensor); ``scheduler(optimizer)`` makes an lr scheduler for
    each, stepped after every step."""
    model = _gpt(torch.bfloat16)
    params = list(model.parameters())
    ref = Reference(cls, kwargs, params)
    with _tight_optimizer(cls, params, tmp_path, kwargs) as opt:
        assert _split_params(opt.sub_groups)
        schedulers = [] if scheduler is None else [scheduler(opt), scheduler(ref.opt)]
        read = 0
        for step in range(1, steps + 1):
            _loss(model, step).backward()
            opt.step()
            ref.step(1.0)
            assert opt.last_step is not None
            read += opt.last_step.traffic.total_read_nbytes
            for s in schedulers:
                s.step()
            assert opt.param_groups[0]["lr"] == ref.opt.param_groups[0]["lr"]
            for i, (a, e) in enumerate(zip(params, ref.expected16(), strict=True)):
                assert torch.equal(a.detach(), e), f"step {step}: param {i} differs"
            opt.zero_grad()
        assert read > 0
        _assert_states_equal(
            dict(opt.state_dict()["state"].items()), ref.opt.state_dict()["state"], ""
        )
        if schedulers:  # it changed the lr: the test means something
            assert ref.opt.param_groups[0]["lr"] != kwargs["lr"]


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_is_bit_identical_to_x_fused(tmp_path: Path, name: str) -> None:
    cls, kwargs = FUSED[name]
    _run(cls, kwargs, tmp_path, steps=6)


@pytest.mark.parametrize(
    ("name", "make"),
    [
        ("lambda", lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9**s)),
        ("cosine", lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4)),
    ],
    ids=["lambda", "cosine"],
)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_lr_schedulers_drive_it_as_x(
    tmp_path: Path, name: str, make: Callable[[torch.optim.Optimizer], Any], optimizer: str
) -> None:
    del name
    cls, kwargs = {
        "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
        "adam": (torch.optim.Adam, {"lr": 1e-2}),
    }[optimizer]
    _run(cls, kwargs, tmp_path, steps=6, scheduler=make)


# -- the overlapped step over an offloaded model ------------------------------------------

IN, HIDDEN, STEPS = 32, 64, 4


def _mlp() -> nn.Sequential:
    model = nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, IN)
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.to(torch.bfloat16)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, IN, generator=g).to(torch.bfloat16), torch.randn(8, IN, generator=g)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "ordinary"])
@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_overlapped_step_over_an_offloaded_model_matches_x(
    tmp_path: Path, name: str, overlap: bool
) -> None:
    """``StepConfig(overlap=True)``: the updates run behind the next forward, with an lr
    scheduler changing the lr right after each step() (the update keeps its step's lr);
    parameters bit-identical to X over fp32 masters of a plain copy of the model at every
    step, and every state tensor at the end."""
    cls, kwargs = {
        "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
        "adagrad": (torch.optim.Adagrad, {"lr": 0.05}),
    }[name]
    plain = _mlp()
    masters = [p.detach().float().clone() for p in plain.parameters()]
    ref = cls(masters, **kwargs)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref, lambda s: 0.8**s)
    config = OffloadConfig.create(
        nvme_dirs=[tmp_path / "nvme"],
        device="cpu",
        device_nbytes=20_000,
        host_nbytes=60_000,  # < params + grads + state: the state spills to NVMe
        step=StepConfig(sub_group_numel=2048, overlap=overlap),
    )
    with (
        swapper.offload(_mlp(), config) as wrapped,
        OffloadOptimizer(cls, wrapped.parameters(), tiers=wrapped, **kwargs) as opt,
    ):
        assert opt.config.overlap is overlap
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.8**s)
        for step in range(1, STEPS + 1):
            x, y = _batch(step)
            ours = (wrapped(x).float() - y).pow(2).mean()
            ours.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            theirs = (plain(x).float() - y).pow(2).mean()
            theirs.backward()
            assert float(ours.detach()) == float(theirs.detach()), f"step {step}: loss"
            for m, p in zip(masters, plain.parameters(), strict=True):
                m.grad = p.grad.float()
            ref.step()
            ref_sched.step()
            with torch.no_grad():
                for m, p in zip(masters, plain.parameters(), strict=True):
                    p.copy_(m)
            plain.zero_grad()
        opt.wait_pending()
        moved = opt.manager.stats().kind_nbytes
        assert moved.get((Kind.OPTIM_STATE, Tier.NVME, Tier.HOST), 0) > 0  # state streamed
        for (key, value), p in zip(
            wrapped.state_dict().items(), plain.state_dict().values(), strict=True
        ):
            assert torch.equal(value, p), key
        _assert_states_equal(
            dict(opt.state_dict()["state"].items()), ref.state_dict()["state"], name
        )


class _TwoHeads(nn.Module):
    """A trunk and two heads; a step that uses one head leaves the other without a
    gradient (its ``.grad`` None, as ``torch.optim`` sees it)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(IN, HIDDEN)
        self.a = nn.Linear(HIDDEN, IN)
        self.b = nn.Linear(HIDDEN, IN)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
        return getattr(self, head)(torch.relu(self.trunk(x)))


@pytest.mark.parametrize("budgets", ["unlimited", "tight"])
def test_a_head_without_gradient_is_skipped_over_an_offloaded_model(
    tmp_path: Path, budgets: str
) -> None:
    """Over an offloaded model (unlimited budgets: the step converts every gradient at
    once; tight: piece by piece from the tiers), a parameter the forward did not use is
    skipped as X skips it: Adam over a plain copy, bitwise, every step and every state."""
    cls, kwargs = torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.01}
    plain = _TwoHeads()
    masters = [p.detach().float().clone() for p in plain.parameters()]
    ref = cls(masters, **kwargs)
    if budgets == "unlimited":
        config = OffloadConfig.create(device="cpu", step=StepConfig(sub_group_numel=2048))
    else:
        config = OffloadConfig.create(
            nvme_dirs=[tmp_path / "nvme"], device="cpu", device_nbytes=20_000,
            host_nbytes=60_000, step=StepConfig(sub_group_numel=2048),
        )  # fmt: skip
    heads = ["a", "a", "b", "a", "b", "b"]
    with (
        swapper.offload(_TwoHeads(), config) as wrapped,
        OffloadOptimizer(cls, wrapped.parameters(), tiers=wrapped, **kwargs) as opt,
    ):
        for step, head in enumerate(heads, start=1):
            x, y = _batch(step)
            (wrapped(x, head).float() - y).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            (plain(x, head).float() - y).pow(2).mean().backward()
            for m, p in zip(masters, plain.parameters(), strict=True):
                m.grad = None if p.grad is None else p.grad.float()
            ref.step()
            with torch.no_grad():
                for m, p in zip(masters, plain.parameters(), strict=True):
                    p.copy_(m)
            plain.zero_grad()
            for (key, value), p in zip(
                wrapped.state_dict().items(), plain.state_dict().values(), strict=True
            ):
                assert torch.equal(value, p), f"step {step} ({head}): {key}"
        ours = dict(opt.state_dict()["state"].items())
        _assert_states_equal(ours, ref.state_dict()["state"], budgets)
