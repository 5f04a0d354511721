"""Gradients the optimizer step has read whole are dropped, not written to NVMe (issue 24).

Under a host budget the step's optimizer state needs room; before, a retained gradient the
step had already read was a victim like any other and was written to NVMe (durably) only
to be unregistered by ``zero_grad``. Now the step unregisters it as soon as every
sub-group holding a piece of it has been computed (``TieredParams.consumed``); the run's
results are unchanged, and using such a gradient again before ``zero_grad`` (a second
``step()``, a backward adding into it) raises :class:`ConsumedGradError` naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import swapper
from swapper import Kind, OffloadAdamW, OffloadConfig, StepConfig, Tier
from swapper.zero.local.params import ConsumedGradError

IN, HIDDEN = 64, 128
SUB_GROUP_NUMEL = 2048  # several sub-groups, boundaries inside the parameters


def _mlp() -> nn.Sequential:
    model = nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, IN),
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.to(torch.bfloat16)


def _config(tmp_path: Path | None, *, overlap: bool = False) -> OffloadConfig:
    step = StepConfig(sub_group_numel=SUB_GROUP_NUMEL, overlap=overlap, max_grad_norm=1.0)
    if tmp_path is None:
        return OffloadConfig.create(device="cpu", step=step)
    return OffloadConfig.create(
        nvme_dirs=[tmp_path / "nvme"],
        device="cpu",
        device_nbytes=40_000,
        host_nbytes=120_000,  # < 16-bit params + grads + the optimizer state
        step=step,
    )


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(8, IN, generator=generator).bfloat16(),
            torch.randn(8, IN, generator=generator),
        )
        for _ in range(steps)
    ]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()


def _grad_keys(wrapped: swapper.OffloadedModel) -> list[str]:
    keys = wrapped.manager.keys()  # (a TierManager is not iterable)
    return [key for key in keys if key.startswith("grad/")]


def _train(
    config: OffloadConfig, steps: int
) -> tuple[list[float], dict[str, torch.Tensor], list[list[str]], int]:
    """Losses, final weights, the gradient keys registered after each step (before its
    zero_grad), and the gradient bytes written to NVMe."""
    losses: list[float] = []
    after_step: list[list[str]] = []
    with (
        swapper.offload(_mlp(), config) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        for x, y in _data(steps):
            loss = _loss(wrapped, x, y)
            loss.backward()
            optimizer.step()
            optimizer.wait_pending()
            after_step.append(_grad_keys(wrapped))
            optimizer.zero_grad()
            losses.append(loss.item())
        written = wrapped.stats().moved_nbytes(Kind.GRAD16, Tier.HOST, Tier.NVME)
        return losses, wrapped.state_dict(), after_step, written


@pytest.mark.parametrize("overlap", [False, True])
def test_consumed_gradients_are_dropped_and_training_is_unchanged(
    overlap: bool, tmp_path: Path
) -> None:
    losses, weights, after_step, _ = _train(_config(tmp_path, overlap=overlap), 4)
    free_losses, free_weights, _, _ = _train(_config(None), 4)

    assert losses == free_losses and len(set(losses)) > 1
    assert list(weights) == list(free_weights)
    for name, tensor in weights.items():
        assert torch.equal(tensor, free_weights[name]), name
    # budgeted: every gradient was read whole by the step and dropped before zero_grad
    # (before the change all 6 stayed registered, and were written when evicted)
    assert after_step == [[]] * 4


def test_a_consumed_gradient_is_not_read_again_before_zero_grad(tmp_path: Path) -> None:
    (x, y), (x2, y2) = _data(2)
    with (
        swapper.offload(_mlp(), _config(tmp_path)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        _loss(wrapped, x, y).backward()
        optimizer.step()
        # a second step on the same gradients: PyTorch would apply them again; they are
        # gone, and it says so (naming a parameter) instead of stepping with zeros
        with pytest.raises(
            ConsumedGradError,
            match=r"step\(\) would read the gradient of parameter '\d\.(weight|bias)'.*zero_grad",
        ):
            optimizer.step()
        # a backward that would add into them: refused alike, nothing changed
        with pytest.raises(ConsumedGradError, match="a backward adds into"):
            _loss(wrapped, x2, y2).backward()
        wrapped.release_stale_holds(warn=False)
        optimizer.zero_grad()
        assert not _grad_keys(wrapped)
        _loss(wrapped, x2, y2).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_dropping_writes_fewer_gradient_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from swapper.zero.local.tiered import TieredParams

    _, weights, _, written = _train(_config(tmp_path / "a"), 3)
    monkeypatch.setattr(TieredParams, "consumed", lambda self, params: None)
    _, kept_weights, kept_after, kept_written = _train(_config(tmp_path / "b"), 3)

    assert all(torch.equal(weights[n], kept_weights[n]) for n in weights)
    assert all(len(keys) == 6 for keys in kept_after)  # (the old behaviour)
    assert written < kept_written
