"""At 2 gloo ranks, the device floor the wrap accepts for a Hugging Face model with
activation checkpointing on is a budget that never fails later in the backward (issue
27): Llama, GPT-2, Qwen2 and T5 (test_hf's tiny configs), non-reentrant and reentrant.
Each rank's floor is the one the wrap names when it refuses a budget of 1 byte; at that
budget two steps train on both ranks and each rank's device peak stays within it. Every
collective has a timeout (the process group's and ``DistributedConfig.timeout_s``).
Skipped without transformers.
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from test_dist_train import PG_TIMEOUT_S, _spawn  # noqa: E402
from test_hf import HOST_NBYTES, MODELS, VOCAB, _build, _loss  # noqa: E402

import swapper  # noqa: E402
from swapper import OffloadAdamW, OffloadConfig, StepConfig, SwapConfigError, Tier  # noqa: E402
from swapper.zero.config.distributed import DistributedConfig  # noqa: E402

pytestmark = pytest.mark.dist

WORLD = 2
CHECKPOINTING = ("non-reentrant", "reentrant")


def _config(tmp: str, device_nbytes: int) -> OffloadConfig:
    return OffloadConfig(
        manager=OffloadConfig.create(
            nvme_dirs=[tmp],
            device="cpu",
            device_nbytes=device_nbytes,
            host_nbytes=HOST_NBYTES,
            timeout_s=20.0,
        ).manager,
        step=StepConfig(sub_group_numel=4096),
        distributed=DistributedConfig(timeout_s=PG_TIMEOUT_S),
    )


def _floor(kind: str, checkpointing: str, tmp: str) -> int:
    """The smallest device budget the wrap accepts (each refusal names the next)."""
    budget = 1
    for attempt in range(10):
        model = _build(kind, checkpointing)
        try:
            config = _config(os.path.join(tmp, f"floor{attempt}"), budget)
            swapper.offload(model, config, dist.group.WORLD).close()
            return budget
        except SwapConfigError as exc:
            found = re.search(r"at least (\d+)", str(exc))
            if found is None:
                raise
            budget = int(found.group(1))
    raise AssertionError("no floor after 10 refusals")


def train_at_floors(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Per (model, checkpointing): the floor, each step's loss and the device peak; or
    the error a step raised."""
    out: dict[str, Any] = {}
    for kind in MODELS:
        for checkpointing in CHECKPOINTING:
            case = f"{kind}/{checkpointing}"
            where = os.path.join(tmp, case.replace("/", "-"))
            floor = _floor(kind, checkpointing, where)
            model = _build(kind, checkpointing)
            generator = torch.Generator().manual_seed(1)
            losses: list[float] = []
            try:
                with (
                    swapper.offload(
                        model, _config(os.path.join(where, "run"), floor), dist.group.WORLD
                    ) as wrapped,
                    OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
                ):
                    for _ in range(2):
                        ids = torch.randint(0, VOCAB, (2 * world, 8), generator=generator)
                        loss = _loss(wrapped, kind, ids[rank * 2 : rank * 2 + 2])
                        loss.backward()
                        optimizer.step()
                        optimizer.zero_grad()
                        losses.append(loss.item())
                    peak = wrapped.stats().tiers[Tier.DEVICE].peak_nbytes
                out[case] = {"floor": floor, "losses": losses, "peak": peak}
            except Exception as exc:  # (a budget the wrap accepted failing later)
                out[case] = {"floor": floor, "error": f"{type(exc).__name__}: {exc}"}
                return out  # (the ranks' collectives may be out of step now: stop)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(train_at_floors, WORLD, tmp_path_factory.mktemp("hf-floor"), join_s=540.0)


@pytest.mark.parametrize("checkpointing", CHECKPOINTING)
@pytest.mark.parametrize("kind", list(MODELS))
def test_two_ranks_a_budget_the_wrap_accepts_trains(
    kind: str, checkpointing: str, results: list[dict[str, Any]]
) -> None:
    for rank, out in enumerate(results):
        run = out[f"{kind}/{checkpointing}"]
        assert "error" not in run, f"rank {rank}: {run.get('error')}"
        assert len(run["losses"]) == 2 and all(v == v for v in run["losses"])
        assert run["peak"] is not None and 0 < run["peak"] <= run["floor"]
