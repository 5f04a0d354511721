"""Review findings on the overlapped step over ranks (swapper.zero.shard_overlap)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_dist_overlap import LR, _config
from test_dist_train import BATCH, VOCAB, _batches, _model, _spawn

import swapper
from swapper import OffloadAdamW

pytestmark = pytest.mark.dist


def load_after_eval(rank: int, world: int, tmp: str, overlap: bool) -> dict[str, Any]:
    """A step, the sharded state kept and evaluated; another step; an evaluation forward
    (its read-ahead leaves gathers of the current shards in flight); the kept state
    loaded back: the next evaluation must be the kept one's. Unlimited budgets: the
    gathers are started ahead (the tight ones leave no room for them in this model).
    With overlap, ShardedModel.before_param_write skipped its drain for every write while
    a gate was installed, so the load's writes left those gathers holding the old
    shards, and the next forward used them."""
    config = _config(tmp, f"load{int(overlap)}", tight=False, overlap=overlap)
    out: dict[str, Any] = {}
    with swapper.offload(_model().to(torch.bfloat16), config, dist.group.WORLD) as wrapped:
        optimizer = OffloadAdamW(wrapped.parameters(), lr=LR, tiers=wrapped)
        batches = _batches()
        probe = batches[0][:2, :-1]

        def train_step(tokens: torch.Tensor) -> None:
            share = tokens[rank * BATCH // world : (rank + 1) * BATCH // world]
            logits = wrapped(share[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, VOCAB), share[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad()

        train_step(batches[0])
        kept = wrapped.sharded_state_dict()  # waits for the update
        kept = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kept.items()}
        with torch.no_grad():
            out["kept_eval"] = wrapped(probe).float().clone()
        train_step(batches[1])
        wrapped.sharded_state_dict()  # the update ended
        with torch.no_grad():
            wrapped(probe)  # read-ahead: gathers of the current shards in flight
        out["pending"] = sum(st.pending is not None for st in wrapped._states.values())
        wrapped.load_sharded_state_dict(kept)
        with torch.no_grad():
            out["loaded_eval"] = wrapped(probe).float().clone()
        optimizer.close()
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["ordinary", "overlap"])
def test_load_after_read_ahead_reads_the_loaded_shards(tmp_path: Path, overlap: bool) -> None:
    seen = _spawn(load_after_eval, 2, tmp_path, overlap, join_s=120.0)
    for r in seen:
        assert r["pending"], "no gather in flight at the load"
        assert torch.equal(r["kept_eval"], r["loaded_eval"]), "a gather read the old shards"
