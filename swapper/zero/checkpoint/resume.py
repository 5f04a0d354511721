"""Resume of a training snapshot, below the models: the manager opened at a snapshot, the
parameters adopted, the resume finished (:mod:`swapper.zero.checkpoint.snapshot` is the save
half, above the models, and says what a snapshot holds).

Job: what :class:`~swapper.zero.local.offload.OffloadedModel` (``open_manager``,
``adopt_param``, ``finish_resume``, ``keeps_store``) and the sharded resume
(:mod:`swapper.zero.checkpoint.shard_resume`: ``verify_snapshot``, ``proves_damage``,
``not_proven_damaged``, ``finish_resume``) call while they are built or closed. It takes a
manager, keys and tensors, never a model: the models import it, and it imports no model
(nor the save half), so the checkpoint room is not in a knot with them.

Resume (``swapper.offload(..., resume=True | "name")``): the store is reopened, the newest
snapshot that reads whole (its file decodes, every tensor's bytes match their checksums;
a damaged one is logged and the one before it used) or the named one is chosen, every
key is switched back to it, and the model adopts the parameters it names (same names,
shapes and dtypes, or :class:`~swapper.step.StateDictError` naming the file); the RNG
states are restored; ``OffloadAdamW(..., tiers=model)`` then adopts the optimizer state
and counters (:mod:`swapper.step.resume`).
"""

from __future__ import annotations

import logging
from collections.abc import Set
from pathlib import Path

import torch

from swapper.distributed.identity import refuse_other_layout
from swapper.manager import Kind, ManagerConfig, TierManager, UnknownKeyError
from swapper.manager.snapshot import open_at_snapshot, snapshot_store
from swapper.step.resume import ResumedState
from swapper.step.state import StateDictError
from swapper.zero.checkpoint.commit import refuse_other_world_size
from swapper.zero.checkpoint.rebuild import Rebuilder, register_rebuilt
from swapper.zero.checkpoint.rng import decode_rng as _decode_rng
from swapper.zero.checkpoint.rng import set_rng_state as _set_rng_state
from tiers import signals
from tiers.errors import SwapConfigError, SwapCorruptionError, SwapEOFError, SwapIOError
from tiers.nvme import NvmeStore
from tiers.nvme.snapshots import SnapshotDamagedError, SnapshotInfo, SnapshotNotFoundError
from tiers.signals import wait_future

__all__ = [
    "DAMAGE_ERRORS",
    "FORMAT",
    "VERSION",
    "adopt_param",
    "finish_resume",
    "keeps_store",
    "not_proven_damaged",
    "open_manager",
    "proves_damage",
    "restore_rng",
    "verify_snapshot",
]

log = logging.getLogger("swapper.zero.checkpoint.snapshot")  # (one logger for both halves)

#: The snapshot's JSON ``extra`` (:mod:`swapper.zero.checkpoint.snapshot` writes it):
FORMAT = "swapper-training-snapshot"
VERSION = 2
#: the fields of each version read
_FIELDS = {
    1: frozenset({"format", "version", "step", "optimizer", "rng", "extra"}),
    2: frozenset({"format", "version", "step", "optimizer", "rng", "extra", "rebuilt"}),
}


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
    store = snapshot_store(manager)
    return store is not None and bool(store.snapshots() or store.damaged_snapshots())
