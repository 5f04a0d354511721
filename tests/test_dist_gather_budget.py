"""Gathered buffers charged to the device budget at N > 1 (issue 12 follow-up).

Two gloo ranks, one spawn: the floor a wrap reports (:mod:`swapper.zero.sharded.gather_budget`)
is probed with budgets of 1 byte and floor - 1 byte (refused on every rank with a
:class:`SwapConfigError` naming the module and the bytes to set), then a few steps are
trained at the floor and with an unlimited device budget: bit-identical, and the device
peak the manager reports counts the gathered buffers (at least the largest module's
buffer and staging) without passing the budget.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_ckpt_train import spawn, values
from torch import nn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig, Tier
from swapper.zero.config.distributed import DistributedConfig
from tiers.errors import SwapConfigError

pytestmark = pytest.mark.dist

VOCAB, CONTEXT, D, HIDDEN = 37, 8, 24, 400
BATCH, STEPS, LR = 8, 3, 1e-2
PG_TIMEOUT_S = 30.0


class Tiny(nn.Module):
    """Uneven sizes, a tied embedding/head (held through the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.fc1 = nn.Linear(D, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, D)
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        x = x + self.fc2(F.gelu(self.fc1(x)))
        return self.head(self.ln(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = Tiny()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.to(torch.bfloat16)


def _config(device_nbytes: int | None, method: str) -> OffloadConfig:
    return OffloadConfig(
        manager=OffloadConfig.create(
            device="cpu", device_nbytes=device_nbytes, timeout_s=20.0
        ).manager,
        step=StepConfig(sub_group_numel=1024, max_grad_norm=1.0),
        distributed=DistributedConfig(fetch_collective=method, timeout_s=PG_TIMEOUT_S),
    )


def _refusal(rank: int, device_nbytes: int, method: str) -> str:
    try:
        swapper.offload(_model(), _config(device_nbytes, method), dist.group.WORLD)
    except SwapConfigError as exc:
        return str(exc)
    raise AssertionError(f"rank {rank}: a device budget of {device_nbytes} B was accepted")


def _train(rank: int, world: int, device_nbytes: int | None, method: str) -> dict[str, Any]:
    model = _model()
    wrapped = swapper.offload(model, _config(device_nbytes, method), dist.group.WORLD)
    optimizer = OffloadAdamW(wrapped.parameters(), lr=LR, tiers=wrapped)
    g = torch.Generator().manual_seed(1)
    losses = []
    try:
        for _ in range(STEPS):
            tokens = torch.randint(0, VOCAB, (BATCH, CONTEXT + 1), generator=g)
            share = tokens[rank * BATCH // world : (rank + 1) * BATCH // world]
            logits = wrapped(share[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), share[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        device = wrapped.stats().tiers[Tier.DEVICE]
        budget = wrapped._budget  # type: ignore[attr-defined]
        return {
            "losses": losses,
            "params": {k: v.clone() for k, v in wrapped.state_dict().items()},
            "peak": device.peak_nbytes,
            "charged_after": budget.charged_nbytes,
        }
    finally:
        wrapped.close()  # type: ignore[operator]


def _need(message: str) -> int:
    found = re.search(r"raise device_nbytes to at least (\d+)", message)
    assert found, message
    return int(found.group(1))


def budgets(rank: int, world: int, tmp: str, method: str) -> dict[str, Any]:
    first = _refusal(rank, 1, method)
    floor = _need(first)
    below = _refusal(rank, floor - 1, method)
    return {
        "first": first,
        "floor": floor,
        "below": below,
        "at_floor": _train(rank, world, floor, method),
        "free": _train(rank, world, None, method),
    }


# -- harness (tests/dist_ckpt_train.py's) ------------------------------------------------


def _spawn(target: Callable[..., Any], world: int, tmp: Path, *args: Any) -> list[Any]:
    """Each rank's value of ``target(rank, world, str(tmp), *args)``."""
    return values(spawn(target, world, tmp, *args))


@pytest.mark.parametrize("method", ["all_gather", "all_reduce"])
def test_gathers_charged_to_the_device_budget(tmp_path: Path, method: str) -> None:
    results = _spawn(budgets, 2, tmp_path, method)
    buffer = (HIDDEN * D + HIDDEN) * 2  # fc1's gathered buffer, the largest (no padding)
    staging = buffer if method == "all_gather" else 0
    floors = {r["floor"] for r in results}
    assert len(floors) == 1, f"ranks disagree on the floor: {floors}"
    floor = floors.pop()
    assert floor >= buffer + staging
    for r, res in enumerate(results):
        for message in (res["first"], res["below"]):
            assert "module 'fc1'" in message, message
            assert f"at least {floor}" in message, message
        assert f"device budget of {floor - 1} bytes" in res["below"]
        at_floor, free = res["at_floor"], res["free"]
        assert at_floor["losses"] == free["losses"], f"rank {r}"
        # the peak counts the gathered buffers, and never passes the budget
        assert buffer + staging <= at_floor["peak"] <= floor, (r, at_floor["peak"], floor)
        assert free["peak"] >= buffer + staging, (r, free["peak"])
        assert at_floor["charged_after"] == free["charged_after"] == 0
    a, b = results[0]["at_floor"]["params"], results[0]["free"]["params"]
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs at the floor"
