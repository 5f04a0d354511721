"""Hugging Face PEFT (LoRA) at 2 gloo ranks (issue 27): the tiny random Llama of
test_peft, with bf16 adapters (``get_peft_model(..., autocast_adapter_dtype=False)``) and
with PEFT's default fp32 adapters over the bf16 base (``autocast_adapter_dtype=True``:
each fp32 adapter its own master, its fp32 gradient reduce-scattered in fp32 and retained
in memory, never on NVMe), HF's non-reentrant gradient checkpointing on (enabled before the wrap, as
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
from pathlib import Path
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
from test_peft import ADAM, DEVICE_NBYTES, _batches, _lora, _lora32, _train_plain

import swapper
from swapper import Kind, OffloadAdamW, OffloadConfig, StepConfig, SwapConfigError
from swapper.zero.config.distributed import DistributedConfig
from swapper.zero.model.frozen import TrainableSetChanged

pytestmark = pytest.mark.dist

WORLD = 2
ABS_TOL = 4 * float(ADAM["lr"])  # (test_dist_train: an ulp of a mean, an lr-sized step)
ADAPTERS = ("bf16", "fp32")
HOST_NBYTES = 160_000  # < a rank's share of the base: on NVMe


def _checkpointed(adapters: str) -> nn.Module:
    """test_peft's LoRA model (``adapters``: bf16, or PEFT's default fp32 over the bf16
    base), HF's non-reentrant checkpointing on."""
    model = _lora() if adapters == "bf16" else _lora32()
    inner = model.base_model.model  # type: ignore[union-attr]
    inner.gradient_checkpointing_enable(  # type: ignore[operator]
        gradient_checkpointing_kwargs={"use_reentrant": False}
    )
    return model.train()


def _fp32_grad_nbytes(model: nn.Module) -> int:
    """Host bytes of the fp32 trainable parameters' gradients (kept in memory, never on
    NVMe; each a host block, 4 KiB-aligned): the host budget makes room for all of them
    (a rank retains only its shards)."""
    return sum(
        -(-p.numel() * 4 // 4096) * 4096
        for p in model.parameters()
        if p.requires_grad and p.dtype == torch.float32
    )


def _config(tmp: str, host_nbytes: int | None) -> OffloadConfig:
    """Each rank's budgets: ``host_nbytes`` None: unlimited; else that host budget, the
    quarter device budget, NVMe under ``tmp``."""
    settings: dict[str, Any] = {}
    if host_nbytes is not None:
        settings = {
            "device_nbytes": DEVICE_NBYTES,
            "host_nbytes": host_nbytes,
            "timeout_s": 20.0,
            "nvme_dirs": [os.path.join(tmp, "nvme")],
        }
    return OffloadConfig(
        manager=OffloadConfig.create(device="cpu", **settings).manager,
        step=StepConfig(sub_group_numel=4096),
        distributed=DistributedConfig(fetch_collective="all_reduce", timeout_s=PG_TIMEOUT_S),
    )


def train(rank: int, world: int, tmp: str, tight: bool, adapters: str) -> dict[str, Any]:
    model = _checkpointed(adapters)
    host = HOST_NBYTES + _fp32_grad_nbytes(model) if tight else None
    config = _config(os.path.join(tmp, str(tight)), host)
    wrapped = swapper.offload(model, config, dist.group.WORLD)
    optimizer = OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped)
    manager = wrapped.manager
    grad_kinds: set[str] = set()  # of the gradients retained after each backward
    written: set[str] = set()  # keys released as modified (a frozen one: never)
    release = manager.release

    def spy(key: str, *, modified: bool = True, cold: bool = False) -> None:
        if modified:
            written.add(key)
        release(key, modified=modified, cold=cold)

    def note_grads() -> None:
        keys = manager.keys()  # (a TierManager is not iterable)
        grad_kinds.update(manager.info(k).kind.value for k in keys if k.startswith("grad/"))

    manager.release = spy  # type: ignore[method-assign]
    shares = [ids[rank * len(ids) // world : (rank + 1) * len(ids) // world] for ids in _batches()]
    steps = [lambda ids=ids: wrapped(input_ids=ids, labels=ids).loss for ids in shares]
    out = run_steps(wrapped, optimizer, steps, after_backward=note_grads)
    return {**out, "grad_kinds": grad_kinds, "written": written}


def run_both(rank: int, world: int, tmp: str, adapters: str) -> dict[str, Any]:
    return {
        "tight": train(rank, world, tmp, True, adapters),
        "free": train(rank, world, tmp, False, adapters),
    }


@pytest.fixture(scope="module", params=ADAPTERS)
def results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[dict[str, Any]]]:
    adapters = str(request.param)
    ranks = _spawn(
        run_both, WORLD, tmp_path_factory.mktemp(f"peft-{adapters}"), adapters, join_s=420.0
    )
    return adapters, ranks


def test_two_ranks_peft_lora_with_checkpointing_quarter_budget(
    results: tuple[str, list[dict[str, Any]]],
) -> None:
    adapters, ranks = results
    tight = [r["tight"] for r in ranks]
    free = [r["free"] for r in ranks]
    for rank in range(WORLD):
        # within the budget, bit-identical to unlimited budgets at the same ranks
        assert tight[rank]["losses"] == free[rank]["losses"]
        peak = tight[rank]["device_peak"]
        assert peak is not None and 0 < peak <= DEVICE_NBYTES
    assert list(tight[0]["params"]) == list(free[0]["params"])
    for name, value in tight[0]["params"].items():
        assert torch.equal(value, free[0]["params"][name]), name
        fp32 = adapters == "fp32" and "lora_" in name  # (trained in their own dtype)
        assert value.dtype == (torch.float32 if fp32 else torch.bfloat16), name
    # the optimizer holds the adapters' shards only (the frozen base: none)
    trainable = sum(p.numel() for p in _lora().parameters() if p.requires_grad)
    assert trainable <= sum(r["optimizer_numel"] for r in tight) < 2 * trainable
    assert all(r["nvme_read"] > 0 for r in tight)  # the base came back from NVMe
    # the gradients retained in the adapters' dtype; fp32 ones never on NVMe
    kind = Kind.GRAD16 if adapters == "bf16" else Kind.GRAD32
    assert all(r["grad_kinds"] == {kind.value} and r["grad32_nvme"] == 0 for r in tight)
    frozen = {f"param/{n}" for n, p in _lora().named_parameters() if not p.requires_grad}
    assert all(not r["written"] & frozen for r in tight)  # the base is only read
    # close to one plain PyTorch process (fp32 masters of the adapters; fp32 adapters
    # their own masters)
    plain_model = _checkpointed(adapters)
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


def wrap_refused(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Wrap PEFT's default fp32 adapters at 2 ranks under a host budget below their
    gradient shards (as the host charges them): the error, and whether anything moved."""
    model = _checkpointed("fp32")
    config = _config(os.path.join(tmp, "refused"), 3 * 4096)  # < a rank's 28 gradients
    try:
        swapper.offload(model, config, dist.group.WORLD).close()
    except SwapConfigError as exc:
        return {"message": str(exc), "moved": any(p.numel() == 0 for p in model.parameters())}
    return {"message": None}


def test_two_ranks_fp32_gradients_that_do_not_fit_are_refused_at_wrap(
    tmp_path: Path,
) -> None:
    """fp32 gradient shards stay in memory (never on NVMe): a host budget that cannot
    hold this rank's, counted as the host charges them (4 KiB blocks), is refused on
    every rank at the wrap, naming an adapter, before anything moves."""
    for out in _spawn(wrap_refused, WORLD, tmp_path, join_s=120.0):
        message = out["message"]
        assert message is not None and "fp32 trainable" in message and "lora_" in message
        assert "never on NVMe" in message and "host" in message
        assert not out["moved"]


def bad_inputs(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """At 2 ranks: a PEFT model converted to fp32 entirely, and a frozen base weight made
    trainable after the wrap: each error, and whether anything had moved."""
    out: dict[str, Any] = {}
    whole = _lora32().float()
    try:
        swapper.offload(whole, _config(os.path.join(tmp, "fp32"), None), dist.group.WORLD)
        out["fp32"] = None
    except SwapConfigError as exc:
        out["fp32"] = str(exc)
        out["fp32_moved"] = any(p.numel() == 0 for p in whole.parameters())
    model = _checkpointed("bf16")
    wrapped = swapper.offload(model, _config(os.path.join(tmp, "toggle"), None), dist.group.WORLD)
    try:
        name, param = next((n, p) for n, p in model.named_parameters() if "q_proj.base" in n)
        param.requires_grad_(True)
        ids = _batches()[0][rank : rank + 1]
        try:
            wrapped(input_ids=ids, labels=ids)
            out["toggle"] = None
        except TrainableSetChanged as exc:
            out["toggle"], out["toggled"] = str(exc), name
        out["held"] = wrapped.core.holds.held_nbytes
    finally:
        wrapped.close()
    return out


def test_two_ranks_bad_inputs_are_refused_naming_them(tmp_path: Path) -> None:
    """A model converted to fp32 entirely is refused at the wrap on every rank before
    anything moves; ``requires_grad`` toggled after the wrap is refused at the next
    forward on every rank, naming the parameter, with nothing held."""
    for out in _spawn(bad_inputs, WORLD, tmp_path, join_s=180.0):
        assert out["fp32"] is not None and "float32" in out["fp32"], out["fp32"]
        assert "only beside a 16-bit base" in out["fp32"] and not out["fp32_moved"]
        assert out["toggle"] is not None and repr(out["toggled"]) in out["toggle"]
        assert out["held"] == 0
