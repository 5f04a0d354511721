"""Frozen parameters at 2 gloo ranks (swapper.zero.model.frozen through swapper.zero.sharded;
issue 27): the hand-written LoRA model of test_frozen trains with each rank's device
budget at a quarter of the whole model's 16-bit bytes, bit-identical to unlimited budgets
at the same ranks and close to one plain PyTorch process (the tolerance of
test_dist_train: the ranks' mean gradients are summed in another order): a frozen
module's gathered buffer is released after its backward, not at the end of the whole
backward.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_dist_train import PG_TIMEOUT_S, _spawn
from test_frozen import (
    BATCH,
    BETAS,
    DEVICE_NBYTES,
    EPS,
    LR,
    SUB_GROUP_NUMEL,
    WEIGHT_DECAY,
    _data,
    _loss,
    _net,
    _train_plain,
)

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig, Tier
from swapper.zero.config.distributed import DistributedConfig

pytestmark = pytest.mark.dist

WORLD = 2
CKPT = ("none", "non-reentrant", "reentrant")
ABS_TOL = 4 * LR  # as test_dist_train: an ulp of a mean can become an lr-sized step


def _config(tmp: str, name: str, tight: bool) -> OffloadConfig:
    settings: dict[str, Any] = {}
    if tight:
        settings = {
            "device_nbytes": DEVICE_NBYTES,
            "host_nbytes": 60_000,
            "timeout_s": 20.0,
            "nvme_dirs": [os.path.join(tmp, name)],
        }
    return OffloadConfig(
        manager=OffloadConfig.create(device="cpu", **settings).manager,
        step=StepConfig(sub_group_numel=SUB_GROUP_NUMEL),
        # all_reduce: no staging buffer beside the gathered one (a quarter budget)
        distributed=DistributedConfig(fetch_collective="all_reduce", timeout_s=PG_TIMEOUT_S),
    )


def train(rank: int, world: int, tmp: str, name: str, tight: bool, ckpt: str) -> dict[str, Any]:
    model = _net(ckpt)
    wrapped = swapper.offload(model, _config(tmp, name, tight), dist.group.WORLD)
    optimizer = OffloadAdamW(
        wrapped.parameters(),
        lr=LR,
        betas=BETAS,
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
        tiers=wrapped,
    )
    share = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    steps = [lambda x=x, y=y: _loss(wrapped(x[share]), y[share]) for x, y in _data()]
    return run_steps(wrapped, optimizer, steps)


def run_steps(
    wrapped: Any, optimizer: OffloadAdamW, steps: Iterable[Callable[[], torch.Tensor]]
) -> dict[str, Any]:
    """Each step's loss backpropagated, the optimizer stepped; then :func:`summary`; the
    optimizer and the wrap closed however it ends."""
    losses = []
    try:
        for compute in steps:
            loss = compute()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        return summary(wrapped, optimizer, losses)
    finally:
        optimizer.close()
        wrapped.close()


def summary(wrapped: Any, optimizer: OffloadAdamW, losses: list[float]) -> dict[str, Any]:
    """What a rank's run gives the parent: losses, weights, device peak, the optimizer's
    elements, the NVMe bytes read."""
    stats = wrapped.stats()
    return {
        "losses": losses,
        "params": {k: v.clone() for k, v in wrapped.state_dict().items()},
        "device_peak": stats.tiers[Tier.DEVICE].peak_nbytes,
        "optimizer_numel": sum(sg.numel for sg in optimizer.sub_groups),
        "nvme_read": stats.moved(Tier.NVME, Tier.HOST).nbytes,
    }


def run_all(rank: int, world: int, tmp: str) -> dict[str, Any]:
    return {
        f"{ckpt}/{'tight' if tight else 'free'}": train(
            rank, world, tmp, f"{ckpt}-{tight}", tight, ckpt
        )
        for ckpt in CKPT
        for tight in (True, False)
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(run_all, WORLD, tmp_path_factory.mktemp("frozen2"), join_s=300.0)


# Non-reentrant checkpointing failed here until 2026-11-28 (a CheckpointError: the
# recompute's saved frozen weights had shape [0]; swapper.zero.model.saved says why).
@pytest.mark.parametrize("ckpt", CKPT)
def test_two_ranks_frozen_base_quarter_budget(ckpt: str, results: list[dict[str, Any]]) -> None:
    tight = [r[f"{ckpt}/tight"] for r in results]
    free = [r[f"{ckpt}/free"] for r in results]
    for rank in range(WORLD):
        # within the budget, bit-identical to unlimited budgets at the same ranks
        assert tight[rank]["losses"] == free[rank]["losses"]
        peak = tight[rank]["device_peak"]
        assert peak is not None and 0 < peak <= DEVICE_NBYTES
    for a, b in zip(tight[0]["params"].values(), free[0]["params"].values(), strict=True):
        assert torch.equal(a, b)
    # the optimizer holds the trainable parameters' shards only (frozen: none)
    trainable = sum(p.numel() for p in _net().parameters() if p.requires_grad)
    assert trainable <= sum(r["optimizer_numel"] for r in tight) < 2 * trainable
    # the base went to NVMe and was read back from there on both ranks
    assert all(r["nvme_read"] > 0 for r in tight)
    # close to one plain PyTorch process (fp32 masters of the trainable parameters)
    plain = _train_plain(ckpt)
    mean = [sum(r["losses"][i] for r in tight) / WORLD for i in range(len(plain.losses))]
    torch.testing.assert_close(mean, plain.losses, rtol=0.0, atol=0.01)
    for name, expected in plain.params.items():
        actual = tight[0]["params"][name]
        if "lora_" not in name:
            assert torch.equal(actual, expected), f"frozen {name} changed"
        torch.testing.assert_close(actual.float(), expected.float(), rtol=0.0, atol=ABS_TOL)
