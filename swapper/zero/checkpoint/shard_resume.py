"""Resume over several ranks: every rank agrees on one committed snapshot, then adopts it.

Job: :func:`choose_sharded`, called by :func:`~swapper.zero.sharded.setup.place_model` for
``swapper.offload(model, config, group, resume=...)`` before any shard is placed, and
:func:`adopt_shard` / :func:`finish_sharded_resume` while and after they are.

Choosing, on every rank alike (every decision is made from data all ranks hold, so all
ranks decide the same, or raise the same error):

1. local, nothing raised yet: rank 0 reads the commit records in its configured NVMe
   directory (:mod:`swapper.zero.checkpoint.commit`); each rank claims its directories,
   opens its store (if any) and digests each of its parts' files;
2. one :func:`~swapper.zero.checkpoint.shard_snapshot.all_gather_json` of all that;
3. a snapshot of another world size (the newest record, or the named one; or one
   process's snapshots and no record) is refused everywhere with a
   :class:`~swapper.zero.checkpoint.commit.WorldSizeMismatchError` that says to reshard
   through the DCP export; then a rank's local failure fails every rank;
4. candidates, newest first (``resume=True``) or the named one: a record whose part on
   some rank is missing, damaged or not the one it digested is passed over with a
   logged reason (named: :class:`~swapper.zero.checkpoint.commit.CommitRecordError`
   naming the record and the part);
5. each rank reads its part's tensors back (checksums) and checks its training fields
   and shard (rank, world size, partition); one all_gather of the verdicts; a failure
   anywhere passes the candidate over everywhere (named: raised);
6. each rank switches its store to the chosen part (durably), and the manager is opened
   on it by :func:`~swapper.zero.sharded.setup.place_model` (which agrees on the outcome).

No record at all (and no damaged one): a fresh start, each rank's leftover store
removed (parts without a record are a snapshot that never completed).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from swapper.distributed import DistGroup
from swapper.distributed.identity import claim_store_identity
from swapper.manager import Kind, ManagerConfig, TierManager, UnknownKeyError
from swapper.step.resume import ResumedState
from swapper.step.state import StateDictError
from swapper.zero.checkpoint.agree import agree_or_raise, all_gather_json, raise_failed
from swapper.zero.checkpoint.commit import (
    CommitRecordError,
    WorldSizeMismatchError,
    part_digest,
    read_commits,
    reshard_advice,
)
from swapper.zero.checkpoint.resume import (
    finish_resume,
    not_proven_damaged,
    proves_damage,
    verify_snapshot,
)
from swapper.zero.config.offload import OffloadConfig
from tiers.aio import AioEngine
from tiers.errors import SwapConfigError, SwapIOError
from tiers.nvme import NvmeStore, remove_store
from tiers.nvme.metafiles import StoreFiles, read_metadata
from tiers.nvme.records import ManifestError
from tiers.nvme.snapshots import SnapshotDamagedError, SnapshotNotFoundError

__all__ = ["ResumeChoice", "ShardRecord", "adopt_shard", "choose_sharded", "finish_sharded_resume"]


class ShardRecord(Protocol):
    """What the resume reads of one parameter's record on this rank (the sharded model's
    :class:`~swapper.zero.sharded.state.ShardSlot` is one): named here so that this
    module, which the sharded set-up calls, does not import the sharded room back."""

    @property
    def name(self) -> str:
        """The parameter's name in the model."""
        ...

    @property
    def key(self) -> str:
        """Its shard's key in this rank's manager (``param/<name>``)."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The parameter's 16-bit dtype."""
        ...

    @property
    def local_numel(self) -> int:
        """Elements this rank stores of it (padding included; 0: another rank owns it)."""
        ...


log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ResumeChoice:
    """What :func:`choose_sharded` decided: this rank's manager config (its own
    directories) and the snapshot its store now stands at (None: a fresh start)."""

    config: ManagerConfig
    resumed: ResumedState | None


class _Local:
    """This rank's view before the agreement (step 1), and its open store."""

    def __init__(self) -> None:
        self.store: NvmeStore | None = None
        self.engine: AioEngine | None = None
        self.error: Exception | None = None
        self.config: ManagerConfig | None = None

    def close(self, *, remove: bool = False) -> None:
        try:
            if self.store is not None:
                self.store.close(remove=remove)
        finally:
            self.store = None
            if self.engine is not None:
                self.engine.close()
                self.engine = None


def choose_sharded(
    config: OffloadConfig, group: DistGroup, resume: bool | str, plan_digest: str
) -> ResumeChoice:
    """Agree on the snapshot to resume from and switch every rank's store to it (module
    docstring). Call it on every rank alike.

    Raises (on every rank alike, unless said):
        SwapConfigError: ``resume`` is not a bool or str; no NVMe tier.
        WorldSizeMismatchError: the snapshot was taken at another world size (names the
            commit record, or one process's snapshot file).
        SnapshotNotFoundError: ``resume="name"`` and no commit record of that name.
        CommitRecordError: the named snapshot's record is damaged, or names a part that
            is missing, damaged or another (names the record and the part).
        SnapshotDamagedError: every committed snapshot is unusable (the reasons listed),
            or the named one's part fails its checks (names the file).
        StateDictError: the snapshot is of another model partition (names the file).
        StoreIdentityError, ManifestError, SwapIOError, ...: this rank's own failure to
            open its store, or to read its part of the newest snapshot with an I/O error
            that does not prove it damaged (never passed over); PeerFailedError: another
            rank's (quoted).
        CollectiveError: a collective failed or timed out.
    """
    what = "choosing the snapshot to resume from"
    mc = config.manager
    local = _Local()
    view: dict[str, Any] = {"error": None, "parts": {}, "damaged": {}}
    try:
        if not isinstance(resume, (bool, str)):
            raise SwapConfigError(f"resume={resume!r} must be True, False or a snapshot name")
        if not mc.nvme_dirs:
            raise SwapConfigError("resume needs an NVMe tier: nvme_dirs is empty")
        base = Path(mc.nvme_dirs[0])
        if group.rank == 0:
            records, damaged = read_commits(base, mc.store_name)
            view["commits"] = [
                {"name": r.name, "part": r.part, "seq": r.seq, "world_size": r.world_size,
                 "path": str(r.path), "parts": [[p.path, p.digest] for p in r.parts]}
                for r in records
            ]  # fmt: skip
            view["damaged_commits"] = damaged
            view["single"] = [str(p) for _, p in StoreFiles((base,), mc.store_name).snapshots()]
        _open_local(local, config, group, view)
    except Exception as exc:
        local.error = exc
        view = {"error": f"{type(exc).__name__}: {exc}", "parts": {}, "damaged": {}}
    except BaseException:  # a Ctrl-C: its store must not stay open (locked) behind it
        local.close()
        raise
    everyone = all_gather_json(group, view, what)
    try:
        return _decide(local, everyone, group, resume, plan_digest)
    finally:
        local.close()


def _open_local(
    local: _Local, config: OffloadConfig, group: DistGroup, view: dict[str, Any]
) -> None:
    mc = config.manager
    dirs = claim_store_identity(mc.nvme_dirs, mc.store_name, group.rank, group.world_size)
    local.config = dataclasses.replace(mc, nvme_dirs=dirs)
    files = StoreFiles(tuple(dirs), mc.store_name)
    if not files.manifest.exists():
        if files.snapshots():
            raise ManifestError(
                f"{files.manifest} is missing but snapshot files of store {mc.store_name!r} "
                f"are there ({files.snapshots()[0][1]}, ...): restore the manifest, or "
                "delete the store with tiers.nvme.remove_store"
            )
        return
    local.engine = AioEngine(mc.aio)
    local.store = NvmeStore.open(dirs, local.engine, name=mc.store_name, verify=mc.verify)
    for info in local.store.snapshots():
        data = read_metadata(info.path, "snapshot file")
        view["parts"][info.name] = part_digest(data)
    view["damaged"] = local.store.damaged_snapshots()
    view["store"] = True


def _decide(
    local: _Local, everyone: list[Any], group: DistGroup, resume: bool | str, plan: str
) -> ResumeChoice:
    world = group.world_size
    zero = everyone[0]
    commits: list[dict[str, Any]] = zero.get("commits") or []
    damaged_commits: dict[str, str] = zero.get("damaged_commits") or {}
    named = [c for c in commits if c["name"] == resume] if isinstance(resume, str) else commits
    if named and named[0]["world_size"] != world:
        c = named[0]
        raise WorldSizeMismatchError(
            f"commit record {c['path']}: snapshot {c['name']!r}: "
            + reshard_advice(c["world_size"], world),
            path=c["path"], found=c["world_size"], expected=world,
        )  # fmt: skip
    if not commits and not damaged_commits and zero.get("single"):
        raise WorldSizeMismatchError(
            f"snapshot file {zero['single'][0]} is one process's: " + reshard_advice(1, world),
            path=zero["single"][0], found=1, expected=world,
        )  # fmt: skip
    raise_failed(group, local.error, [v["error"] for v in everyone], "resume: opening the stores")
    if local.config is None:  # unreachable: raise_failed raised on this rank
        raise SwapConfigError("resume: this rank's store was not opened")
    if isinstance(resume, str):
        if resume in damaged_commits:
            raise CommitRecordError(damaged_commits[resume])
        if not named:
            raise SnapshotNotFoundError(
                f"resume={resume!r}: no commit record of that name (there are "
                f"{[c['name'] for c in commits]}); a snapshot without one never completed"
            )
    for why in damaged_commits.values():
        log.warning("resume: ignoring a damaged commit record: %s", why)
    if not named:
        if damaged_commits:
            raise SnapshotDamagedError(
                "resume: every commit record is damaged: " + "; ".join(damaged_commits.values())
            )
        orphans = sorted({n for v in everyone for n in v["parts"]})
        if orphans:
            log.warning("resume: parts %s have no commit record (never completed)", orphans)
        if any(v.get("store") for v in everyone):  # (else a first run: nothing to say)
            log.warning("resume: no committed snapshot; starting afresh")
        error: Exception | None = None
        try:
            local.close(remove=True)
            config = local.config
            remove_store(config.nvme_dirs, name=config.store_name)
            # remove_store took the identity record too: this rank's fresh store claims
            # its directories again (they are <shared dir>/rank{r}of{N}).
            claim_store_identity(
                [Path(d).parent for d in config.nvme_dirs],
                config.store_name,
                group.rank,
                group.world_size,
            )
        except Exception as exc:
            error = exc
        agree_or_raise(group, error, "resume: removing the stores to start afresh")
        return ResumeChoice(local.config, None)
    reasons: list[str] = []
    for c in named:
        if c["world_size"] != world:  # an older record of another run: not this one's
            why = f"commit record {c['path']}: " + reshard_advice(c["world_size"], world)
        else:
            why = _parts_missing(c, everyone)
        if why is None:
            resumed, why = _verify_everywhere(local, group, c, plan, fatal=isinstance(resume, str))
            if resumed is not None:
                error = None
                try:
                    if local.store is None:  # unreachable: a part was verified in it
                        raise SwapConfigError("resume: this rank's store is not open")
                    local.store.restore_snapshot(c["part"])
                except Exception as exc:
                    error = exc
                agree_or_raise(group, error, f"resume: switching the stores to {c['name']!r}")
                return ResumeChoice(local.config, resumed)
        if isinstance(resume, str):
            raise CommitRecordError(why)
        log.warning("resume: snapshot %r is unusable, trying an older one: %s", c["name"], why)
        reasons.append(why)
    raise SnapshotDamagedError(
        "resume: every committed snapshot is unusable: " + "; ".join(reasons)
    )


def _parts_missing(commit: dict[str, Any], everyone: list[Any]) -> str | None:
    """Why a record's parts are not all there as it digested them (None: they are)."""
    name = commit["part"]
    for r, (path, digest) in enumerate(commit["parts"]):
        view = everyone[r]
        found = view["parts"].get(name)
        if found is None:
            state = f"damaged ({view['damaged'][name]})" if name in view["damaged"] else "missing"
            return f"commit record {commit['path']}: rank {r}'s part {path} is {state}"
        if found != digest:
            return (
                f"commit record {commit['path']}: rank {r}'s part {path} is not the one it "
                "committed (its digest differs: changed or replaced since)"
            )
    return None


def _verify_everywhere(
    local: _Local, group: DistGroup, commit: dict[str, Any], plan: str, *, fatal: bool
) -> tuple[ResumedState | None, str]:
    """Every rank reads its part back and checks it; one all_gather of the verdicts.
    Returns (this rank's resumed state, "") when all passed, else (None, the reasons).

    Only a part proven damaged or incomplete
    (:func:`~swapper.zero.checkpoint.snapshot.proves_damage`,
    or missing) lets the caller pass the snapshot over: any other error (a transient
    EIO reading a part) is raised on every rank, never a silent roll-back.

    Raises:
        StateDictError: the part is of another partition (on every rank).
        SwapIOError: reading a part failed without proving it damaged (on its rank, naming
            the snapshot and file; PeerFailedError elsewhere).
        the part's own error when ``fatal`` (on its rank; PeerFailedError elsewhere).
    """
    name = commit["part"]  # (the store snapshot name: the record's, unless saved again)
    resumed: ResumedState | None = None
    error: Exception | None = None
    other_model = False
    unproven = False  # an error that proves nothing of the part: raised everywhere
    path: Path | None = None
    try:
        if local.store is None:
            raise SnapshotNotFoundError(f"snapshot {name!r}: this rank has no store")
        info = next(i for i in local.store.snapshots() if i.name == name)
        path = info.path
        shard = info.extra.get("shard") if isinstance(info.extra, dict) else None
        if isinstance(info.extra, dict):  # checked as one process's, less the shard
            rest = {k: v for k, v in info.extra.items() if k != "shard"}
            info = dataclasses.replace(info, extra=rest)
        resumed = verify_snapshot(local.store, info)
        resumed.name = commit["name"]  # (the snapshot's name, not its parts')
        expected = {"rank": group.rank, "world_size": group.world_size, "plan": plan}
        if not isinstance(shard, dict) or shard.keys() != expected.keys():
            raise SnapshotDamagedError(f"snapshot file {info.path}: no shard record")
        if (shard["rank"], shard["world_size"]) != (group.rank, group.world_size):
            raise SnapshotDamagedError(
                f"snapshot file {info.path} is rank {shard['rank']} of {shard['world_size']}'s "
                f"part, found as rank {group.rank} of {group.world_size}'s"
            )
        if shard["plan"] != plan:
            other_model = True
            raise StateDictError(
                f"snapshot file {info.path} is of another partition (another model, or other "
                "partition settings) than this model's"
            )
    except Exception as exc:  # (damaged, corrupt, unreadable: said at the agreement below)
        error = exc
        if not (other_model or proves_damage(exc) or isinstance(exc, SnapshotNotFoundError)):
            unproven = True
            if isinstance(exc, SwapIOError):
                error = not_proven_damaged(exc, commit["name"], path or Path(name))
                error.__cause__ = exc
    mine = {"error": None if error is None else f"{type(error).__name__}: {error}",
            "other_model": other_model, "unproven": unproven}  # fmt: skip
    verdicts = all_gather_json(group, mine, f"resume: checking snapshot {name!r}")
    messages = [v["error"] for v in verdicts]
    if any(v["other_model"] or v["unproven"] for v in verdicts) or fatal:
        raise_failed(group, error, messages, f"resume: snapshot {name!r}")
    failed = [f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None]
    if failed:
        return None, f"snapshot {name!r}: " + "; ".join(failed)
    return resumed, ""


def adopt_shard(manager: TierManager, resumed: ResumedState, slot: ShardRecord) -> None:
    """Check that the resumed manager holds ``slot``'s shard as planned (a parameter this
    rank stores nothing of: it holds none).

    Raises:
        StateDictError: it holds none, or one of another shape or dtype (names the file).
    """
    where = f"snapshot file {resumed.path}"
    try:
        info = manager.info(slot.key)
    except UnknownKeyError:
        if slot.local_numel == 0:
            return
        raise StateDictError(f"{where} holds no shard of parameter {slot.name!r}") from None
    if (
        info.kind is not Kind.PARAM16
        or tuple(info.shape) != (slot.local_numel,)
        or info.dtype != slot.dtype
    ):
        raise StateDictError(
            f"{where}: the shard of {slot.name!r} is {info.kind.value} {info.dtype} "
            f"{list(info.shape)}; this model's is param16 {slot.dtype} [{slot.local_numel}]"
        )


def finish_sharded_resume(
    manager: TierManager, slots: Sequence[ShardRecord], resumed: ResumedState
) -> None:
    """After every shard is adopted: refuse parameters the model lacks, drop retained
    gradients, restore this rank's RNG states (:func:`finish_resume` over this rank's
    shard keys).

    Raises:
        StateDictError: the part holds a parameter this model lacks (names the file).
    """
    finish_resume(manager, {s.key for s in slots}, resumed)
