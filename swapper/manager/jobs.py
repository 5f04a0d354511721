"""Work the manager does off the caller's thread: ``evict`` and ``prefetch`` requests on the
mover threads, and ``flush`` (write every dirty tensor, keep it in memory).

Invariants:

* A request is counted in ``ctx.jobs`` from :meth:`MoverJobs.submit` until it has ended,
  whatever happened to it; ``close`` waits for 0 before shutting the pool, so no job
  ever runs against a closed store.
* ``close(remove=True)`` writes nothing: an eviction queued and not yet started when it
  begins is cancelled (its future fails with ManagerClosedError naming remove=True);
  one already started is waited for, and its write too, before any memory is freed
  (memory with I/O in flight is never freed: past ``close_timeout_s`` the close raises
  and keeps everything open).
* A read-ahead claims nothing until it runs (``Prefetch.QUEUED``); a fetch that comes
  first takes the entry over and the queued read-ahead does nothing. A running read-ahead
  (``Prefetch.RUNNING``) is waited for by a fetch of the same key, never duplicated.
* A read-ahead from NVMe into host memory is issued and left to its completion
  (:meth:`MoverJobs._read_ahead`), which settles the entry and ends the
  read-ahead: a mover thread never waits for the disk, so a few threads keep many reads
  in flight and the disk's queue full. The read counts in ``ctx.jobs`` until it ends.
* Its share of the read-ahead window is held from ``prefetch`` until the tensor is
  fetched, evicted, or the read-ahead fails (then given back at once).
* Futures handed to callers are resolved outside the lock (their callbacks may call the
  manager).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from swapper.manager.config import Tier
from swapper.manager.context import ManagerContext
from swapper.manager.entry import EntryState, Prefetch, SwapEntry
from swapper.manager.errors import ManagerClosedError, NotDurableError
from swapper.manager.mover import Mover
from swapper.manager.shared import in_flight, named_error, store_key_of
from tiers.budget import Reservation
from tiers.protocols import MemoryBlock
from tiers.signals import wait_cond, wait_future

__all__ = ["MoverJobs"]

log = logging.getLogger("swapper.manager")

_S = EntryState


class MoverJobs:
    """The mover threads' requests and ``flush`` (see the module docstring)."""

    def __init__(self, ctx: ManagerContext, mover: Mover) -> None:
        self._ctx = ctx
        self._mover = mover

    def submit(self, job: Callable[..., None], *args: object) -> None:
        """Lock held. Queue ``job(*args)`` for a mover thread; ``close`` waits for it."""
        self._ctx.pool.submit(self._run, job, *args)
        self._ctx.jobs += 1

    def _run(self, job: Callable[..., None], *args: object) -> None:
        try:
            job(*args)
        finally:
            with self._ctx.cond:
                self._ctx.jobs -= 1
                self._ctx.notify()

    def evict(self, entry: SwapEntry, to: Tier, deadline: float, future: Future[None]) -> None:
        """An ``evict`` request: move ``entry`` down to ``to``, then resolve ``future``."""
        ctx = self._ctx
        # The future is resolved outside the lock: its callbacks may call the manager.
        with ctx.cond:
            cancelled = ctx.removing
        if cancelled:  # a write into a store about to be deleted would be wasted
            future.set_exception(
                ManagerClosedError(
                    f"evict of key={entry.key!r} cancelled: close(remove=True) began before "
                    "it started (nothing is written; the store's files are deleted)"
                )
            )
            return
        try:
            with ctx.cond:
                ctx.await_idle(entry, deadline, "evict")
                work = entry.tier is not None and entry.tier.rank < to.rank  # else: there
                if work and entry.readahead is not None:
                    entry.readahead.release()
                    entry.readahead = None
                if work and to is Tier.NVME and entry.clean:
                    ctx.free_memory(entry)
                    ctx.set_state(entry, _S.ON_NVME)
                    work = False
                if work:
                    ctx.set_state(entry, _S.WRITING if to is Tier.NVME else _S.MOVING)
                version = entry.version
            if not work:
                future.set_result(None)
            elif to is Tier.NVME:
                self._mover.write_out(entry, version, future, deadline, keep=False)
            else:
                self._mover.demote(entry, to, deadline)
                future.set_result(None)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)

    def prefetch(self, entry: SwapEntry, target: Tier, window: Reservation) -> None:
        """A read-ahead request: bring ``entry`` into ``target`` if it still needs it and
        room can be had without taking what is needed sooner; else give up quietly."""
        ctx = self._ctx
        deadline = time.monotonic() + ctx.config.timeout_s
        landed = handed = False
        try:
            with ctx.cond:
                if ctx.closing or entry.prefetch is not Prefetch.QUEUED:
                    return
                entry.prefetch = Prefetch.RUNNING
                while entry.state.transient:
                    ctx.wait(deadline, entry)
                if entry.state not in (_S.RESIDENT, _S.ON_NVME) or entry.tier is target:
                    return  # gone, in use, or already there
            block, room = self._mover.obtain_move(entry, target, deadline, read_ahead=True)
            if block is None:
                return
            with ctx.cond:
                source = entry.tier
                if entry.state not in (_S.RESIDENT, _S.ON_NVME) or source is target:
                    block.release()
                    ctx.notify()
                    return
                ctx.set_state(entry, _S.READING if source is None else _S.MOVING)
            if source is None and target is Tier.HOST:
                # Issued and left to its completion, which settles the entry and ends
                # the read-ahead: the thread goes on to the next request meanwhile.
                self._read_ahead(entry, block, window)
                handed = True
                return
            self._mover.transfer(
                entry, block, source, target, deadline, pin=False, readahead=window, room=room
            )
            landed = True
        except Exception as exc:
            log.debug("read-ahead of key=%r failed: %s", entry.key, exc)
        finally:
            if not handed:
                if not landed:
                    window.release()
                    ctx.stats.add(prefetch_dropped=1)
                with ctx.cond:
                    entry.prefetch = Prefetch.NONE
                    ctx.notify()

    def _read_ahead(self, entry: SwapEntry, block: MemoryBlock, window: Reservation) -> None:
        """Start reading a READING entry (``Prefetch.RUNNING``) from NVMe into host
        ``block`` and return at once: a read-ahead does not hold a mover thread while the
        disk works, so the threads keep the disk's queue full.

        From here on the read's completion owns ``block``, ``window`` and the entry: it
        settles it RESIDENT in the host tier holding ``window`` (or, failed, ON_NVME with
        both freed) and ends the read-ahead (``Prefetch.NONE``). The read counts in
        ``ctx.jobs`` until then, so ``close`` waits for it.

        Raises:
            SwapIOError: the read could not be issued; the entry is ON_NVME again and
                ``block`` freed (``window`` stays the caller's).
        """
        ctx = self._ctx
        with ctx.cond:
            ctx.jobs += 1
        ctx.stats.begin(Tier.NVME, Tier.HOST)
        try:
            future = entry.io = ctx.nvme().read(store_key_of(entry), block.tensor)
        except BaseException as exc:
            ctx.stats.end(Tier.NVME, Tier.HOST, None)
            self._mover.end_read(entry, block, None)
            with ctx.cond:
                ctx.jobs -= 1
                ctx.notify()
            raise named_error(exc, "reading", entry.key) from exc

        def done(future: Future[int]) -> None:
            error = future.exception()
            ctx.stats.end(Tier.NVME, Tier.HOST, None if error else entry.nbytes, entry.kind)
            with ctx.cond:
                if error is None:
                    entry.block, entry.tier = block, Tier.HOST
                    entry.readahead = window
                    entry.last_use = next(ctx.clock)
                    ctx.set_state(entry, _S.RESIDENT)
                else:
                    block.release()
                    window.release()
                    ctx.set_state(entry, _S.ON_NVME)
                entry.prefetch = Prefetch.NONE
                ctx.jobs -= 1
                ctx.notify()
            if error is not None:
                ctx.stats.add(prefetch_dropped=1)
                log.debug("read-ahead of key=%r failed: %s", entry.key, error)

        future.add_done_callback(done)

    def flush(self, deadline: float, *, final: bool, skip: frozenset[str] = frozenset()) -> None:
        """Write every dirty RESIDENT entry (memory kept) but those in ``skip``, wait, save
        the manifest.

        ``final`` (close, nothing else running): first let transfers under way end (an
        eviction that fails leaves a dirty entry to write), and at the end every entry must
        be clean. Otherwise only the writes this flush starts are judged: other threads may
        be moving and dirtying tensors meanwhile.

        Raises:
            NotDurableError: names the keys not durable.
        """
        ctx = self._ctx
        store = ctx.store
        if store is None:
            return
        with ctx.cond:
            if final:
                ctx.wait_for_transfers(deadline)
            dirty = [
                e
                for e in ctx.entries.values()
                if e.state is _S.RESIDENT and not e.clean and e.key not in skip
            ]
        writes: list[tuple[str, Future[None]]] = []
        for entry in dirty:
            # Claimed one at a time, just before its write: an entry claimed and not yet
            # being written could never be a victim, and staging a device entry may need
            # room that only such a victim can give.
            with ctx.cond:
                if entry.state is not _S.RESIDENT or entry.clean:
                    continue  # moved, evicted or fetched meanwhile
                ctx.set_state(entry, _S.CLEANING)
                version = entry.version
            future: Future[None] = Future()
            future.set_running_or_notify_cancel()
            self._mover.write_out(entry, version, future, deadline, keep=True)
            writes.append((entry.key, future))
        errors: dict[str, BaseException] = {}
        pending: set[str] = set()
        for key, future in writes:
            # Cut here, the writes go on: their completions settle the entries.
            if not wait_future(future, max(0.0, deadline - time.monotonic()), "manager.flush"):
                pending.add(key)
                continue
            error = future.exception()
            if error is not None:
                errors[key] = error
        if final:
            with ctx.cond:
                ctx.wait_for_transfers(deadline)
                pending |= {e.key for e in ctx.entries.values() if not e.clean} - set(errors)
        store.save_manifest()
        not_durable = sorted(set(errors) | pending)
        if not_durable:
            with ctx.cond:
                where = {k: in_flight(ctx.entries[k]) for k in pending if k in ctx.entries}
            raise NotDurableError(
                f"{len(not_durable)} tensor(s) not durable on NVMe: "
                + ", ".join(
                    f"{key!r} ({errors[key]})"
                    if key in errors
                    else f"{key!r} (still in flight) [{where.get(key, 'no request')}]"
                    for key in not_durable[:10]
                )
                + (" ..." if len(not_durable) > 10 else "")
                + (
                    ". The writes still in flight go on (their memory kept until they end): "
                    "call close() (or flush()) again to keep waiting"
                    if pending
                    else ""
                ),
                keys=not_durable,
                errors=errors,
            )

    def shutdown(self, *, remove: bool) -> None:
        """The work of ``TierManager.close``: refuse new work, let queued requests end,
        then write everything (or, with ``remove``, nothing) and free it all. Cut, it
        leaves the manager closing with everything else open; called again, it finishes.

        Raises:
            NotDurableError: as ``close`` documents.
        """
        ctx = self._ctx
        deadline = time.monotonic() + ctx.config.close_timeout_s
        with ctx.cond:
            if ctx.closed:
                return
            ctx.closing = True
            ctx.removing = ctx.removing or remove
            ctx.notify()
            # Queued evictions run (with ``remove``: are cancelled); queued read-aheads give
            # up. (Waited for here, not in the pool's shutdown, so that Ctrl-C can stop it;
            # and only until the deadline: a read-ahead the disk never completes counts
            # here until it does.)
            while ctx.jobs:
                left = deadline - time.monotonic()
                if left <= 0:
                    moving = sorted(
                        (e for e in ctx.entries.values() if e.state.transient),
                        key=lambda e: e.key,
                    )
                    busy = [e.key for e in moving]
                    shown = ", ".join(f"{e.key!r} ({in_flight(e)})" for e in moving[:10])
                    raise NotDurableError(
                        f"close: {ctx.jobs} request(s) (evictions, read-aheads) still "
                        f"running after close_timeout_s={ctx.config.close_timeout_s} s"
                        + (f", moving {shown}" if busy else "")
                        + (" ..." if len(busy) > 10 else "")
                        + ": the disk has not completed them. Nothing was freed or written; "
                        "call close() again to keep waiting",
                        keys=busy,
                        errors={},
                    )
                wait_cond(ctx.cond, left, "manager.close")
        ctx.pool.shutdown(wait=True)
        if remove:
            with ctx.cond:
                # Nothing is written, but memory that I/O uses is freed only once it ends.
                ctx.wait_for_transfers(deadline)
                moving = sorted(
                    (e for e in ctx.entries.values() if e.state.transient), key=lambda e: e.key
                )
                busy = [e.key for e in moving]
                shown = ", ".join(f"{e.key!r} ({in_flight(e)})" for e in moving[:10])
            if busy:  # never free a buffer with I/O in flight: keep everything open
                raise NotDurableError(
                    f"close(remove=True): {len(busy)} transfer(s) still in flight after "
                    f"close_timeout_s={ctx.config.close_timeout_s} s: "
                    + shown
                    + (" ..." if len(busy) > 10 else "")
                    + "; nothing was freed or deleted: call close() again to keep waiting",
                    keys=busy,
                    errors={},
                )
            ctx.release_all(remove=True)
            return
        failed: NotDurableError | None = None
        if ctx.store is not None:
            with ctx.cond:
                for entry in ctx.entries.values():
                    if entry.state is _S.IN_USE:
                        log.warning(
                            "close: key=%r is still in use (%d fetch(es)); writing it as modified",
                            entry.key,
                            entry.users,
                        )
                        entry.users = 0
                        entry.version += 1
                        ctx.set_state(entry, _S.RESIDENT)
            try:
                self.flush(deadline, final=True)
            except NotDurableError as exc:
                if set(exc.keys) - set(exc.errors):
                    raise  # writes still in flight: keep everything open for them
                failed = exc
            except Exception:
                ctx.release_all()
                raise
            # (Interrupted: everything stays open, and close() again finishes the job.)
        ctx.release_all()
        if failed is not None:
            raise failed
