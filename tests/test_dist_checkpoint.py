"""Snapshots and resume over several ranks (swapper.zero.checkpoint.shard_snapshot, shard_resume,
snapshot_commit): each rank's part, one commit record, keep_last across ranks; a resume
agreed by every rank that continues bit-exactly; bad inputs refused by name or passed
over with a logged reason; another world size refused with the DCP advice; final_digest
the same at every world size. The SIGKILL test is tests/test_dist_checkpoint_kill.py.

Each test spawns 2 gloo ranks once (tests/dist_ckpt_train.py: a tiny GPT whose optimizer
state spills to NVMe, a 20 s timeout on every collective) and runs its scenarios one
after the other in them.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from dist_ckpt_train import config, model, spawn, train, values
from hypothesis import given
from hypothesis import strategies as st

import swapper
from swapper.zero.checkpoint.commit import (
    CommitRecordError,
    RankPart,
    WorldSizeMismatchError,
    commit_path,
    encode_commit,
    parse_commit,
    part_digest,
    read_commits,
    remove_orphan_commits,
    write_commit,
)

STORE = "swapper-offload"
WORLD = 2


def _name(step: int) -> str:
    return f"step-{step:09d}"


def _part(swap: Path, rank: int, step: int) -> Path:
    return swap / f"rank{rank}of{WORLD}" / f"{STORE}.{_name(step)}.snap"


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _resume(rank: int, world: int, swap: Path, resume: bool | str) -> dict[str, Any]:
    """Wrap with ``resume`` and close at once: what was resumed, or the error raised."""
    handler = _Warnings()
    logging.getLogger("swapper.zero.checkpoint.shard_resume").addHandler(handler)
    try:
        import torch.distributed as dist

        wrapped = swapper.offload(model(), config(swap), dist.group.WORLD, resume=resume)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "warnings": handler.messages}
    finally:
        logging.getLogger("swapper.zero.checkpoint.shard_resume").removeHandler(handler)
    resumed = wrapped.resumed
    wrapped.close()
    return {"step": None if resumed is None else resumed.step, "warnings": handler.messages}


# -- save and resume ------------------------------------------------------------------------


def _one_rank_fails(rank: int, world: int, swap: str) -> dict[str, Any]:
    """A snapshot that fails on rank 1 only (a tensor in use there): an error on every
    rank, no commit record, no part left; then one that succeeds."""
    import torch
    import torch.distributed as dist

    from swapper import OffloadAdamW
    from swapper.zero import save_snapshot

    gpt = model()
    wrapped = swapper.offload(gpt, config(swap), dist.group.WORLD)
    optimizer = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
    out: dict[str, Any] = {}
    try:
        tokens = torch.randint(0, 64, (2, 9))
        wrapped(tokens[:, :-1]).float().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        key = next(s.key for s in wrapped.slots if s.local_numel)  # type: ignore[union-attr]
        if rank == 1:
            wrapped.manager.fetch(key)
        try:
            save_snapshot(wrapped, optimizer, name="busy")
        except Exception as exc:
            out["error"] = type(exc).__name__
            out["message"] = str(exc)
        if rank == 1:
            wrapped.manager.release(key, modified=False)
        dist.barrier()  # (rank 0 drops its part before it raises)
        out["parts_after_failure"] = sorted(p.name for p in Path(swap).rglob("*.snap"))
        out["records_after_failure"] = [r.name for r in read_commits(Path(swap), STORE)[0]]
        save_snapshot(wrapped, optimizer, name="busy")
        out["records"] = [r.name for r in read_commits(Path(swap), STORE)[0]]
    finally:
        optimizer.close()
        wrapped.close()
    return out


def _stop_and_resume(rank: int, world: int, tmp: str) -> dict[str, Any]:
    whole = train(rank, world, f"{tmp}/a", steps=6, every=2)
    stopped = train(rank, world, f"{tmp}/b", steps=6, every=2, stop_after=3)
    again = train(rank, world, f"{tmp}/b", steps=6, every=2)
    fewer = train(rank, world, f"{tmp}/c", steps=5, every=2)
    fails = _one_rank_fails(rank, world, f"{tmp}/d")
    return {"whole": whole, "stopped": stopped, "again": again, "fewer": fewer, "fails": fails}


@pytest.mark.dist
def test_stop_and_resume_over_two_ranks_ends_bit_identical(tmp_path: Path) -> None:
    runs = values(spawn(_stop_and_resume, WORLD, tmp_path))
    for r, run in enumerate(runs):
        whole, again = run["whole"], run["again"]
        assert run["stopped"]["resumed"] == 0 and again["resumed"] == 2, r
        assert again["losses"] == whole["losses"][2:], r  # steps 3..6, bit for bit
        assert again["digest"] == whole["digest"], r
        assert run["fewer"]["digest"] != whole["digest"]  # the digest sees one step
        assert run["whole"]["digest"] == runs[0]["whole"]["digest"]  # same on every rank
    # keep_last=2 on every rank and in the records: 4 and 6 kept, 2 dropped
    swap = tmp_path / "a"
    records, damaged = read_commits(swap, STORE)
    assert [r.name for r in records] == [_name(6), _name(4)] and not damaged
    newest = records[0]
    assert newest.world_size == WORLD and newest.step == 6
    for rank in range(WORLD):
        part = _part(swap, rank, 6)
        assert newest.parts[rank].path == part.relative_to(swap).as_posix()
        assert newest.parts[rank].digest == part_digest(part.read_bytes())
        assert sorted(p.name for p in part.parent.glob("*.snap")) == [
            f"{STORE}.{_name(4)}.snap",
            f"{STORE}.{_name(6)}.snap",
        ]
    # a snapshot that fails on one rank: an error on both, nothing committed or left
    fails = [run["fails"] for run in runs]
    assert fails[1]["error"] == "EntryInUseError", fails[1]
    assert fails[0]["error"] == "PeerFailedError" and "EntryInUseError" in fails[0]["message"]
    for f in fails:
        assert f["parts_after_failure"] == [] and f["records_after_failure"] == []
        assert f["records"] == ["busy"]
    report = runs[1]["whole"]["reports"][-1]
    assert report.commit == commit_path(swap, STORE, _name(6))
    assert report.path == _part(swap, 1, 6) and report.written_nbytes > 0
    assert report.dropped == (_name(2),)


# -- bad input ---------------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def _flip_a_bit_only_4_names(rank_dir: Path) -> tuple[Path, int]:
    """Flip one bit in an optimizer state extent that snapshot 4 names and 2 does not."""
    from tiers.aio import AioEngine
    from tiers.config import AioConfig
    from tiers.nvme import NvmeStore

    engine = AioEngine(AioConfig())
    try:
        with NvmeStore.open([rank_dir], engine, name=STORE) as store:
            key = next(
                k
                for k in store.snapshots()[-1].keys
                if k.startswith("optim_state/")
                and store.snapshot_tensor(_name(4), k).extents[0].offset
                != store.snapshot_tensor(_name(2), k).extents[0].offset
            )
            extent = store.snapshot_tensor(_name(4), key).extents[0]
    finally:
        engine.close()
    where = (rank_dir / f"{STORE}.bin", extent.offset + 100)
    _flip(*where)
    return where


def _bad_inputs(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import torch.distributed as dist

    swap = Path(tmp) / "swap"
    train(rank, world, str(swap), steps=4, every=2, keep_last=None)
    out: dict[str, Any] = {}

    def step(label: str, resume: bool | str = True) -> None:
        out[label] = _resume(rank, world, swap, resume)

    def barrier() -> None:
        dist.barrier()

    n4 = _name(4)
    # a record that names another part than rank 1's (its digest differs)
    record_path = commit_path(swap, STORE, n4)
    if rank == 0:
        good = record_path.read_bytes()
        record = parse_commit(good, record_path, store=STORE, name=n4)
        parts = list(record.parts)
        parts[1] = dataclasses.replace(parts[1], digest="sha256:" + "0" * 64)
        changed = encode_commit(
            store=STORE, name=n4, seq=record.seq, step=4, world_size=WORLD,
            created=record.created, parts=parts,
        )  # fmt: skip
        record_path.write_bytes(changed)
    barrier()
    step("other_part")
    step("other_part_named", n4)
    barrier()
    if rank == 0:
        record_path.write_bytes(good)
    if rank == 1:
        _part(swap, 1, 4).rename(swap / "moved.snap")  # a missing part
    barrier()
    step("missing")
    step("missing_named", n4)
    barrier()
    if rank == 1:
        (swap / "moved.snap").rename(_part(swap, 1, 4))
    if rank == 0:  # a truncated part
        data = _part(swap, 0, 4).read_bytes()
        _part(swap, 0, 4).write_bytes(data[: len(data) // 2])
    barrier()
    step("truncated")
    step("truncated_named", n4)
    barrier()
    if rank == 0:
        _part(swap, 0, 4).write_bytes(data)
    if rank == 1:  # one bit flipped in a tensor only rank 1's part of 4 names
        where = _flip_a_bit_only_4_names(swap / "rank1of2")
    barrier()
    step("corrupt_tensor")
    step("corrupt_tensor_named", n4)
    barrier()
    if rank == 1:
        _flip(*where)  # back
    if rank == 0:
        # a commit record without its parts, newer than every other
        record = read_commits(swap, STORE)[0][0]
        fake = encode_commit(
            store=STORE, name="step-000000009", seq=record.seq + 1, step=9,
            world_size=WORLD, created=record.created, parts=list(record.parts),
        )  # fmt: skip
        commit_path(swap, STORE, "step-000000009").write_bytes(fake)
    barrier()
    step("no_parts")
    step("no_parts_named", "step-000000009")
    barrier()
    if rank == 0:
        commit_path(swap, STORE, "step-000000009").unlink()
        # a corrupted commit record (one byte flipped)
        bad = bytearray(good)
        bad[len(bad) // 3] ^= 0x01
        record_path.write_bytes(bytes(bad))
    barrier()
    step("corrupt_record")
    step("corrupt_record_named", n4)
    barrier()
    if rank == 0:
        record_path.write_bytes(good)
        # a commit record from another world size, newest
        parts = [RankPart(r, f"rank{r}of4/x.snap", "sha256:" + "0" * 64, 1) for r in range(4)]
        other = encode_commit(
            store=STORE, name="step-000000010", seq=99, step=10, world_size=4,
            created=1.0, parts=parts,
        )  # fmt: skip
        commit_path(swap, STORE, "step-000000010").write_bytes(other)
    barrier()
    step("other_world")
    barrier()
    if rank == 0:
        commit_path(swap, STORE, "step-000000010").unlink()
    barrier()
    step("nope", "nope")
    step("good")  # everything put back: the newest again
    step("named_older", _name(2))  # a named one, older than the newest
    return out


@pytest.mark.dist
def test_bad_inputs_are_named_or_passed_over(tmp_path: Path) -> None:
    runs = values(spawn(_bad_inputs, WORLD, tmp_path))
    swap = tmp_path / "swap"
    record4 = str(commit_path(swap, STORE, _name(4)))
    for r, out in enumerate(runs):
        # resume=True falls back to the last good snapshot, saying why
        for label, what, good in [
            ("other_part", "its digest differs", 2),
            ("missing", "is missing", 2),
            ("truncated", "is damaged", 2),
            ("no_parts", "is missing", 4),  # (4's parts are whole again by then)
        ]:
            assert out[label].get("step") == good, (r, label, out[label])
            assert any(what in w for w in out[label]["warnings"]), (r, label, out[label])
        # named: a typed error naming the record and the part
        for label, part_rank in [("other_part_named", 1), ("missing_named", 1),
                                 ("truncated_named", 0)]:  # fmt: skip
            got = out[label]
            assert got.get("error") == "CommitRecordError", (r, label, got)
            assert record4 in got["message"], (r, label, got)
            assert f"rank{part_rank}of2/{STORE}.{_name(4)}.snap" in got["message"], (r, label)
        # a tensor of rank 1's part fails its checksum: passed over on both ranks
        got = out["corrupt_tensor"]
        assert got.get("step") == 2, (r, got)
        assert any("rank 1:" in w and _name(4) in w for w in got["warnings"]), (r, got)
        got = out["corrupt_tensor_named"]
        expected = "SwapCorruptionError" if r == 1 else "PeerFailedError"
        assert got.get("error") == expected, (r, got)
        got = out["no_parts_named"]
        assert got.get("error") == "CommitRecordError" and "step-000000009.commit" in got["message"]
        # a damaged record: ignored with a warning (4's is the damaged one: 2 is used)
        assert out["corrupt_record"].get("step") == 2
        assert any("damaged commit record" in w for w in out["corrupt_record"]["warnings"])
        got = out["corrupt_record_named"]
        assert got.get("error") == "CommitRecordError" and record4 in got["message"]
        assert "corrupted" in got["message"]
        got = out["other_world"]
        assert got.get("error") == "WorldSizeMismatchError", (r, got)
        assert "step-000000010.commit" in got["message"] and "import_dcp" in got["message"]
        assert out["nope"].get("error") == "SnapshotNotFoundError"
        assert out["good"].get("step") == 4, (r, out["good"])
        assert out["named_older"].get("step") == 2, (r, out["named_older"])
    # one process resuming what two ranks left: refused, with the resharding advice
    with pytest.raises(WorldSizeMismatchError, match=r"taken by 2 rank\(s\).*export_dcp"):
        swapper.offload(model(), config(swap), resume=True)


def _other_model(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Snapshots of the tiny GPT, resumed by a GPT of another width, then by its own."""
    import torch
    import torch.distributed as dist

    from swapper.pressure.model import GPT, GPTConfig, init_weights_

    swap = Path(tmp) / "swap"
    train(rank, world, str(swap), steps=2, every=2)
    out: dict[str, Any] = {}
    wider = GPT(GPTConfig(vocab_size=64, context=16, d_model=48, n_layers=2, n_heads=2))
    wider = wider.to(torch.bfloat16)
    init_weights_(wider, seed=0)
    for label, resume in (("other", True), ("other_named", _name(2))):
        try:
            swapper.offload(wider, config(swap), dist.group.WORLD, resume=resume).close()
            out[label] = {"error": None}
        except Exception as exc:
            out[label] = {"error": type(exc).__name__, "message": str(exc)}
    out["own"] = _resume(rank, world, swap, True)  # the snapshot is still there, usable
    return out


@pytest.mark.dist
def test_another_models_snapshot_is_refused_on_every_rank(tmp_path: Path) -> None:
    runs = values(spawn(_other_model, WORLD, tmp_path))
    swap = tmp_path / "swap"
    for r, out in enumerate(runs):
        for label in ("other", "other_named"):
            got = out[label]
            # each rank names its own part and what is wrong with it
            assert got["error"] == "StateDictError", (r, label, got)
            assert str(_part(swap, r, 2)) in got["message"], got
            assert "another model" in got["message"], got
        assert out["own"].get("step") == 2, (r, out["own"])


# -- final_digest across world sizes --------------------------------------------------------


def _digests(rank: int, world: int, tmp: str, steps: int) -> str:
    run = train(rank, world, f"{tmp}/w{world}", steps=steps, every=100, same_data=True, clip=None)
    return run["digest"]


@pytest.mark.dist
@pytest.mark.parametrize("steps", [0, 2])
def test_final_digest_is_the_same_at_every_world_size(tmp_path: Path, steps: int) -> None:
    one = values(spawn(_digests, 1, tmp_path / "one", steps))
    two = values(spawn(_digests, WORLD, tmp_path / "two", steps))
    assert two[0] == two[1] == one[0]


# -- the commit record's format -----------------------------------------------------------

#: Part file names inside the rank's directory ('..' is refused by parse_commit, rightly)
_NAMES = st.text("abcxyz/_-.0123456789", min_size=1, max_size=30).filter(
    lambda name: ".." not in Path(name).parts
)
_PARTS = st.lists(
    st.tuples(_NAMES, st.integers(0, 1 << 40)),
    min_size=1,
    max_size=5,
)


@given(_PARTS, st.integers(0, 1 << 62), st.integers(0, 1 << 62), st.floats(0, 1e12))
def test_commit_record_round_trips(
    parts: list[tuple[str, int]], seq: int, step: int, created: float
) -> None:
    rank_parts = [
        RankPart(r, f"rank{r}of{len(parts)}/{p}", "sha256:" + f"{n:064x}"[-64:], n)
        for r, (p, n) in enumerate(parts)
    ]
    data = encode_commit(
        store=STORE, name="s", seq=seq, step=step, world_size=len(parts), created=created,
        parts=rank_parts,
    )  # fmt: skip
    back = parse_commit(data, Path("/x/r.commit"), store=STORE, name="s")
    assert back.parts == tuple(rank_parts)
    assert (back.seq, back.step, back.world_size, back.created) == (seq, step, len(parts), created)
    # any one byte flipped, or the file cut short: refused, naming the file
    for damaged in (data[: len(data) - 7], data[:10] + bytes([data[10] ^ 1]) + data[11:]):
        with pytest.raises(CommitRecordError, match=re.escape("/x/r.commit")):
            parse_commit(damaged, Path("/x/r.commit"), store=STORE, name="s")


def test_a_record_of_another_snapshot_or_store_is_refused() -> None:
    part = RankPart(0, "rank0of1/a.snap", "sha256:" + "a" * 64, 3)
    data = encode_commit(
        store=STORE, name="s", seq=0, step=0, world_size=1, created=0.0, parts=[part]
    )
    with pytest.raises(CommitRecordError, match="snapshot"):
        parse_commit(data, Path("r"), store=STORE, name="t")
    with pytest.raises(CommitRecordError, match="store"):
        parse_commit(data, Path("r"), store="other", name="s")
    two = dataclasses.replace(part, rank=1)
    data = encode_commit(
        store=STORE, name="s", seq=0, step=0, world_size=2, created=0.0, parts=[two, part]
    )
    with pytest.raises(CommitRecordError, match="rank"):
        parse_commit(data, Path("r"), store=STORE, name="s")


def test_records_on_disk_listed_newest_first_damaged_named_orphans_removed(
    tmp_path: Path,
) -> None:
    part = RankPart(0, "rank0of1/a.snap", "sha256:" + "a" * 64, 3)
    for seq, name in [(0, "old"), (5, "new"), (2, "mid")]:
        data = encode_commit(
            store=STORE, name=name, seq=seq, step=seq, world_size=1, created=0.0, parts=[part]
        )
        write_commit(tmp_path, data, STORE, name)
    torn = commit_path(tmp_path, STORE, "torn")
    torn.write_bytes(commit_path(tmp_path, STORE, "old").read_bytes()[:-20])
    orphan = tmp_path / f".{STORE}.x.commit.0123abcd.tmp"
    orphan.write_bytes(b"half")
    records, damaged = read_commits(tmp_path, STORE)
    assert [r.name for r in records] == ["new", "mid", "old"]
    assert list(damaged) == ["torn"] and str(torn) in damaged["torn"]
    assert remove_orphan_commits(tmp_path, STORE) == [orphan]
    assert not orphan.exists() and torn.exists()
    assert read_commits(tmp_path / "absent", STORE) == ([], {})


def _transient(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """A transient EIO reading rank 1's part of the newest snapshot: resume=True raises
    on every rank (rank 1 naming the snapshot and file) instead of passing it over; once
    the error is gone the newest is resumed."""
    import errno

    import torch.distributed as dist

    from tiers.errors import SwapIOError
    from tiers.nvme import NvmeStore

    swap = Path(tmp) / "swap"
    train(rank, world, str(swap), steps=4, every=2, keep_last=None)
    real = NvmeStore.read_snapshot
    injected: list[str] = []

    def flaky(self: NvmeStore, name: str, key: str, out: Any) -> Any:
        if name == _name(4) and not injected:
            injected.append(key)
            raise SwapIOError(errno.EIO, "Input/output error (injected)", str(swap / "x.bin"))
        return real(self, name, key, out)

    if rank == 1:
        NvmeStore.read_snapshot = flaky  # type: ignore[method-assign]
    try:
        failed = _resume(rank, world, swap, True)
    finally:
        NvmeStore.read_snapshot = real  # type: ignore[method-assign]
    dist.barrier()
    return {"failed": failed, "injected": injected, "again": _resume(rank, world, swap, True)}


@pytest.mark.dist
def test_a_transient_read_error_fails_the_resume_on_every_rank(tmp_path: Path) -> None:
    ranks = values(spawn(_transient, WORLD, tmp_path, join_s=150))
    assert ranks[1]["injected"], "no read of the newest part: nothing is tested"
    assert ranks[1]["failed"]["error"] == "SwapIOError", ranks[1]
    message = ranks[1]["failed"]["message"]
    assert _name(4) in message and str(_part(tmp_path / "swap", 1, 4)) in message, message
    assert "does not fall back" in message
    assert ranks[0]["failed"]["error"] == "PeerFailedError", ranks[0]
    for r in ranks:
        assert "step" not in r["failed"], r  # nothing resumed from step 2
        assert r["again"]["step"] == 4, r


def test_a_commit_record_that_cannot_be_read_is_raised_not_listed_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An EIO reading a commit record proves nothing of it: listed as damaged, resume
    would pass over the newest snapshot to an older one."""
    import errno
    import os

    from swapper.zero.checkpoint import commit as snapshot_commit
    from tiers.errors import SwapIOError
    from tiers.nvme.records import ManifestError

    part = RankPart(0, "rank0of1/a.snap", "sha256:" + "a" * 64, 3)
    for seq, name in [(0, "old"), (1, "new")]:
        data = encode_commit(
            store=STORE, name=name, seq=seq, step=seq, world_size=1, created=0.0, parts=[part]
        )
        write_commit(tmp_path, data, STORE, name)
    real = snapshot_commit.read_metadata

    def eio(path: Path, what: str, **kwargs: Any) -> bytes:
        if path.name.endswith(".new.commit"):  # as read_metadata reports an EIO
            cause = OSError(errno.EIO, os.strerror(errno.EIO))
            raise ManifestError(f"cannot read the {what} {path}: {cause.strerror}") from cause
        return real(path, what, **kwargs)

    monkeypatch.setattr(snapshot_commit, "read_metadata", eio)
    with pytest.raises(SwapIOError, match="not proof of damage") as info:
        read_commits(tmp_path, STORE)
    assert info.value.errno == errno.EIO
    assert info.value.filename == str(commit_path(tmp_path, STORE, "new"))
    monkeypatch.setattr(snapshot_commit, "read_metadata", real)
    assert [r.name for r in read_commits(tmp_path, STORE)[0]] == ["new", "old"]
