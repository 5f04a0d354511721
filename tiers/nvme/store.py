"""The NVMe store: tensors by key in extents of data files, verified, locked, crash-true.

Each swap directory holds one data file (``<name>.bin``); a tensor's bytes live in chunks
of at most ``stripe_nbytes``, each in an :class:`~tiers.nvme.records.Extent` of some data
file with the XXH3-64 digest of its bytes (:mod:`tiers.nvme.placement` says where). The
store's files are listed in :mod:`tiers.nvme.metafiles`; it holds the lock of
:mod:`tiers.nvme.lock` from before it reads anything until :meth:`NvmeStore.close`.

Life of one version of a key::

    write(key, t): validate, allocate extents, reserve file space ──ENOSPC──▶ extents freed,
      │                                                      SwapNoSpaceError raised
      ▼
    WRITING: one engine request per extent, all issued at once; each extent's digest
      │      computed on the caller's thread meanwhile
      ├─ a piece failed ──────────────────────▶ DISCARDED: extents freed; the future raises
      │                                          SwapIOError; the key keeps its old version
      ├─ superseded (a write issued later has ▶ DISCARDED: extents freed; the future succeeds
      │  committed, or the key was deleted)      once the state that superseded it is durable
      ▼
    COMMITTED: the key's current version (info/read use it); a "put" record is queued for
      │        the journal, and the version is pinned (it may be named by durable state)
      ▼ group commit (tiers.nvme.committer): data files fdatasync'd, record appended to the
      │ journal, journal fdatasync'd
    DURABLE: named by the durable state (manifest + journal); the write's future succeeds
      │ a newer write commits, or delete(key) (which queues a "delete" record)
      ▼
    RETIRED: reads in flight still pin it; so does the durable state, until the record that
      │      superseded it is durable
      ▼ no pins left
    FREED: its extents back to the free lists

Invariant (what makes a crash safe): extents named by the durable state are never handed
out again until a durable record supersedes them, so reopening after a crash or power cut
at any point finds every version whose write future had succeeded (or a later one), with
the bytes it had. A delete is durable with the next group commit: once a later write's
future succeeds, or :meth:`NvmeStore.sync`, :meth:`~NvmeStore.save_manifest` or
:meth:`~NvmeStore.close` returns.

Reads: every extent read is checked against its recorded digest on a verifier thread as
soon as that extent lands (hashing overlaps the I/O still in flight) and the future fails
with :class:`~tiers.errors.SwapCorruptionError` on a mismatch; ``verify=False`` skips this,
and with ``checksum=False`` there is nothing to check. XXH3-64 runs at 10-17 GB/s on one
core with the data in memory (4-6 GB/s on data just read, on a loaded 2-core machine),
about 0.1-0.2 s of CPU per GB read. The padding after an extent is never read.

This module is the public API and the lifecycle; the requests in flight and the glue to
the committer are in :mod:`tiers.nvme.core`; retained snapshots (copy-on-write, a
manifest switch: ``snapshot``, ``snapshots``, ``read_snapshot``, ``restore_snapshot``,
``drop_snapshot``, ``prune_snapshots``) in :mod:`tiers.nvme.snapshotting`.

Buffers: the engine uses O_DIRECT only for 4 KiB-aligned memory; stage through
page-aligned buffers (:mod:`tiers.buffers`) for the fast path.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from tiers.aio.engine import AioEngine, Op
from tiers.config import DIRECT_ALIGNMENT
from tiers.errors import SwapConfigError
from tiers.nvme import opening
from tiers.nvme.committer import CommitItem
from tiers.nvme.core import write_runs
from tiers.nvme.futures import StoreFuture, digest
from tiers.nvme.journal import encode_delete
from tiers.nvme.lock import StoreLock
from tiers.nvme.metafiles import StoreFiles
from tiers.nvme.records import (
    DirUsage,
    StoreClosedError,
    StoredTensor,
    byte_view,
    check_dirs,
    check_key,
    check_name,
)
from tiers.nvme.snapshotting import SnapshotStore
from tiers.units import format_size

__all__ = ["NvmeStore"]

log = logging.getLogger("swapper.tiers.nvme")


class NvmeStore(SnapshotStore):
    """Tensors by key in data files over one or more swap directories.

    Thread-safe: reads and writes of any keys may run concurrently from any threads; of
    two writes of one key the one issued last wins. Close with :meth:`close` or use as a
    context manager. One store at a time may have a store's files open (this process or
    another): a second is refused with :class:`~tiers.errors.StoreLockedError`.

    Args:
        dirs: the swap directories (created 0700 if missing). The data files go there.
        engine: the engine that does the I/O; the caller closes it after the store.
        stripe_nbytes: tensors are cut into stripes of this many bytes, placed round-robin
            over the directories, and stripes into chunks of at most 4 MiB
            (:data:`~tiers.nvme.placement.CHUNK_NBYTES`): each chunk is one I/O request
            with its own checksum. A positive multiple of 4 KiB.
        checksum: record an XXH3-64 digest of every chunk written. Without it nothing
            can be verified: reads return whatever the disk holds.
        verify: check every chunk read against its digest (see the module docstring).
            Not recorded in the store: pass it again to :meth:`open`.
        name: the files' base name (see :mod:`tiers.nvme.metafiles`). Give each store
            sharing a directory its own name.

    Raises:
        SwapConfigError: no directories, a directory named twice, a bad setting or name.
        StoreLockedError: another open store holds the directories.
        StoreExistsError: a store of that name is already there; the message names the
            calls that reopen it and that delete it.
        SwapIOError: a directory or file cannot be created.
    """

    def __init__(
        self,
        dirs: Sequence[str | os.PathLike[str]],
        engine: AioEngine,
        *,
        stripe_nbytes: int = 16 << 20,
        checksum: bool = True,
        verify: bool = True,
        name: str = "swapper-store",
    ) -> None:
        paths = check_dirs(dirs)
        if type(stripe_nbytes) is not int or stripe_nbytes <= 0 or stripe_nbytes % DIRECT_ALIGNMENT:
            raise SwapConfigError(
                f"stripe_nbytes={stripe_nbytes!r} must be a positive multiple of "
                f"{DIRECT_ALIGNMENT} bytes (e.g. 16MiB)"
            )
        _check_flags(checksum=checksum, verify=verify)
        check_name(name)
        files = StoreFiles(tuple(paths), name)
        self._setup(
            engine,
            opening.create(files, engine, stripe_nbytes=stripe_nbytes, checksum=checksum),
            verify,
        )

    @classmethod
    def open(
        cls,
        dirs: Sequence[str | os.PathLike[str]],
        engine: AioEngine,
        *,
        name: str = "swapper-store",
        verify: bool = True,
    ) -> NvmeStore:
        """Reopen a store: its manifest with the journal replayed over it.

        Finds every write whose future had succeeded and every delete made durable (see
        the module docstring), whatever happened since (a crash, a power cut). Stripe size
        and checksum setting come from the manifest; the free lists are rebuilt from the
        extents named; temporary files of an interrupted save are deleted; a journal with
        anything in it is compacted into a new manifest.

        Raises:
            StoreLockedError: another open store holds the directories.
            ManifestError: no store there, or its manifest or journal is refused (the
                message names the file and the field), names other directories (the same
                order is needed), or its extents do not fit the data files; the message
                says what to do.
            SwapConfigError: ``dirs``, ``name`` or ``verify`` are not usable.
            SwapIOError: a path is not a directory, a data file is not a regular file or
                cannot be opened, or the compacted manifest cannot be written.
        """
        paths = check_dirs(dirs)
        check_name(name)
        _check_flags(checksum=True, verify=verify)
        store = cls.__new__(cls)
        store._setup(engine, opening.reopen(StoreFiles(tuple(paths), name), engine), verify)
        return store

    # -- properties and queries ---------------------------------------------------------

    @property
    def dirs(self) -> list[Path]:
        """The swap directories, absolute, in order."""
        return list(self._files.dirs)

    @property
    def stripe_nbytes(self) -> int:
        return self._table.placement.stripe_nbytes

    @property
    def checksum(self) -> bool:
        """Whether writes record a digest (XXH3-64) of every chunk."""
        return self._checksum

    @property
    def verify_reads(self) -> bool:
        """Whether reads are checked against recorded digests (``verify`` and ``checksum``)."""
        return self._verify and self._checksum

    @property
    def name(self) -> str:
        return self._files.name

    @property
    def manifest_path(self) -> Path:
        return self._files.manifest

    @property
    def journal_path(self) -> Path:
        return self._files.journal

    def dir_usage(self) -> list[DirUsage]:
        """Space used in each directory's data file."""
        with self._lock:
            placement = self._table.placement
            return [
                DirUsage(
                    self._files.data(i),
                    placement.used_nbytes(i),
                    placement.end_nbytes(i),
                    0 if self._closed else f.size(),
                )
                for i, f in enumerate(self._data)
            ]

    def info(self, key: str) -> StoredTensor:
        """What is stored under ``key`` (its current version).

        Raises:
            StoreKeyError: nothing is stored under ``key``.
        """
        with self._lock:
            return self._table.current(key, "info").stored

    def keys(self) -> list[str]:
        """The keys with a stored tensor, oldest first (a deleted key rewritten is new)."""
        with self._lock:
            return self._table.keys()

    def __iter__(self) -> Iterator[str]:
        """Iterate over a snapshot of :meth:`keys`."""
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return self._table.has(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._table.keys())

    # -- I/O --------------------------------------------------------------------------

    def write(self, key: str, tensor: torch.Tensor) -> StoreFuture:
        """Store ``tensor``'s bytes, dtype and shape under ``key``; returns at once.

        The bytes go to newly allocated extents; the key switches to them when every
        piece is written, and the future succeeds once that is durable (see the module
        docstring); the previous version stays readable until then, and for good if the
        write fails. ``tensor`` must not be changed before the future completes.

        Raises (at once):
            TypeError: ``key`` is not a non-empty str, ``tensor`` is not a CPU tensor, or
                its dtype cannot be viewed as bytes.
            ValueError: ``tensor`` is not contiguous.
            SwapNoSpaceError: no room for it on disk; the message names the key, and the
                store and the key's old version are unchanged.
            StoreClosedError: the store is closed.
            SwapIOError: an earlier failure to sync stopped the store from writing.
        The future raises :class:`~tiers.errors.SwapIOError` naming the key and the file
        when a piece fails or the write cannot be made durable; the key then keeps its
        old version.
        """
        check_key(key)
        data = byte_view(tensor, key, Op.WRITE.value)
        future = StoreFuture(Op.WRITE, key, data.numel())
        digests: list[int | None] = []
        hashing = False
        # The state changes are made together under the lock, and from the moment the
        # future expects its parts every path settles them (which undoes what failed).
        with self._lock:
            self._check_writable("write", key)
            version = self._table.start_write(key, tensor.dtype, tuple(tensor.shape), data.numel())
            self._ops += 1
            self._writing += 1
            extents = version.stored.extents
            digests = [None] * len(extents)
            hashing = self._checksum and bool(extents)
            future.expect(
                len(write_runs(extents)) + int(hashing),
                lambda error: self._finish_write(version, digests, future, error),
            )
        try:
            self._reserve_space(extents)
            self._issue(future, data, extents, verify=False)
        except BaseException as exc:
            self._abort(future, exc)
        if hashing:
            # After the pieces are issued, so that hashing overlaps the I/O.
            try:
                start = 0
                for i, e in enumerate(extents):
                    digests[i] = digest(data[start : start + e.nbytes])
                    start += e.nbytes
            except BaseException as exc:  # e.g. KeyboardInterrupt: still settle the write
                future.part_done(exc)
                raise
            future.part_done(None)
        return future

    def read(self, key: str, out: torch.Tensor) -> StoreFuture:
        """Read ``key``'s bytes into ``out``; returns at once.

        ``out`` must be a contiguous CPU tensor of exactly the stored byte count; its
        dtype and shape may differ (a uint8 staging buffer of the right size will do), the
        bytes are copied as they are. The version read stays allocated until the future
        completes, even if the key is rewritten or deleted meanwhile.

        Raises (at once):
            StoreKeyError: nothing is stored under ``key``.
            TypeError, ValueError: ``out`` is not a contiguous CPU tensor, or its byte
                count differs; the message names the key and both dtypes and shapes.
            StoreClosedError: the store is closed.
        The future raises :class:`~tiers.errors.SwapCorruptionError` when a chunk's bytes
        do not match its recorded digest (not checked with ``verify=False``), or
        :class:`~tiers.errors.SwapIOError` naming the key and the file; ``out`` then holds
        no tensor.
        """
        return self._read(key, out, verify=self.verify_reads)

    def verify(self, key: str) -> bool:
        """Read ``key`` back and check every chunk's digest (whatever ``verify`` says).

        Returns:
            True when they all match; False when the store records no checksums.

        Raises:
            SwapCorruptionError: the bytes on disk differ from those written (named).
            StoreKeyError: nothing is stored under ``key``.
            SwapIOError: the read failed.
        """
        with self._lock:
            nbytes = self._table.current(key, "verify").stored.nbytes
        self._read(key, torch.empty(nbytes, dtype=torch.uint8), verify=self._checksum).result()
        return self._checksum

    def delete(self, key: str) -> None:
        """Forget ``key``; returns at once. A write of ``key`` in flight is discarded.

        Durable with the next group commit (once a later write's future succeeds, or
        :meth:`sync` returns); the extents are reused only once it is durable and no read
        in flight uses them.

        Raises:
            StoreKeyError: nothing is stored under ``key``.
            StoreClosedError: the store is closed.
            SwapIOError: an earlier failure to sync stopped the store from writing.
        """
        check_key(key)
        with self._lock:
            self._check_writable("delete", key)
            self._table.delete(key)
            self._committer.put(CommitItem(payload=encode_delete(key), change=(key, None)))

    # -- durability -------------------------------------------------------------------

    def sync(self) -> None:
        """Wait until every write completed and every delete made before this call is
        durable (one group commit at most).

        Also retries the directory sync of a snapshot drop that failed (see
        :meth:`drop_snapshot`), unless a snapshot operation is under way.

        Raises:
            StoreClosedError: the store is closed.
            SwapIOError: durability failed (the store no longer writes).
        """
        self._wait_committer("sync", checkpoint=False)
        if self._unsynced_drops and self._snap_mutex.acquire(blocking=False):
            try:
                self._settle_drops()
            finally:
                self._snap_mutex.release()

    def hurry(self) -> None:
        """Someone waits for a write: make the writes completed so far durable without
        waiting, as a group commit otherwise does, for the other writes still in flight
        (up to :data:`~tiers.nvme.committer.GATHER_S`). Returns at once; any thread."""
        self._committer.hurry()

    def save_manifest(self) -> None:
        """Write the manifest of the durable state and start an empty journal.

        Waits for the changes queued before it to be durable first, so the manifest holds
        every key's current version as of this call (writes in flight are not in it). The
        manifest is replaced atomically (temporary file, fsync, rename, directory fsync)
        before the journal is reset, so a crash at any point leaves a state open() reads
        whole. Durability does not need it (the journal gives that): it bounds the journal
        and the time open() takes to replay it.

        Raises:
            SwapIOError: the manifest could not be written (the journal still holds
                everything), or durability failed earlier.
            StoreClosedError: the store is closed.
        """
        self._wait_committer("save_manifest", checkpoint=True)

    # -- lifecycle --------------------------------------------------------------------

    def close(self, *, remove: bool = False) -> None:
        """Wait for the requests in flight and make the deletes durable, then close the
        files and release the lock. Idempotent. With ``remove``, changes not yet durable
        are dropped instead: their writes' futures fail (``SwapIOError`` from a
        ``StoreClosedError``) and nothing more is flushed before the files go.

        The store's files stay on disk unless ``remove``: then they are deleted (data
        files, manifest, journal, snapshot files, lock files, the identity record a rank's
        store keeps beside them) and the directories the
        constructor created are removed if nothing else is in them. Nothing else is ever deleted.

        Raises:
            StoreLockedError: ``remove`` after an earlier close, and another store has
                opened the files since (nothing is deleted).
        """
        with self._lock:
            self._closing = True
            if remove and not self._closed:
                # Nothing written is read again: the writes in flight still end (the
                # kernel uses their buffers), but none is flushed or journaled.
                self._committer.discard(
                    StoreClosedError(
                        f"store {self._files.name!r} was closed with remove=True before "
                        "this change was durable; its files are deleted"
                    )
                )
            while self._ops:
                self._idle.wait()
        if not self._closed:
            # Each step is idempotent: a close() cut short (Ctrl-C) is finished by the next.
            self._committer.stop()
            self._journal.close()
            for f in self._data:
                f.close()
            self._hasher.shutdown(wait=True)
            self._closed = True
        if remove and not self._removed:
            lock = self._store_lock if self._store_lock.held else StoreLock.acquire(self._files)
            n = len(self._files.dirs)
            for path in [
                *(self._files.data(i) for i in range(n)),
                self._files.manifest,
                self._files.journal,
                *(path for _, path in self._files.snapshots()),
                *self._files.orphans(),
                self._files.identity,  # (a rank's store: whose it was, gone with it)
            ]:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            lock.release(remove=True)
            self._removed = True
            for path in reversed(self._created_dirs):
                with contextlib.suppress(OSError):  # not empty: someone else's files
                    path.rmdir()
        else:
            self._store_lock.release()

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} tensors"
        return (
            f"<NvmeStore {self.name!r} dirs={[str(p) for p in self.dirs]} "
            f"stripe={format_size(self.stripe_nbytes)} ({state})>"
        )


def _check_flags(*, checksum: object, verify: object) -> None:
    for name, value in (("checksum", checksum), ("verify", verify)):
        if not isinstance(value, bool):
            raise SwapConfigError(f"{name}={value!r} must be True or False")
