"""swapper.step.clip: the global gradient norm and the clip coefficient, rounded as
``torch.nn.utils.clip_grad_norm_`` rounds them, so that training with ``max_grad_norm`` is
bit-identical to plain PyTorch (fp32 master copies, ``torch.optim.AdamW(fused=True)``,
``clip_grad_norm_`` on the fp32 gradients) — with ordinary parameters and with an offloaded
model under tight budgets (issue 15: the coefficient was computed in double, and runs
drifted from step 3-4).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig
from swapper.step.clip import clip_coefficient, grad_norm32, total_norm

ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
STEPS = 8
#: below the gradients' norm (about 0.3-1 here): every step clips
MAX_NORMS = [0.01, 0.25]


# -- the functions against torch's own -------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=3), min_size=1, max_size=6),
    max_norm=st.floats(1e-4, 10.0),
    scale=st.floats(1e-3, 10.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_norm_and_coefficient_equal_clip_grad_norm(
    shapes: list[list[int]], max_norm: float, scale: float, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    grads16 = [(torch.randn(s, generator=g) * scale).bfloat16() for s in shapes]
    masters = [torch.zeros(s, requires_grad=True) for s in shapes]
    for m, g16 in zip(masters, grads16, strict=True):
        m.grad = g16.float()
    expected_total = torch.nn.utils.clip_grad_norm_(masters, max_norm)

    total = total_norm(grad_norm32(grads16))
    assert total.dtype == torch.float32
    assert torch.equal(total, expected_total)
    factor = float(clip_coefficient(total, max_norm))
    for m, g16 in zip(masters, grads16, strict=True):
        ours = g16.float()
        if factor != 1.0:  # as OffloadAdamW: no multiply by exactly 1
            ours.mul_(factor)
        assert m.grad is not None
        assert torch.equal(ours, m.grad)


def test_empty_total_is_zero() -> None:
    assert grad_norm32([]) == []
    assert float(total_norm([])) == 0.0


# -- whole training runs against plain PyTorch ----------------------------------------------


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(48, 96),
        nn.GELU(),
        nn.LayerNorm(96),
        nn.Linear(96, 80),
        nn.GELU(),
        nn.Linear(80, 24),
    )
    return model.to(torch.bfloat16)


def _batches(micro: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [
        [
            (torch.randn(8, 48, generator=g).bfloat16(), torch.randn(8, 24, generator=g))
            for _ in range(micro)
        ]
        for _ in range(STEPS)
    ]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()


@dataclasses.dataclass
class Trained:
    params16: dict[str, torch.Tensor]
    #: master weights, exp_avg, exp_avg_sq: every parameter's, flat, end to end
    state: dict[str, torch.Tensor]


def _plain(data: list[list[tuple[torch.Tensor, torch.Tensor]]], max_norm: float) -> Trained:
    """The reference: fp32 masters, clip_grad_norm_ on their fp32 grads, fused AdamW."""
    model = _mlp()
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    optimizer = torch.optim.AdamW(masters, **ADAM, fused=True)  # type: ignore[arg-type]
    for micro_batches in data:
        for x, y in micro_batches:
            _loss(model, x, y).backward()
        for param, master in zip(params, masters, strict=True):
            assert param.grad is not None
            master.grad = param.grad.float()
            param.grad = None
        norm = torch.nn.utils.clip_grad_norm_(masters, max_norm)
        assert float(norm) > max_norm  # the step really clips
        optimizer.step()
        with torch.no_grad():
            for param, master in zip(params, masters, strict=True):
                param.copy_(master)
    state = {
        "master": torch.cat([m.reshape(-1) for m in masters]),
        **{
            row: torch.cat([optimizer.state[m][row].reshape(-1) for m in masters])
            for row in ("exp_avg", "exp_avg_sq")
        },
    }
    return Trained({k: v.detach().clone() for k, v in model.state_dict().items()}, state)


def _state(optimizer: OffloadAdamW) -> dict[str, torch.Tensor]:
    """OffloadAdamW's state, its sub-groups end to end (one param group)."""
    saved = optimizer.state_dict()["state"]
    parts = [saved[sg.index] for sg in optimizer.sub_groups]
    return {row: torch.cat([p[row] for p in parts]) for row in ("master", "exp_avg", "exp_avg_sq")}


def _assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype, name
        differing = int((actual[name] != value).sum())
        assert differing == 0, f"{name}: {differing} of {value.numel()} elements differ"


@pytest.mark.parametrize("max_norm", MAX_NORMS)
@pytest.mark.parametrize("micro", [1, 2], ids=["one-micro-step", "accumulate-2"])
def test_local_params_clipping_bit_identical_to_pytorch(
    tmp_path: Path, micro: int, max_norm: float
) -> None:
    data = _batches(micro)
    model = _mlp()
    config = StepConfig(sub_group_numel=1 << 20, max_grad_norm=max_norm)
    with OffloadAdamW(
        model.parameters(),
        **ADAM,
        tiers=swapper.ManagerConfig(device_nbytes=0, host_nbytes=None),
        config=config,
    ) as optimizer:
        for micro_batches in data:
            for x, y in micro_batches:
                _loss(model, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
        state = _state(optimizer)
    expected = _plain(data, max_norm)
    _assert_bitwise(state, expected.state)  # fp32: what bf16 rounding would hide
    _assert_bitwise(dict(model.state_dict()), expected.params16)


@pytest.mark.parametrize("max_norm", MAX_NORMS)
@pytest.mark.parametrize("micro", [1, 2], ids=["one-micro-step", "accumulate-2"])
def test_offloaded_clipping_bit_identical_to_pytorch(
    tmp_path: Path, micro: int, max_norm: float
) -> None:
    data = _batches(micro)
    config = OffloadConfig.create(
        nvme_dirs=[tmp_path / "nvme"],
        device="cpu",
        device_nbytes=40_000,  # about the largest module (96*80+80)*2 = 15 520 B, twice
        host_nbytes=200_000,  # less than params + grads + 12 B/param of state: spills
        step=StepConfig(sub_group_numel=4096, max_grad_norm=max_norm),
    )
    with (
        swapper.offload(_mlp(), config) as wrapped,
        OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as optimizer,
    ):
        for micro_batches in data:
            for x, y in micro_batches:
                _loss(wrapped, x, y).backward()
            optimizer.step()
            assert optimizer.last_step is not None and optimizer.last_step.grad_norm is not None
            assert optimizer.last_step.grad_norm > max_norm
            optimizer.zero_grad()
        state = _state(optimizer)
        params = wrapped.state_dict()
    expected = _plain(data, max_norm)
    _assert_bitwise(state, expected.state)  # fp32: what bf16 rounding would hide
    _assert_bitwise(params, expected.params16)
