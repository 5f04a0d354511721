"""Hugging Face PEFT (LoRA) at 2 gloo ranks (issue 27): the tiny random Llama of
test_peft with bf16 adapters (``get_peft_model(..., autocast_adapter_dtype=False)``) and
HF's non-reentrant gradient checkpointing on (enabled before the wrap, as
``swapper.hf.Trainer`` does), each rank's device budget a quarter of the whole model's
16-bit bytes and a small host budget (the base on NVMe): 10 steps bit-identical to
unlimited budgets at the same ranks, and close to one plain PyTorch process (the
tolerance of test_dist_train and test_dist_frozen: the ranks' mean gradients are summed
in another order). Every collective has a timeout (the process group's and
``DistributedConfig.timeout_s``).

Needs ``transformers`` and ``peft``; skipped without them.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("transformers")
pytest.importorskip("peft")

from test_dist_frozen import run_steps
from test_dist_train import PG_TIMEOUT_S, _spawn
from test_peft import ADAM, DEVICE_NBYTES, _batches, _lora, _train_plain

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig
from swapper.zero.config.distributed import DistributedConfig

pytestmark = pytest.mark.dist

WORLD = 2
ABS_TOL = 4 * float(ADAM["lr"])  # (test_dist_train: an ulp of a mean, an lr-sized step)


def _checkpointed() -> nn.Module:
    """test_peft's LoRA model (bf16 adapters), HF's non-reentrant checkpointing on."""
    model = _lora()
    inner = model.base_model.model  # type: ignore[union-attr]
    inner.gradient_checkpointing_enable(  # type: ignore[operator]
        gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    return model.train()


def _config(tmp: str, tight: bool) -> OffloadConfig:
    settings: dict[str, Any] = {}
    if tight:
        settings = {
            "device_nbytes": DEVICE_NBYTES,
            "host_nbytes": 160_000,  # < a rank's share of the base: on NVMe
            "timeout_s": 20.0,
            "nvme_dirs": [os.path.join(tmp, "nvme")],
        }
    return OffloadConfig(
        manager=OffloadConfig.create(device="cpu", **settings).manager,
        step=StepConfig(sub_group_numel=4096),
        distributed=DistributedConfig(fetch_collective="all_reduce", timeout_s=PG_TIMEOUT_S),
    )


def train(rank: int, world: int, tmp: str, tight: bool) -> dict[str, Any]:
    model = _checkpointed()
    config = _config(os.path.join(tmp, str(tight)), tight)
    wrapped = swapper.offload(model, config, dist.group.WORLD)
    optimizer = OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped)
    shares = [ids[rank * len(ids) // world : (rank + 1) * len(ids) // world] for ids in _batches()]
    steps = [lambda ids=ids: wrapped(input_ids=ids, labels=ids).loss for ids in shares]
    return run_steps(wrapped, optimizer, steps)


def run_both(rank: int, world: int, tmp: str) -> dict[str, Any]:
    return {"tight": train(rank, world, tmp, True), "free": train(rank, world, tmp, False)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(run_both, WORLD, tmp_path_factory.mktemp("peft2"), join_s=420.0)


def test_two_ranks_peft_lora_with_checkpointing_quarter_budget(
    results: list[dict[str, Any]],
) -> None:
    tight = [r["tight"] for r in results]
    free = [r["free"] for r in results]
    for rank in range(WORLD):
        # within the budget, bit-identical to unlimited budgets at the same ranks
        assert tight[rank]["losses"] == free[rank]["losses"]
        peak = tight[rank]["device_peak"]
        assert peak is not None and 0 < peak <= DEVICE_NBYTES
    assert list(tight[0]["params"]) == list(free[0]["params"])
    for name, value in tight[0]["params"].items():
        assert torch.equal(value, free[0]["params"][name]), name
    # the optimizer holds the adapters' shards only (the frozen base: none)
    trainable = sum(p.numel() for p in _lora().parameters() if p.requires_grad)
    assert trainable <= sum(r["optimizer_numel"] for r in tight) < 2 * trainable
    assert all(r["nvme_read"] > 0 for r in tight)  # the base came back from NVMe
    # close to one plain PyTorch process (fp32 masters of the adapters)
    plain_model = _checkpointed()
    plain = _train_plain(plain_model)
    mean = [sum(r["losses"][i] for r in tight) / WORLD for i in range(len(plain))]
    assert len(set(plain)) > 1  # it trains
    torch.testing.assert_close(mean, plain, rtol=0.0, atol=0.01)
    expected = plain_model.state_dict()
    assert list(expected) == list(tight[0]["params"])
    for name, value in expected.items():
        actual = tight[0]["params"][name]
        if "lora_" not in name:
            assert torch.equal(actual, value), f"frozen {name} changed"
        torch.testing.assert_close(actual.float(), value.float(), rtol=0.0, atol=ABS_TOL)
