"""swapper.zero.model.recompute: activation checkpointing (``torch.utils.checkpoint``) under
``swapper.offload`` (issue 15).

A checkpointed block's forward runs again inside the backward and the module hooks with it.
Non-reentrant checkpointing with early stop (torch's default) abandons that recompute
part-way by raising inside it: the modules it leaves must release what they fetched (was:
parameters left held, a 60 s ``BudgetTimeout`` under a tight device budget). Training with
checkpointing — non-reentrant with and without early stop, and reentrant — is
bit-identical to plain PyTorch with the same checkpointing (fp32 masters,
``torch.optim.AdamW(fused=True)``); a device budget that cannot hold what a recompute holds
fails at once with an error that says what to raise.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig, SwapConfigError, Tier
from swapper.zero.model.recompute import checkpointed_need

ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
STEPS = 4
D = 32
#: Block.up: (32 * 64 + 64) * 2 B; Block.down: (64 * 32 + 32) * 2 B
UP_NBYTES, DOWN_NBYTES = (D * 2 * D + 2 * D) * 2, (2 * D * D + D) * 2
#: a recompute of a block holds `down` (its backward waits) and `up` (recomputed)
RECOMPUTE_NBYTES = UP_NBYTES + DOWN_NBYTES
MODES = ["non-reentrant", "non-reentrant-no-early-stop", "reentrant"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    """Three residual blocks, each run through ``torch.utils.checkpoint`` (the block's
    own hooks inside the checkpoint, as transformers 4.x and most training code do)."""

    def __init__(self, mode: str | None) -> None:
        super().__init__()
        self.inp = nn.Linear(16, D)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.out = nn.Linear(D, 8)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.mode is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.mode == "reentrant")
        return self.out(h)


def _net(mode: str | None) -> Net:
    torch.manual_seed(0)
    return Net(mode).to(torch.bfloat16)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 16, generator=g).bfloat16(), torch.randn(8, 8, generator=g))
        for _ in range(STEPS)
    ]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()


def _plain(mode: str, data: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    model = _net(mode)
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    optimizer = torch.optim.AdamW(masters, **ADAM, fused=True)  # type: ignore[arg-type]
    for x, y in data:
        _loss(model, x, y).backward()
        for param, master in zip(params, masters, strict=True):
            assert param.grad is not None
            master.grad = param.grad.float()
            param.grad = None
        optimizer.step()
        with torch.no_grad():
            for param, master in zip(params, masters, strict=True):
                param.copy_(master)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _config(tmp_path: Path, device_nbytes: int) -> OffloadConfig:
    return OffloadConfig.create(
        nvme_dirs=[tmp_path / "nvme"],
        device="cpu",
        device_nbytes=device_nbytes,
        host_nbytes=60_000,  # < params + grads + 12 B/param of state: NVMe is used
        step=StepConfig(sub_group_numel=2048),
    )


#: device budgets: non-reentrant recomputes while a module's backward waits for it (two
#: modules held); reentrant recomputes the block before the backward of its modules (one)
BUDGETS = {
    "non-reentrant": RECOMPUTE_NBYTES,
    "non-reentrant-no-early-stop": RECOMPUTE_NBYTES,
    "reentrant": UP_NBYTES + 64,
}


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_training_bit_identical_to_pytorch(
    tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    data = _data()
    early_stop = mode != "non-reentrant-no-early-stop"
    with set_checkpoint_early_stop(early_stop):
        expected = _plain(mode, data)
        model = _net(mode)
        with (
            caplog.at_level(logging.WARNING, logger="swapper"),
            swapper.offload(model, _config(tmp_path, BUDGETS[mode])) as wrapped,
            OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as optimizer,  # type: ignore[arg-type]
        ):
            for x, y in data:
                _loss(wrapped, x, y).backward()
                # released by the backward itself, a recompute stopped early included
                assert all(slot.users == 0 for slot in wrapped.core.by_name.values())
                optimizer.step()
                optimizer.zero_grad()
            stats = wrapped.stats()
    assert not [r for r in caplog.records if "left by a failed pass" in r.getMessage()]
    assert stats.moved(Tier.HOST, Tier.NVME).nbytes > 0
    peak = stats.tiers[Tier.DEVICE].peak_nbytes
    assert peak is not None and peak <= BUDGETS[mode]
    actual = {k: v.detach() for k, v in model.state_dict().items()}
    assert list(actual) == list(expected)
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


@pytest.mark.parametrize("mode", ["non-reentrant", "non-reentrant-no-early-stop"])
def test_recompute_that_cannot_fit_fails_at_once(tmp_path: Path, mode: str) -> None:
    """Room for the largest module (accepted at wrap: the model does not say it is
    checkpointed), not for a non-reentrant recompute: a clear error at the fetch, not a
    timeout (was: BudgetTimeout after 60 s)."""
    x, y = _data()[0]
    with (
        set_checkpoint_early_stop(mode != "non-reentrant-no-early-stop"),
        swapper.offload(_net(mode), _config(tmp_path, UP_NBYTES + 64)) as wrapped,
    ):
        loss = _loss(wrapped, x, y)
        started = time.monotonic()
        with pytest.raises(SwapConfigError, match=rf"budget to at least {RECOMPUTE_NBYTES}\b"):
            loss.backward()
        assert time.monotonic() - started < 10  # (the budget's timeout is 60 s)
        wrapped.release_stale_holds()
        assert all(slot.users == 0 for slot in wrapped.core.by_name.values())
        wrapped.module.mode = None  # without checkpointing it fits
        _loss(wrapped, x, y).backward()


def test_checkpointed_need_counts_two_modules_of_a_flagged_layer() -> None:
    model = _net(None)
    nbytes = lambda p: p.numel() * p.element_size()  # noqa: E731
    assert checkpointed_need(model, nbytes) is None  # nothing says it is checkpointed
    for block in model.blocks:
        block.gradient_checkpointing = True  # as Hugging Face flags its layers
    model.gradient_checkpointing = True  # and the stack holding them (not innermost)
    need = checkpointed_need(model, nbytes)
    assert need is not None and need[0] == RECOMPUTE_NBYTES
    assert "'blocks.0.up'" in need[1] and "'blocks.0.down'" in need[1]
