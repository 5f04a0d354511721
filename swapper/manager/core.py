"""TierManager: every tensor's bytes in device memory, host memory or NVMe, moved on demand.

The states of one tensor and the changes between them are drawn in
:mod:`swapper.manager.entry`; this module decides when they happen.

Threads and locks
-----------------
One lock (with its condition) guards every :class:`SwapEntry`; it is held only for
bookkeeping, never across I/O, copies or ``allocate()``. Work happens in three places:

* the caller's thread: ``register``, ``fetch`` (including the room it makes), ``flush``;
* ``mover_threads`` worker threads: ``evict`` and ``prefetch`` requests;
* I/O completion callbacks (the AIO engine's threads): the end of every NVMe write, which
  frees the source memory only then.

A thread that needs room in a tier (``_obtain``) chooses victims under the lock, marks them
WRITING or MOVING, and evicts them itself: a host victim's write is issued and completes
in a callback; a device victim is copied down to the host tier inline (which may in turn
evict host victims). It then waits on the condition, which is notified whenever memory is
freed or an entry changes state. Nobody ever waits for a request still queued for a
worker: an entry is claimed only by a thread that works on it at once, so every wait is on
progress that is already under way (or on a caller's ``release``, bounded by
``timeout_s``).

Bounds: each tier's bytes by its budget; bytes being written by ``write_behind_nbytes``;
bytes read ahead and not yet fetched by ``prefetch_window_nbytes``. Every byte in flight
to or from NVMe sits in a host block (a device tensor is staged through one), so I/O never
holds more than the host budget.

Interrupts and exceptions
-------------------------
Every public call runs in a :mod:`tiers.signals` section: Ctrl-C (or SIGTERM/SIGHUP with
a Python handler) is recorded, not raised, and delivered only at a *wait point* (each
place a thread blocks: ``manager.room``, ``manager.transfer``, ``manager.drain``,
``manager.flush``, ``manager.close``, ``store.read``, ``store.write``, ``device.copy``,
``budget.reserve``) or when the call ends. So a ``KeyboardInterrupt`` can surface exactly
where an error can (a timeout, a failed read), and the code below is written for the
waits, not for every bytecode. Sections cost about 1 µs (see :mod:`tiers.signals`).

Two rules make every cut safe:

1. A buffer with I/O in flight belongs to the I/O until its completion arrives. A waiter
   whose wait for a read or a registration's write is cut hands the buffers (and the
   write-behind window, and the caller's tensor) to the request's done-callback, which
   frees them and settles the entry; the entry stays transient until then, so nobody
   else touches it. A device copy cannot be called back: a cut wait still waits for it
   (it is short) before its buffers can go. Writes of victims and flushes are always
   settled by their completion, cut or not.
2. Every transition an exception can cut has its undo next to it, run before the
   exception leaves the manager. The edges, by state (see :mod:`swapper.manager.entry`):

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
   fetch: → IN_USE         a signal delivered as the fetch ends         pin undone: RESIDENT
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

   A cut ``close()`` leaves the manager closing (new work refused) with everything else
   open: ``close()`` again finishes. Transitions between two wait points happen under the
   lock with signals held, so none is seen half done.

What no code can close: a signal arriving in the bytecodes between the end of a call and
the caller storing its result (``t = manager.fetch(k)``) is raised there and the result is
lost. Callers inside swapper that keep their own records of what they hold (the step
pipeline, the offload hooks) call within their own section, so the signal waits until
the record is made.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future

import torch

from swapper.manager.config import Kind, ManagerConfig, Policy, Tier
from swapper.manager.entry import EntryInfo, EntryState, MemoryBlock, Prefetch, SwapEntry
from swapper.manager.errors import (
    EntryInUseError,
    KeyExistsError,
    ManagerClosedError,
    ManagerTimeout,
    NotDurableError,
    NotInUseError,
    UnknownKeyError,
)
from swapper.manager.policy import AccessOrder, choose_victims
from swapper.manager.stats import ManagerStats, StatsRecorder, TierStats
from tiers.aio import AioEngine
from tiers.budget import BudgetExceededError, BudgetTimeout, ByteBudget, Reservation
from tiers.device import DeviceTier
from tiers.errors import SwapConfigError, SwapError, SwapIOError
from tiers.host import HostTier
from tiers.nvme import ManifestError, NvmeStore
from tiers.signals import at_waits, deliver_pending, held, wait_cond, wait_future, wait_point
from tiers.units import format_size

__all__ = ["TierManager"]

log = logging.getLogger("swapper.manager")

_S = EntryState


class TierManager:
    """Tensors by key across device, host and NVMe tiers under per-tier byte budgets.

    Thread-safe: any number of threads may call any method at once. Use as a context
    manager or call :meth:`close`, which leaves every tensor durable on NVMe with a saved
    manifest; :meth:`open` brings them back.

    Args:
        config: the settings; a new NVMe store is created in ``config.nvme_dirs``.

    Raises:
        SwapConfigError: the device is not usable.
        StoreExistsError: a store of that name is already in the directories (use
            :meth:`open`, or delete it).
        BackendUnavailableError, SwapIOError: the AIO engine or the store's files cannot
            be set up.
    """

    def __init__(self, config: ManagerConfig) -> None:
        self._setup(config, reopen=False)

    @classmethod
    def open(cls, config: ManagerConfig) -> TierManager:
        """Reopen the store a manager left in ``config.nvme_dirs`` at :meth:`close`: every
        tensor comes back registered, with its kind, dtype and shape, ON_NVME.

        Raises:
            SwapConfigError: ``config.nvme_dirs`` is empty.
            ManifestError: no manifest there, or one not written by a TierManager.
            BackendUnavailableError, SwapIOError: as for the constructor.
        """
        manager = cls.__new__(cls)
        manager._setup(config, reopen=True)
        return manager

    def _setup(self, config: ManagerConfig, *, reopen: bool) -> None:
        if not isinstance(config, ManagerConfig):
            raise TypeError(f"config must be a ManagerConfig, got {type(config).__name__}")
        if reopen and not config.nvme_dirs:
            raise SwapConfigError("nothing to reopen: nvme_dirs is empty")
        self.config = config
        self._placement = config.placement
        self._device = DeviceTier(config.device_nbytes, device=config.device)
        self._host = HostTier(config.host_nbytes, arena_nbytes=config.host_arena_nbytes)
        self._memory: dict[Tier, HostTier | DeviceTier] = {
            Tier.DEVICE: self._device,
            Tier.HOST: self._host,
        }
        self._readahead = ByteBudget("read-ahead", config.prefetch_window_nbytes)
        self._writebehind = ByteBudget("write-behind", config.write_behind_nbytes)
        self._entries: dict[str, SwapEntry] = {}
        self._cond = threading.Condition(threading.Lock())
        self._epoch = 0  # bumped on every notify: "something changed since I looked"
        self._clock = itertools.count(1)  # LRU time
        self._order: AccessOrder | None = None
        self._recorded: list[str] | None = None
        self._stats = StatsRecorder()
        self._last_log = time.monotonic()
        self._closing = False
        self._closed = False
        self._jobs = 0  # evict and prefetch requests submitted and not yet ended
        self._engine: AioEngine | None = None
        self._store: NvmeStore | None = None
        if config.nvme_dirs:
            self._engine = AioEngine(config.aio)
            try:
                if reopen:
                    self._store = NvmeStore.open(
                        config.nvme_dirs,
                        self._engine,
                        name=config.store_name,
                        verify=config.verify,
                    )
                    self._load_entries()
                else:
                    self._store = NvmeStore(
                        config.nvme_dirs,
                        self._engine,
                        stripe_nbytes=config.stripe_nbytes,
                        checksum=config.checksum,
                        verify=config.verify,
                        name=config.store_name,
                    )
            except BaseException:
                if self._store is not None:
                    self._store.close()
                self._engine.close()
                self._host.close()
                raise
        # Threads start on the first submit, not here.
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.mover_threads, thread_name_prefix="swapper-mover"
        )
        # Futures handed to callers are resolved here, never on an AIO worker: a caller's
        # done-callback may call the manager, and a read it issues needs those workers.
        self._notifier = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="swapper-notify"
        )

    def _load_entries(self) -> None:
        store = self._store
        for store_key in store:  # a snapshot of its keys
            kind_name, _, key = store_key.partition("/")
            try:
                kind = Kind(kind_name)
            except ValueError:
                raise ManifestError(
                    f"{store.manifest_path}: key {store_key!r} was not written by a TierManager "
                    "(expected '<kind>/<key>')"
                ) from None
            stored = store.info(store_key)
            entry = SwapEntry(
                key,
                kind,
                stored.dtype,
                stored.shape,
                stored.nbytes,
                self._home(kind, stored.nbytes),
            )
            entry.nvme_version = entry.version
            entry.transition(_S.ON_NVME)
            self._entries[key] = entry

    # -- public API -------------------------------------------------------------------

    def register(self, key: str, tensor: torch.Tensor, kind: Kind | str) -> None:
        """Take a copy of ``tensor`` under ``key``; the caller's tensor is not kept.

        It goes to the first tier of ``kind``'s placement whose budget has room now,
        without evicting anything; to NVMe (written and waited for) when none has room or
        it is larger than every memory budget on the list. Without NVMe on the list it
        waits for room (evicting victims) in the first memory tier it fits. The bytes are
        copied once, whatever the strides.

        Raises:
            TypeError: ``key`` is not a non-empty str or ``tensor`` not a dense tensor.
            ValueError: ``kind`` is not a :class:`Kind`.
            KeyExistsError: ``key`` is registered already.
            BudgetExceededError: it fits no tier on its list (names key, size, budget).
            BudgetTimeout: no room came free within ``timeout_s``.
            SwapIOError: the write to NVMe failed (names key and file); nothing is kept.
            ManagerClosedError: the manager is closed.
        """
        _check_key(key)
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(f"register of key={key!r}: expected a dense torch.Tensor")
        kind = _kind(kind)
        nbytes = tensor.numel() * tensor.element_size()
        with at_waits:
            deadline = time.monotonic() + self.config.timeout_s
            with self._cond:
                self._check_open()
                # A registration of the key that is still under way (one whose caller
                # was interrupted ends when its write does): wait for its outcome.
                while (old := self._entries.get(key)) is not None and old.state is _S.NEW:
                    self._wait(deadline, old)
                if key in self._entries:
                    raise KeyExistsError(
                        f"key={key!r} is already registered ({self._entries[key].kind.value}); "
                        "unregister it first"
                    )
                entry = SwapEntry(
                    key, kind, tensor.dtype, tuple(tensor.shape), nbytes, self._home(kind, nbytes)
                )
                entry.last_use = next(self._clock)
                self._entries[key] = entry
            self._place_new(entry, tensor, deadline)

    def fetch(
        self, key: str, tier: Tier | str | None = None, *, timeout_s: float | None = None
    ) -> torch.Tensor:
        """The tensor in memory tier ``tier`` (default: its home), marked in use.

        Waits only for what is missing: a transfer already under way (a prefetch) is
        waited for, else this thread moves the bytes itself, making room by evicting
        victims. Time spent waiting counts as stall. The tensor stays in place until
        :meth:`release`; a key may be fetched by several callers at once (into one tier).

        Raises:
            UnknownKeyError: ``key`` is not registered.
            ValueError: ``tier`` is not a memory tier.
            EntryInUseError: it is in use in another tier.
            BudgetExceededError: it can never fit ``tier``'s budget.
            BudgetTimeout, ManagerTimeout: no room, or another thread's transfer did not
                end, within ``timeout_s`` (default ``config.timeout_s``).
            SwapIOError: reading it, or writing a victim out, failed (names key and file).
            ManagerClosedError: the manager is closed.
        """
        with at_waits:
            return self._fetch(key, tier, timeout_s)

    def _fetch(self, key: str, tier: Tier | str | None, timeout_s: float | None) -> torch.Tensor:
        start = time.monotonic()
        deadline = start + self._timeout(timeout_s)
        with self._cond:
            self._check_open()
            entry = self._get(key)
            target = self._fetch_tier(entry, tier)
            self._note_access(entry)
            entry.waiters += 1  # from here on it is nobody's victim
            if entry.prefetch is Prefetch.QUEUED:
                # This fetch moves it now; a read-ahead starting later would read it
                # again after the caller has used it (and perhaps written it out).
                entry.prefetch = Prefetch.NONE
        hit, waited, ok = False, False, False
        try:
            while True:
                with self._cond:
                    ready, waited_now = self._await_settled(entry, target, deadline)
                    waited |= waited_now
                    if ready:
                        tensor = self._pin(entry)
                        hit = True
                        break
                block = self._obtain(
                    target, entry.nbytes, what=f"key={key!r}", deadline=deadline, moving=entry
                )
                if block is None:
                    continue  # it no longer needs us (it arrived, or someone else moves it)
                with self._cond:
                    source = entry.tier
                    if entry.state not in (_S.RESIDENT, _S.ON_NVME) or source is target:
                        block.release()  # someone moved it while we made room: look again
                        self._notify()
                        continue
                    self._set_state(entry, _S.READING if source is None else _S.MOVING)
                self._transfer(entry, block, source, target, deadline, pin=True)
                with self._cond:
                    tensor = entry.block.view(entry.dtype, entry.shape)
                break
            try:
                # A signal that came during the fetch is delivered here, with the pin
                # undone, rather than after the caller holds the tensor without knowing.
                deliver_pending()
            except BaseException:
                self._unpin(entry)
                raise
            ok = True
            return tensor
        finally:
            elapsed = time.monotonic() - start
            with self._cond:
                entry.waiters -= 1
            if ok:
                self._stats.add(
                    fetches=1,
                    stall_s=elapsed if (waited or not hit) else 0.0,
                    prefetch_hits=int(hit),
                    prefetch_misses=int(not hit),
                )
            else:
                self._stats.add(stall_s=elapsed)
            self._maybe_log()

    def release(self, key: str, *, modified: bool = True) -> None:
        """The caller is done with a fetched tensor; when nobody holds it, it can be evicted.

        Pass ``modified=False`` when the tensor was only read: a clean NVMe copy then stays
        valid and evicting the tensor later writes nothing.

        Raises:
            UnknownKeyError: ``key`` is not registered.
            NotInUseError: ``key`` is not fetched.
        """
        with held, self._cond:
            if self._closed:
                raise ManagerClosedError("the tier manager is closed")
            entry = self._get(key)
            if entry.users == 0:
                raise NotInUseError(f"release of key={key!r}, which no fetch is holding")
            if modified:
                entry.version += 1
            if entry.tier is Tier.DEVICE:
                # Copies out of it may run from other threads, on streams that know nothing
                # of the kernels this caller queued on its own.
                entry.ready = self._device.mark_ready()
            entry.users -= 1
            if entry.users == 0:
                self._set_state(entry, _S.RESIDENT)

    def prefetch(self, keys: Iterable[str], tier: Tier | str | None = None) -> int:
        """Read ahead: start bringing ``keys`` into ``tier`` (default: each one's home).

        Never blocks: requests go to the worker threads, and each one takes only room that
        is free or held by tensors needed later than it (by the recorded order, or any
        LRU victim without one); otherwise it is dropped. Keys already there, in use, or
        already requested are skipped, as are keys beyond the read-ahead window.

        Returns:
            how many requests were queued.

        Raises:
            UnknownKeyError: a key is not registered (nothing is queued then).
            ValueError: ``tier`` is not a memory tier.
            ManagerClosedError: the manager is closed.
        """
        queued: list[SwapEntry] = []
        with held, self._cond:
            self._check_open()
            entries = [self._get(key) for key in keys]
            for entry in entries:
                target = self._fetch_tier(entry, tier)
                if (
                    entry.prefetch is not Prefetch.NONE
                    or entry.state is _S.IN_USE
                    or (entry.tier is target and not entry.state.transient)
                ):
                    continue
                window = self._readahead.try_reserve(
                    _window_share(self._readahead, entry.nbytes), what=f"key={entry.key!r}"
                )
                if window is None:
                    self._stats.add(prefetch_dropped=1)
                    continue
                entry.prefetch = Prefetch.QUEUED
                queued.append(entry)
                self._submit(self._prefetch_job, entry, target, window)
        return len(queued)

    def evict(
        self, key: str, to: Tier | str = Tier.NVME, *, timeout_s: float | None = None
    ) -> Future[None]:
        """Write-behind: move ``key`` down to tier ``to``; returns at once.

        The future completes when the bytes are in ``to`` (durable, for NVMe); only then is
        the source memory freed. A tensor already in ``to`` or below is left alone; one
        with a clean NVMe copy is dropped from memory without writing.

        Raises (at once):
            UnknownKeyError: ``key`` is not registered.
            ValueError: ``to`` is the device tier.
            EntryInUseError: it is in use.
            SwapConfigError: ``to`` is NVMe and there is no NVMe tier.
            ManagerClosedError: the manager is closed.
        The future raises :class:`~tiers.errors.SwapIOError` (names key and file) when the
        write failed: the tensor is then still where it was, with its data;
        :class:`EntryInUseError` when it was fetched again before the eviction started.
        """
        to = _tier(to)
        if to is Tier.DEVICE:
            raise ValueError("evict moves a tensor down: to must be 'host' or 'nvme'")
        deadline = time.monotonic() + self._timeout(timeout_s)
        with held, self._cond:
            self._check_open()
            entry = self._get(key)
            if to is Tier.NVME and self._store is None:
                raise SwapConfigError(f"evict of key={key!r} to nvme: nvme_dirs is empty")
            if entry.state is _S.IN_USE:
                raise EntryInUseError(
                    f"evict of key={key!r}: it is in use ({entry.users} fetch(es) not released)"
                )
            future: Future[None] = Future()
            future.set_running_or_notify_cancel()
            self._submit(self._evict_job, entry, to, deadline, future)
        return future

    def unregister(self, key: str, *, timeout_s: float | None = None) -> None:
        """Forget ``key``: its memory is freed and its NVMe copy deleted.

        Raises:
            UnknownKeyError: ``key`` is not registered.
            EntryInUseError: it is in use.
            ManagerTimeout: a transfer of it did not end within ``timeout_s``.
            ManagerClosedError: the manager is closed.
        """
        deadline = time.monotonic() + self._timeout(timeout_s)
        with at_waits, self._cond:
            self._check_open()
            entry = self._get(key)
            self._await_idle(entry, deadline, "unregister")
            self._free_memory(entry)
            store_key = _store_key(entry)
            # Under the lock: a new registration of the key must not lose its bytes to this.
            if self._store is not None and store_key in self._store:
                self._store.delete(store_key)
            self._set_state(entry, _S.GONE)
            del self._entries[key]

    def flush(self, *, timeout_s: float | None = None) -> None:
        """Write every tensor not in use whose NVMe copy is stale (memory kept), wait for
        those writes, and save the manifest: a checkpoint of the tensors not in use.

        Tensors in use, or in transfer, are not written: their NVMe copy, if any, stays
        the one of their last eviction or flush. Without NVMe, nothing.

        Raises:
            NotDurableError: some writes failed or did not end within ``timeout_s``
                (default ``config.close_timeout_s``); it names the keys. The manifest is
                saved with what is durable.
            SwapIOError: the manifest could not be saved.
            ManagerClosedError: the manager is closed.
        """
        with self._cond:
            self._check_open()
        timeout = self.config.close_timeout_s if timeout_s is None else timeout_s
        with at_waits:
            self._flush(time.monotonic() + timeout, final=False)

    def close(self, *, remove: bool = False) -> None:
        """Make every tensor durable on NVMe, save the manifest, free everything. Idempotent.

        Waits for requests queued and writes in flight (up to ``config.close_timeout_s``).
        Tensors still in use are released first, as modified (logged as a warning).
        Without NVMe the tensors are simply dropped. With ``remove`` nothing is written:
        every tensor is dropped and the store's files are deleted (a scratch manager).

        Raises:
            NotDurableError: some tensors could not be written (named): everything is
                closed anyway and their bytes are gone; or writes were still in flight at
                the deadline (named): then nothing is closed, and calling ``close()``
                again waits for them again.
        """
        with at_waits:
            self._close(remove)

    def _close(self, remove: bool) -> None:
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._notify()
            # Queued evictions run; queued read-aheads give up. (Waited for here, not in
            # the pool's shutdown, so that Ctrl-C can stop the wait.)
            while self._jobs:
                wait_cond(self._cond, None, "manager.close")
        self._pool.shutdown(wait=True)
        deadline = time.monotonic() + self.config.close_timeout_s
        if remove:
            with self._cond:
                # Nothing is written, but memory that I/O uses is freed only once it ends.
                self._wait_for_transfers(deadline)
            self._release_all(remove=True)
            return
        failed: NotDurableError | None = None
        if self._store is not None:
            with self._cond:
                for entry in self._entries.values():
                    if entry.state is _S.IN_USE:
                        log.warning(
                            "close: key=%r is still in use (%d fetch(es)); writing it as modified",
                            entry.key,
                            entry.users,
                        )
                        entry.users = 0
                        entry.version += 1
                        self._set_state(entry, _S.RESIDENT)
            try:
                self._flush(deadline, final=True)
            except NotDurableError as exc:
                if set(exc.keys) - set(exc.errors):
                    raise  # writes still in flight: keep everything open for them
                failed = exc
            except Exception:
                self._release_all()
                raise
            # (Interrupted: everything stays open, and close() again finishes the job.)
        self._release_all()
        if failed is not None:
            raise failed

    def _release_all(self, *, remove: bool = False) -> None:
        with self._cond:
            for entry in self._entries.values():
                self._free_memory(entry)
            self._closed = True
        self._notifier.shutdown(wait=True)  # every caller's future is resolved by now
        if self._store is not None:
            self._store.close(remove=remove)
        if self._engine is not None:
            self._engine.close()
        self._host.close()
        self._device.close()

    def __enter__(self) -> TierManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- access order and queries -------------------------------------------------------

    def record_access_order(self, keys: Iterable[str]) -> None:
        """Set the order in which keys will be fetched, step after step (cyclic).

        With ``policy`` AUTO or BELADY, victims are then the tensors whose next use is
        furthest away; the current step is taken to start at the first key.

        Raises:
            TypeError: a key is not a str.
        """
        order = AccessOrder.of(list(keys))
        with self._cond:
            self._order = order

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the fetches made inside the ``with`` block as the access order.

        Example::

            with manager.recording():
                run_one_step()  # every fetch is noted, in order
        """
        with self._cond:
            self._recorded = []
        try:
            yield
        finally:
            with self._cond:
                keys, self._recorded = self._recorded or [], None
                self._order = AccessOrder.of(keys)

    def info(self, key: str) -> EntryInfo:
        """A snapshot of ``key``'s entry.

        Raises:
            UnknownKeyError: ``key`` is not registered.
        """
        with self._cond:
            return self._get(key).info()

    def keys(self) -> list[str]:
        """The registered keys, in registration order."""
        with self._cond:
            return list(self._entries)

    def __contains__(self, key: object) -> bool:
        with self._cond:
            return key in self._entries

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    def stats(self) -> ManagerStats:
        """Bytes moved per tier pair and their speed, stall time, read-ahead hits and misses,
        bytes and peak bytes per tier."""
        tiers = {
            tier: TierStats(m.budget.limit_nbytes, m.budget.used_nbytes, m.budget.peak_nbytes)
            for tier, m in self._memory.items()
        }
        stored = (
            0 if self._store is None else sum(u.allocated_nbytes for u in self._store.dir_usage())
        )
        tiers[Tier.NVME] = TierStats(None, stored, None)
        return self._stats.snapshot(tiers)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._entries)} tensors"
        return f"<TierManager {self._device.device} ({state})>"

    # -- placement ----------------------------------------------------------------------

    def _place_new(self, entry: SwapEntry, tensor: torch.Tensor, deadline: float) -> None:
        """Settle a NEW entry: RESIDENT in the first memory tier with room, else ON_NVME.

        On any failure, and on a signal that came meanwhile, the entry is dropped (GONE)
        and this raises; a signal is delivered here rather than after the key is visible.
        """
        placement = self._placement[entry.kind]
        memory_tiers = [t for t in placement if t is not Tier.NVME]
        block: MemoryBlock | None = None
        try:
            too_large: BudgetExceededError | None = None
            tier = None
            for tier in memory_tiers:
                try:
                    block = self._memory[tier].try_alloc(entry.nbytes, what=f"key={entry.key!r}")
                except BudgetExceededError as exc:
                    too_large = exc
                    continue
                if block is not None:
                    break
            if block is None and Tier.NVME not in placement:
                fitting = [t for t in memory_tiers if self._fits_ever(t, entry.nbytes)]
                if not fitting and too_large is not None:
                    raise too_large
                tier = fitting[0]
                block = self._obtain(
                    tier, entry.nbytes, what=f"key={entry.key!r}", deadline=deadline
                )
            if block is not None:
                with torch.no_grad():
                    block.view(entry.dtype, entry.shape).copy_(tensor)  # the one copy
                deliver_pending()
        except BaseException:
            with self._cond:
                if block is not None:
                    block.release()
                self._drop_new(entry, wrote=False)
            raise
        if block is None:
            self._write_new(entry, tensor, deadline)
            return
        with self._cond:
            entry.block, entry.tier = block, tier
            if tier is Tier.DEVICE:
                # The copy was queued on the caller's stream: later copies out (on a mover
                # thread's stream) must wait for it, or they could read stale bytes.
                entry.ready = self._device.mark_ready()
            self._set_state(entry, _S.RESIDENT)

    def _write_new(self, entry: SwapEntry, tensor: torch.Tensor, deadline: float) -> None:
        """Write a NEW entry's tensor straight to NVMe (from the caller's memory if it can):
        ON_NVME, or on failure dropped (GONE) and it raises.

        When the wait for the write is cut, the exception propagates at once and the
        write's completion finishes the job: it releases the write-behind window, lets
        the source go (the kernel reads it until then) and drops the entry, deleting what
        it wrote. The entry stays NEW meanwhile, so a new ``register`` of the key waits.
        """
        outcome = "failed"  # → "handed" to the completion, or "written"
        try:
            source = tensor.detach().resolve_conj().resolve_neg()
            if source.device.type != "cpu" or not source.is_contiguous():
                # Exactly one copy. (Tensor.to(memory_format=...) would return a strided
                # CPU tensor unchanged, and .contiguous() after .cpu() could copy twice.)
                source = torch.empty(entry.shape, dtype=entry.dtype).copy_(source)
            window = self._reserve_window(self._writebehind, entry, deadline)
            self._stats.begin(Tier.HOST, Tier.NVME)
            try:
                future = self._store.write(_store_key(entry), source)
            except BaseException as exc:
                window.release()
                self._stats.end(Tier.HOST, Tier.NVME, None)
                raise _named(exc, "writing", entry.key) from exc

            def ended(error: BaseException | None) -> None:
                window.release()
                self._stats.end(Tier.HOST, Tier.NVME, None if error else entry.nbytes, entry.kind)

            try:
                wait_future(future, None, "store.write")
            except BaseException:
                outcome = "handed"

                def abandoned(done: Future[int], source: torch.Tensor = source) -> None:
                    # ``source`` is bound here so that it lives until the write has ended.
                    error = done.exception()
                    ended(error)
                    with self._cond:
                        self._drop_new(entry, wrote=error is None)

                future.add_done_callback(abandoned)
                raise
            error = future.exception()
            ended(error)
            if error is not None:
                raise _named(error, "writing", entry.key) from error
            outcome = "written"
            deliver_pending()  # now rather than after the key is visible
        except BaseException:
            if outcome != "handed":
                with self._cond:
                    self._drop_new(entry, wrote=outcome == "written")
            raise
        with self._cond:
            entry.nvme_version = entry.version
            self._set_state(entry, _S.ON_NVME)

    def _drop_new(self, entry: SwapEntry, *, wrote: bool) -> None:
        """Lock held. Undo a registration that did not finish: NEW → GONE, forgotten, and
        the NVMe copy its write made deleted (``wrote``)."""
        if wrote and self._store is not None:
            store_key = _store_key(entry)
            try:
                if store_key in self._store:
                    self._store.delete(store_key)
            except SwapError as exc:  # a closed store: nothing of it is read again
                log.warning("key=%r: could not delete its abandoned copy: %s", entry.key, exc)
        entry.transition(_S.GONE)
        if self._entries.get(entry.key) is entry:
            del self._entries[entry.key]
        self._notify()

    def _home(self, kind: Kind, nbytes: int) -> Tier:
        for tier in self._placement[kind]:
            if tier is Tier.NVME or self._fits_ever(tier, nbytes):
                return tier
        return self._placement[kind][-1]

    def _fetch_tier(self, entry: SwapEntry, tier: Tier | str | None) -> Tier:
        if tier is None:
            if entry.home is not Tier.NVME:
                return entry.home
            memory = [t for t in self._placement[entry.kind] if t is not Tier.NVME]
            return memory[0] if memory else Tier.HOST
        tier = _tier(tier)
        if tier is Tier.NVME:
            raise ValueError(
                f"key={entry.key!r}: fetch brings a tensor into memory: tier must "
                "be 'device' or 'host'"
            )
        return tier

    def _fits_ever(self, tier: Tier, nbytes: int) -> bool:
        memory = self._memory[tier]
        limit = memory.budget.limit_nbytes
        return limit is None or memory.charge(nbytes) <= limit

    def _destination(self, entry: SwapEntry, tier: Tier) -> Tier | None:
        """Lock held. Where a victim in ``tier`` goes: the next slower tier of its placement
        that can hold it; None when it cannot leave."""
        for candidate in self._placement[entry.kind]:
            if candidate.rank <= tier.rank:
                continue
            if candidate is Tier.NVME:
                # A device tensor reaches NVMe through a host staging block.
                staged = tier is Tier.HOST or self._fits_ever(Tier.HOST, entry.nbytes)
                return candidate if self._store is not None and staged else None
            if self._fits_ever(candidate, entry.nbytes):
                return candidate
        return None

    # -- room -------------------------------------------------------------------------

    def _obtain(
        self,
        tier: Tier,
        nbytes: int,
        *,
        what: str,
        deadline: float,
        moving: SwapEntry | None = None,
        read_ahead: bool = False,
    ) -> MemoryBlock | None:
        """A block of ``nbytes`` in ``tier``, evicting victims until it fits.

        ``moving`` is the entry the block is for, if any: None is returned as soon as it no
        longer needs moving into ``tier`` (it got there, or another thread took it over).
        A ``read_ahead`` evicts only victims nobody waits for and, with an access order,
        only those needed later than ``moving``; and returns None rather than waiting for
        users or timing out.

        Raises:
            BudgetExceededError: it can never fit.
            BudgetTimeout: no room by ``deadline``.
            SwapIOError, BudgetTimeout: evicting a victim failed (the victim keeps its data).
        """
        memory = self._memory[tier]
        charge = memory.charge(nbytes)
        evictions: list[Future[None]] = []
        waited_s = max(0.0, deadline - time.monotonic())  # the most this call waits
        while True:
            with self._cond:
                epoch = self._epoch
                if moving is not None and not self._needs_move(moving, tier, read_ahead):
                    return None
            block = memory.try_alloc(nbytes, what=what)
            if block is not None:
                return block
            for future in evictions:
                if future.done() and future.exception() is not None:
                    raise future.exception()
            plans: list[tuple[SwapEntry, Tier, int]] = []
            with self._cond:
                if read_ahead and self._closing:
                    return None
                if self._epoch != epoch:
                    continue  # something changed since try_alloc: look again
                plans = self._pick_victims(tier, charge, moving, read_ahead)
                if plans is None:
                    return None
                if not plans and self._epoch == epoch:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        if read_ahead:
                            return None
                        raise self._room_timeout(tier, nbytes, what, waited_s)
                    wait_cond(self._cond, left, "manager.room")
            issued = 0
            try:
                for victim, dest, version in plans:
                    evictions.append(self._evict_claimed(victim, dest, version, deadline))
                    issued += 1
            finally:
                if issued < len(plans):
                    # Cut while evicting one (which settled itself): the victims claimed
                    # after it were never started and go back to RESIDENT.
                    with self._cond:
                        for victim, _, _ in plans[issued + 1 :]:
                            self._set_state(victim, _S.RESIDENT)

    def _needs_move(self, entry: SwapEntry, tier: Tier, read_ahead: bool) -> bool:
        """Lock held. Whether ``entry`` still waits to be moved into ``tier`` by the caller:
        not there, not owned by a transfer, and (for a fetch) not being read ahead."""
        return (
            entry.state in (_S.RESIDENT, _S.ON_NVME)
            and entry.tier is not tier
            and (read_ahead or entry.prefetch is not Prefetch.RUNNING)
        )

    def _pick_victims(
        self, tier: Tier, charge: int, moving: SwapEntry | None, read_ahead: bool
    ) -> list[tuple[SwapEntry, Tier, int]] | None:
        """Lock held. Choose and claim victims to free ``charge`` bytes of ``tier``.

        Entries that fetches wait for come last (a read-ahead never takes them): evicting
        one wastes a transfer, but two fetches each protecting what the other must evict
        would otherwise wait for each other forever.

        Clean victims bound for NVMe are dropped at once; the others are returned as
        (entry, destination, version) to be evicted by the caller. Returns [] when the
        bytes already on their way out cover the need, or (demand) when nothing can be
        evicted now; None when a read-ahead should give up.
        """
        budget = self._memory[tier].budget
        if budget.limit_nbytes is None:
            return []
        leaving = sum(
            e.block.charged_nbytes
            for e in self._entries.values()
            if e.tier is tier and e.state in (_S.MOVING, _S.WRITING)
        )
        deficit = charge - budget.available_nbytes - leaving
        if deficit <= 0:
            return []
        candidates = [
            e
            for e in self._entries.values()
            if e.tier is tier
            and e.state is _S.RESIDENT
            and e is not moving
            and e.prefetch is not Prefetch.RUNNING
            and self._destination(e, tier) is not None
        ]
        order = self._order_in_use()
        free = [e for e in candidates if e.waiters == 0]
        if read_ahead:
            chosen = choose_victims(
                free,
                deficit,
                _charged,
                order=order,
                speculative=True,
                not_before=order.distance(moving.key) if order and moving else None,
            )
            if not chosen:
                return None
        else:
            chosen = choose_victims(free, deficit, _charged, order=order)
            short = deficit - sum(_charged(e) for e in chosen)
            if short > 0:
                wanted = [e for e in candidates if e.waiters > 0]
                chosen += choose_victims(wanted, short, _charged, order=order)
        plans = []
        for victim in chosen:
            dest = self._destination(victim, tier)
            if victim.readahead is not None:
                victim.readahead.release()  # read ahead for nothing
                victim.readahead = None
                self._stats.add(prefetch_wasted=1)
            if dest is Tier.NVME and victim.clean:
                self._free_memory(victim)
                self._set_state(victim, _S.ON_NVME)
                continue
            self._set_state(victim, _S.WRITING if dest is Tier.NVME else _S.MOVING)
            plans.append((victim, dest, victim.version))
        return plans

    def _room_timeout(self, tier: Tier, nbytes: int, what: str, waited_s: float) -> BudgetTimeout:
        """Lock held."""
        budget = self._memory[tier].budget
        in_use = sorted(e.key for e in self._entries.values() if e.tier is tier and e.users)
        shown = ", ".join(repr(k) for k in in_use[:5]) + (" ..." if len(in_use) > 5 else "")
        return BudgetTimeout(
            f"{what} needs {format_size(nbytes)} of the {tier.value} tier "
            f"({format_size(budget.used_nbytes)} of {format_size(budget.limit_nbytes)} held) "
            f"and none came free within {waited_s:.3g}s; in use there: "
            f"{shown or 'nothing'}: release tensors or raise {tier.value}_nbytes",
            what=what,
            nbytes=nbytes,
            budget=budget.name,
            used_nbytes=budget.used_nbytes,
            timeout_s=waited_s,
        )

    # -- transfers ----------------------------------------------------------------------

    def _evict_claimed(
        self, entry: SwapEntry, dest: Tier, version: int, deadline: float
    ) -> Future[None]:
        """Evict an entry already marked WRITING (dest NVMe) or MOVING (dest host). Cut
        or failed, the entry is settled (RESIDENT where it was) before this raises."""
        future: Future[None] = Future()
        future.set_running_or_notify_cancel()
        if dest is Tier.NVME:
            self._write_out(entry, version, future, deadline, keep=False)
            return future
        try:
            self._demote(entry, dest, deadline)
        except BaseException as exc:
            future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            future.set_result(None)
        return future

    def _demote(self, entry: SwapEntry, dest: Tier, deadline: float) -> None:
        """Copy a MOVING entry down to memory tier ``dest``; RESIDENT there, or where it
        was on failure."""
        source = entry.tier
        try:
            block = self._obtain(dest, entry.nbytes, what=f"key={entry.key!r}", deadline=deadline)
        except BaseException:
            with self._cond:
                self._set_state(entry, _S.RESIDENT)
            raise
        self._transfer(entry, block, source, dest, deadline, pin=False)

    def _transfer(
        self,
        entry: SwapEntry,
        block: MemoryBlock,
        source: Tier | None,
        target: Tier,
        deadline: float,
        *,
        pin: bool,
        readahead: Reservation | None = None,
    ) -> None:
        """Copy a READING (``source`` None: from NVMe) or MOVING entry into ``block`` of
        ``target``; then free the old memory and settle: IN_USE if ``pin``, else RESIDENT
        (holding ``readahead``). On failure the entry is back where it was and ``block``
        freed, and it raises; if the wait for a read from NVMe was cut, both happen only
        when the read ends (see :meth:`_read_into`).
        """
        if source is None:
            self._read_into(entry, block, target, deadline)
        else:
            try:
                with self._stats.transfer(source, target, entry.nbytes, entry.kind):
                    self._copy(block.tensor, entry.block.tensor, after=entry.ready)
            except BaseException:
                with self._cond:
                    block.release()
                    self._set_state(entry, _S.RESIDENT)
                raise
        with self._cond:
            old, entry.block, entry.tier = entry.block, block, target
            if old is not None:
                old.release()
            if pin:
                entry.users += 1
                self._set_state(entry, _S.IN_USE)
                if entry.readahead is not None:  # a read-ahead that a fetch moved on
                    entry.readahead.release()
                    entry.readahead = None
            else:
                if readahead is not None:
                    entry.readahead = readahead
                    entry.last_use = next(self._clock)
                self._set_state(entry, _S.RESIDENT)

    def _read_into(
        self, entry: SwapEntry, block: MemoryBlock, target: Tier, deadline: float
    ) -> None:
        """Read a READING entry from NVMe into ``block`` of ``target`` (staged through a host
        block for the device). On failure ``block`` (and the staging block) is freed and
        the entry is back ON_NVME, and it raises.

        The kernel writes into the buffer until the read ends: when the wait for it is
        cut (a signal, an error), the exception propagates at once and the read's
        completion does the freeing and settling; the entry stays READING until then.
        """
        staging: MemoryBlock | None = None
        handed = False
        try:
            if target is not Tier.HOST:
                staging = self._obtain(
                    Tier.HOST,
                    entry.nbytes,
                    what=f"staging for key={entry.key!r}",
                    deadline=deadline,
                )
            buffer = block if staging is None else staging
            with self._stats.transfer(Tier.NVME, Tier.HOST, entry.nbytes, entry.kind):
                future = self._store.read(_store_key(entry), buffer.tensor)
                try:
                    wait_future(future, None, "store.read")
                except BaseException:
                    handed = True
                    future.add_done_callback(
                        lambda _f, staging=staging: self._end_read(entry, block, staging)
                    )
                    raise
                error = future.exception()
                if error is not None:
                    raise error
            if staging is not None:
                with self._stats.transfer(Tier.HOST, target, entry.nbytes, entry.kind):
                    self._copy(block.tensor, staging.tensor)
        except BaseException as exc:
            if not handed:
                self._end_read(entry, block, staging)
            if isinstance(exc, OSError):
                raise _named(exc, "reading", entry.key) from exc
            raise
        if staging is not None:
            with self._cond:
                staging.release()
                self._notify()

    def _end_read(self, entry: SwapEntry, block: MemoryBlock, staging: MemoryBlock | None) -> None:
        """A read that did not land (any thread): its buffers freed, the entry ON_NVME."""
        with self._cond:
            block.release()
            if staging is not None:
                staging.release()
            self._set_state(entry, _S.ON_NVME)

    def _copy(
        self, dst: torch.Tensor, src: torch.Tensor, *, after: torch.cuda.Event | None = None
    ) -> None:
        """Copy between memory tiers and wait for it. A cut wait still waits (a device
        copy cannot be called back, and is short) before its buffers can be freed."""
        copy = self._device.copy(dst, src, after=after)
        try:
            wait_point("device.copy")
        finally:
            copy.wait()

    def _write_out(
        self, entry: SwapEntry, version: int, future: Future[None], deadline: float, *, keep: bool
    ) -> None:
        """Write a WRITING (``keep`` False) or CLEANING entry to NVMe; returns once issued.

        The completion settles the entry (memory freed only if the write succeeded and not
        ``keep``) and then resolves ``future``. Failing (or cut) before the write is
        issued, the entry is settled RESIDENT at once and ``future`` fails; an error is
        reported only through ``future``, anything else (``KeyboardInterrupt``) raised.
        """
        staging: MemoryBlock | None = None
        window: Reservation | None = None
        try:
            if entry.tier is Tier.DEVICE:
                staging = self._obtain(
                    Tier.HOST,
                    entry.nbytes,
                    what=f"staging for key={entry.key!r}",
                    deadline=deadline,
                )
                with self._stats.transfer(Tier.DEVICE, Tier.HOST, entry.nbytes, entry.kind):
                    self._copy(staging.tensor, entry.block.tensor, after=entry.ready)
                source = staging.view(entry.dtype, entry.shape)
            else:
                source = entry.block.view(entry.dtype, entry.shape)
            window = self._reserve_window(self._writebehind, entry, deadline)
            self._stats.begin(Tier.HOST, Tier.NVME)
            try:
                store_future = self._store.write(_store_key(entry), source)
            except BaseException:
                self._stats.end(Tier.HOST, Tier.NVME, None)
                raise
        except BaseException as exc:
            named = _named(exc, "writing", entry.key)
            self._end_write(entry, version, staging, window, named, keep)
            future.set_exception(named)
            if not isinstance(exc, Exception):
                raise
            return

        def done(store_future: Future[int]) -> None:
            error = store_future.exception()
            self._stats.end(Tier.HOST, Tier.NVME, None if error else entry.nbytes, entry.kind)
            named = None if error is None else _named(error, "writing", entry.key)
            self._end_write(entry, version, staging, window, named, keep)
            if named is None:
                self._notifier.submit(future.set_result, None)
            else:
                self._notifier.submit(future.set_exception, named)

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
        if window is not None:
            window.release()
        with self._cond:
            if staging is not None:
                staging.release()
            if error is None:
                entry.nvme_version = version
                if not keep:
                    self._free_memory(entry)
            self._set_state(entry, _S.ON_NVME if error is None and not keep else _S.RESIDENT)
        if isinstance(error, Exception):
            self._stats.add(write_errors=1)
            log.warning("write of key=%r to NVMe failed; it stays in memory: %s", entry.key, error)

    def _reserve_window(self, budget: ByteBudget, entry: SwapEntry, deadline: float) -> Reservation:
        return budget.reserve(
            _window_share(budget, entry.nbytes),
            what=f"key={entry.key!r}",
            timeout_s=max(0.0, deadline - time.monotonic()),
        )

    # -- worker jobs ------------------------------------------------------------------

    def _submit(self, job: Callable[..., None], *args: object) -> None:
        """Lock held. Queue ``job(*args)`` for a mover thread; :meth:`close` waits for it."""
        self._pool.submit(self._run_job, job, *args)
        self._jobs += 1

    def _run_job(self, job: Callable[..., None], *args: object) -> None:
        try:
            job(*args)
        finally:
            with self._cond:
                self._jobs -= 1
                self._notify()

    def _evict_job(self, entry: SwapEntry, to: Tier, deadline: float, future: Future[None]) -> None:
        # The future is resolved outside the lock: its callbacks may call the manager.
        try:
            with self._cond:
                self._await_idle(entry, deadline, "evict")
                work = entry.tier is not None and entry.tier.rank < to.rank  # else: there
                if work and entry.readahead is not None:
                    entry.readahead.release()
                    entry.readahead = None
                if work and to is Tier.NVME and entry.clean:
                    self._free_memory(entry)
                    self._set_state(entry, _S.ON_NVME)
                    work = False
                if work:
                    self._set_state(entry, _S.WRITING if to is Tier.NVME else _S.MOVING)
                version = entry.version
            if not work:
                future.set_result(None)
            elif to is Tier.NVME:
                self._write_out(entry, version, future, deadline, keep=False)
            else:
                self._demote(entry, to, deadline)
                future.set_result(None)
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)

    def _prefetch_job(self, entry: SwapEntry, target: Tier, window: Reservation) -> None:
        deadline = time.monotonic() + self.config.timeout_s
        landed = False
        try:
            with self._cond:
                if self._closing or entry.prefetch is not Prefetch.QUEUED:
                    return
                entry.prefetch = Prefetch.RUNNING
                while entry.state.transient:
                    self._wait(deadline, entry)
                if entry.state not in (_S.RESIDENT, _S.ON_NVME) or entry.tier is target:
                    return  # gone, in use, or already there
            block = self._obtain(
                target,
                entry.nbytes,
                what=f"key={entry.key!r}",
                deadline=deadline,
                moving=entry,
                read_ahead=True,
            )
            if block is None:
                return
            with self._cond:
                source = entry.tier
                if entry.state not in (_S.RESIDENT, _S.ON_NVME) or source is target:
                    block.release()
                    self._notify()
                    return
                self._set_state(entry, _S.READING if source is None else _S.MOVING)
            self._transfer(entry, block, source, target, deadline, pin=False, readahead=window)
            landed = True
        except Exception as exc:
            log.debug("read-ahead of key=%r failed: %s", entry.key, exc)
        finally:
            if not landed:
                window.release()
                self._stats.add(prefetch_dropped=1)
            with self._cond:
                entry.prefetch = Prefetch.NONE
                self._notify()

    # -- flush ------------------------------------------------------------------------

    def _flush(self, deadline: float, *, final: bool) -> None:
        """Write every dirty RESIDENT entry (memory kept), wait, save the manifest.

        ``final`` (close, nothing else running): first let transfers under way end (an
        eviction that fails leaves a dirty entry to write), and at the end every entry must
        be clean. Otherwise only the writes this flush starts are judged: other threads may
        be moving and dirtying tensors meanwhile.

        Raises:
            NotDurableError: names the keys not durable.
        """
        if self._store is None:
            return
        with self._cond:
            if final:
                self._wait_for_transfers(deadline)
            dirty = [e for e in self._entries.values() if e.state is _S.RESIDENT and not e.clean]
        writes: list[tuple[str, Future[None]]] = []
        for entry in dirty:
            # Claimed one at a time, just before its write: an entry claimed and not yet
            # being written could never be a victim, and staging a device entry may need
            # room that only such a victim can give.
            with self._cond:
                if entry.state is not _S.RESIDENT or entry.clean:
                    continue  # moved, evicted or fetched meanwhile
                self._set_state(entry, _S.CLEANING)
                version = entry.version
            future: Future[None] = Future()
            future.set_running_or_notify_cancel()
            self._write_out(entry, version, future, deadline, keep=True)
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
            with self._cond:
                self._wait_for_transfers(deadline)
                pending |= {e.key for e in self._entries.values() if not e.clean} - set(errors)
        self._store.save_manifest()
        not_durable = sorted(set(errors) | pending)
        if not_durable:
            raise NotDurableError(
                f"{len(not_durable)} tensor(s) not durable on NVMe: "
                + ", ".join(
                    f"{key!r} ({errors[key]})" if key in errors else f"{key!r} (still in flight)"
                    for key in not_durable[:10]
                )
                + (" ..." if len(not_durable) > 10 else ""),
                keys=not_durable,
                errors=errors,
            )

    def _wait_for_transfers(self, deadline: float) -> None:
        """Lock held. Wait until no entry is transient, or until ``deadline``."""
        while any(e.state.transient for e in self._entries.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            wait_cond(self._cond, left, "manager.drain")

    # -- helpers (lock held unless noted) -------------------------------------------------

    def _check_open(self) -> None:
        if self._closing:
            raise ManagerClosedError("the tier manager is closed")

    def _get(self, key: str) -> SwapEntry:
        entry = self._entries.get(key) if isinstance(key, str) else None
        if entry is None:
            raise UnknownKeyError(f"no tensor registered under key={key!r}")
        return entry

    def _notify(self) -> None:
        self._epoch += 1
        self._cond.notify_all()

    def _set_state(self, entry: SwapEntry, new: EntryState) -> None:
        entry.transition(new)
        self._notify()

    def _wait(self, deadline: float, entry: SwapEntry) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ManagerTimeout(
                f"key={entry.key!r}: waited too long for its {entry.state.value} transfer "
                f"(prefetch {entry.prefetch.value}) to end"
            )
        wait_cond(self._cond, left, "manager.transfer")

    def _await_settled(self, entry: SwapEntry, target: Tier, deadline: float) -> tuple[bool, bool]:
        """Wait out transfers of ``entry``. Returns (it is in ``target`` now, waited)."""
        waited = False
        while True:
            if entry.state is _S.GONE:
                raise UnknownKeyError(f"key={entry.key!r} was unregistered during the fetch")
            if entry.tier is target and entry.state in (_S.RESIDENT, _S.IN_USE):
                return True, waited
            if entry.state.transient or entry.prefetch is Prefetch.RUNNING:
                waited = True
                self._wait(deadline, entry)
                continue
            if entry.state is _S.IN_USE:
                raise EntryInUseError(
                    f"fetch of key={entry.key!r} into {target.value}: it is in use in "
                    f"{entry.tier.value}; release it first"
                )
            return False, waited

    def _await_idle(self, entry: SwapEntry, deadline: float, doing: str) -> None:
        """Lock held: wait until no transfer of ``entry`` runs; it must be neither
        unregistered nor in use by then.

        Raises:
            UnknownKeyError: it was unregistered meanwhile.
            EntryInUseError: it is (or was fetched again and is) in use.
            ManagerTimeout: a transfer did not end by ``deadline``.
        """
        while entry.state.transient or entry.prefetch is Prefetch.RUNNING:
            self._wait(deadline, entry)
        if entry.state is _S.GONE:
            raise UnknownKeyError(f"{doing} of key={entry.key!r}: it is no longer registered")
        if entry.state is _S.IN_USE:
            raise EntryInUseError(
                f"{doing} of key={entry.key!r}: it is in use ({entry.users} fetch(es) not released)"
            )

    def _pin(self, entry: SwapEntry) -> torch.Tensor:
        entry.users += 1
        if entry.users == 1:
            self._set_state(entry, _S.IN_USE)
        if entry.readahead is not None:
            entry.readahead.release()
            entry.readahead = None
        return entry.block.view(entry.dtype, entry.shape)

    def _unpin(self, entry: SwapEntry) -> None:
        """Undo a :meth:`_pin` whose tensor never reached the caller (lock not held)."""
        with self._cond:
            entry.users -= 1
            if entry.users == 0:
                self._set_state(entry, _S.RESIDENT)

    def _free_memory(self, entry: SwapEntry) -> None:
        if entry.block is not None:
            if entry.tier is Tier.DEVICE:
                # A user's kernels may still read it on their own stream (CUDA).
                entry.block.release(after=entry.ready)
            else:
                entry.block.release()
        if entry.readahead is not None:
            entry.readahead.release()
        entry.block, entry.tier, entry.readahead = None, None, None
        self._notify()

    def _note_access(self, entry: SwapEntry) -> None:
        entry.last_use = next(self._clock)
        if self._order is not None:
            self._order.advance(entry.key)
        if self._recorded is not None:
            self._recorded.append(entry.key)

    def _order_in_use(self) -> AccessOrder | None:
        policy = self.config.policy
        if policy is Policy.LRU or self._order is None:
            return None
        return self._order

    def _timeout(self, timeout_s: float | None) -> float:
        return self.config.timeout_s if timeout_s is None else timeout_s

    def _maybe_log(self) -> None:
        """Lock not held."""
        interval = self.config.stats_interval_s
        now = time.monotonic()
        if interval is None or now - self._last_log < interval:
            return
        self._last_log = now
        log.info("swapper: %s", self.stats().summary())


# -- module helpers -----------------------------------------------------------------------


def _check_key(key: object) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"key must be a non-empty str, got {key!r}")


def _kind(kind: Kind | str) -> Kind:
    try:
        return Kind(kind)
    except ValueError:
        names = ", ".join(k.value for k in Kind)
        raise ValueError(f"kind={kind!r} is not one of: {names}") from None


def _tier(tier: Tier | str) -> Tier:
    try:
        return Tier(tier)
    except ValueError:
        names = ", ".join(t.value for t in Tier)
        raise ValueError(f"tier={tier!r} is not one of: {names}") from None


def _store_key(entry: SwapEntry) -> str:
    """The store's key: the kind rides along so that a reopened store knows it."""
    return f"{entry.kind.value}/{entry.key}"


def _window_share(budget: ByteBudget, nbytes: int) -> int:
    """What one request takes of a window: its size, or the whole window if larger (a
    tensor larger than the window then goes alone rather than never)."""
    limit = budget.limit_nbytes
    return nbytes if limit is None else min(nbytes, limit)


def _named(error: BaseException, doing: str, key: str) -> BaseException:
    """An I/O error re-raised with the manager's key in its message; the file stays."""
    if not isinstance(error, OSError):
        return error
    cls = type(error) if isinstance(error, SwapIOError) else SwapIOError
    code = error.errno if error.errno is not None else errno.EIO
    named = cls(code, f"{doing} key={key!r} failed: {error.strerror or error}", error.filename)
    named.__cause__ = error
    return named


def _charged(entry: SwapEntry) -> int:
    """Bytes evicting ``entry`` frees in its tier."""
    return entry.block.charged_nbytes
