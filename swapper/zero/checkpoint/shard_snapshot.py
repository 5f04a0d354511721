"""A training snapshot over several ranks: every rank's part, then one commit record.

Job: :func:`save_sharded`, what :func:`swapper.zero.checkpoint.snapshot.save_snapshot` does for a
:class:`~swapper.zero.sharded.model.ShardedModel`. On every rank alike, in this order::

    checks (local) ──► agree ──► rank 0 reads the commit records and names the parts
      (the snapshot's name, or ``<name>--g<k>`` when a record uses it: a snapshot saved
      again under its name) ──► agree ──► each rank: its store snapshot under that
          name (its *part*: dirty tensors written, every extent durable, the part's
          file renamed in and its directory fsync'd)
      ──► all_gather of (ok, digest of the part's file) = the barrier
      ──► rank 0: the commit record (tmp + fsync + rename over a record of the same
          name + dir fsync) ──► agree
      ──► keep_last: rank 0 removes the records beyond the newest K (durably), then
          tells the parts kept; each rank drops its parts not among them (without
          keep_last: each drops the parts of the record just replaced, if any)

Every step that can fail locally is followed by an agreement (one small all_gather with
the group's timeout), so a failure on one rank is an error on all, never a hang: the
failing rank raises its own error, the others :class:`~swapper.distributed.
PeerFailedError` naming it and its message. A kill at any moment leaves either no
commit record for the new snapshot (its parts are never chosen for resume, and are
dropped by the next ``keep_last``; a snapshot it replaces keeps its record and parts)
or a complete one; retention only ever drops a record after the newest record is
durable, and a record before its parts.

The one collective used is :func:`~swapper.zero.checkpoint.agree.all_gather_json` (JSON
values; also by :mod:`swapper.zero.checkpoint.shard_resume`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swapper.manager.snapshot import snapshot_manager, snapshot_store
from swapper.step.resume import optimizer_meta
from swapper.zero.checkpoint.agree import agree_or_raise, all_gather_json, raise_failed
from swapper.zero.checkpoint.commit import (
    RankPart,
    commit_path,
    encode_commit,
    part_digest,
    part_name,
    read_commits,
    remove_commit,
    remove_orphan_commits,
    write_commit,
)
from swapper.zero.checkpoint.report import SnapshotReport, check_saveable
from swapper.zero.checkpoint.resume import FORMAT, VERSION
from swapper.zero.checkpoint.rng import rng_state
from tiers.errors import SwapConfigError
from tiers.nvme.metafiles import read_metadata
from tiers.nvme.snapshots import check_snapshot_name
from tiers.signals import at_waits

if TYPE_CHECKING:
    from swapper.step.optimizer import StreamedOptimizer
    from swapper.zero.sharded.model import ShardedModel
    from tiers.nvme import NvmeStore

__all__ = [
    "ShardedSnapshotReport",
    "agree_or_raise",
    "all_gather_json",
    "raise_failed",
    "save_sharded",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ShardedSnapshotReport(SnapshotReport):
    """:class:`~swapper.zero.checkpoint.snapshot.SnapshotReport` of one rank (its part: ``path``,
    bytes written and named), with ``commit``: the commit record in rank 0's directory."""

    commit: Path | None = None


def save_sharded(
    model: ShardedModel,
    optimizer: StreamedOptimizer | None,
    *,
    name: str | None,
    extra: Mapping[str, Any] | None,
    keep_last: int | None,
) -> ShardedSnapshotReport:
    """:func:`swapper.zero.checkpoint.snapshot.save_snapshot` over several ranks (module
    docstring); call it on every rank alike. Its report is this rank's (its part's bytes
    and file) with ``commit`` the record's path in rank 0's directory.

    Raises:
        SwapConfigError, StateDictError, StepPendingError, TypeError, ValueError and what
            :func:`~swapper.manager.snapshot.snapshot_manager` raises, on the rank where it
            happened (no commit record is written: the snapshot does not exist);
        PeerFailedError: on the other ranks;
        DeferredStepError: this rank's overlapped update failed (PeerFailedError on the
            others; :meth:`~swapper.zero.sharded.model.ShardedModel.settle_update`);
        CollectiveError: a collective failed or timed out.
    """
    started = time.perf_counter()
    group = model.group
    manager_config = model.config.manager
    store = manager_config.store_name
    step = optimizer.step_count if optimizer is not None else 0
    name = f"step-{step:09d}" if name is None else name
    what = f"snapshot {name!r}"
    error: Exception | None = None
    meta: dict[str, Any] = {}
    model.settle_update(what)  # an overlapped update's end, agreed (raises on every rank)
    try:
        if not manager_config.nvme_dirs:
            raise SwapConfigError(f"{what}: snapshots need an NVMe tier (nvme_dirs is empty)")
        check_snapshot_name(name, store)
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise SwapConfigError(f"keep_last={keep_last!r} must be None or an int >= 1")
        check_saveable(model, optimizer)
        shard = {"rank": group.rank, "world_size": group.world_size, "plan": model.plan.digest()}
        meta = {  # the fields of swapper.zero.checkpoint.snapshot's snapshots, and the shard
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "optimizer": None if optimizer is None else optimizer_meta(optimizer),
            "rng": rng_state(),
            "extra": None if extra is None else dict(extra),
            "rebuilt": [],  # (parts are written whole: no 16-bit params left out yet)
            "shard": shard,
        }
    except Exception as exc:
        error = exc
    agree_or_raise(group, error, f"{what}: checks")
    base = Path(manager_config.nvme_dirs[0])
    record = commit_path(base, store, name)
    # The parts go under a store snapshot name no record uses (part_name): a snapshot of
    # this name already committed keeps its record and parts whole until the new record
    # has replaced it (one rename), so a kill at any moment leaves one of the two.
    plan: dict[str, Any] = {"error": None}
    if group.rank == 0:
        try:
            records, damaged = read_commits(base, store)
            old = next((r.part for r in records if r.name == name), None)
            plan = {
                "error": None,
                "part": part_name(name, {r.part for r in records} | set(damaged)),
                "old": old,
            }
        except Exception as exc:
            error = exc
            plan = {"error": f"{type(exc).__name__}: {exc}"}
    plans = all_gather_json(group, plan, f"{what}: naming the parts")
    raise_failed(group, error, [p["error"] for p in plans], f"{what}: reading the commit records")
    part: str = plans[0]["part"]
    replaced: str | None = plans[0]["old"]

    manager = model.manager
    mine: dict[str, Any] = {"error": None}
    done = None
    try:
        model.release_stale_holds()  # a forward or backward that raised
        model.drain()  # gathers started ahead hold shards
        kept = optimizer.stored_state.kept_released() if optimizer is not None else nullcontext()
        with kept:
            # (replace: a part of that name is one no record names, left by a kill)
            done = snapshot_manager(manager, part, extra=meta, replace=True)
        data = read_metadata(done.info.path, "snapshot file")
        mine = {
            "error": None,
            "path": done.info.path.relative_to(base).as_posix(),
            "digest": part_digest(data),
            "nbytes": len(data),
        }
    except Exception as exc:
        error = exc
        mine = {"error": f"{type(exc).__name__}: {exc}"}
    parts = all_gather_json(group, mine, f"{what}: the parts are durable")  # the barrier
    if any(p["error"] is not None for p in parts):
        if done is not None:  # never committed: this rank's part is of no use
            _drop_parts(model, [part])
        raise_failed(group, error, [p["error"] for p in parts], f"{what}: writing the parts")
    if group.rank == 0:
        try:
            records, _ = read_commits(base, store)
            rank_parts = [
                RankPart(r, p["path"], p["digest"], p["nbytes"]) for r, p in enumerate(parts)
            ]
            data = encode_commit(
                store=store, name=name, seq=max((r.seq for r in records), default=-1) + 1,
                step=step, world_size=group.world_size, created=time.time(), parts=rank_parts,
                part=part,
            )  # fmt: skip
            write_commit(base, data, store, name)  # (renamed over the replaced one's)
        except Exception as exc:
            error = exc
    agree_or_raise(group, error, f"{what}: writing the commit record {record}")
    if keep_last is not None:
        dropped = _retain(model, base, part, keep_last)
    elif replaced is not None and replaced != part:  # no record names it any more
        dropped = _drop_parts(model, [replaced])
    else:
        dropped = []
    if done is None:  # unreachable: a failed part raised above
        raise SwapConfigError(f"{what}: no part was written")
    info = done.info
    seconds = time.perf_counter() - started
    log.info(
        "snapshot %s (rank %d of %d): step %d, %d bytes written of %d named, %.3f s",
        name, group.rank, group.world_size, step, done.written_nbytes + info.file_nbytes,
        info.nbytes, seconds,
    )  # fmt: skip
    return ShardedSnapshotReport(
        name=name,
        step=step,
        seconds=seconds,
        written_nbytes=done.written_nbytes + info.file_nbytes,
        nbytes=info.nbytes,
        path=info.path,
        dropped=tuple(dropped),
        commit=record,
    )


def _retain(model: ShardedModel, base: Path, newest: str, keep_last: int) -> list[str]:
    """keep_last over the ranks: rank 0 removes the records beyond the newest
    ``keep_last`` (each durably, before any part), all ranks learn which parts are kept
    (store snapshot names), and each drops its parts of every other snapshot (older ones,
    replaced ones, and parts that never got a record). ``newest`` (the part just
    committed) is kept whatever the listing says. Returns the part names this rank
    dropped."""
    group = model.group
    store = model.config.manager.store_name
    keep: list[str] = []
    damaged_names: list[str] = []
    error: Exception | None = None
    if group.rank == 0:
        try:
            records, damaged = read_commits(base, store)
            damaged_names = sorted(damaged)
            others = [r for r in records if r.part != newest]
            keep = [newest] + [r.part for r in others[: keep_last - 1]]
            remove_orphan_commits(base, store)  # (a record's write cut off by a crash)
            for old in others[keep_last - 1 :]:
                remove_commit(old.path)
            for bad, why in damaged.items():  # never deleted unread: record and parts stay
                log.warning("snapshot retention: leaving a damaged commit record: %s", why)
                keep.append(bad)
        except Exception as exc:
            error = exc
    decided = all_gather_json(
        group,
        {
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "keep": keep,
            "damaged": damaged_names,
        },
        "snapshot retention (keep_last)",
    )
    if decided[0]["error"] is not None:
        # The new snapshot is committed; only the clean-up failed: said, not raised.
        log.warning("snapshot retention skipped: rank 0 failed: %s", decided[0]["error"])
        return []
    store_ = _store(model)
    kept = set(decided[0]["keep"])
    damaged = tuple(f"{n}--g" for n in decided[0]["damaged"])  # (their parts: unknown)
    doomed = [
        s.name for s in store_.snapshots() if s.name not in kept and not s.name.startswith(damaged)
    ]
    return _drop_parts(model, doomed)


def _store(model: ShardedModel) -> NvmeStore:
    """This rank's store (a sharded snapshot is taken only with an NVMe tier)."""
    store = snapshot_store(model.manager)
    if store is None:
        raise SwapConfigError("no NVMe tier: nvme_dirs is empty")
    return store


def _drop_parts(model: ShardedModel, names: list[str]) -> list[str]:
    """Drop this rank's parts ``names``; a failure is logged (the space is reclaimed by a
    later retention), never raised: the committed snapshots are whole either way."""
    store = _store(model)
    dropped: list[str] = []
    with at_waits:
        for name in names:
            try:
                store.drop_snapshot(name)
                dropped.append(name)
            except Exception as exc:
                log.warning("snapshot retention: cannot drop part %r: %s", name, exc)
    return dropped
