"""A manager's tensors as one retained store snapshot, and a manager opened at one.

Job: the two manager-level halves of a checkpoint. :func:`snapshot_manager` makes every
tensor's NVMe copy current (the dirty ones written, memory kept; the clean ones only
named) and then has the store retain them under a name
(:meth:`tiers.nvme.NvmeStore.snapshot`: a manifest switch, nothing copied).
:func:`open_at_snapshot` switches a store left by an earlier run (closed or killed) back
to a chosen snapshot and reopens a :class:`~swapper.manager.TierManager` on it.

What a training snapshot adds on top (step counters, RNG, the optimizer's layout) is
:mod:`swapper.zero.checkpoint`'s; this module knows only tensors and keys.

Both are for a quiet manager: nothing fetched, nothing else calling it meanwhile (a
training loop between steps). :func:`snapshot_manager` checks that and refuses otherwise,
because a tensor in use may change after its bytes were named.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from swapper.manager.config import ManagerConfig, Tier
from swapper.manager.core import TierManager
from swapper.manager.entry import EntryState, SwapEntry
from swapper.manager.errors import EntryInUseError, NotDurableError
from swapper.manager.shared import store_key_of
from tiers.aio import AioEngine
from tiers.errors import SwapConfigError
from tiers.nvme import NvmeStore, remove_store
from tiers.nvme.metafiles import StoreFiles
from tiers.nvme.records import ManifestError
from tiers.nvme.snapshots import SnapshotInfo
from tiers.signals import at_waits

__all__ = [
    "ManagerSnapshot",
    "dirty_in_memory",
    "entry_versions",
    "open_at_snapshot",
    "snapshot_manager",
    "snapshot_store",
]

log = logging.getLogger("swapper.manager")


@dataclasses.dataclass(frozen=True)
class ManagerSnapshot:
    """What :func:`snapshot_manager` did.

    Attributes:
        info: the store's record of the snapshot (name, keys, bytes named, its file).
        written_nbytes: tensor bytes written to make the NVMe copies current (the dirty
            ones); the snapshot's file (``info.file_nbytes``) comes on top.
        seconds: wall time of the whole call.
        dropped: snapshots removed by ``keep_last`` (and a same-named one replaced).
        left_out: the keys of ``leave_out`` neither written nor named (see
            :func:`snapshot_manager`).
    """

    info: SnapshotInfo
    written_nbytes: int
    seconds: float
    dropped: tuple[str, ...]
    left_out: tuple[str, ...] = ()


def snapshot_store(manager: TierManager) -> NvmeStore | None:
    """The store holding ``manager``'s snapshots (to list or drop them: the training
    snapshots' retention, whether closing must keep the files), or None without an NVMe
    tier. Taking a snapshot goes through :func:`snapshot_manager`, never the store."""
    return manager._ctx.store


def entry_versions(manager: TierManager, keys: Iterable[str]) -> dict[str, int]:
    """The modification counter of each of ``keys`` that is registered (bumped by every
    ``release(modified=True)``): equal counters mean nobody released the tensor as
    modified in between."""
    ctx = manager._ctx
    with ctx.cond:
        return {k: e.version for k in keys if (e := ctx.entries.get(k)) is not None}


def dirty_in_memory(
    manager: TierManager, keys: Iterable[str], *, timeout_s: float | None = None
) -> dict[str, tuple[int, Tier]]:
    """Of ``keys``, those whose bytes are only in memory (their NVMe copy stale or
    missing), resident and unused, once the transfers under way have ended: key →
    (modification counter, memory tier). What :func:`snapshot_manager` may leave out.

    Raises:
        ManagerTimeout: the transfers did not end within ``timeout_s`` (default
            ``config.close_timeout_s``).
        ManagerClosedError: the manager is closed.
    """
    ctx = manager._ctx
    timeout = manager.config.close_timeout_s if timeout_s is None else timeout_s
    with at_waits, ctx.cond:
        ctx.check_open()
        ctx.wait_for_transfers(time.monotonic() + timeout)
        found: dict[str, tuple[int, Tier]] = {}
        for key in keys:
            e = ctx.entries.get(key)
            if e is not None and _leavable(e) and e.tier is not None:
                found[key] = (e.version, e.tier)
        return found


def _leavable(entry: SwapEntry) -> bool:
    return entry.state is EntryState.RESIDENT and not entry.clean and not entry.users


def snapshot_manager(
    manager: TierManager,
    name: str,
    *,
    extra: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
    replace: bool = False,
    timeout_s: float | None = None,
    leave_out: Mapping[str, int] | None = None,
) -> ManagerSnapshot:
    """Retain every tensor of ``manager`` as it is now under snapshot ``name`` of its store.

    Waits for transfers under way, writes each tensor whose NVMe copy is stale (memory
    kept, as :meth:`TierManager.flush`), then takes the store snapshot; tensors already
    current on NVMe cost nothing but their line in the snapshot file.

    Args:
        name: the store snapshot's name (1 to 64 letters, digits, '_' or '-').
        extra: JSON-able metadata kept with it (see :meth:`NvmeStore.snapshot`).
        keep_last: then keep only this many newest snapshots.
        replace: a snapshot of that name (or a damaged file of that name, logged) is
            replaced, atomically (:meth:`NvmeStore.snapshot` ``replace``); else it is
            an error.
        timeout_s: for the transfers and writes (default ``config.close_timeout_s``).
        leave_out: key → modification counter (:func:`entry_versions`): each such tensor
            still at that counter and dirty in memory (:func:`dirty_in_memory`) is neither
            written nor named by the snapshot (it stays dirty in memory); the caller
            keeps in ``extra`` what rebuilds it. A resume at the snapshot finds no such
            key (:meth:`NvmeStore.restore_snapshot` deletes it).

    Raises:
        SwapConfigError: the manager has no NVMe tier.
        EntryInUseError: a tensor is fetched (in use); release it first (named).
        NotDurableError: some writes failed or did not end in time (named), or a tensor
            of ``leave_out`` changed or was written meanwhile; no snapshot.
        SnapshotExistsError: ``name`` is taken and not ``replace``.
        SwapIOError, TypeError, ValueError: as :meth:`NvmeStore.snapshot`.
        ManagerClosedError: the manager is closed.
    """
    started = time.perf_counter()
    ctx = manager._ctx
    store = ctx.nvme()
    timeout = manager.config.close_timeout_s if timeout_s is None else timeout_s
    deadline = time.monotonic() + timeout
    with at_waits:
        with ctx.cond:
            ctx.check_open()
            ctx.wait_for_transfers(deadline)
            busy = sorted(e.key for e in ctx.entries.values() if e.users)
            wanted = leave_out or {}
            left = sorted(
                k
                for k, version in wanted.items()
                if (e := ctx.entries.get(k)) is not None and e.version == version and _leavable(e)
            )
            changed = sorted(set(wanted) - set(left))
            dirty_nbytes = sum(
                e.nbytes for e in ctx.entries.values() if not e.clean and e.key not in wanted
            )
        if busy:
            raise EntryInUseError(
                f"snapshot {name!r}: {len(busy)} tensor(s) are in use (fetched, not released): "
                f"{', '.join(map(repr, busy[:5]))}; take snapshots between steps"
            )
        if changed:
            # What the caller recorded to rebuild them would not be what they hold.
            raise NotDurableError(
                f"snapshot {name!r}: {len(changed)} tensor(s) to leave out changed, moved or "
                f"were written since they were chosen ({', '.join(map(repr, changed[:5]))}); "
                "take it while nothing else uses the manager",
                keys=changed,
                errors={},
            )
        manager._jobs.flush(deadline, final=False, skip=frozenset(left))
        with ctx.cond:
            ctx.wait_for_transfers(deadline)
            stale = sorted(
                e.key
                for e in ctx.entries.values()
                if e.state.transient
                or (not e.clean and (e.key not in wanted or e.version != wanted[e.key]))
            )
        if stale:
            # Another thread used the manager meanwhile: the copies would not be one moment.
            raise NotDurableError(
                f"snapshot {name!r}: {len(stale)} tensor(s) changed or moved while it was "
                f"being taken ({', '.join(map(repr, stale[:5]))}); take it while nothing "
                "else uses the manager",
                keys=stale,
                errors={},
            )
        dropped: list[str] = []
        damaged = store.damaged_snapshots()
        if replace and name in damaged:
            # (found damaged at open, logged, and never used since: this one replaces it)
            log.warning("snapshot %r replaces a damaged file of that name: %s", name, damaged[name])
        replaced = replace and (name in damaged or any(s.name == name for s in store.snapshots()))
        excluded = [store_key_of(ctx.entries[k]) for k in left]
        # Replaced in one rename, not dropped first: a failure or a kill before the new
        # one is durable must leave the old one (with keep_last=1, the only one).
        info = store.snapshot(name, extra=extra, exclude=excluded, replace=replace)
        if replaced:
            dropped.append(name)
        if keep_last is not None:
            dropped.extend(store.prune_snapshots(keep_last=keep_last))
    seconds = time.perf_counter() - started
    return ManagerSnapshot(info, dirty_nbytes, seconds, tuple(dropped), tuple(left))


#: choose(store) → the name of the snapshot to open at, or None: there is nothing to
#: resume (the store is then removed and a new one made). Raises to refuse.
Choose = Callable[[NvmeStore], "str | None"]


def open_at_snapshot(config: ManagerConfig, choose: Choose) -> TierManager | None:
    """A manager on the store in ``config.nvme_dirs`` switched to the snapshot ``choose``
    picks, or None when there is nothing to resume from.

    Nothing to resume: no store there; leftovers of a store whose creation was cut off
    (no manifest, no snapshot file: deleted); or a store with no snapshot at all, for
    which ``choose`` returns None (deleted: it holds no state a run can continue from).
    Otherwise the store is opened, ``choose(store)`` names a snapshot, every key is
    switched to it durably (:meth:`NvmeStore.restore_snapshot`: what the killed run did
    after it is dropped; the snapshots are kept), and a manager reopens the store with
    every tensor ON_NVME.

    Raises:
        SwapConfigError: ``config.nvme_dirs`` is empty.
        ManifestError: snapshot files lie there without the store's manifest (nothing is
            deleted: restore the manifest, or ``remove_store``).
        what ``choose`` raises (the store is closed, nothing changed), and what
        :meth:`NvmeStore.open` and :meth:`TierManager.open` raise.
    """
    if not config.nvme_dirs:
        raise SwapConfigError("resume needs an NVMe tier: nvme_dirs is empty")
    files = StoreFiles(tuple(Path(d) for d in config.nvme_dirs), config.store_name)
    if not os.path.lexists(files.manifest):
        if files.snapshots():
            raise ManifestError(
                f"{files.manifest} is missing but snapshot files of store "
                f"{config.store_name!r} are there ({files.snapshots()[0][1]}, ...): restore "
                "the manifest, or delete the store with tiers.nvme.remove_store"
            )
        # A run killed while its store was being created: nothing was ever retained.
        removed = remove_store(config.nvme_dirs, name=config.store_name)
        if removed:
            log.warning("resume: removed %d file(s) of a store never completed", len(removed))
        return None
    engine = AioEngine(config.aio)
    try:
        store = NvmeStore.open(
            config.nvme_dirs, engine, name=config.store_name, verify=config.verify
        )
        remove = False
        try:
            chosen = choose(store)
            if chosen is None:
                remove = True
                log.warning(
                    "resume: store %r holds no snapshot; starting afresh", config.store_name
                )
            else:
                store.restore_snapshot(chosen)
        finally:
            store.close(remove=remove)
    finally:
        engine.close()
    if remove:
        return None
    return TierManager.open(config)
