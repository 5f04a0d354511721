"""A multi-rank snapshot saved again under its own name (the default name twice at one
step, or after a step skipped for overflow), the job SIGKILLed at each point of the
second save: the resume finds a whole committed snapshot, the old one or the new one
(by its digest), never none (with keep_last=1, none meant a fresh start that deleted
the stores: the whole run lost).

Each case spawns 2 gloo ranks twice (tests/dist_ckpt_train.py: a tiny GPT, a 20 s
timeout on every collective): a run that saves ``s`` after step 1, again after step 2
with a kill armed in :mod:`swapper.zero.shard_snapshot` (rank 0 SIGKILLs every rank,
itself last); then a resume that reports its step and ``final_digest``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_ckpt_train import CONFIG, PER_RANK, config, model, spawn, values

import swapper
from swapper import OffloadAdamW
from swapper.zero.checkpoint import final_digest, save_snapshot

pytestmark = pytest.mark.dist

WORLD = 2


def _kill_all(run: Path) -> None:
    """SIGKILL every rank of this job (their pids in ``run``), this one last."""
    for r in range(WORLD):
        pid = int((run / f"pid{r}").read_text())
        if pid != os.getpid():
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str, run: Path) -> None:
    """Kill the job at ``point`` of the next snapshot (rank 0 only; a marker file says
    that the point was reached and whether the new record was written by then)."""
    from swapper.zero import shard_snapshot as ss

    def at(where: str) -> None:
        if where == point:
            (run / "fired").write_text(where)
            _kill_all(run)

    original_remove, original_write = ss.remove_commit, ss.write_commit
    original_snapshot, original_drop = ss.snapshot_manager, ss._drop_parts

    def remove_commit(path: Path) -> None:
        original_remove(path)
        at("record-removed")

    def snapshot_manager(*args: Any, **kwargs: Any) -> Any:
        done = original_snapshot(*args, **kwargs)
        at("part-written")
        return done

    def write_commit(*args: Any, **kwargs: Any) -> Path:
        at("record-before")
        path = original_write(*args, **kwargs)
        (run / "committed").write_text("yes")
        at("record-after")
        return path

    def drop_parts(*args: Any, **kwargs: Any) -> list[str]:
        dropped = original_drop(*args, **kwargs)
        at("parts-dropped")
        return dropped

    ss.remove_commit = remove_commit  # type: ignore[assignment]
    ss.snapshot_manager = snapshot_manager  # type: ignore[assignment]
    ss.write_commit = write_commit  # type: ignore[assignment]
    ss._drop_parts = drop_parts  # type: ignore[assignment]


def _step(wrapped: Any, optimizer: OffloadAdamW, rank: int) -> None:
    tokens = torch.randint(0, CONFIG.vocab_size, (PER_RANK * WORLD, 9))
    share = tokens[rank * PER_RANK :][:PER_RANK]
    logits = wrapped(share[:, :-1])
    loss = F.cross_entropy(logits.float().reshape(-1, CONFIG.vocab_size), share[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _save_twice(
    rank: int, world: int, tmp: str, swap: str, point: str, keep_last: int | None
) -> list[str]:
    run = Path(tmp)
    (run / f"pid{rank}").write_text(str(os.getpid()))
    torch.manual_seed(1234)
    wrapped = swapper.offload(model(), config(swap), dist.group.WORLD, resume=False)
    optimizer = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
    try:
        digests = []
        for _ in range(2):
            _step(wrapped, optimizer, rank)
            digests.append(final_digest(wrapped, optimizer))
            if rank == 0:
                (run / f"digest{len(digests)}").write_text(digests[-1])
            if len(digests) == 2 and rank == 0:
                _arm(point, run)
            save_snapshot(wrapped, optimizer, name="s", keep_last=keep_last)
        return digests
    finally:
        optimizer.close()
        wrapped.close()


def _resume(rank: int, world: int, tmp: str, swap: str) -> tuple[int, str]:
    wrapped = swapper.offload(model(), config(swap), dist.group.WORLD, resume=True)
    optimizer = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
    try:
        return optimizer.step_count, final_digest(wrapped, optimizer)
    finally:
        optimizer.close()
        wrapped.close()


@pytest.mark.parametrize(
    ("point", "keep_last"),
    [
        ("record-removed", 1),
        ("part-written", 1),
        ("record-before", 1),
        ("record-after", 1),
        ("parts-dropped", 1),
        ("record-before", None),
        ("parts-dropped", None),
    ],
)
def test_a_snapshot_saved_again_under_its_name_survives_a_kill_at_every_point(
    tmp_path: Path, point: str, keep_last: int | None
) -> None:
    swap, run = tmp_path / "swap", tmp_path / "run"
    try:
        results = spawn(_save_twice, WORLD, run, str(swap), point, keep_last, join_s=90)
    except RuntimeError as exc:  # killed: no rank left a result
        assert "left no result" in str(exc), exc
        assert (run / "fired").read_text() == point
    else:  # this design never passes that point with these snapshots: nothing to kill
        values(results)
        assert not (run / "fired").exists()
    old, new = (run / "digest1").read_text(), (run / "digest2").read_text()
    assert old != new
    resumed = values(spawn(_resume, WORLD, tmp_path / "resume", str(swap), join_s=90))
    assert resumed[0] == resumed[1], resumed
    step, digest = resumed[0]
    assert step in (1, 2), f"kill at {point}: resumed at step {step} (a fresh start)"
    assert digest == (old, new)[step - 1], f"kill at {point}: the digest is not step {step}'s"
    if (run / "committed").exists():  # the new record was written: it is the one chosen
        assert step == 2
