"""Review findings on the overlapped step over ranks (swapper.zero.sharded.overlap)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_dist_overlap import LR, _config, _host_use
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


def interrupted_drain(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Every rank's drain of the gathers started ahead raises (as a Ctrl-C or a failed
    gather would) when ``step()`` starts the update: the step must leave nothing changed
    (no step counted, no update left that never ends), and ``step()`` again must take it."""
    config = _config(tmp, "drain", tight=False, overlap=True)
    out: dict[str, Any] = {}
    with swapper.offload(_model().to(torch.bfloat16), config, dist.group.WORLD) as wrapped:
        optimizer = OffloadAdamW(wrapped.parameters(), lr=LR, tiers=wrapped)
        tokens = _batches()[0]
        share = tokens[rank * BATCH // world : (rank + 1) * BATCH // world]
        logits = wrapped(share[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, VOCAB), share[:, 1:].reshape(-1)).backward()
        overlap = wrapped.overlap
        real = overlap._drain

        def drain() -> None:
            overlap._drain = real
            raise KeyboardInterrupt

        overlap._drain = drain
        try:
            optimizer.step()
            out["raised"] = "nothing"
        except KeyboardInterrupt:
            out["raised"] = "KeyboardInterrupt"
        out["steps_after_interrupt"] = optimizer.step_count
        optimizer.step()  # hung (waited forever for an update never started)
        optimizer.zero_grad()
        with torch.no_grad():
            wrapped(share[:, :-1])
        out["steps"] = optimizer.step_count
        optimizer.close()
    return out


def test_interrupt_at_step_start_leaves_the_step_undone(tmp_path: Path) -> None:
    seen = _spawn(interrupted_drain, 2, tmp_path, join_s=60.0)
    for r in seen:
        assert r["raised"] == "KeyboardInterrupt"
        assert r["steps_after_interrupt"] == 0, "the interrupted step was counted"
        assert r["steps"] == 1


def one_rank_short(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Rank 0's host budget cannot hold a gather's shards beside the update, rank 1's
    can: making the overlapped optimizer must fail on both (the docstring of
    ShardOverlap.install says it is an agreement; it was not: rank 1 went on alone)."""
    host = 25_000 if rank == 0 else 48_000
    out: dict[str, Any] = {}
    with swapper.offload(_model(), _host_use(tmp, "short", host, True), dist.group.WORLD) as w:
        try:
            OffloadAdamW(w.parameters(), lr=LR, tiers=w).close()
            out["refused"] = "no error"
        except Exception as exc:
            out["refused"] = type(exc).__name__
    return out


def test_host_room_refused_on_one_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    seen = _spawn(one_rank_short, 2, tmp_path, join_s=60.0)
    assert [r["refused"] for r in seen] == ["SwapConfigError", "PeerFailedError"]


def import_while_pending(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """The weights exported after step 1; step 2's update held back (pending); the
    export imported into the model alone (no optimizer) at once: the model must then hold
    the imported weights (the update's later writes overwrote some of them)."""
    from test_dist_overlap import _hold_update

    from swapper.zero.checkpoint.dcp_export import export_dcp
    from swapper.zero.checkpoint.dcp_import import import_dcp

    config = _config(tmp, "import", tight=False, overlap=True)
    out: dict[str, Any] = {}
    with swapper.offload(_model().to(torch.bfloat16), config, dist.group.WORLD) as wrapped:
        optimizer = OffloadAdamW(wrapped.parameters(), lr=LR, tiers=wrapped)
        batches = _batches()
        for step, tokens in enumerate(batches[:2], 1):
            share = tokens[rank * BATCH // world : (rank + 1) * BATCH // world]
            logits = wrapped(share[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, VOCAB), share[:, 1:].reshape(-1)).backward()
            if step == 2:
                _hold_update(optimizer, 0.5)
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:
                export_dcp(wrapped, os.path.join(tmp, "dcp"))
                out["exported"] = wrapped.state_dict()
        import_dcp(wrapped, os.path.join(tmp, "dcp"))
        out["imported"] = wrapped.state_dict()
        optimizer.close()
    return out


def test_import_while_an_update_is_pending_keeps_the_imported_weights(tmp_path: Path) -> None:
    seen = _spawn(import_while_pending, 2, tmp_path, join_s=60.0)
    for name, value in seen[0]["exported"].items():
        assert torch.equal(seen[0]["imported"][name], value), f"{name}: the update overwrote it"


def interrupted_read_ahead(rank: int, world: int, tmp: str, interrupt: bool) -> dict[str, Any]:
    """A step; a forward whose first read-ahead is cut at the gate's wait (a Ctrl-C, on
    every rank: nothing unpaired); another step; an evaluation. The module whose
    pre-forward hook was cut must not stay gathered: its hold leaked (users stayed 1) and
    every later forward used that buffer, the values from before step 2."""
    config = _config(tmp, f"ra{int(interrupt)}", tight=False, overlap=True)
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
        wrapped.sharded_state_dict()  # the update ended (the gate then passes at once)
        if interrupt:
            overlap = wrapped.overlap
            real = overlap.before_gather
            calls: list[int] = []

            def before_gather(params: Any) -> None:
                calls.append(1)
                if len(calls) == 2:  # the first read-ahead (the first is the module's own)
                    overlap.before_gather = real  # type: ignore[method-assign]
                    raise KeyboardInterrupt
                real(params)

            overlap.before_gather = before_gather  # type: ignore[method-assign]
            try:
                with torch.no_grad():
                    wrapped(probe)
            except KeyboardInterrupt:
                pass
        train_step(batches[1])
        wrapped.sharded_state_dict()
        with torch.no_grad():
            out["eval"] = wrapped(probe).float().clone()
        out["held"] = [s.name for s in wrapped._states.values() if s.users]
        optimizer.close()
    return out


def test_a_read_ahead_cut_at_the_gate_leaves_no_module_gathered(tmp_path: Path) -> None:
    clean = _spawn(interrupted_read_ahead, 2, tmp_path / "clean", False, join_s=60.0)
    cut = _spawn(interrupted_read_ahead, 2, tmp_path / "cut", True, join_s=60.0)
    for r in range(2):
        assert torch.equal(cut[r]["eval"], clean[r]["eval"]), f"rank {r}: stale weights used"
        assert cut[r]["held"] == [], f"rank {r}: modules left gathered {cut[r]['held']}"
