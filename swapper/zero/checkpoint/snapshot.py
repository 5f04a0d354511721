"""Training snapshots of an offloaded model and its optimizer, resume, and ``final_digest``.

Job: everything a run needs to continue bit-exactly after a stop or a crash, as one
retained snapshot of the store the model's manager already writes to:

* the tensors: the 16-bit parameters (``param16/param/<name>``), the optimizer's state
  sub-groups (``optim_state/<name>/state/<i>``: fp32 master, exp_avg, exp_avg_sq), and
  retained 16-bit gradients if any (dropped at resume); those dirty in memory are
  written first, those already current on NVMe are only named (:mod:`swapper.manager.snapshot`),
  except the 16-bit parameters that are exactly their fp32 masters rounded (those a step
  left dirty): neither written nor named, rebuilt from the masters at resume and checked
  against a digest (:mod:`swapper.zero.checkpoint.rebuild`), so a snapshot right after a step
  writes next to nothing;
* the rest, as the snapshot's JSON ``extra`` (one file with the tensors' extents, written
  atomically after they are durable, so a snapshot exists whole or not at all)::

      {"format": "swapper-training-snapshot", "version": 2, "step": 12,
       "optimizer": <swapper.step.resume.optimizer_meta> | null,
       "rng": {"cpu": "<base64 of torch.get_rng_state()>", "cuda": ["<base64>", ...]},
       "extra": <the user's JSON object> | null,
       "rebuilt": <swapper.zero.checkpoint.rebuild's list: parameters left out>}

  (version 1, before ``rebuilt``, is read too.)

Resume (``swapper.offload(..., resume=True | "name")``): the store is reopened, the newest
snapshot that reads whole (its file decodes, every tensor's bytes match their checksums;
a damaged one is logged and the one before it used) or the named one is chosen, every
key is switched back to it, and the model adopts the parameters it names (same names,
shapes and dtypes, or :class:`~swapper.step.StateDictError` naming the file); the RNG
states are restored; ``OffloadAdamW(..., tiers=model)`` then adopts the optimizer state
and counters (:mod:`swapper.step.resume`).

Crash safety comes from the store: a snapshot's file appears (rename) only once every
extent it names is durable, and those extents are never reused while it exists; a kill
at any moment leaves the previous snapshots whole, and what the killed run did after its
last snapshot is discarded at resume.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Set
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swapper.distributed.identity import refuse_other_layout
from swapper.manager import Kind, ManagerConfig, TierManager, UnknownKeyError
from swapper.manager.snapshot import open_at_snapshot, snapshot_manager
from swapper.step.optimizer import StepPendingError, StreamedOptimizer
from swapper.step.resume import ResumedState, optimizer_meta
from swapper.step.state import StateDictError
from swapper.zero.checkpoint.digest import final_digest
from swapper.zero.checkpoint.rebuild import Rebuilder, choose_left_out, register_rebuilt
from swapper.zero.checkpoint.rng import decode_rng as _decode_rng
from swapper.zero.checkpoint.rng import rng_state as _rng_state
from swapper.zero.checkpoint.rng import set_rng_state as _set_rng_state
from tiers import signals
from tiers.errors import SwapConfigError, SwapCorruptionError, SwapEOFError, SwapIOError
from tiers.nvme import NvmeStore
from tiers.nvme.snapshots import SnapshotDamagedError, SnapshotInfo, SnapshotNotFoundError
from tiers.signals import wait_future

if TYPE_CHECKING:
    from swapper.zero.local.offload import OffloadedModel
    from swapper.zero.sharded.model import ShardedModel

__all__ = [
    "SnapshotReport",
    "adopt_param",
    "final_digest",
    "finish_resume",
    "keeps_store",
    "open_manager",
    "save_snapshot",
]

log = logging.getLogger(__name__)

FORMAT = "swapper-training-snapshot"
VERSION = 2
#: the fields of each version read
_FIELDS = {
    1: frozenset({"format", "version", "step", "optimizer", "rng", "extra"}),
    2: frozenset({"format", "version", "step", "optimizer", "rng", "extra", "rebuilt"}),
}


@dataclasses.dataclass(frozen=True)
class SnapshotReport:
    """What :func:`save_snapshot` did.

    Attributes:
        name: the snapshot's name.
        step: the optimizer's step count it holds.
        seconds: wall time.
        written_nbytes: tensor bytes written (those dirty in memory), plus the file.
        nbytes: tensor bytes it holds (the state's size), ``rebuilt_nbytes`` included.
        path: its file.
        dropped: snapshots removed (``keep_last``, or one of the same name replaced).
    """

    name: str
    step: int
    seconds: float
    written_nbytes: int
    nbytes: int
    path: Path
    dropped: tuple[str, ...]
    rebuilt_nbytes: int = 0  #: 16-bit parameters left out, rebuilt from masters at resume


def save_snapshot(
    model: OffloadedModel | ShardedModel,
    optimizer: StreamedOptimizer | None = None,
    *,
    name: str | None = None,
    extra: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
) -> SnapshotReport:
    """Retain everything needed to continue training bit-exactly as one snapshot of the
    model's store (module docstring). Call it between steps (after ``zero_grad``: retained
    gradients would be written too, and are not resumed). With several ranks, call it on
    every rank alike: each rank's store snapshot is its part, and rank 0 writes one commit
    record once every part is durable (:mod:`swapper.zero.checkpoint.shard_snapshot`; the report is
    then a ``ShardedSnapshotReport``, with the record's path).

    Args:
        optimizer: the model's :class:`OffloadAdamW` (its state and counters are saved).
        name: default ``step-<step, 9 digits>``; a snapshot of that name is replaced.
        extra: the caller's JSON-able metadata (str keys; lists, not tuples), returned at
            resume as ``model.resumed.extra``.
        keep_last: keep only this many newest snapshots (>= 1; several ranks: applied
            to the records and every rank's parts once the new record is durable).

    Raises:
        SwapConfigError: the model has no NVMe tier, or the optimizer is not the model's;
            ``name`` or ``keep_last`` is unusable.
        StepPendingError: a step failed part-way (finish it with ``step()`` first).
        StateDictError: a load of the optimizer's state stopped part-way.
        TypeError, ValueError: ``extra`` or a param group setting cannot be kept as JSON.
        and what :func:`~swapper.manager.snapshot.snapshot_manager` raises (no snapshot).
        PeerFailedError, CollectiveError: several ranks, another rank failed (quoted) or
            a collective failed or timed out (no commit record: no snapshot).
    """
    from swapper.zero.sharded.model import ShardedModel  # (both import this module)

    if isinstance(model, ShardedModel):  # several ranks
        from swapper.zero.checkpoint.shard_snapshot import save_sharded

        return save_sharded(model, optimizer, name=name, extra=extra, keep_last=keep_last)
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        # (0 would drop the snapshot just taken, and report it as kept)
        raise SwapConfigError(f"keep_last={keep_last!r} must be None or an int >= 1")
    check_saveable(model, optimizer)
    started = time.perf_counter()
    step = optimizer.step_count if optimizer is not None else 0
    if name is None:
        name = f"step-{step:09d}"
    model.release_stale_holds()  # a forward or backward that raised
    model.end_persistence()  # (its holds released first: swapper.zero.local.persist)
    model.drop_kept_grads()  # (entries zero_grad kept empty: not written)
    left = choose_left_out(model.manager, optimizer)  # (before the kept sub-groups go)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "optimizer": None if optimizer is None else optimizer_meta(optimizer),
        "rng": _rng_state(),
        "extra": None if extra is None else dict(extra),
        "rebuilt": left.record,
    }
    kept = optimizer.stored_state.kept_released() if optimizer is not None else nullcontext()
    with kept:
        done = snapshot_manager(
            model.manager,
            name,
            extra=meta,
            keep_last=keep_last,
            replace=True,
            leave_out=left.versions,
        )
    info = done.info
    seconds = time.perf_counter() - started  # (choosing the left-out params included)
    log.info(
        "snapshot %s: step %d, %d bytes written of %d named (+ %d rebuilt at resume), %.3f s",
        name,
        step,
        done.written_nbytes + info.file_nbytes,
        info.nbytes,
        left.nbytes,
        seconds,
    )
    return SnapshotReport(
        name=info.name,
        step=step,
        seconds=seconds,
        written_nbytes=done.written_nbytes + info.file_nbytes,
        nbytes=info.nbytes + left.nbytes,
        path=info.path,
        dropped=done.dropped,
        rebuilt_nbytes=left.nbytes,
    )


def check_saveable(
    model: OffloadedModel | ShardedModel, optimizer: StreamedOptimizer | None
) -> None:
    """Refuse a snapshot of ``optimizer`` that would not resume (see :func:`save_snapshot`).

    Raises:
        SwapConfigError, StateDictError, StepPendingError: as :func:`save_snapshot`.
    """
    if optimizer is not None:
        if optimizer.manager is not model.manager:
            raise SwapConfigError(
                "save_snapshot: the optimizer keeps its state in another manager than the "
                "model's; build it with OffloadAdamW(model.parameters(), tiers=model)"
            )
        optimizer.wait_pending()  # an overlapped update finished (or its failure raised)
        view = optimizer.stored_state
        if view.load_incomplete:
            raise StateDictError(
                "a load_state_dict() or import_dcp() stopped part-way: the optimizer's state "
                "is partly old, partly loaded; load it again before taking a snapshot"
            )
        if view.pending is not None:
            raise StepPendingError(
                f"step {view.pending} failed part-way; call step() again to finish it "
                "before taking a snapshot"
            )


# -- resume --------------------------------------------------------------------------------


def open_manager(
    config: ManagerConfig, resume: bool | str
) -> tuple[TierManager, ResumedState | None]:
    """The manager for :class:`OffloadedModel`: a new one, or (``resume``) one opened at a
    snapshot with what the model and optimizer adopt.

    ``resume=True``: the newest usable snapshot; a new store when there is none (no store,
    or one without any snapshot). An older snapshot is used only when the newer ones are
    proven damaged (:func:`proves_damage`); an I/O error reading one is raised.
    ``resume="name"``: that snapshot, or an error.

    Raises:
        SwapConfigError: ``resume`` is not a bool or str, or there is no NVMe tier.
        SnapshotDamagedError: the named snapshot, or every snapshot there, is damaged
            (torn, corrupt, or its tensors' bytes fail their checksums); names the file.
        SnapshotNotFoundError: no snapshot of that name (the message lists them).
        WorldSizeMismatchError: the store holds snapshots of several ranks (their commit
            records), none of one process.
        StoreLayoutError: a store of that name in several ranks' layout is in a directory
            (open in another process or left on disk; names both layouts).
        SwapIOError: reading the newest snapshot failed with an I/O error that does not
            prove it damaged (EIO, EAGAIN...): names the snapshot and its file; nothing is
            rolled back (run again, or name an older snapshot).
        and what :class:`TierManager` and :meth:`TierManager.open` raise.
    """
    if resume is False:
        refuse_other_layout(config.nvme_dirs, config.store_name, None)  # several ranks'?
        return TierManager(config), None
    if not isinstance(resume, (bool, str)):
        raise SwapConfigError(f"resume={resume!r} must be True, False or a snapshot name")
    from swapper.zero.checkpoint.commit import refuse_other_world_size

    refuse_other_world_size(config.nvme_dirs, config.store_name)  # several ranks' store?
    refuse_other_layout(config.nvme_dirs, config.store_name, None)  # (and not resumed)
    chosen: list[ResumedState] = []

    def choose(store: NvmeStore) -> str | None:
        resumed = _choose(store, resume)
        if resumed is not None:
            chosen.append(resumed)
        return None if resumed is None else resumed.name

    # In a section: a Ctrl-C as open_at_snapshot returns would leave the manager open
    # (its store locked) with nobody to close it; it lands at a wait (the snapshot's
    # reads) or at the section's end, inside the try that closes it. (The caller keeps
    # the manager in a section of its own: see OffloadedModel.)
    manager: TierManager | None = None
    try:
        with signals.at_waits:
            manager = open_at_snapshot(config, choose)
            if manager is not None:  # the parameters the snapshot left out, dirty in memory
                register_rebuilt(manager, chosen[0].rebuilt)
                chosen[0].rebuilt = {}
    except BaseException:
        if manager is not None:
            manager.close()
        raise
    if manager is None:
        if isinstance(resume, str):
            raise SnapshotNotFoundError(
                f"resume={resume!r}: there is no store {config.store_name!r} in "
                f"{[str(d) for d in config.nvme_dirs]} to resume from"
            )
        return TierManager(config), None
    return manager, chosen[0]


def _choose(store: NvmeStore, resume: bool | str) -> ResumedState | None:
    infos = store.snapshots()  # oldest first
    damaged = store.damaged_snapshots()
    for why in damaged.values():
        log.warning("resume: ignoring a damaged snapshot: %s", why)
    if isinstance(resume, str):
        if resume in damaged:
            raise SnapshotDamagedError(damaged[resume])
        candidates = [i for i in infos if i.name == resume]
        if not candidates:
            raise SnapshotNotFoundError(
                f"resume={resume!r}: store {store.name!r} has no snapshot of that name (it "
                f"has {[i.name for i in infos]})"
            )
    else:
        if not infos and not damaged:
            return None
        if not infos:
            raise SnapshotDamagedError(
                f"resume: every snapshot of store {store.name!r} is damaged: "
                + "; ".join(damaged.values())
            )
        candidates = list(reversed(infos))
    failures: list[BaseException] = []
    for info in candidates:
        try:
            return _check(store, info)
        except (SnapshotDamagedError, SwapCorruptionError, SwapIOError) as exc:
            if isinstance(resume, str):
                raise
            if isinstance(exc, SwapIOError) and not proves_damage(exc):
                # a transient read error must not silently roll training back
                raise not_proven_damaged(exc, info.name, info.path) from exc
            log.warning("resume: snapshot %r is unusable, trying an older one: %s", info.name, exc)
            failures.append(exc)
    raise failures[0]  # (the newest's; the others are logged)


#: What proves a snapshot damaged or incomplete: its file torn or not a training
#: snapshot's, bytes failing their checksum, a file shorter than its extents. Only these
#: let ``resume=True`` fall back to an older snapshot.
DAMAGE_ERRORS: tuple[type[BaseException], ...] = (
    SnapshotDamagedError,
    SwapCorruptionError,
    SwapEOFError,
)


def proves_damage(exc: BaseException) -> bool:
    """Whether ``exc``, raised while checking a snapshot, proves it damaged or incomplete
    (:data:`DAMAGE_ERRORS`); any other error (EIO, EAGAIN, ...) says nothing of its bytes."""
    return isinstance(exc, DAMAGE_ERRORS)


def not_proven_damaged(exc: SwapIOError, name: str, path: Path) -> SwapIOError:
    """The error ``resume=True`` raises instead of falling back to an older snapshot when
    reading snapshot ``name`` (file ``path``) failed with an I/O error that proves
    nothing of its bytes: falling back would silently roll training back."""
    return SwapIOError(
        exc.errno,
        f"resume: reading snapshot {name!r} (file {path}) failed: {exc} -- an I/O error, "
        "not proof that the snapshot is damaged, so resume does not fall back to an older "
        "one (that would roll training back). Check the disk and run again; to resume "
        "from an older snapshot on purpose, pass resume='<its name>'",
        exc.filename or str(path),
    )


def _check(store: NvmeStore, info: SnapshotInfo) -> ResumedState:
    """The training metadata of ``info``, once its tensors read back whole.

    Raises:
        SnapshotDamagedError: its metadata is not a training snapshot's (names the file).
        SwapCorruptionError, SwapIOError: a tensor's bytes fail their checksum or cannot
            be read (named; :func:`proves_damage` tells which prove it damaged).
    """
    where = f"snapshot file {info.path}"
    meta = info.extra
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SnapshotDamagedError(
            f"{where} is not a training snapshot (taken by NvmeStore.snapshot directly?)"
        )
    version = meta.get("version")
    fields = _FIELDS.get(version) if type(version) is int else None
    if meta.keys() != fields:
        raise SnapshotDamagedError(
            f"{where}: training snapshot fields {sorted(meta)} of version "
            f"{meta.get('version')!r}; this swapper reads versions {sorted(_FIELDS)}"
        )
    step, optimizer = meta["step"], meta["optimizer"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise SnapshotDamagedError(f"{where}: step={step!r} is not an int >= 0")
    if optimizer is not None and not isinstance(optimizer, dict):
        raise SnapshotDamagedError(f"{where}: optimizer is not an object")
    _decode_rng(meta["rng"], where)  # checked now: a bad one is a damaged snapshot
    rebuilder = Rebuilder(meta.get("rebuilt", []), store, info, where)
    largest = max((store.snapshot_tensor(info.name, k).nbytes for k in info.keys), default=0)
    scratch = torch.empty(largest, dtype=torch.uint8)
    for key in info.keys:
        nbytes = store.snapshot_tensor(info.name, key).nbytes
        future = store.read_snapshot(info.name, key, scratch[:nbytes])
        wait_future(future, None, "resume.read")  # (Ctrl-C stops a long verification here)
        future.result()
        rebuilder.feed(key, scratch[:nbytes])
    return ResumedState(
        name=info.name,
        path=info.path,
        step=step,
        optimizer=optimizer,
        extra=meta["extra"],
        rng=meta["rng"],
        rebuilt=rebuilder.finish(),
    )


def adopt_param(manager: TierManager, resumed: ResumedState, key: str, param: torch.Tensor) -> None:
    """Check that the resumed manager holds parameter ``key`` as ``param`` is shaped.

    Raises:
        StateDictError: it holds no such parameter, or one of another shape or dtype: the
            snapshot is of another model (names the file).
    """
    where = f"snapshot file {resumed.path}"
    try:
        info = manager.info(key)
    except UnknownKeyError:
        raise StateDictError(
            f"{where} holds no parameter {key.removeprefix('param/')!r}: it is of another model"
        ) from None
    if info.kind is not Kind.PARAM16 or tuple(info.shape) != tuple(param.shape):
        raise StateDictError(
            f"{where}: parameter {key.removeprefix('param/')!r} is {list(info.shape)} "
            f"there, {list(param.shape)} here: the snapshot is of another model"
        )
    if not param.is_meta and info.dtype != param.dtype:
        raise StateDictError(
            f"{where}: parameter {key.removeprefix('param/')!r} is {info.dtype} there, "
            f"{param.dtype} here"
        )


def finish_resume(manager: TierManager, own: Set[str], resumed: ResumedState) -> None:
    """After every parameter is adopted into ``manager``: refuse parameters the model
    lacks (``own``: the model's parameter keys, ``param/<name>``), drop the retained
    gradients (a resumed run starts its step afresh), restore the RNG states, and leave
    the user's ``extra`` in ``resumed.extra``. (The model hands over its manager and keys,
    not itself: this module is below the models.)

    Raises:
        StateDictError: the snapshot holds a parameter this model lacks (names the file).
    """
    keys = manager.keys()
    for key in keys:
        if key.startswith("param/") and key not in own:
            raise StateDictError(
                f"snapshot file {resumed.path} holds parameter {key.removeprefix('param/')!r}, "
                "which this model lacks: it is of another model"
            )
    for key in keys:
        if manager.info(key).kind in (Kind.GRAD16, Kind.GRAD32):  # (retained gradients)
            manager.unregister(key)
    restore_rng(resumed)
    log.info("resumed from snapshot %r (step %d, %s)", resumed.name, resumed.step, resumed.path)


def verify_snapshot(store: NvmeStore, info: SnapshotInfo) -> ResumedState:
    """The training metadata of ``info`` once its tensors read back whole (what resume
    checks of each candidate; several ranks check each part with it).

    Raises:
        as ``_check``: SnapshotDamagedError, SwapCorruptionError, SwapIOError.
    """
    return _check(store, info)


def restore_rng(resumed: ResumedState) -> None:
    """Set this process's RNG states to those the snapshot recorded.

    Raises:
        SnapshotDamagedError: they do not decode (names the file).
    """
    _set_rng_state(_decode_rng(resumed.rng, str(resumed.path)))


def keeps_store(manager: TierManager) -> bool:
    """Whether the manager's store holds snapshots (then closing must keep its files)."""
    store = manager._ctx.store
    return store is not None and bool(store.snapshots() or store.damaged_snapshots())
