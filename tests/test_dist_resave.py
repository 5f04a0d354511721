"""A multi-rank snapshot saved again under its own name (the default name twice at one
step, or after a step skipped for overflow), the job SIGKILLed at each point of the
second save: the resume finds a whole committed snapshot, the old one or the new one
(by its digest), never none (with keep_last=1, none meant a fresh start that deleted
the stores: the whole run lost).

Each case spawns 2 gloo ranks twice (tests/dist_ckpt_train.py: a tiny GPT, a 20 s
timeout on every collective): a run that saves ``s`` after step 1, again after step 2
with a kill armed in :mod:`swapper.zero.checkpoint.shard_snapshot` (rank 0 SIGKILLs every rank,
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
from hypothesis import given
from hypothesis import strategies as st

import swapper
from swapper import OffloadAdamW
from swapper.zero.checkpoint.commit import (
    CommitRecordError,
    RankPart,
    encode_commit,
    parse_commit,
    part_name,
    read_commits,
)
from swapper.zero.checkpoint.snapshot import final_digest, save_snapshot
from tiers.nvme.snapshots import check_snapshot_name

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
    from swapper.zero.checkpoint import shard_snapshot as ss

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


# -- the record's part name ---------------------------------------------------------------


def _record(part: str | None, name: str = "s") -> bytes:
    digest = "sha256:" + "0" * 64
    parts = [RankPart(r, f"rank{r}of2/x.{part or name}.snap", digest, 1) for r in (0, 1)]
    return encode_commit(
        store="x", name=name, seq=3, step=2, world_size=2, created=1.0, parts=parts, part=part
    )


def test_a_record_names_its_parts_only_when_they_are_not_under_its_own_name() -> None:
    plain = _record(None)
    assert b'"part"' not in plain  # (the format of the records before: they still read)
    assert parse_commit(plain, Path("r"), store="x", name="s").part == "s"
    assert b'"part"' not in _record("s")
    assert parse_commit(_record("s--g1"), Path("r"), store="x", name="s").part == "s--g1"
    for bad in ("../s", "-s", "a" * 65, "s.snap"):
        with pytest.raises(CommitRecordError, match="part"):
            parse_commit(_record(bad), Path("r"), store="x", name="s")


@given(st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,63}", fullmatch=True), st.integers(0, 5))
def test_part_name_is_a_snapshot_name_not_taken(name: str, generations: int) -> None:
    taken: set[str] = set()
    for _ in range(generations):
        taken.add(part_name(name, taken))
    chosen = part_name(name, taken)
    assert chosen not in taken
    assert check_snapshot_name(chosen, "x") == chosen
    assert part_name(name, set()) == name


def _resave_three_times(rank: int, world: int, tmp: str, swap: str) -> list[list[str]]:
    torch.manual_seed(1234)
    wrapped = swapper.offload(model(), config(swap), dist.group.WORLD, resume=False)
    optimizer = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
    store = wrapped.manager._ctx.nvme()
    try:
        listed = []
        for _ in range(3):
            _step(wrapped, optimizer, rank)
            save_snapshot(wrapped, optimizer, name="s", keep_last=None)
            listed.append(sorted(i.name for i in store.snapshots()))
        return listed
    finally:
        optimizer.close()
        wrapped.close()


def test_saved_again_without_keep_last_the_replaced_parts_are_dropped(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    listed = values(spawn(_resave_three_times, WORLD, tmp_path / "run", str(swap), join_s=90))
    assert listed[0] == listed[1] == [["s"], ["s--g1"], ["s"]]
    records, damaged = read_commits(swap, "swapper-offload")
    assert not damaged and [(r.name, r.part) for r in records] == [("s", "s")]
    resumed = values(spawn(_resume, WORLD, tmp_path / "resume", str(swap), join_s=90))
    assert [step for step, _ in resumed] == [3, 3]
