"""The store's snapshot API: copy-on-write snapshots as a manifest switch.

Job: :class:`SnapshotStore`, the part of :class:`~tiers.nvme.store.NvmeStore` that takes,
lists, reads, drops and restores retained snapshots (file format in
:mod:`tiers.nvme.snapshots`).

Life of a snapshot::

    snapshot(name): the current versions captured and pinned (under the store's lock),
      │ then a group commit makes everything committed so far durable (nothing is
      │ copied), then its file is written (tmp + fsync + rename + directory fsync)
      ▼
    RETAINED: its versions stay pinned: later writes of its keys take new extents and
      │       its extents are never handed out again (nor at a later open: the opener
      │       allocates every extent a snapshot file names)
      ├─ snapshot(name, replace=True): a new snapshot of that name, its file renamed over
      │    this one's (a crash leaves one of the two whole); then this one's pins released
      ├─ restore_snapshot(name): one journal record switches every key to the snapshot's
      │    version and deletes the keys it does not name (replayed whole or not at all)
      ▼ drop_snapshot(name): its file removed, the directory fsync'd
    DROPPED: its pins released; what only it held is freed

Invariants: a snapshot's file exists only once every version it names is durable, and its
pins are released only once the file's removal is durable; so after a crash at any
instant the store opens with the snapshot whole or without it, and its extents hold the
bytes they held when it was taken. Snapshot operations are serialised (``_snap_mutex``)
and each counts as a request in flight, so :meth:`close` waits for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiers.errors import SwapConfigError, SwapIOError
from tiers.nvme import opening
from tiers.nvme.committer import CommitItem
from tiers.nvme.core import StoreCore
from tiers.nvme.futures import StoreFuture
from tiers.nvme.journal import encode_switch
from tiers.nvme.metafiles import fsync_dir, replace_file
from tiers.nvme.records import StoredTensor
from tiers.nvme.snapshots import (
    SnapshotExistsError,
    SnapshotInfo,
    SnapshotNotFoundError,
    check_snapshot_name,
    encode_extra,
    encode_snapshot,
)
from tiers.nvme.versions import Version

__all__ = ["SnapshotStore"]

log = logging.getLogger("swapper.tiers.nvme")


@dataclass(eq=False)
class _Held:
    """A retained snapshot in memory: its versions each hold one pin from it."""

    name: str
    seq: int
    created: float
    versions: dict[str, Version]
    extra: Any
    path: Path
    file_nbytes: int


class SnapshotStore(StoreCore):
    """The snapshot methods of :class:`~tiers.nvme.store.NvmeStore` (module docstring)."""

    def _load_snapshots(self, opened: opening.Opened, held: list[dict[str, Version]]) -> None:
        self._snap_mutex = threading.Lock()
        self._snaps: dict[str, _Held] = {}
        for loaded, versions in zip(opened.snapshots, held, strict=True):
            c = loaded.content
            self._snaps[c.name] = _Held(
                c.name, c.seq, c.created, versions, c.extra, loaded.path, loaded.file_nbytes
            )
        self._damaged = dict(opened.damaged)
        # Dropped snapshots whose unlink could not be synced: (directory, versions pinned).
        # Their pins go once a later sync of the directory succeeds (_settle_drops).
        self._unsynced_drops: list[tuple[Path, list[Version]]] = []
        self._snap_seq = max((h.seq for h in self._snaps.values()), default=-1) + 1

    @contextlib.contextmanager
    def _snapshot_op(self, what: str) -> Iterator[None]:
        """One snapshot operation at a time, counted as a request in flight."""
        with self._snap_mutex:
            with self._lock:
                self._check_writable(what, None)
                self._ops += 1
            try:
                self._settle_drops()
                yield
            finally:
                with self._lock:
                    self._op_done()

    def _unknown(self, name: str, what: str) -> SnapshotNotFoundError:
        if name in self._damaged:
            path, why = self._damaged[name]
            return SnapshotNotFoundError(
                f"{what}: snapshot {name!r} of store {self._files.name!r} is damaged ({why}); "
                f"drop_snapshot({name!r}) deletes its file {path}"
            )
        known = sorted(self._snaps, key=lambda n: self._snaps[n].seq)
        return SnapshotNotFoundError(
            f"{what}: store {self._files.name!r} has no snapshot {name!r} "
            f"(it has {known}); snapshots() lists them"
        )

    def _info(self, held: _Held) -> SnapshotInfo:
        """Lock held."""
        exclusive = sum(
            e.allocated_nbytes
            for v in held.versions.values()
            if v.retired and v.pins == 1
            for e in v.stored.extents
        )
        return SnapshotInfo(
            name=held.name,
            seq=held.seq,
            created=held.created,
            keys=tuple(held.versions),
            nbytes=sum(v.stored.nbytes for v in held.versions.values()),
            exclusive_nbytes=exclusive,
            file_nbytes=held.file_nbytes,
            path=held.path,
            extra=held.extra,
        )

    # -- public API ---------------------------------------------------------------------

    def snapshot(
        self,
        name: str,
        *,
        extra: Mapping[str, Any] | bytes | None = None,
        keep_last: int | None = None,
        exclude: Collection[str] = (),
        replace: bool = False,
    ) -> SnapshotInfo:
        """Durably retain every key's current version under ``name``, without copying.

        Waits until every write completed and every delete made before the call is
        durable (one group commit), then writes the snapshot's file (its only cost besides
        that commit: ``file_nbytes`` in the result). Writes still in flight are not in it.
        From then on the versions it names are never overwritten or freed (later writes
        of the keys go to new extents) until :meth:`drop_snapshot`. With ``keep_last``,
        :meth:`prune_snapshots` runs after it.

        Args:
            name: 1 to 64 letters, digits, '_' or '-', not starting with '-'.
            extra: the caller's metadata, kept with the snapshot and returned in
                :class:`SnapshotInfo`: a JSON-able Mapping (str keys; lists, not tuples)
                or bytes, at most 16 MiB encoded.
            exclude: keys not retained (the caller keeps their bytes some other way);
                restoring the snapshot deletes them.
            replace: a snapshot of that name (or a damaged file of that name) is
                replaced: the new file is renamed over the old one, so a crash or a
                failure at any moment leaves one of the two whole; what only the old one
                held is freed after the rename is durable.

        Raises:
            SwapConfigError: ``name`` or ``keep_last`` is not usable.
            TypeError, ValueError: ``extra`` is not JSON-able exactly, or too large.
            SnapshotExistsError: a snapshot (or a damaged snapshot file) of that name
                exists and not ``replace``; or another file is in its place.
            SwapIOError: the commit or the file write failed (no snapshot is made; one
                being replaced is kept).
            StoreClosedError: the store is closed.
        """
        name = check_snapshot_name(name, self._files.name)
        _check_keep_last(keep_last)
        encoded_extra = encode_extra(extra, self._files.name, name)
        path = self._files.snapshot(name)
        with self._snapshot_op("snapshot"):
            with self._lock:
                known = name in self._snaps or name in self._damaged
                if (known and not replace) or (not known and os.path.lexists(path)):
                    raise SnapshotExistsError(
                        f"store {self._files.name!r} already has a snapshot {name!r} ({path}); "
                        f"drop_snapshot({name!r}) first, pass replace=True, or choose "
                        "another name"
                    )
                old = self._snaps.get(name)  # (replaced: pinned until its file is gone)
                versions = self._table.currents()
                for key in exclude:
                    versions.pop(key, None)
                for version in versions.values():
                    self._table.pin(version)
            written = False
            try:
                self._wait_committer("snapshot", checkpoint=False)  # they are all durable now
                held = _Held(name, self._snap_seq, time.time(), versions, extra, path, 0)
                data = encode_snapshot(
                    store=self._files.name,
                    name=name,
                    seq=held.seq,
                    created=held.created,
                    dirs=list(self._files.dirs),
                    stripe_nbytes=self._table.placement.stripe_nbytes,
                    checksum=self._checksum,
                    extra=encoded_extra,
                    tensors=[v.stored for v in versions.values()],
                )
                held.file_nbytes = len(data)
                written = True  # from here the file may be in place
                replace_file(path, data, "snapshot file", account=self._files.snapshots_account())
            except BaseException:
                if written and known:
                    self._failed_replace(path, data, versions)
                    raise
                if written and os.path.lexists(path):
                    try:
                        path.unlink()
                        fsync_dir(path.parent)
                    except OSError:
                        # Its file may survive: keep its pins so its extents stay whole.
                        log.exception("cannot remove the failed snapshot file %s", path)
                        raise
                with self._lock:
                    for version in versions.values():
                        self._table.unpin(version)
                raise
            with self._lock:
                self._snaps[name] = held
                self._damaged.pop(name, None)
                self._snap_seq += 1
                if old is not None:  # its file is durably replaced: its pins go
                    for version in old.versions.values():
                        self._table.unpin(version)
                info = self._info(held)
        if keep_last is not None:
            self.prune_snapshots(keep_last=keep_last)
        return info

    def _failed_replace(self, path: Path, data: bytes, versions: dict[str, Version]) -> None:
        """A replacing file write failed: if the new file may be in place (the rename
        done, its directory fsync failed), both its versions and the old snapshot's stay
        pinned (until the store is reopened), so whichever file survives is whole; else
        the new versions are unpinned and the old snapshot is as it was."""
        try:
            maybe_new = path.read_bytes() == data
        except FileNotFoundError:
            maybe_new = False
        except OSError:
            maybe_new = True
        if maybe_new:
            log.error(
                "snapshot file %s was replaced but the rename may not be durable: the "
                "extents of both versions stay held until the store is reopened",
                path,
            )
            return
        with self._lock:
            for version in versions.values():
                self._table.unpin(version)

    def snapshots(self) -> list[SnapshotInfo]:
        """The retained snapshots, oldest first (damaged ones: :meth:`damaged_snapshots`)."""
        with self._lock:
            return [self._info(h) for h in sorted(self._snaps.values(), key=lambda h: h.seq)]

    def damaged_snapshots(self) -> dict[str, str]:
        """Snapshot files found damaged at open (ignored; their extents are not held), by
        name: what is wrong, naming the file. :meth:`drop_snapshot` deletes one."""
        with self._lock:
            return {name: why for name, (_, why) in sorted(self._damaged.items())}

    def snapshot_tensor(self, name: str, key: str) -> StoredTensor:
        """What snapshot ``name`` holds under ``key`` (dtype, shape, extents), as :meth:`info`.

        Raises:
            SnapshotNotFoundError: no snapshot ``name``, or it does not hold ``key``.
        """
        with self._lock:
            return self._snap_version(name, key, "snapshot_tensor").stored

    def _snap_version(self, name: str, key: str, what: str) -> Version:
        """Lock held."""
        held = self._snaps.get(name) if isinstance(name, str) else None
        if held is None:
            raise self._unknown(str(name), what)
        version = held.versions.get(key) if isinstance(key, str) else None
        if version is None:
            raise SnapshotNotFoundError(
                f"{what}: snapshot {name!r} of store {self._files.name!r} holds no "
                f"key={key!r} (nothing was stored under it when the snapshot was taken)"
            )
        return version

    def read_snapshot(self, name: str, key: str, out: torch.Tensor) -> StoreFuture:
        """Read ``key``'s bytes as snapshot ``name`` holds them into ``out``; as :meth:`read`
        (verified the same way; the version stays allocated until the future completes,
        even if the snapshot is dropped meanwhile).

        Raises (at once):
            SnapshotNotFoundError: no snapshot ``name``, or it does not hold ``key``.
            TypeError, ValueError, StoreClosedError: as :meth:`read`.
        The future raises as :meth:`read`'s does.
        """
        return self._read(
            key,
            out,
            verify=self._verify and self._checksum,
            pick=lambda: self._snap_version(name, key, "read_snapshot"),
        )

    def drop_snapshot(self, name: str) -> None:
        """Delete snapshot ``name`` durably (its file removed, the directory fsync'd), then
        free what only it held. Also deletes a damaged snapshot's file.

        Raises:
            SnapshotNotFoundError: no snapshot (nor damaged snapshot file) ``name``.
            SwapIOError: the file could not be removed (the snapshot is kept), or the
                removal could not be synced (the snapshot is gone from the listing but its
                extents stay held until a later snapshot operation or :meth:`sync` syncs
                the directory, or the store is reopened).
            StoreClosedError: the store is closed.
        """
        with self._snapshot_op("drop_snapshot"):
            with self._lock:
                held = self._snaps.get(name) if isinstance(name, str) else None
                path = held.path if held is not None else self._damaged.get(name, (None,))[0]
                if path is None:
                    raise self._unknown(str(name), "drop_snapshot")
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise SwapIOError(
                    exc.errno, f"cannot delete snapshot {name!r}: {exc.strerror}", str(path)
                ) from exc
            with self._lock:
                self._snaps.pop(name, None)
                self._damaged.pop(name, None)
            try:
                fsync_dir(path.parent)
            except BaseException:
                # The unlink may not survive a crash, and the file names these extents:
                # keep them until a later sync of the directory succeeds.
                if held is not None:
                    with self._lock:
                        self._unsynced_drops.append((path.parent, list(held.versions.values())))
                raise
            if held is not None:
                with self._lock:
                    for version in held.versions.values():
                        self._table.unpin(version)

    def _settle_drops(self) -> None:
        """Retry the directory syncs that failed in :meth:`drop_snapshot`; unpin what each
        success makes safe. A failure again keeps them for the next try (no error: the
        drop raised already). Caller holds ``_snap_mutex``."""
        while self._unsynced_drops:
            directory, versions = self._unsynced_drops[0]
            try:
                fsync_dir(directory)
            except SwapIOError as exc:
                log.warning("snapshot directory still cannot be synced: %s", exc)
                return
            with self._lock:
                for version in versions:
                    self._table.unpin(version)
            self._unsynced_drops.pop(0)

    def prune_snapshots(self, *, keep_last: int) -> list[str]:
        """Drop all but the ``keep_last`` newest snapshots (by ``seq``).

        Returns:
            The names dropped, oldest first.

        Raises:
            SwapConfigError: ``keep_last`` is not a non-negative int.
            SwapIOError, StoreClosedError: as :meth:`drop_snapshot` (those before the
                failure are dropped).
        """
        _check_keep_last(keep_last)
        with self._lock:
            names = [h.name for h in sorted(self._snaps.values(), key=lambda h: h.seq)]
        doomed = names[: max(0, len(names) - keep_last)]
        for name in doomed:
            self.drop_snapshot(name)
        return doomed

    def restore_snapshot(self, name: str) -> None:
        """Make snapshot ``name``'s versions current again and delete every key it does not
        name, durably and without copying (one journal record: a crash replays all of it
        or none). Writes in flight complete as superseded. The snapshot is kept.

        Raises:
            SnapshotNotFoundError: no snapshot ``name``.
            SwapIOError: the record could not be made durable (the store stops writing,
                as for any failed commit), or durability failed earlier.
            StoreClosedError: the store is closed.
        """
        with self._snapshot_op("restore_snapshot"):
            with self._lock:
                held = self._snaps.get(name) if isinstance(name, str) else None
                if held is None:
                    raise self._unknown(str(name), "restore_snapshot")
                changes = self._table.restore(held.versions)
                if changes:
                    payload = encode_switch(
                        [v.stored for _, v in changes if v is not None],
                        [k for k, v in changes if v is None],
                    )
                    self._committer.put(CommitItem(payload=payload, change=changes))
            self._wait_committer("restore_snapshot", checkpoint=False)


def _check_keep_last(keep_last: object) -> None:
    if keep_last is not None and (type(keep_last) is not int or keep_last < 0):
        raise SwapConfigError(f"keep_last={keep_last!r} must be None or an int >= 0")
