"""The store's machinery under its public API: requests in flight and the commit glue.

Job: what :class:`~tiers.nvme.store.NvmeStore` does between a call and its future's
outcome. Issue one engine request per extent; settle a write once its pieces and
checksums are in (commit it in the version table and queue its record, or discard it);
settle a read once its pieces are in and verified; and the callbacks the committer thread
runs (sync the data files, apply durable records, write a manifest snapshot, record a
failure). State lives here too (set up by :meth:`StoreCore._setup`).

Invariants:

- ``_lock`` guards the version table, ``_ops``, ``_broken`` and ``_closing``; items are
  queued to the committer while holding it, so records are journaled in commit order.
- ``_ops`` counts requests and waits whose futures are not resolved; ``close`` waits for
  0 before it stops the committer and closes files, so no buffer, extent or descriptor a
  request uses is released under it.
- A write's future is resolved once: at once when it failed, else by the committer when
  its record (or, if superseded, what superseded it) is durable.
- After a failure to make records durable (``_broken``) no write or delete is accepted:
  what reached the journal is unknown, so nothing is appended after it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import logging
import os
import threading
from collections.abc import Callable
from typing import NoReturn

import torch

from tiers.aio.engine import AioEngine, Op
from tiers.config import DIRECT_ALIGNMENT
from tiers.errors import SwapIOError
from tiers.nvme import opening
from tiers.nvme.committer import CommitItem, GroupCommitter
from tiers.nvme.futures import ReadCheck, StoreFuture
from tiers.nvme.journal import encode_put
from tiers.nvme.manifest import encode_manifest
from tiers.nvme.metafiles import written_nbytes
from tiers.nvme.records import Extent, StoreClosedError, StoreWrites, byte_view, check_key
from tiers.nvme.versions import Outcome, Version, VersionTable

__all__ = ["JOURNAL_COMPACT_NBYTES", "VERIFY_THREADS", "StoreCore"]

log = logging.getLogger("swapper.tiers.nvme")

#: Journal bytes after which the committer writes a manifest and starts a new journal
#: (at least; twice the last manifest's size when that is larger).
JOURNAL_COMPACT_NBYTES = 64 << 20
#: Threads that hash extents as they are read (XXH3 releases the GIL).
VERIFY_THREADS = 2


class StoreCore:
    """The machinery of :class:`~tiers.nvme.store.NvmeStore` (see the module docstring)."""

    def _setup(self, engine: AioEngine, opened: opening.Opened, verify: bool) -> None:
        """State shared by the constructor and :meth:`open` (no I/O, no thread started)."""
        self._engine = engine
        self._files = opened.files
        self._store_lock = opened.lock
        self._data = opened.data
        self._created_dirs = opened.created_dirs
        self._checksum = opened.checksum
        self._verify = verify
        self._table = VersionTable(opened.placement)
        self._data_written = 0  # tensor bytes of completed writes (``written``)
        self._meta_base = self._metadata_counts()  # what the open itself wrote
        snapshots = [s.content.tensors.values() for s in opened.snapshots]
        held = self._table.load(opened.tensors, snapshots)
        self._load_snapshots(opened, held)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._ops = 0  # requests and waits not yet resolved
        self._broken: BaseException | None = None
        self._closing = False
        self._closed = False
        self._removed = False
        self._journal = opened.journal
        self._writing = 0  # writes issued whose pieces are not all done yet
        self._committer = GroupCommitter(
            opened.journal,
            manifest_path=self._files.manifest,
            snapshot=self._snapshot,
            sync_data=self._sync_data,
            apply=self._apply,
            failed=self._failed,
            compact_nbytes=JOURNAL_COMPACT_NBYTES,
            name=f"swapper-nvme-commit-{self._files.name}",
            in_flight=lambda: self._writing,
        )
        self._hasher = concurrent.futures.ThreadPoolExecutor(
            max_workers=VERIFY_THREADS, thread_name_prefix="swapper-nvme-verify"
        )

    def _wait_committer(self, what: str, *, checkpoint: bool) -> None:
        if threading.current_thread() is self._committer.thread:
            raise RuntimeError(
                f"{what}() called from a store future's callback would wait for itself: "
                "call it from another thread"
            )
        waiter: concurrent.futures.Future[None] = concurrent.futures.Future()

        def done(error: BaseException | None) -> None:
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(error)

        with self._lock:
            self._check_writable(what, None)
            self._ops += 1
            self._committer.put(CommitItem(done=done, checkpoint=checkpoint))
        try:
            waiter.result()
        finally:
            with self._lock:
                self._op_done()

    def _snapshot(self, generation: int) -> bytes:
        """The manifest of the durable state at ``generation`` (the committer's thread)."""
        with self._lock:
            tensors = self._table.durable()
        return encode_manifest(
            name=self._files.name,
            dirs=self._files.dirs,
            stripe_nbytes=self._table.placement.stripe_nbytes,
            checksum=self._checksum,
            generation=generation,
            tensors=tensors,
        )

    def _sync_data(self, dir_indexes: set[int]) -> None:
        for i in sorted(dir_indexes):
            try:
                os.fdatasync(self._data[i].fd)
            except OSError as exc:
                raise SwapIOError(
                    exc.errno or errno.EIO,
                    f"fdatasync failed: {exc.strerror}",
                    str(self._files.data(i)),
                ) from exc

    def _load_snapshots(self, opened: opening.Opened, held: list[dict[str, Version]]) -> None:
        """Set up the snapshot state (see :class:`~tiers.nvme.snapshotting.SnapshotStore`)."""

    def _apply(self, items: list[CommitItem]) -> None:
        """The records are durable: move the durable state on (the committer's thread).
        A switch record (a snapshot restored) carries a list of changes."""
        changes = []
        for item in items:
            if isinstance(item.change, list):
                changes.extend(item.change)
            else:
                changes.append(item.change)
        with self._lock:
            self._table.apply_durable(changes)

    def _failed(self, error: BaseException) -> None:
        log.error(
            "store %r can no longer make writes durable: %s; close it and reopen it with "
            "NvmeStore.open() to go on from what is durable",
            self._files.name,
            error,
        )
        with self._lock:
            if self._broken is None:
                self._broken = error

    def _check_open(self) -> None:
        """Lock held."""
        if self._closing:
            raise StoreClosedError(
                f"store {self._files.name!r} is closed; no new requests are accepted"
            )

    def _check_writable(self, what: str, key: str | None) -> None:
        """Lock held."""
        self._check_open()
        if self._broken is not None:
            about = f" of key={key!r}" if key is not None else ""
            raise SwapIOError(
                getattr(self._broken, "errno", None) or errno.EIO,
                f"{what}{about} refused: store {self._files.name!r} could not make earlier writes "
                f"durable ({self._broken}); close it and reopen it with NvmeStore.open()",
                getattr(self._broken, "filename", None),
            )

    def _op_done(self) -> None:
        """Lock held."""
        self._ops -= 1
        if self._ops == 0:
            self._idle.notify_all()

    def _reserve_space(self, extents: tuple[Extent, ...]) -> None:
        """Allocate disk space up to the padded end of every extent, per file.

        Raises:
            SwapNoSpaceError: a filesystem is full (the file keeps what it had).
        """
        ends: dict[int, int] = {}
        for e in extents:
            ends[e.dir_index] = max(ends.get(e.dir_index, 0), e.offset + e.allocated_nbytes)
        for dir_index, end in sorted(ends.items()):
            self._data[dir_index].reserve(end)

    def _issue(
        self, future: StoreFuture, data: torch.Tensor, extents: tuple[Extent, ...], *, verify: bool
    ) -> None:
        """Hand every extent's piece of ``data`` (a flat uint8 view) to the engine at once;
        with ``verify`` a read's piece is done only once its digest matches."""
        if future.parts == 0:
            future.complete()  # nothing to transfer: settle now (outside the lock)
            return
        if future.op is Op.WRITE:
            # A write needs no per-extent check, so extents that lie back to back in one
            # file go out as one engine request, which the engine cuts at block_size
            # boundaries of file space: kernel requests of block_size, not of the 4 MiB
            # chunk size.
            for dir_index, offset, start, nbytes in write_runs(extents):
                piece = data[start : start + nbytes]
                future.attach(self._engine.pwrite(piece, self._data[dir_index], offset), None)
            return
        submit = self._engine.pread
        start = 0
        for e in extents:
            piece = data[start : start + e.nbytes]
            io = submit(piece, self._data[e.dir_index], e.offset)
            check = None
            if verify and e.checksum is not None:
                path = str(self._files.data(e.dir_index))
                check = ReadCheck(future, e, piece, path, self._hasher.submit)
            future.attach(io, check)
            start += e.nbytes

    def _abort(self, future: StoreFuture, error: BaseException) -> NoReturn:
        """Issuing failed part-way: settle the parts never issued, wait for those that
        were (the kernel may still be using the buffer and the extents), then raise the
        error with the key named. The future's finish step has undone the request."""
        for _ in range(future.parts - future.issued):
            future.part_done(error)
        raised = future.exception()  # waits for the pieces in flight
        raise raised if raised is not None else error

    def _finish_write(
        self,
        version: Version,
        digests: list[int | None],
        future: StoreFuture,
        error: BaseException | None,
    ) -> None:
        """Runs once when every part of a write is done (any thread; lock not held)."""
        stored = version.stored
        stored = dataclasses.replace(
            stored,
            extents=tuple(
                dataclasses.replace(e, checksum=d)
                for e, d in zip(stored.extents, digests, strict=True)
            ),
        )
        payload = encode_put(stored) if error is None else b""
        with self._lock:
            if error is None and self._broken is not None:
                error = SwapIOError(errno.EIO, f"the store is not writing: {self._broken}")
            outcome = self._table.finish_write(version, stored, ok=error is None)
            self._writing -= 1
            if error is None:
                self._data_written += stored.nbytes
            if outcome is Outcome.COMMITTED:
                self._committer.put(
                    CommitItem(
                        payload=payload,
                        dirs=tuple(sorted({e.dir_index for e in stored.extents})),
                        change=(stored.key, version),
                        done=lambda e: self._resolve_write(future, e),
                    )
                )
            elif outcome is Outcome.SUPERSEDED:  # succeeds once what superseded it is durable
                self._committer.put(CommitItem(done=lambda e: self._resolve_write(future, e)))
            else:
                self._op_done()
                self._committer.nudge()  # a group may be waiting for this write to join
        if outcome is Outcome.FAILED:
            future.resolve(error)

    def _metadata_counts(self) -> tuple[int, int, int]:
        """(journal, manifest, snapshot files) bytes this process wrote to this store's
        metadata files (:func:`~tiers.nvme.metafiles.count_written`)."""
        files = self._files
        return (
            written_nbytes([files.journal]),
            written_nbytes([files.manifest]),
            written_nbytes([files.snapshots_account()]),
        )

    def last_progress_s(self) -> float:
        """When a piece of any of this store's reads or writes last ended, in
        ``time.monotonic()`` seconds: a slow disk keeps it moving, a stuck one does not."""
        return self._engine.progress.last_s

    def written(self) -> StoreWrites:
        """Bytes written to this store's files since it was opened, by file kind."""
        journal, manifest, snapshot = self._metadata_counts()
        base = self._meta_base
        with self._lock:
            data = self._data_written
        return StoreWrites(data, journal - base[0], manifest - base[1], snapshot - base[2])

    def _resolve_write(self, future: StoreFuture, error: BaseException | None) -> None:
        """The committer's verdict on a write (its thread)."""
        if error is not None:
            named = SwapIOError(
                getattr(error, "errno", None) or errno.EIO,
                f"write of key={future.key!r} is not durable: {error}",
                getattr(error, "filename", None),
            )
            named.__cause__ = error
            error = named
        future.resolve(error)
        with self._lock:
            self._op_done()

    def _read(
        self,
        key: str,
        out: torch.Tensor,
        *,
        verify: bool,
        pick: Callable[[], Version] | None = None,
    ) -> StoreFuture:
        """Read the key's current version, or the one ``pick()`` returns (lock held)."""
        check_key(key)
        future = StoreFuture(Op.READ, key, 0)
        with self._lock:
            self._check_open()
            version = self._table.current(key, "read") if pick is None else pick()
            stored = version.stored
            data = byte_view(out, key, Op.READ.value)
            if data.numel() != stored.nbytes:
                raise ValueError(
                    f"read of key={key!r}: out is {out.dtype} {tuple(out.shape)} "
                    f"({data.numel()} bytes) but the stored tensor is {stored.dtype} "
                    f"{stored.shape} ({stored.nbytes} bytes)"
                )
            future.nbytes = stored.nbytes
            self._table.pin(version)
            self._ops += 1
            future.expect(
                len(stored.extents), lambda error: self._finish_read(version, future, error)
            )
        try:
            self._issue(future, data, stored.extents, verify=verify)
        except BaseException as exc:
            self._abort(future, exc)
        return future

    def _finish_read(self, version: Version, future: StoreFuture, error: BaseException | None):
        with self._lock:
            self._table.unpin(version)
            self._op_done()
        future.resolve(error)


def write_runs(extents: tuple[Extent, ...]) -> list[tuple[int, int, int, int]]:
    """``extents`` merged into runs that one write request can cover:
    ``(dir_index, file offset, start in the tensor's bytes, nbytes)``.

    Two neighbours merge when the second starts in the same file where the first's bytes
    end, with no padding between them (the first's ``nbytes`` is a multiple of 4 KiB), so
    a run's bytes are contiguous both in the tensor and in the file.
    """
    runs: list[tuple[int, int, int, int]] = []
    start = 0
    for e in extents:
        if runs:
            d, offset, run_start, nbytes = runs[-1]
            if d == e.dir_index and offset + nbytes == e.offset and nbytes % DIRECT_ALIGNMENT == 0:
                runs[-1] = (d, offset, run_start, nbytes + e.nbytes)
                start += e.nbytes
                continue
        runs.append((e.dir_index, e.offset, start, e.nbytes))
        start += e.nbytes
    return runs
