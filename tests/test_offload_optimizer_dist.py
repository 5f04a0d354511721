"""``OffloadOptimizer`` over a model sharded across 2 gloo ranks (issue 26): tight budgets
bit-identical to unlimited ones, and within the multi-rank tolerance of one process (the
recipe and the model of tests/test_dist_train.py, whose spawn and deadline it reuses)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_dist_train import ABS_TOL, BATCH, LR, STEPS, VOCAB, _batches, _config, _model, _spawn

import swapper
from swapper import OffloadOptimizer, Tier
from swapper.step import UnsupportedOptimizerError

pytestmark = pytest.mark.dist

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": LR}),
}


def train(rank: int, world: int, tmp: str, name: str, tight: bool) -> dict[str, Any]:
    cls, kwargs = OPTIMIZERS[name]
    group = dist.group.WORLD if world > 1 else None
    variant = {"name": f"{name}-{'tight' if tight else 'free'}", "tight": tight}
    wrapped = swapper.offload(_model(), _config(tmp, variant), group)
    optimizer = OffloadOptimizer(cls, wrapped.parameters(), tiers=wrapped, **kwargs)
    losses: list[float] = []
    try:
        for tokens in _batches():
            share = tokens[rank * BATCH // world : (rank + 1) * BATCH // world]
            logits = wrapped(share[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), share[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        return {
            "losses": losses,
            "params": {k: v.clone() for k, v in wrapped.state_dict().items()},
            "nvme_read": wrapped.stats().moved(Tier.NVME, Tier.HOST).nbytes,
        }
    finally:
        optimizer.close()
        wrapped.close()


def adafactor(rank: int, world: int, tmp: str) -> str:
    wrapped = swapper.offload(_model(), _config(tmp, {"name": "ada"}), dist.group.WORLD)
    try:
        OffloadOptimizer(torch.optim.Adafactor, wrapped.parameters(), tiers=wrapped)
    except UnsupportedOptimizerError as exc:
        return str(exc)
    finally:
        wrapped.close()
    return "accepted"


def test_not_elementwise_over_ranks_is_refused(tmp_path: Path) -> None:
    """Each rank holds shards: Adafactor's row and column means need whole parameters."""
    for message in _spawn(adafactor, 2, tmp_path):
        assert "Adafactor is not element-wise" in message


def both(rank: int, world: int, tmp: str, name: str) -> list[dict[str, Any]]:
    return [train(rank, world, tmp, name, tight) for tight in (True, False)]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_two_ranks_tight_equals_free_and_close_to_one_process(tmp_path: Path, name: str) -> None:
    tight, free = zip(*_spawn(both, 2, tmp_path / "ranks", name), strict=True)
    single = train(0, 1, str(tmp_path / "one"), name, False)
    assert all(r["nvme_read"] > 0 for r in tight)  # the state streamed on every rank
    for a, b in zip(tight, free, strict=True):
        assert a["losses"] == b["losses"]
    assert tight[0]["params"].keys() == free[0]["params"].keys() == single["params"].keys()
    for key, value in free[0]["params"].items():
        assert torch.equal(tight[0]["params"][key], value), key
        diff = float((value.float() - single["params"][key].float()).abs().max())
        assert diff <= ABS_TOL, f"{key}: max |diff| {diff} over 2 ranks vs one process"
    mean = [sum(r["losses"][i] for r in free) / 2 for i in range(STEPS)]
    assert mean == pytest.approx(single["losses"], abs=0.01)
