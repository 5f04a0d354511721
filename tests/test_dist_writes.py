"""Sharded models (issue 12): writes outside the hooks, dtype refusals, contiguous
ownership and the measured backward offload (:mod:`swapper.zero.sharded.writes`,
:func:`swapper.zero.sharded.setup.dtype_refusal`, ``DistributedConfig.ownership``,
:attr:`swapper.zero.sharded.grads.GradReducer.trace`).

The multi-process tests spawn 2 gloo ranks with the harness and tiny model of
``tests/test_dist_train.py`` (a timeout on the process group and on every collective;
each spawn joined with its own deadline, so a hang fails in seconds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_dist_train import BATCH, PG_TIMEOUT_S, VOCAB, _batches, _model, _same, _spawn
from torch import nn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig
from swapper.distributed import ParamInfo, plan_contiguous, plan_partition, plan_windows
from swapper.zero.config.distributed import DistributedConfig
from swapper.zero.sharded.setup import dtype_refusal, module_dtype_refusal
from tiers.errors import SwapConfigError

pytestmark = pytest.mark.dist


def _config(tmp: str, name: str, **distributed: Any) -> OffloadConfig:
    return OffloadConfig.create(
        device="cpu",
        host_nbytes=48_000,  # below each rank's gradients: some go to NVMe
        nvme_dirs=[Path(tmp, name)],
        step=StepConfig(sub_group_numel=1024),
        distributed=DistributedConfig(timeout_s=PG_TIMEOUT_S, **distributed),
    )


def _step(wrapped: Any, optimizer: Any, tokens: torch.Tensor, rank: int, world: int) -> None:
    share = tokens[rank * BATCH // world : (rank + 1) * BATCH // world]
    logits = wrapped(share[:, :-1])
    F.cross_entropy(logits.float().reshape(-1, VOCAB), share[:, 1:].reshape(-1)).backward()
    optimizer.step()
    optimizer.zero_grad()


# -- writes outside the hooks ------------------------------------------------------------


def writes(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Writes outside the hooks, on one rank and on every rank; what each rank saw."""
    seen: dict[str, Any] = {}
    model = _model()
    with swapper.offload(model, _config(tmp, "writes"), dist.group.WORLD) as wrapped:
        optimizer = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
        data = _batches()
        _step(wrapped, optimizer, data[0], rank, world)
        before = wrapped.state_dict()  # no write yet: no error
        if rank == 1:
            torch.nn.init.zeros_(model.fc1.weight)  # on the parameter: its own counter
        try:
            _step(wrapped, optimizer, data[1], rank, world)
            seen["one_rank"] = "no error"
        except Exception as exc:
            seen["one_rank"] = type(exc).__name__
            seen["one_rank_message"] = str(exc)
        optimizer.zero_grad()
        seen["unchanged"] = wrapped.state_dict()  # raised once; the tiers' values kept
        seen["before"] = before
        model.fc2.weight.data.normal_()  # through .data, on every rank: the placeholder
        try:
            wrapped.state_dict()
            seen["every_rank"] = "no error"
        except Exception as exc:
            seen["every_rank"] = type(exc).__name__
            seen["every_rank_message"] = str(exc)
        _step(wrapped, optimizer, data[1], rank, world)  # and training goes on
        seen["trained"] = True
        optimizer.close()
    seen["class"] = type(model.fc1.weight).__name__  # given back when closed
    return seen


def test_writes_outside_the_hooks_raise_on_every_rank(tmp_path: Path) -> None:
    seen = _spawn(writes, 2, tmp_path, join_s=60.0)
    assert [s["one_rank"] for s in seen] == ["PeerFailedError", "OffloadedWriteError"]
    assert "rank(s) [1]" in seen[0]["one_rank_message"]
    message = seen[1]["one_rank_message"]
    assert "'fc1.weight'" in message and "on rank 1" in message and "fc2" not in message
    assert "load_sharded_state_dict" in message
    _same(seen[0]["unchanged"], seen[0]["before"])  # the write was lost, and said so
    assert [s["every_rank"] for s in seen] == ["OffloadedWriteError"] * 2
    for r, s in enumerate(seen):
        assert (
            "'fc2.weight'" in s["every_rank_message"] and f"on rank {r}" in s["every_rank_message"]
        )
        assert s["trained"] and s["class"] == "Parameter"


# -- several dtypes ----------------------------------------------------------------------


def test_dtype_refusal_names_the_dtypes_and_parameters() -> None:
    bf16, fp32, fp16 = "torch.bfloat16", "torch.float32", "torch.float16"
    assert dtype_refusal([("a", bf16), ("b", bf16)]) is None
    assert dtype_refusal([]) is None
    # fp32 beside one 16-bit dtype (PEFT's default adapters, a norm kept fp32): accepted
    assert dtype_refusal([("w1", bf16), ("ln.weight", fp32), ("ln.bias", fp32)]) is None
    adapters = [("q.base_layer.weight", bf16), ("q.lora_A.default.weight", fp32)]
    assert dtype_refusal(adapters) is None
    both = dtype_refusal([("a", bf16), ("b", fp16)] + [(f"h{i}", fp16) for i in range(5)])
    assert both is not None and "float16: 6 ('b', 'h0', 'h1', 'h2', ...); bfloat16: 1" in both
    assert "several 16-bit dtypes are not supported yet" in both
    only = dtype_refusal([("x", fp32)])
    assert only is not None and "float32: 1 ('x')" in only and "bf16 or fp16" in only
    assert "only beside a 16-bit base" in only
    odd = dtype_refusal([("w", bf16), ("d", "torch.float64")])
    assert odd is not None and "float64: 1 ('d')" in odd and ".to(torch.bfloat16)" in odd


def test_a_module_owning_two_dtypes_is_refused_naming_it() -> None:
    """With several ranks a module's gather is one buffer of one dtype: an fp32
    parameter beside a bf16 one in the same module is refused, naming the module (fp32
    adapters of their own modules pass)."""
    mixed = nn.Linear(4, 4).to(torch.bfloat16)
    mixed.scale = nn.Parameter(torch.ones(4))  # fp32, owned by the bf16 Linear
    own = nn.Sequential(nn.Linear(4, 4).to(torch.bfloat16), nn.Linear(4, 2))
    assert module_dtype_refusal(list(own.named_children())) is None
    refusal = module_dtype_refusal([("proj", mixed)])
    assert refusal is not None and "module 'proj'" in refusal
    assert "'weight' bfloat16" in refusal and "'scale' float32" in refusal


# -- contiguous ownership and the measured offload ---------------------------------------


def test_plan_contiguous_owns_whole_parameters_in_runs() -> None:
    infos = [
        ParamInfo(name=f"p{i}", numel=n, itemsize=2, module_index=i // 2)
        for i, n in enumerate([100, 5, 300, 7, 200, 1, 250, 90])
    ]
    plan = plan_contiguous(infos, 4)
    owners = [p.owner for p in plan.params]
    assert all(o is not None for o in owners)
    assert owners == sorted(owners)  # runs, in forward order
    assert len(set(owners)) == 4
    assert all(p.local_numel(p.owner or 0) == p.numel for p in plan.params)
    assert plan.digest() != plan_partition(infos, 4).digest()
    with pytest.raises(SwapConfigError):
        plan_contiguous(infos, 0)


def ownership(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Three steps with each ownership, the last backward traced."""
    out: dict[str, Any] = {}
    for name in ("balanced", "contiguous"):
        config = _config(tmp, name, ownership=name)
        with swapper.offload(_model(), config, dist.group.WORLD) as wrapped:
            optimizer = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
            reducer = wrapped._grads  # type: ignore[union-attr]
            for step, tokens in enumerate(_batches()[:3]):
                reducer.trace = [] if step == 2 else None
                trace = reducer.trace
                _step(wrapped, optimizer, tokens, rank, world)
            optimizer.close()
            out[name] = {
                "params": wrapped.state_dict(),
                "trace": trace,
                "planned": plan_windows(wrapped.plan),  # type: ignore[union-attr]
                "owners": [p.owner for p in wrapped.plan.params],  # type: ignore[union-attr]
            }
    return out


def test_contiguous_ownership_trains_identically_and_the_offload_is_measured(
    tmp_path: Path,
) -> None:
    seen = _spawn(ownership, 2, tmp_path, join_s=90.0)
    assert all(o is not None for o in seen[0]["contiguous"]["owners"])
    assert None in seen[0]["balanced"]["owners"]  # large parameters cut over the ranks
    # elementwise the same sums and AdamW updates, whoever owns what (no clipping)
    _same(seen[0]["balanced"]["params"], seen[0]["contiguous"]["params"])
    for name in ("balanced", "contiguous"):
        planned = dict(seen[0][name]["planned"])
        for r in range(2):
            trace = seen[r][name]["trace"]
            assert len(trace) == len(planned)  # one record per gradient group
            for rec in trace:  # the bytes handed to the tiers are the plan's
                assert rec.retained_nbytes == planned[rec.module_index][r], (name, rec)
                assert rec.collective == "reduce_scatter" and rec.reduce_dtype == "bfloat16"
                assert rec.reduce_s >= 0 and rec.offload_s >= 0
        # every rank took part in every window's collective, with the same buffer
        wire = [[rec.wire_nbytes for rec in seen[r][name]["trace"]] for r in range(2)]
        assert wire[0] == wire[1]

    # contiguous: a window's bytes on one rank (but where the cut falls inside a module:
    # fc1's weight and bias here); balanced: every large window spread over both
    def shared(name: str) -> int:
        pairs = zip(seen[0][name]["trace"], seen[1][name]["trace"], strict=True)
        return sum(1 for a, b in pairs if a.retained_nbytes and b.retained_nbytes)

    assert shared("contiguous") <= 1
    assert shared("balanced") >= 2  # fc1 and fc2 (their weights are cut in two)


def test_ownership_setting_is_checked() -> None:
    with pytest.raises(SwapConfigError, match="ownership"):
        DistributedConfig(ownership="random")
    assert DistributedConfig.from_dict({"ownership": "contiguous"}).ownership == "contiguous"
