# Size: every move of bytes (registration, the demand fetch and assign, the room cascade
# placement plans carried out, transfers; ~970 lines), each next to its undo: one file, so a
# fetch enters it once. The next split: the registration and assign paths to their own module.
"""The mover: bytes between tiers (copies, NVMe reads and writes) and their completions.

Every transfer starts from an entry some thread has claimed (a transient state, see
:mod:`swapper.manager.entry`) and ends by settling it; who settles it is the rule that
makes interrupts and errors safe.

Interrupts and exceptions
-------------------------
Every public call of the manager runs in a :mod:`tiers.signals` section: Ctrl-C (or
SIGTERM/SIGHUP with a Python handler) is recorded, not raised, and delivered only at a
*wait point* (each place a thread blocks: ``manager.room``, ``manager.transfer``,
``manager.drain``, ``manager.flush``, ``manager.close``, ``store.read``, ``store.write``,
``device.copy``, ``budget.reserve``) or when the call ends. So a ``KeyboardInterrupt`` can
surface exactly where an error can (a timeout, a failed read), and the code is written for
the waits, not for every bytecode. Two rules make every cut safe:

1. A buffer with I/O in flight belongs to the I/O until its completion arrives. A waiter
   whose wait for a read or a registration's write is cut hands the buffers (and the
   write-behind window, and the caller's tensor) to the request's done-callback, which
   frees them and settles the entry; the entry stays transient until then, so nobody
   else touches it. A device copy cannot be called back: a cut wait still waits for it
   (it is short) before its buffers can go. Writes of victims and flushes are always
   settled by their completion, cut or not.
2. Every transition an exception can cut has its undo next to it, run before the
   exception leaves the manager:

   ======================  ==========================================  ====================
   transition              cut at (wait points; errors alike)          becomes
   ======================  ==========================================  ====================
   register: NEW           room (memory tier without NVMe)              GONE, block freed
   NEW → ON_NVME           budget.reserve                               GONE
                           store.write (write in flight)                NEW until the write
                                                                        ends, then GONE (the
                                                                        copy it made deleted)
   fetch: → READING        manager.room (staging), device.copy          ON_NVME, blocks freed
                           store.read (read in flight)                  READING until the
                                                                        read ends, then
                                                                        ON_NVME, blocks freed
   fetch: → MOVING         device.copy                                  RESIDENT where it was
   assign: → READING       manager.room, device.copy (the copy of the      ON_NVME, old copy
     (never read)            new value into the new block)                valid, block freed
   fetch: → IN_USE         a signal or error after the pin (counting,   pin undone: RESIDENT
                           logging, the section's end: ``undo_if_cut``)
   victim → WRITING        room for staging, device.copy,               RESIDENT, data kept
     (or CLEANING, flush)  budget.reserve (before the write is issued)
                           after it is issued: never (completion)       ON_NVME / RESIDENT
   victims claimed, not    the eviction of an earlier one               RESIDENT
     yet evicted
   victim → MOVING         room in the host, device.copy                RESIDENT where it was
   read-ahead: → READING   as fetch (a mover: errors only)              as fetch
   fetch, unregister,      making room, waiting for another thread's    unchanged
     evict                   transfer (before any change of their own)
   flush, close            waiting for writes (they go on)              settled by the writes
   ======================  ==========================================  ====================

   Transitions between two wait points happen under the lock with signals held, so none
   is seen half done.

What no code can close: a signal arriving in the bytecodes between the end of a call and
the caller storing its result (``t = manager.fetch(k)``) is raised there and the result is
lost. Callers inside swapper that keep their own records of what they hold (the step
pipeline, the offload hooks) call within their own section, so the signal waits until
the record is made.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from swapper.manager.config import Tier
from swapper.manager.context import ManagerContext
from swapper.manager.entry import EntryState, Prefetch, SwapEntry
from swapper.manager.errors import ManagerIOTimeout, UnknownKeyError
from swapper.manager.placement import Placement, Plan
from swapper.manager.shared import (
    BehindFuture,
    entry_view,
    forget_view,
    named_error,
    release_when_written,
    store_key_of,
    window_share,
)
from swapper.manager.watchdog import resolve_once
from tiers.budget import ByteBudget, Reservation
from tiers.errors import SwapError
from tiers.protocols import MemoryBlock
from tiers.signals import deliver_pending, wait_cond, wait_point, wait_progressing

__all__ = ["Mover"]

log = logging.getLogger("swapper.manager")

_S = EntryState
_LEAVING = (_S.WRITING, _S.MOVING)


class HostRoom:
    """The host room one fetch's cascade claimed ahead (``Placement.claim_room``): the host
    victims being evicted for it and their evictions. The cascade's host blocks (a device
    victim's demotion or staging, the read's staging) wait for these victims to leave
    rather than asking placement again; only if they have all left and the host still
    has no room (another thread took it) is placement asked once more."""

    __slots__ = ("evictions", "victims")

    def __init__(self) -> None:
        self.victims: list[SwapEntry] = []
        self.evictions: list[Future[None]] = []


class Mover:
    """Transfers of one manager's entries (see the module docstring)."""

    def __init__(self, ctx: ManagerContext, placement: Placement) -> None:
        self._ctx = ctx
        self._placement = placement

    # -- registration ---------------------------------------------------------------------

    def place_new(
        self,
        entry: SwapEntry,
        tensor: torch.Tensor,
        deadline: float,
        behind: BehindFuture | None = None,
    ) -> bool:
        """Settle a NEW entry where placement says (:meth:`Placement.new_home`): RESIDENT
        in the first memory tier with room (copied once), else ON_NVME (:meth:`write_new`;
        with ``behind``: the write issued, its completion settles the entry and resolves
        ``behind``). Returns whether a write to NVMe was issued.

        On any failure, and on a signal that came meanwhile, the entry is dropped (GONE)
        and this raises; a signal is delivered here rather than after the key is visible.
        """
        ctx = self._ctx
        block: MemoryBlock | None = None
        view: torch.Tensor | None = None
        try:
            block, tier = self._placement.new_home(entry)
            if block is None and tier is not None:
                block = self.obtain_now(
                    tier, entry.nbytes, what=f"key={entry.key!r}", deadline=deadline
                )
            if block is not None:
                view = block.view(entry.dtype, entry.shape)
                if tensor.requires_grad:
                    with torch.no_grad():
                        view.copy_(tensor)  # the one copy
                else:
                    view.copy_(tensor)  # (no autograd to keep out: no context to enter)
                deliver_pending()
        except BaseException:
            with ctx.cond:
                if block is not None:
                    block.release()
                self.drop_new(entry, wrote=False)
            raise
        if block is None:
            self.write_new(entry, tensor, deadline, behind)
            return True
        with ctx.cond:
            entry.block, entry.tier = block, tier
            entry.view, entry.view_block = view, block  # what fetches hand out
            if tier is Tier.DEVICE:
                # The copy was queued on the caller's stream: later copies out (on a mover
                # thread's stream) must wait for it, or they could read stale bytes.
                entry.ready = ctx.device.mark_ready()
            ctx.set_state(entry, _S.RESIDENT)
        return False

    def write_new(
        self,
        entry: SwapEntry,
        tensor: torch.Tensor,
        deadline: float,
        behind: BehindFuture | None = None,
    ) -> None:
        """Write a NEW entry's tensor straight to NVMe (from the caller's memory if it can):
        ON_NVME, or on failure dropped (GONE) and it raises.

        With ``behind`` (:meth:`TierManager.register_behind`), it returns once the write is
        issued: the completion settles the entry (ON_NVME, or GONE) and then resolves
        ``behind`` (with the named error on failure); the source is kept alive until then,
        and ``behind.released`` is done once the write's pieces have ended (before its
        flush: :class:`~swapper.manager.shared.BehindFuture`).

        When the wait for the write is cut (an interrupt, or ``deadline`` passed:
        :class:`~swapper.manager.ManagerTimeout`), the exception propagates at once and the
        write's completion finishes the job: it releases the write-behind window, lets
        the source go (the kernel reads it until then) and drops the entry, deleting what
        it wrote. The entry stays NEW meanwhile, so a new ``register`` of the key waits.
        """
        ctx = self._ctx
        outcome = "failed"  # → "handed" to the completion, or "written"
        try:
            source = tensor.detach().resolve_conj().resolve_neg()
            if source.device.type != "cpu" or not source.is_contiguous():
                # Exactly one copy. (Tensor.to(memory_format=...) would return a strided
                # CPU tensor unchanged, and .contiguous() after .cpu() could copy twice.)
                source = torch.empty(entry.shape, dtype=entry.dtype).copy_(source)
            window = self._reserve_window(ctx.writebehind, entry, deadline)
            ctx.stats.begin(Tier.HOST, Tier.NVME)
            store = ctx.nvme()
            try:
                future = entry.io = store.write(store_key_of(entry), source)
            except BaseException as exc:
                window.release()
                ctx.stats.end(Tier.HOST, Tier.NVME, None)
                raise named_error(exc, "writing", entry.key) from exc

            def ended(error: BaseException | None) -> None:
                window.release()
                ctx.stats.end(Tier.HOST, Tier.NVME, None if error else entry.nbytes, entry.kind)

            if behind is not None:
                outcome = "handed"
                future.add_done_callback(
                    lambda done, source=source: self._settle_new(done, entry, ended, behind)
                )
                release_when_written(future, behind)
                return
            try:
                ctx.hurry_writes()  # the caller waits for this write to be durable
                issued = time.monotonic()
                progress = store.last_progress_s
                if not wait_progressing(future, deadline, progress, "store.write"):
                    raise future.timed_out(
                        time.monotonic() - issued,
                        f"ManagerConfig.timeout_s={ctx.config.timeout_s}",
                        cls=ManagerIOTimeout,
                        then=f"register of key={entry.key!r} gives up: the registration is "
                        "undone when the write ends (the key is then free)",
                    )
            except BaseException:
                outcome = "handed"

                def abandoned(done: Future[int], source: torch.Tensor = source) -> None:
                    # ``source`` is bound here so that it lives until the write has ended.
                    error = done.exception()
                    ended(error)
                    with ctx.cond:
                        self.drop_new(entry, wrote=error is None)

                future.add_done_callback(abandoned)
                raise
            error = future.exception()
            ended(error)
            if error is not None:
                raise named_error(error, "writing", entry.key) from error
            outcome = "written"
            deliver_pending()  # now rather than after the key is visible
        except BaseException:
            if outcome != "handed":
                with ctx.cond:
                    self.drop_new(entry, wrote=outcome == "written")
            raise
        with ctx.cond:
            entry.nvme_version = entry.version
            ctx.set_state(entry, _S.ON_NVME)

    def _settle_new(
        self,
        done: Future[int],
        entry: SwapEntry,
        ended: Callable[[BaseException | None], None],
        behind: BehindFuture,
    ) -> None:
        """The completion of a registration's write nobody waits for (``write_new`` with
        ``behind``): the entry ON_NVME, or dropped (GONE) on failure; then ``behind``."""
        ctx = self._ctx
        error = done.exception()
        ended(error)
        named = None if error is None else named_error(error, "writing", entry.key)
        with ctx.cond:
            if named is None:
                entry.nvme_version = entry.version
                ctx.set_state(entry, _S.ON_NVME)
            else:
                self.drop_new(entry, wrote=False)
        ctx.notifier.submit(resolve_once, behind, named)

    def drop_new(self, entry: SwapEntry, *, wrote: bool) -> None:
        """Lock held. Undo a registration that did not finish: NEW → GONE, forgotten, and
        the NVMe copy its write made deleted (``wrote``)."""
        ctx = self._ctx
        if wrote and ctx.store is not None:
            store_key = store_key_of(entry)
            try:
                if store_key in ctx.store:
                    ctx.store.delete(store_key)
            except SwapError as exc:  # a closed store: nothing of it is read again
                log.warning("key=%r: could not delete its abandoned copy: %s", entry.key, exc)
        entry.transition(_S.GONE)
        if ctx.entries.get(entry.key) is entry:
            del ctx.entries[entry.key]
        ctx.notify()

    # -- down: victims and evictions --------------------------------------------------------

    def evict_claimed(
        self,
        entry: SwapEntry,
        dest: Tier,
        version: int,
        deadline: float,
        room: HostRoom | None = None,
    ) -> Future[None]:
        """Evict an entry already marked WRITING (dest NVMe) or MOVING (dest host), its host
        block (demoted, or staging) from ``room`` when the cascade claimed one. Cut or
        failed, the entry is settled (RESIDENT where it was) before this raises."""
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        if dest is Tier.NVME:
            self.write_out(entry, version, future, deadline, keep=False, room=room)
            return future
        try:
            self.demote(entry, dest, deadline, room)
        except BaseException as exc:
            future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            future.set_result(None)
        return future

    def demote(
        self, entry: SwapEntry, dest: Tier, deadline: float, room: HostRoom | None = None
    ) -> None:
        """Copy a MOVING entry down to memory tier ``dest`` (its block there from ``room``,
        if any); RESIDENT there, or where it was on failure."""
        source = entry.tier
        try:
            what = f"key={entry.key!r}"
            block = self.obtain_now(dest, entry.nbytes, what=what, deadline=deadline, room=room)
        except BaseException:
            with self._ctx.cond:
                self._ctx.set_state(entry, _S.RESIDENT)
            raise
        self.transfer(entry, block, source, dest, deadline, pin=False)

    def write_out(
        self,
        entry: SwapEntry,
        version: int,
        future: Future[None],
        deadline: float,
        *,
        keep: bool,
        room: HostRoom | None = None,
    ) -> None:
        """Write a WRITING (``keep`` False) or CLEANING entry to NVMe; returns once issued
        (a device entry staged through a host block, from ``room`` if any).

        The completion settles the entry (memory freed only if the write succeeded and not
        ``keep``) and then resolves ``future``. Failing (or cut) before the write is
        issued, the entry is settled RESIDENT at once and ``future`` fails; an error is
        reported only through ``future``, anything else (``KeyboardInterrupt``) raised.
        """
        ctx = self._ctx
        staging: MemoryBlock | None = None
        window: Reservation | None = None
        try:
            held = _block_of(entry)
            if entry.tier is Tier.DEVICE:
                staging = self.obtain_now(
                    Tier.HOST,
                    entry.nbytes,
                    what=f"staging for key={entry.key!r}",
                    deadline=deadline,
                    room=room,
                )
                with ctx.stats.transfer(Tier.DEVICE, Tier.HOST, entry.nbytes, entry.kind):
                    self._copy(staging.tensor, held.tensor, after=entry.ready)
                source = staging.view(entry.dtype, entry.shape)
            else:
                source = held.view(entry.dtype, entry.shape)
            window = self._reserve_window(ctx.writebehind, entry, deadline)
            ctx.stats.begin(Tier.HOST, Tier.NVME)
            store = ctx.nvme()
            try:
                store_future = entry.io = store.write(store_key_of(entry), source)
            except BaseException:
                ctx.stats.end(Tier.HOST, Tier.NVME, None)
                raise
            if not keep:
                # An eviction's waiters (the step's write-behind, evict().result()) get a
                # typed timeout if the disk never completes the write (a slow disk, whose
                # writes keep ending, does not fail it); a flush (``keep``) judges its own
                # writes at its deadline.
                ctx.watchdog.watch(
                    future,
                    store_future,
                    start=deadline - ctx.config.timeout_s,
                    deadline=deadline,
                    setting=f"ManagerConfig.timeout_s={ctx.config.timeout_s}",
                    progress=store.last_progress_s,
                )
        except BaseException as exc:
            named = named_error(exc, "writing", entry.key)
            self._end_write(entry, version, staging, window, named, keep)
            future.set_exception(named)
            if not isinstance(exc, Exception):
                raise
            return

        def done(store_future: Future[int]) -> None:
            error = store_future.exception()
            ctx.stats.end(Tier.HOST, Tier.NVME, None if error else entry.nbytes, entry.kind)
            named = None if error is None else named_error(error, "writing", entry.key)
            self._end_write(entry, version, staging, window, named, keep)
            # (Once: the watchdog may have failed it with a timeout already.)
            ctx.notifier.submit(resolve_once, future, named)

        store_future.add_done_callback(done)

    def _end_write(
        self,
        entry: SwapEntry,
        version: int,
        staging: MemoryBlock | None,
        window: Reservation | None,
        error: BaseException | None,
        keep: bool,
    ) -> None:
        """Settle a write (any thread): durable → ON_NVME (memory freed) or RESIDENT (kept);
        failed or never issued → RESIDENT with its data."""
        ctx = self._ctx
        if window is not None:
            window.release()
        with ctx.cond:
            if staging is not None:
                staging.release()
            if error is None:
                entry.nvme_version = version
                if not keep:
                    ctx.free_memory(entry)
            ctx.set_state(entry, _S.ON_NVME if error is None and not keep else _S.RESIDENT)
        if isinstance(error, Exception):
            ctx.stats.add(write_errors=1)
            log.warning("write of key=%r to NVMe failed; it stays in memory: %s", entry.key, error)

    # -- up: fetches and read-ahead ------------------------------------------------------------

    def fetch(
        self, key: str, tier: Tier | str | None, timeout_s: float, in_place: bool
    ) -> torch.Tensor:
        """:meth:`~swapper.manager.TierManager.fetch` when the tensor is not simply
        resident where it is wanted (that case is ``ManagerContext.fetch_resident``):
        :meth:`bring` it, counting the stall, and pin it. ``in_place``: into the memory
        tier it is in when it is settled in one (else ``tier``).

        Raises:
            as :meth:`~swapper.manager.TierManager.fetch`.
        """
        ctx = self._ctx
        start = time.monotonic()
        deadline = start + timeout_s
        with ctx.cond:
            ctx.check_open()
            entry = ctx.get(key)
            target = self._placement.fetch_tier(entry, tier)
            if in_place and entry.tier is not None and not entry.state.transient:
                target = entry.tier
            self._want(entry)
        brought = False
        try:
            tensor, hit, waited = self.bring(entry, target, deadline)
            brought = True
        finally:
            elapsed = time.monotonic() - start
            with ctx.cond:
                entry.waiters -= 1
            if not brought:
                ctx.stats.add(stall_s=elapsed)
        # Pinned from here on: whatever cuts the rest (a signal, an error in the counting)
        # undoes the pin before it leaves, so no entry stays in use without a holder.
        try:
            # A signal that came during the fetch is delivered here, with the pin
            # undone, rather than after the caller holds the tensor without knowing.
            deliver_pending()
            self._count_fetch(elapsed, hit, waited)
        except BaseException:
            ctx.unpin(entry)
            raise
        return tensor

    def assign(
        self,
        key: str,
        source: torch.Tensor,
        tier: Tier | str | None,
        timeout_s: float,
        convert: bool,
    ) -> None:
        """:meth:`~swapper.manager.TierManager.assign`: ``key``'s whole value replaced by
        ``source``, its old value never read. Counted as a fetch is (a hit when it was in
        memory, else a miss; the time spent waiting as stall), with no transfer.

        Raises:
            as :meth:`~swapper.manager.TierManager.assign`.
        """
        ctx = self._ctx
        start = time.monotonic()
        deadline = start + timeout_s
        with ctx.cond:
            ctx.check_open()
            entry = ctx.get(key)
            _check_assignable(entry, source, convert)
            target = self._placement.fetch_tier(entry, tier)
            self._want(entry)
        placed = False
        try:
            hit, waited = self._place_value(entry, source, target, deadline)
            placed = True
        finally:
            elapsed = time.monotonic() - start
            with ctx.cond:
                entry.waiters -= 1
            if not placed:
                ctx.stats.add(stall_s=elapsed)
        self._count_fetch(elapsed, hit, waited)

    def _want(self, entry: SwapEntry) -> None:
        """Lock held. A fetch or assign of ``entry`` begins: its access noted, and from
        here on it is nobody's victim (``waiters``) until the caller's ``finally``."""
        self._ctx.note_access(entry)
        entry.waiters += 1
        if entry.prefetch is Prefetch.QUEUED:
            # This call moves it now; a read-ahead starting later would read it again
            # after the caller has used it (and perhaps written it out).
            entry.prefetch = Prefetch.NONE

    def _count_fetch(self, elapsed: float, hit: bool, waited: bool) -> None:
        """One fetch (or assign) in the stats: a hit when it was where it was wanted, its
        ``elapsed`` seconds a stall when it waited for another transfer or was a miss."""
        self._ctx.stats.add(
            fetches=1,
            stall_s=elapsed if (waited or not hit) else 0.0,
            prefetch_hits=int(hit),
            prefetch_misses=int(not hit),
        )

    def _place_value(
        self, entry: SwapEntry, source: torch.Tensor, target: Tier, deadline: float
    ) -> tuple[bool, bool]:
        """:meth:`assign`'s work. A transfer of ``entry`` under way (a read-ahead reading
        it, an eviction writing it) is waited for first: its buffer is the I/O's until it
        ends. Then, in memory (any tier): ``source`` copied into it where it is, pinned
        for the copy and released modified. On NVMe only: room made in ``target`` as a
        fetch makes it, the entry claimed READING (nobody else touches it), ``source``
        copied into the new block, and only then the block made the entry's, RESIDENT
        and modified. Cut or failed before that, the block is freed and the entry is
        ON_NVME with its old copy, as before.

        Returns:
            (it was in memory: a hit, this waited for another thread's transfer).
        """
        ctx = self._ctx
        waited = False
        what = f"key={entry.key!r}"
        while True:
            with ctx.cond:
                while entry.state.transient or entry.prefetch is Prefetch.RUNNING:
                    waited = True
                    ctx.wait(deadline, entry)
                if entry.state is _S.GONE:
                    raise UnknownKeyError(f"{what} was unregistered during the assign")
                resident = ctx.pin(entry) if entry.tier is not None else None
            if resident is not None:
                try:
                    resident.view(-1).copy_(source.reshape(-1))
                finally:
                    with ctx.cond:
                        # (modified even if the copy failed part way: memory is the truth)
                        entry.version += 1
                        if entry.tier is Tier.DEVICE:
                            entry.ready = ctx.device.mark_ready()
                        ctx.unpin_locked(entry)
                return True, waited
            block = self.obtain(target, entry.nbytes, what=what, deadline=deadline, moving=entry)
            if block is None:
                continue  # it arrived in memory meanwhile (a read-ahead): copy into it there
            with ctx.cond:
                if entry.state is not _S.ON_NVME:
                    block.release()  # someone moved it while we made room: look again
                    ctx.notify()
                    continue
                ctx.set_state(entry, _S.READING)  # claimed, as a fetch's own read claims it
            try:
                self._copy(block.view(entry.dtype, entry.shape), source.reshape(entry.shape))
            except BaseException:
                with ctx.cond:
                    block.release()
                    ctx.set_state(entry, _S.ON_NVME)  # its NVMe copy untouched: as before
                raise
            with ctx.cond:
                entry.block, entry.tier = block, target
                entry.version += 1  # the NVMe copy is stale now
                if target is Tier.DEVICE:
                    entry.ready = ctx.device.mark_ready()
                ctx.set_state(entry, _S.RESIDENT)
            return False, waited

    def bring(
        self, entry: SwapEntry, target: Tier, deadline: float
    ) -> tuple[torch.Tensor, bool, bool]:
        """A fetch's own work: wait out transfers of ``entry`` under way, then, unless it
        is in ``target`` by then, make room there and move it in; pin it (IN_USE).

        Returns:
            (its tensor, whether it was there already (a hit), whether this waited for
            another thread's transfer).

        Raises:
            as :meth:`~swapper.manager.TierManager.fetch`; the entry is settled where it
            was (or, for a cut read, settles when the read ends).
        """
        ctx = self._ctx
        waited = False
        while True:
            with ctx.cond:
                ready, waited_now = ctx.await_settled(entry, target, deadline)
                waited |= waited_now
                if ready:
                    return ctx.pin(entry), True, waited
            block, room = self.obtain_move(entry, target, deadline)
            if block is None:
                continue  # it no longer needs us (it arrived, or someone else moves it)
            with ctx.cond:
                source = entry.tier
                if entry.state not in (_S.RESIDENT, _S.ON_NVME) or source is target:
                    block.release()  # someone moved it while we made room: look again
                    ctx.notify()
                    continue
                ctx.set_state(entry, _S.READING if source is None else _S.MOVING)
            self.transfer(entry, block, source, target, deadline, pin=True, room=room)
            with ctx.cond:
                return entry_view(entry), False, waited

    def transfer(
        self,
        entry: SwapEntry,
        block: MemoryBlock,
        source: Tier | None,
        target: Tier,
        deadline: float,
        *,
        pin: bool,
        readahead: Reservation | None = None,
        room: HostRoom | None = None,
    ) -> None:
        """Copy a READING (``source`` None: from NVMe) or MOVING entry into ``block`` of
        ``target``; then free the old memory and settle: IN_USE if ``pin``, else RESIDENT
        (holding ``readahead``). A read into the device stages through a host block, from
        ``room`` (the host room claimed with ``block``'s) if any. On failure the entry is
        back where it was and ``block`` freed, and it raises; if the wait for a read from
        NVMe was cut, both happen only when the read ends (see :meth:`_read_into`).
        """
        ctx = self._ctx
        if source is None:
            self._read_into(entry, block, target, deadline, room)
        else:
            try:
                with ctx.stats.transfer(source, target, entry.nbytes, entry.kind):
                    self._copy(block.tensor, _block_of(entry).tensor, after=entry.ready)
            except BaseException:
                with ctx.cond:
                    block.release()
                    ctx.set_state(entry, _S.RESIDENT)
                raise
        with ctx.cond:
            old, entry.block, entry.tier = entry.block, block, target
            if old is not None:
                forget_view(entry)
                ctx.departures += 1
                old.release()
            if pin:
                entry.users += 1
                ctx.set_state(entry, _S.IN_USE)
                if entry.readahead is not None:  # a read-ahead that a fetch moved on
                    entry.readahead.release()
                    entry.readahead = None
            else:
                if readahead is not None:
                    entry.readahead = readahead
                    entry.last_use = next(ctx.clock)
                ctx.set_state(entry, _S.RESIDENT)

    def _read_into(
        self,
        entry: SwapEntry,
        block: MemoryBlock,
        target: Tier,
        deadline: float,
        room: HostRoom | None,
    ) -> None:
        """Read a READING entry from NVMe into ``block`` of ``target`` (staged through a host
        block for the device). On failure ``block`` (and the staging block) is freed and
        the entry is back ON_NVME, and it raises.

        The kernel writes into the buffer until the read ends: when the wait for it is
        cut (a signal, an error), the exception propagates at once and the read's
        completion does the freeing and settling; the entry stays READING until then.
        """
        ctx = self._ctx
        staging: MemoryBlock | None = None
        handed = False
        try:
            if target is not Tier.HOST:
                staging = self.obtain_now(
                    Tier.HOST,
                    entry.nbytes,
                    what=f"staging for key={entry.key!r}",
                    deadline=deadline,
                    room=room,
                )
            buffer = block if staging is None else staging
            with ctx.stats.transfer(Tier.NVME, Tier.HOST, entry.nbytes, entry.kind):
                store = ctx.nvme()
                future = entry.io = store.read(store_key_of(entry), buffer.tensor)
                try:
                    waited = time.monotonic()
                    if not wait_progressing(future, deadline, store.last_progress_s, "store.read"):
                        # The disk stopped answering: name the file and offset; the read
                        # goes on, and its completion frees the buffers (below).
                        raise future.timed_out(
                            time.monotonic() - waited,
                            f"ManagerConfig.timeout_s={ctx.config.timeout_s}",
                        )
                except BaseException:
                    handed = True
                    future.add_done_callback(
                        lambda _f, staging=staging: self.end_read(entry, block, staging)
                    )
                    raise
                error = future.exception()
                if error is not None:
                    raise error
            if staging is not None:
                with ctx.stats.transfer(Tier.HOST, target, entry.nbytes, entry.kind):
                    self._copy(block.tensor, staging.tensor)
        except BaseException as exc:
            if not handed:
                self.end_read(entry, block, staging)
            if isinstance(exc, OSError):
                raise named_error(exc, "reading", entry.key) from exc
            raise
        if staging is not None:
            with ctx.cond:
                staging.release()
                ctx.notify()

    def end_read(self, entry: SwapEntry, block: MemoryBlock, staging: MemoryBlock | None) -> None:
        """A read that did not land (any thread): its buffers freed, the entry ON_NVME."""
        with self._ctx.cond:
            block.release()
            if staging is not None:
                staging.release()
            self._ctx.set_state(entry, _S.ON_NVME)

    # -- room -------------------------------------------------------------------------------

    def obtain(
        self,
        tier: Tier,
        nbytes: int,
        *,
        what: str,
        deadline: float,
        moving: SwapEntry | None = None,
        read_ahead: bool = False,
        room: HostRoom | None = None,
        reads: bool = False,
    ) -> MemoryBlock | None:
        """A block of ``nbytes`` in ``tier``, evicting the victims placement claims until it
        fits. Placement claims the whole cascade at once (:meth:`Placement.claim_room`): the
        victims here and, for a tier above the host, the host room their eviction takes
        (and, with ``reads``, the host staging block of ``moving``'s read from NVMe); the
        host victims are evicted first and put in ``room``, whose host blocks (the
        demotions below, the read's staging later) wait for them instead of asking again.
        In the host, ``room``'s victims count as this call's own.

        ``moving`` is the entry the block is for, if any: None is returned as soon as it no
        longer needs moving into ``tier`` (it got there, or another thread took it over).
        A ``read_ahead`` evicts only victims nobody waits for and, with an access order,
        only those needed later than ``moving``; and returns None rather than waiting for
        users or timing out. Without ``moving`` and ``read_ahead`` it never returns None.
        While victims this call evicts are still leaving, it waits for them rather than
        asking for more (the bytes on their way out are counted as room to come).

        Raises:
            BudgetExceededError: it can never fit.
            BudgetTimeout: no room by ``deadline``.
            SwapIOError, BudgetTimeout: evicting a victim failed (the victim keeps its data).
        """
        ctx = self._ctx
        memory = ctx.memory[tier]
        charge = memory.charge(nbytes)
        cascade = room if room is not None else HostRoom()
        own = cascade if tier is Tier.HOST else HostRoom()  # the victims this call waits for
        waited_s = max(0.0, deadline - time.monotonic())  # the most this call waits
        while True:
            with ctx.cond:
                epoch = ctx.epoch
                if moving is not None and not _needs_move(moving, tier, read_ahead):
                    return None
            block = memory.try_alloc(nbytes, what=what)
            if block is not None:
                return block
            for future in own.evictions:
                error = future.exception() if future.done() else None
                if error is not None:
                    raise error
            with ctx.cond:
                if read_ahead and ctx.closing:
                    return None
                if ctx.epoch != epoch:
                    continue  # something changed since try_alloc: look again
                claimed: tuple[list[Plan], list[Plan]] | None = ([], [])
                # (Their states change under the lock, with a notify: the wait below
                # wakes when one has left.)
                if not any(v.tier is tier and v.state in _LEAVING for v in own.victims):
                    claimed = self._placement.claim_room(
                        tier, charge, moving, read_ahead, reads=reads
                    )
                if claimed is None:
                    return None
                if not claimed[0] and ctx.epoch == epoch:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        if read_ahead:
                            return None
                        raise self._placement.room_timeout(tier, nbytes, what, waited_s)
                    ctx.hurry_writes()  # the room may be held by writes not yet durable
                    wait_cond(ctx.cond, left, "manager.room")
            here, host = claimed
            # The host's victims first: the demotions (and staging) of the victims here
            # take the room they leave.
            plans = [(plan, cascade, None) for plan in host]
            plans += [(plan, own, cascade) for plan in here]
            issued = 0
            try:
                for (victim, dest, version), into, their_room in plans:
                    into.victims.append(victim)
                    into.evictions.append(
                        self.evict_claimed(victim, dest, version, deadline, their_room)
                    )
                    issued += 1
            finally:
                if issued < len(plans):
                    # Cut while evicting one (which settled itself): the victims claimed
                    # after it were never started and go back to RESIDENT.
                    with ctx.cond:
                        for (victim, _, _), _, _ in plans[issued + 1 :]:
                            ctx.set_state(victim, _S.RESIDENT)

    def obtain_move(
        self, entry: SwapEntry, target: Tier, deadline: float, *, read_ahead: bool = False
    ) -> tuple[MemoryBlock | None, HostRoom]:
        """:meth:`obtain` of a block in ``target`` for moving ``entry`` there (a fetch, or a
        ``read_ahead``), with the host room claimed with it: a read from NVMe into the
        device stages through it (:meth:`transfer`'s ``room``).

        Raises:
            as :meth:`obtain`.
        """
        room = HostRoom()
        block = self.obtain(
            target,
            entry.nbytes,
            what=f"key={entry.key!r}",
            deadline=deadline,
            moving=entry,
            read_ahead=read_ahead,
            room=room,
            reads=True,
        )
        return block, room

    def obtain_now(
        self,
        tier: Tier,
        nbytes: int,
        *,
        what: str,
        deadline: float,
        room: HostRoom | None = None,
    ) -> MemoryBlock:
        """:meth:`obtain` for a caller that needs the block whatever happens (staging,
        demotion, a working buffer): never None.

        Raises:
            as :meth:`obtain`.
        """
        block = self.obtain(tier, nbytes, what=what, deadline=deadline, room=room)
        if block is None:  # obtain() returns None only for a moving entry or a read-ahead
            raise RuntimeError(f"no block for {what}: obtain() gave up without a reason")
        return block

    # -- small pieces ---------------------------------------------------------------------------

    def _copy(
        self, dst: torch.Tensor, src: torch.Tensor, *, after: torch.cuda.Event | None = None
    ) -> None:
        """Copy between memory tiers and wait for it. A cut wait still waits (a device
        copy cannot be called back, and is short) before its buffers can be freed."""
        copy = self._ctx.device.copy(dst, src, after=after)
        try:
            wait_point("device.copy")
        finally:
            copy.wait()

    def _reserve_window(self, budget: ByteBudget, entry: SwapEntry, deadline: float) -> Reservation:
        return budget.reserve(
            window_share(budget, entry.nbytes),
            what=f"key={entry.key!r}",
            timeout_s=max(0.0, deadline - time.monotonic()),
        )


def _needs_move(entry: SwapEntry, tier: Tier, read_ahead: bool) -> bool:
    """Lock held. Whether ``entry`` still waits to be moved into ``tier`` by the caller:
    not there, not owned by a transfer, and (for a fetch) not being read ahead."""
    return (
        entry.state in (_S.RESIDENT, _S.ON_NVME)
        and entry.tier is not tier
        and (read_ahead or entry.prefetch is not Prefetch.RUNNING)
    )


def _check_assignable(entry: SwapEntry, source: torch.Tensor, convert: bool) -> None:
    """An ``assign`` of ``source`` to ``entry``: a dense tensor of its numel and dtype (with
    ``convert``: any floating dtype, if the entry's is floating).

    Raises:
        TypeError: not a dense tensor, or another dtype (names the key).
        ValueError: another number of elements (names the key).
    """
    if not isinstance(source, torch.Tensor) or source.layout != torch.strided:
        raise TypeError(f"assign to key={entry.key!r}: expected a dense torch.Tensor")
    if source.dtype != entry.dtype and not (
        convert and source.dtype.is_floating_point and entry.dtype.is_floating_point
    ):
        raise TypeError(
            f"assign to key={entry.key!r}: source is {source.dtype}, the key holds "
            f"{entry.dtype}; convert it first (or pass convert=True for floating dtypes)"
        )
    numel = math.prod(entry.shape)
    if source.numel() != numel:
        raise ValueError(
            f"assign to key={entry.key!r}: source has {source.numel()} elements, the key "
            f"holds {numel} (shape {entry.shape}); write a piece through fetch and release"
        )


def _block_of(entry: SwapEntry) -> MemoryBlock:
    """The memory of an entry that a transfer owns (RESIDENT before it was claimed)."""
    block = entry.block
    if block is None:
        raise RuntimeError(f"key={entry.key!r} is {entry.state.value} without memory")
    return block
