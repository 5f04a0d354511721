"""The overlapped optimizer step (``StepConfig(overlap=True)``) over a model sharded on 2
gloo ranks (issue 14): :mod:`swapper.zero.sharded.overlap`.

Parity: per-step losses, evaluation outputs, the consolidated parameters and each rank's
optimizer state (fp32 master weights and both moments) are bit-identical between the
overlapped run, the ordinary run under the same tight budgets (NVMe really used), and
the ordinary run with unlimited budgets (everything in memory: the 2-rank in-memory
reference of tests/test_dist_train.py, itself checked there against one process and
DDP with torch's AdamW, to a tolerance); for bf16 with clipping and gradient
accumulation (two micro-steps), and for fp16 under a loss scaler with steps skipped
(rank 1 alone finds an inf in one step; the scale starts high enough that the first
step overflows on its own).

Faults: rank 1's background update fails (an injected I/O error): the next forward
raises on every rank within seconds (the forward's end agreement, not a collective's
timeout), ``step()`` again on every rank finishes it, and the run ends bit-identical to
a clean one (nothing applied twice). A consolidated state dict and a digest of the
whole state taken while an update is pending (held back on purpose) wait for it.

Every spawn uses the harness of tests/test_dist_train.py (a short group timeout, every
collective under ``distributed.timeout_s``, a join deadline: a hang fails in seconds).
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_dist_train import BATCH, TIGHT, VOCAB, _batches, _model, _same, _spawn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig, SwapIOError, Tier
from swapper.zero.checkpoint.snapshot import final_digest, save_snapshot
from swapper.zero.config.distributed import DistributedConfig

pytestmark = pytest.mark.dist

STEPS = 6
LR = 1e-2
CLIP = 1.0
TIMEOUT_S = 10.0  # every collective's (a hang fails in seconds, not minutes)
SUB_GROUP_NUMEL = 1024
HELD_STEP = 3  # the step whose update is held back while the state is read


def _config(tmp: str, name: str, *, tight: bool, overlap: bool) -> OffloadConfig:
    settings: dict[str, Any] = {}
    if tight:
        settings = {**TIGHT, "nvme_dirs": [os.path.join(tmp, name)]}
    return OffloadConfig(
        manager=OffloadConfig.create(device="cpu", **settings).manager,
        step=StepConfig(sub_group_numel=SUB_GROUP_NUMEL, max_grad_norm=CLIP, overlap=overlap),
        distributed=DistributedConfig(timeout_s=TIMEOUT_S),
    )


def _inject_inf(wrapped: Any) -> None:
    """Rank 1 alone finds an inf in one of its gradient shards (as a reduce into it
    would have)."""
    slot = next(
        s
        for p in wrapped.parameters()
        if (s := wrapped.slot_of(p)) is not None and s.has_grad and s.local_numel
    )
    grad = wrapped.manager.fetch(slot.grad_key)
    grad[0] = float("inf")
    wrapped.manager.release(slot.grad_key, modified=True)
    slot.grad_sq = float("inf")


def _hold_update(optimizer: OffloadAdamW, seconds: float) -> None:
    """Make this step's update sleep at its first parameter write (it is then pending
    when the caller reads the state); undone after that write."""
    source = optimizer._source
    real = source.write_param

    def write_param(param: torch.Tensor, start: int, values: torch.Tensor) -> None:
        setattr(source, "write_param", real)  # noqa: B010
        time.sleep(seconds)
        real(param, start, values)

    setattr(source, "write_param", write_param)  # noqa: B010


def _optimizer_state(optimizer: OffloadAdamW) -> dict[str, torch.Tensor]:
    state = optimizer.state_dict()["state"]
    return {
        f"{index}.{row}": state[index][row].clone()
        for index in sorted(state)
        for row in ("master", "exp_avg", "exp_avg_sq")
    }


def train(rank: int, world: int, tmp: str, v: dict[str, Any]) -> dict[str, Any]:
    """``STEPS`` steps of two micro-steps each on this rank's share of every batch, an
    evaluation forward after each step (and one before step 2's); the losses,
    evaluations, the state read while an update was pending (step ``HELD_STEP``'s or the
    next taken), the final parameters and optimizer state."""
    dtype = torch.float16 if v.get("fp16") else torch.bfloat16
    config = _config(tmp, v["name"], tight=v["tight"], overlap=v["overlap"])
    wrapped = swapper.offload(_model().to(dtype), config, dist.group.WORLD)
    scaler = swapper.DynamicLossScaler(init_scale=2.0**16) if v.get("fp16") else None
    optimizer = OffloadAdamW(wrapped.parameters(), lr=LR, tiers=wrapped, loss_scaler=scaler)
    out: dict[str, Any] = {"losses": [], "evals": [], "skipped": []}
    try:
        for step, tokens in enumerate(_batches()[:STEPS], 1):
            share = tokens[rank * BATCH // world : (rank + 1) * BATCH // world]
            for part in share.chunk(2):  # gradient accumulation: two micro-steps
                logits = wrapped(part[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), part[:, 1:].reshape(-1))
                out["losses"].append(float(loss.detach()))
                scaled = loss / 2 if scaler is None else scaler.scale(loss / 2)
                scaled.backward()
            if scaler is not None and step == 4 and rank == 1:
                _inject_inf(wrapped)
            if step == 2:  # its read-ahead leaves gathers of the old shards in flight
                with torch.no_grad():
                    out["evals"].append(wrapped(tokens[:2, :-1]).float().clone())
            if step == HELD_STEP:  # (held until a step is taken: a skip writes nothing)
                _hold_update(optimizer, 0.3)
            optimizer.step()
            report = optimizer.last_step
            out["skipped"].append(report is not None and report.skipped)
            if step >= HELD_STEP and not out["skipped"][-1] and "held_params" not in out:
                deferred = optimizer._deferred
                out["pending"] = deferred is not None and deferred._job is not None
                if v["tight"]:  # a snapshot first (it waits), resumed from after the run
                    out["snapshot"] = save_snapshot(wrapped, optimizer).name
                out["held_params"] = wrapped.state_dict()  # waits for the update
                out["held_digest"] = final_digest(wrapped, optimizer)  # type: ignore[arg-type]
            optimizer.zero_grad()
            with torch.no_grad():  # an evaluation forward beside the update
                out["evals"].append(wrapped(tokens[:2, :-1]).float().clone())
        out["params"] = wrapped.state_dict()
        out["optimizer"] = _optimizer_state(optimizer)
        out["steps"] = optimizer.step_count
        stats = wrapped.stats()
        out["nvme_written"] = stats.moved(Tier.HOST, Tier.NVME).nbytes
        out["nvme_read"] = stats.moved(Tier.NVME, Tier.HOST).nbytes
    finally:
        optimizer.close()
        wrapped.close()
    if "snapshot" in out:  # what the snapshot taken while the update was pending holds
        model = _model().to(dtype)
        with swapper.offload(model, config, dist.group.WORLD, resume=out["snapshot"]) as w:
            scaler = swapper.DynamicLossScaler() if v.get("fp16") else None
            with OffloadAdamW(w.parameters(), lr=LR, tiers=w, loss_scaler=scaler) as resumed:
                out["snapshot_digest"] = final_digest(w, resumed)  # type: ignore[arg-type]
    return out


VARIANTS = [
    {"name": "bf16_overlap", "tight": True, "overlap": True},
    {"name": "bf16_tight", "tight": True, "overlap": False},
    {"name": "bf16_memory", "tight": False, "overlap": False},
    {"name": "bf16_memory_overlap", "tight": False, "overlap": True},
    {"name": "fp16_overlap", "tight": True, "overlap": True, "fp16": True},
    {"name": "fp16_tight", "tight": True, "overlap": False, "fp16": True},
    {"name": "fp16_memory", "tight": False, "overlap": False, "fp16": True},
]


def run_variants(rank: int, world: int, tmp: str, variants: list[dict[str, Any]]) -> list[Any]:
    return [train(rank, world, tmp, v) for v in variants]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("overlap")
    results = _spawn(run_variants, 2, tmp, VARIANTS, join_s=240.0)
    return {v["name"]: [r[i] for r in results] for i, v in enumerate(VARIANTS)}


def _identical(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    _same(a[0]["params"], b[0]["params"])
    for r in range(2):
        assert a[r]["losses"] == b[r]["losses"], f"rank {r}: losses differ"
        assert a[r]["skipped"] == b[r]["skipped"]
        assert a[r]["steps"] == b[r]["steps"]
        for x, y in zip(a[r]["evals"], b[r]["evals"], strict=True):
            assert torch.equal(x, y), f"rank {r}: an evaluation differs"
        _same(a[r]["optimizer"], b[r]["optimizer"])  # fp32 master and both moments


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_overlapped_bit_identical_to_ordinary_and_in_memory(runs: Any, dtype: str) -> None:
    overlap, tight, memory = (
        runs[f"{dtype}_overlap"],
        runs[f"{dtype}_tight"],
        runs[f"{dtype}_memory"],
    )
    for r in range(2):
        assert overlap[r]["nvme_written"] > 0 and overlap[r]["nvme_read"] > 0, r
        assert memory[r]["nvme_written"] == 0
    _identical(overlap, tight)
    _identical(overlap, memory)
    if dtype == "bf16":
        _identical(runs["bf16_memory_overlap"], memory)


def test_fp16_skipped_steps_agree(runs: Any) -> None:
    skipped = [r["skipped"] for r in runs["fp16_overlap"]]
    assert skipped[0] == skipped[1]
    assert skipped[0][0], "the first scale must overflow on its own"
    assert skipped[0][3], "step 4 (rank 1's injected inf) must be skipped on every rank"
    assert not skipped[0][-1], "the scale must come down to steps that are taken"
    assert runs["fp16_overlap"][0]["steps"] == STEPS - sum(skipped[0])


def test_state_read_while_pending_waits_for_the_update(runs: Any) -> None:
    for dtype in ("bf16", "fp16"):
        overlap, tight = runs[f"{dtype}_overlap"], runs[f"{dtype}_tight"]
        if "held_params" not in overlap[0]:
            pytest.fail(f"{dtype}: every step from {HELD_STEP} on was skipped: nothing held")
        assert all(r["pending"] for r in overlap), "the update was not pending when read"
        _same(overlap[0]["held_params"], tight[0]["held_params"])
        for r in range(2):
            assert overlap[r]["held_digest"] == tight[r]["held_digest"]
            # the snapshot taken while the update was pending holds the updated state
            assert overlap[r]["snapshot_digest"] == tight[r]["held_digest"]
            assert tight[r]["snapshot_digest"] == tight[r]["held_digest"]


# -- a failed background update on one rank ---------------------------------------------


def _fail_write(optimizer: OffloadAdamW, nth: int) -> None:
    """This rank's next update raises an I/O error at its ``nth`` parameter write."""
    source = optimizer._source
    real = source.write_param
    calls: list[int] = []

    def write_param(param: torch.Tensor, start: int, values: torch.Tensor) -> None:
        calls.append(start)
        if len(calls) == nth:
            setattr(source, "write_param", real)  # noqa: B010
            raise SwapIOError(errno.EIO, "param write: injected", "param16")
        real(param, start, values)

    setattr(source, "write_param", write_param)  # noqa: B010


def failing(rank: int, world: int, tmp: str, nth: int) -> dict[str, Any]:
    """Four overlapped steps under tight budgets, clean and with rank 1's update of step
    2 failing in the background at its ``nth`` parameter write; a forward that raises is
    followed by ``step()`` on every rank, then the same micro-batch again."""
    out: dict[str, Any] = {}
    for name in ("clean", "faulty"):
        errors: list[tuple[str, int, float]] = []
        config = _config(tmp, name, tight=True, overlap=True)
        with swapper.offload(_model(), config, dist.group.WORLD) as wrapped:
            optimizer = OffloadAdamW(wrapped.parameters(), lr=LR, tiers=wrapped)
            for step, tokens in enumerate(_batches()[:4], 1):
                share = tokens[rank * BATCH // world : (rank + 1) * BATCH // world]
                while True:
                    started = time.monotonic()
                    try:
                        logits = wrapped(share[:, :-1])
                    except Exception as exc:  # DeferredStepError here, PeerFailedError there
                        errors.append((type(exc).__name__, step, time.monotonic() - started))
                        if len(errors) > 2:
                            raise
                        optimizer.step()  # finishes the failed update, on every rank
                        optimizer.zero_grad()
                        continue
                    break
                F.cross_entropy(
                    logits.float().reshape(-1, VOCAB), share[:, 1:].reshape(-1)
                ).backward()
                if name == "faulty" and step == 2 and rank == 1:
                    _fail_write(optimizer, nth)
                optimizer.step()
                optimizer.zero_grad()
            out[name] = {
                "params": wrapped.state_dict(),
                "optimizer": _optimizer_state(optimizer),
                "errors": errors,
                "steps": optimizer.step_count,
            }
            optimizer.close()
    return out


@pytest.mark.parametrize("nth", [2, 12], ids=["first_sub_group", "later_sub_group"])
def test_failed_update_on_one_rank_raises_on_every_rank_then_finishes(
    tmp_path: Path, nth: int
) -> None:
    """At the second write nothing is published yet; at the twelfth some sub-groups are
    done (kept, and not applied again when ``step()`` finishes the rest)."""
    seen = _spawn(failing, 2, tmp_path, nth, join_s=120.0)
    assert [(e[0], e[1]) for e in seen[0]["faulty"]["errors"]] == [("PeerFailedError", 3)]
    assert [(e[0], e[1]) for e in seen[1]["faulty"]["errors"]] == [("DeferredStepError", 3)]
    for r in seen:
        assert r["faulty"]["errors"][0][2] < TIMEOUT_S / 2, "surfaced by a timeout, not agreed"
        assert r["clean"]["errors"] == []
        assert r["clean"]["steps"] == r["faulty"]["steps"] == 4
    # finished by step() on every rank, nothing applied twice: as if clean
    _same(seen[0]["faulty"]["params"], seen[0]["clean"]["params"])
    for r in seen:
        _same(r["faulty"]["optimizer"], r["clean"]["optimizer"])


# -- the host budget beside a gather's shards ---------------------------------------------


def _host_use(tmp: str, name: str, host: int, overlap: bool) -> OffloadConfig:
    """Parameters used in the host tier: a gather reads this rank's shards there."""
    return OffloadConfig.create(
        nvme_dirs=[os.path.join(tmp, name)],
        device="cpu",
        param_tiers=("host", "nvme"),
        host_nbytes=host,
        timeout_s=20.0,
        step=StepConfig(sub_group_numel=SUB_GROUP_NUMEL, max_grad_norm=CLIP, overlap=overlap),
        distributed=DistributedConfig(timeout_s=TIMEOUT_S),
    )


def host_room(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """A host budget too small for a gather's shards beside the update (refused on every
    rank when the optimizer is made), then one that holds both: three steps overlapped
    and ordinary."""
    out: dict[str, Any] = {}
    with swapper.offload(_model(), _host_use(tmp, "small", 25_000, True), dist.group.WORLD) as w:
        try:
            OffloadAdamW(w.parameters(), lr=LR, tiers=w).close()
            out["refused"] = ("no error", "")
        except Exception as exc:
            out["refused"] = (type(exc).__name__, str(exc))
        with OffloadAdamW(w.parameters(), lr=LR, tiers=w, config=StepConfig(overlap=False)):
            pass  # nothing was left installed: the model takes another optimizer
    for name, overlap in (("overlap", True), ("ordinary", False)):
        config = _host_use(tmp, name, 48_000, overlap)
        with swapper.offload(_model(), config, dist.group.WORLD) as wrapped:
            optimizer = OffloadAdamW(wrapped.parameters(), lr=LR, tiers=wrapped)
            for tokens in _batches()[:3]:
                share = tokens[rank * BATCH // world : (rank + 1) * BATCH // world]
                logits = wrapped(share[:, :-1])
                F.cross_entropy(
                    logits.float().reshape(-1, VOCAB), share[:, 1:].reshape(-1)
                ).backward()
                optimizer.step()
                optimizer.zero_grad()
            out[name] = {"params": wrapped.state_dict(), "optimizer": _optimizer_state(optimizer)}
            optimizer.close()
    return out


def test_host_budget_too_small_beside_a_gather_is_refused_on_every_rank(tmp_path: Path) -> None:
    seen = _spawn(host_room, 2, tmp_path, join_s=120.0)
    kinds = sorted(r["refused"][0] for r in seen)
    assert kinds in (["SwapConfigError"] * 2, ["PeerFailedError", "SwapConfigError"]), kinds
    for r in seen:
        if r["refused"][0] == "SwapConfigError":
            message = r["refused"][1]
            assert "host_nbytes=25000 cannot hold both" in message, message
            assert "a gather holds up to" in message and "update holds up to" in message
    _same(seen[0]["overlap"]["params"], seen[0]["ordinary"]["params"])
    for r in seen:
        _same(r["overlap"]["optimizer"], r["ordinary"]["optimizer"])


# -- the optimizer closed with an update open ----------------------------------------------


def closed(rank: int, world: int, tmp: str, fail: bool) -> dict[str, Any]:
    """Two overlapped steps (rank 1's second update failing when ``fail``), the optimizer
    closed on every rank, then three forwards."""
    out: dict[str, Any] = {"errors": [], "open": []}
    config = _config(tmp, f"closed{int(fail)}", tight=True, overlap=True)
    with swapper.offload(_model(), config, dist.group.WORLD) as wrapped:
        optimizer = OffloadAdamW(wrapped.parameters(), lr=LR, tiers=wrapped)
        for step, tokens in enumerate(_batches()[:2], 1):
            share = tokens[rank * BATCH // world : (rank + 1) * BATCH // world]
            logits = wrapped(share[:, :-1])
            F.cross_entropy(logits.float().reshape(-1, VOCAB), share[:, 1:].reshape(-1)).backward()
            if fail and step == 2 and rank == 1:
                _fail_write(optimizer, 2)
            optimizer.step()
        optimizer.close()
        for _ in range(3):
            try:
                with torch.no_grad():
                    wrapped(share[:, :-1])
            except Exception as exc:
                out["errors"].append((type(exc).__name__, str(exc)))
            out["open"].append(wrapped.overlap.open)  # type: ignore[union-attr]
    return out


@pytest.mark.parametrize("fail", [False, True], ids=["clean", "failed"])
def test_optimizer_closed_with_an_update_open(tmp_path: Path, fail: bool) -> None:
    """Clean: the first forward after the close agrees it closed on every rank, and no
    forward agrees again. A failed update: every forward raises on every rank, saying that
    the optimizer was closed (step() cannot finish it) rather than to call step()."""
    seen = _spawn(closed, 2, tmp_path, fail, join_s=120.0)
    if not fail:
        for r in seen:
            assert r["errors"] == []
            assert r["open"] == [False, False, False]
        return
    assert [e[0] for e in seen[1]["errors"]] == ["DeferredStepError"] * 3
    assert [e[0] for e in seen[0]["errors"]] == ["PeerFailedError"] * 3
    for r in seen:
        for _, message in r["errors"]:
            assert "optimizer was closed" in message and "load a snapshot" in message
            assert "Call optimizer.step()" not in message
