"""Group commit: the one thread that makes the store's changes durable, many at a time.

Job: take the items the store queues (in commit order, under the store's lock) and, one
group at a time, make them durable in this order:

1. ``fdatasync`` every data file a put record of the group has extents in (O_DIRECT
   writes may sit in the drive's volatile cache, and filling preallocated space changes
   file metadata: both are flushed here), so no record can name bytes a crash could lose;
2. append the group's records to the journal and ``fdatasync`` it (one write, one flush);
3. call ``apply(group)`` (the store moves its durable state forward and frees what a
   durable record superseded), then each item's ``done(None)``.

A group is whatever was queued while the previous one was being synced: many writes
completing together share one flush, and a lone write waits for one flush only. A group of
records also waits, up to :data:`GATHER_S`, for the store's other writes still in flight
(``in_flight()``) to join it, so that its flushes land once the disk's write queue has
drained. A flush issued while writes are in flight is what costs: on the VM where this was
measured a group commit took 5-25 ms with writes in flight against 1-3 ms after them, and
it slows the writes around it. ``swapper-bench tiers`` (2 GiB evicted at once, timed until
durable) committed each pass in about 11 groups with a 20 ms gather and in 1 with 1 s
(12-24 ``fdatasync`` a run against 108-132), and its evict ratio to the raw disk went from
a median 0.91 to 1.17 on a nearly quiet machine (ahead in every round of three of four
sittings; the second, at load 13-20, did not separate them): docs/benchmarks.md,
"Durable evictions: the gather bound". The wait ends at once when:

- nothing else is in flight (a lone write's latency is unchanged);
- a barrier, checkpoint or stop is queued (someone waits for everything queued);
- :meth:`GroupCommitter.hurry` was called since the last group: a caller waits for a write
  in particular (the tier manager does when it waits for an entry's transfer or for memory
  that writes will free), so the bound applies only to nobody-waits write-behind.

So a durable write's completion is delayed, past its own write, by at most ``GATHER_S``
(1 s) plus one group commit, and only while other writes keep the disk busy; a caller
that bounds its writes in flight (the manager's ``write_behind_nbytes``) drains them, and
commits, on its own. The gather holds each write's source buffer until the group is
durable: the buffer cannot be released when its O_DIRECT write completes, because a failed
flush must leave the caller its data (the store refuses further writes then, and the bytes
on disk are not known to be there).

Why two flushes per group and not one (the journal's, with each record carrying its data
checksums so that replay could reject a record whose data did not reach the disk): a
rejected record is a write whose future had succeeded, lost. And the journal's
``fdatasync`` does not make the data files' metadata durable: the data files are reserved
with ``posix_fallocate``, so the first write into an extent converts it from unwritten to
written, a metadata change in the data file that only its own ``fsync``/``fdatasync`` (or
a filesystem journal commit that happens to include it) persists; without it a power cut
leaves that extent reading as zeros under a record that names it. The drive cache flush
alone would be covered by the journal's ``fdatasync`` (ext4 flushes the device whether or
not it commits), so a later refinement could skip a data file's sync when every extent of
the group lies in space already written and synced; it would save about one of the two
flushes of the steady state, not measured here.

Items without a record are barriers: ``done`` runs once everything queued before them is
durable (``NvmeStore.sync``, and writes superseded before they committed). A checkpoint
item writes the manifest of the durable state (``snapshot``) and resets the journal, after
the records queued before it and before any queued after it; so does a group that leaves
the journal longer than ``compact_nbytes`` (automatic compaction).

Invariants:

- Items are made durable, applied and completed in the order they were queued.
- ``done`` is called exactly once per item, on this thread, outside any lock; a failure
  of step 1 or 2 calls ``failed(error)`` (the store stops accepting writes: what reached
  the journal is unknown) and then ``done(error)`` for the group and everything queued
  later.
- :meth:`stop` returns once every item queued before it is done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiers.nvme.journal import Journal
from tiers.nvme.metafiles import replace_file

__all__ = ["GATHER_S", "CommitItem", "GroupCommitter"]

log = logging.getLogger("swapper.tiers.nvme")


#: How long a group of records waits, at most, for the store's writes in flight to join it
#: (seconds). Bounds the extra latency of a durable write on a disk kept busy by other writes
#: when nobody hurries it; long enough for a 2-3 GiB burst of writes to land on a 3-7 GB/s
#: disk, so that such a burst commits in one group (module docstring).
GATHER_S = 1.0


class _JournalLost(Exception):
    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(eq=False)
class CommitItem:
    """One thing to make durable.

    ``payload``: a journal record, or None for a barrier. ``dirs``: indexes of the data
    files its extents are in. ``change``: the store's own note of what it changes (passed
    back through ``apply``). ``done``: called once it is durable (None) or cannot be.
    """

    payload: bytes | None = None
    dirs: tuple[int, ...] = ()
    change: Any = None
    done: Callable[[BaseException | None], None] | None = None
    checkpoint: bool = False
    stop: bool = False


@dataclass(eq=False)
class _Queue:
    items: list[CommitItem] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)


class GroupCommitter:
    """The committer thread of one store (started on the first item queued).

    Args:
        journal: appended to by this thread only.
        manifest_path: where a checkpoint writes the manifest.
        snapshot: the manifest (bytes) of the durable state, at the generation given.
        sync_data: ``fdatasync`` the data files of the given directory indexes.
        apply: called with a durable group's record items, in order.
        failed: called once with the error that stopped durability.
        compact_nbytes: a journal longer than this is compacted after a group (at least;
            twice the last manifest's size when that is larger).
        name: the thread's name.
        in_flight: the store's writes issued and not yet queued here (a hint read without
            the store's lock); a group of records waits up to ``gather_s`` for it to reach 0.
        gather_s: see :data:`GATHER_S` (the default); 0 commits every group at once.
    """

    def __init__(
        self,
        journal: Journal,
        *,
        manifest_path: Path,
        snapshot: Callable[[int], bytes],
        sync_data: Callable[[set[int]], None],
        apply: Callable[[list[CommitItem]], None],
        failed: Callable[[BaseException], None],
        compact_nbytes: int,
        name: str,
        in_flight: Callable[[], int] = lambda: 0,
        gather_s: float | None = None,
    ) -> None:
        self.journal = journal
        self._manifest_path = manifest_path
        self._snapshot = snapshot
        self._sync_data = sync_data
        self._apply = apply
        self._failed = failed
        self._base_compact_nbytes = self._compact_nbytes = compact_nbytes
        self._name = name
        self._in_flight = in_flight
        self._gather_s = GATHER_S if gather_s is None else gather_s
        self._queue = _Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopped = False
        self._hurried = False  # hurry() since the last group was taken
        self._discard: BaseException | None = None  # see discard()
        self.groups = 0  #: groups synced (for tests and stats)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    def put(self, item: CommitItem) -> None:
        """Queue ``item`` (the caller holds the store's lock, which fixes the order)."""
        with self._queue.cond:
            if self._stopped:
                raise RuntimeError("the store's committer is stopped (a bug: the store is closed)")
            self._queue.items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._queue.cond.notify()

    def nudge(self) -> None:
        """A write in flight ended without queuing anything (it failed): a group waiting
        for it to join stops waiting."""
        with self._queue.cond:
            self._queue.cond.notify()

    def hurry(self) -> None:
        """Someone waits for a write: the next group (or the one gathering now) commits
        without waiting for the writes still in flight. Cheap; any thread, any lock held."""
        with self._queue.cond:
            self._hurried = True
            self._queue.cond.notify()

    def discard(self, error: BaseException) -> None:
        """The store's files are about to be deleted: groups taken from now on are not
        made durable (no flush, no journal, no checkpoint); their items complete with
        ``error``. Any thread."""
        with self._queue.cond:
            self._discard = error
            self._queue.cond.notify()

    def stop(self) -> None:
        """Complete everything queued, then end the thread. Idempotent."""
        with self._queue.cond:
            self._stopped = True
            if self._thread is None or not self._thread.is_alive():
                return
            thread = self._thread
            self._queue.items.append(CommitItem(stop=True))
            self._queue.cond.notify()
        thread.join()

    def _take(self) -> list[CommitItem]:
        """The next group: everything queued, up to and including a checkpoint or stop;
        records only wait (up to ``gather_s``) for the store's writes in flight."""
        with self._queue.cond:
            while not self._queue.items:
                self._queue.cond.wait()
            deadline = time.monotonic() + self._gather_s
            while self._gathering() and (left := deadline - time.monotonic()) > 0:
                self._queue.cond.wait(left)
            items = self._queue.items
            self._hurried = False
            for i, item in enumerate(items):
                if item.checkpoint or item.stop:
                    group, self._queue.items = items[: i + 1], items[i + 1 :]
                    return group
            self._queue.items = []
            return items

    def _gathering(self) -> bool:
        """Whether the queue holds only records and more writes may join them (a barrier,
        checkpoint, stop or :meth:`hurry` is someone waiting: commit at once)."""
        items = self._queue.items
        return (
            not self._hurried
            and self._discard is None
            and all(i.payload is not None for i in items)
            and self._in_flight() > 0
        )

    def _run(self) -> None:
        while True:
            group = self._take()
            last = group[-1]
            self._commit(group)
            if last.stop:
                return

    def _commit(self, group: list[CommitItem]) -> None:
        records = [item for item in group if item.payload is not None]
        error = self._error or self._discard
        if error is None and records:
            try:
                self._sync_data({d for item in records for d in item.dirs})
                self.journal.append([item.payload for item in records])  # type: ignore[misc]
                self.groups += 1
            except BaseException as exc:
                error = self._fail(exc)
            else:
                try:
                    self._apply(records)
                except BaseException as exc:  # a bookkeeping bug: stop, do not guess
                    error = self._fail(exc)
        checkpoint_error: BaseException | None = None
        last = group[-1]
        if error is None and (
            last.checkpoint or (not last.stop and self.journal.end > self._compact_nbytes)
        ):
            try:
                self._checkpoint()
            except _JournalLost as exc:
                # The group's records are durable; what comes after them cannot be.
                checkpoint_error = self._fail(exc.error)
            except BaseException as exc:
                # The manifest could not be written: the journal still holds everything.
                checkpoint_error = exc
                if not last.checkpoint:
                    log.warning("automatic journal compaction failed: %s", exc)
        for item in group:
            if item.done is not None:
                outcome = (error or checkpoint_error) if item.checkpoint else error
                try:
                    item.done(outcome)
                except BaseException:  # a caller's callback must not stop durability
                    log.exception("a store completion callback failed")

    def _checkpoint(self) -> None:
        """Write the manifest of the durable state at the next generation, then reset the
        journal to it. A crash between the two leaves a journal of the older generation,
        which open() knows to be in the manifest already.

        Raises:
            SwapIOError: the manifest could not be written (nothing changed).
            _JournalLost: the journal could not be reset (appending to the old one would
                write records that open() ignores): durability must stop.
        """
        generation = self.journal.generation + 1
        manifest = self._snapshot(generation)
        replace_file(self._manifest_path, manifest, "manifest")
        try:
            self.journal.reset(generation)
        except BaseException as exc:
            raise _JournalLost(exc) from exc
        self._compact_nbytes = max(self._base_compact_nbytes, 2 * len(manifest))

    def _fail(self, exc: BaseException) -> BaseException:
        self._error = exc
        try:
            self._failed(exc)
        except BaseException:  # pragma: no cover - the store's handler only records it
            log.exception("recording a durability failure failed")
        return exc
