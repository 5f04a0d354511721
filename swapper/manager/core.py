# Size: the facade (~690 lines): each public call, its units and errors (issue 29 added
# the undo after a pin and the wear check; issue 24 assign).
"""TierManager: every tensor's bytes in device memory, host memory or NVMe, moved on demand.

This module is the facade: the public calls, their checks and their statistics. The work
is done by parts with one job each, every one readable alone:

* :mod:`swapper.manager.context`: the tiers, budgets, store and entry table, under one
  lock, and the state-machine helpers (the states are drawn in :mod:`swapper.manager.entry`);
* :mod:`swapper.manager.placement`: which tier a tensor goes to, and room made there by
  choosing and evicting victims (with :mod:`swapper.manager.policy`);
* :mod:`swapper.manager.mover`: the transfers (copies, NVMe reads and writes) and their
  completions, and the rules that make interrupts safe;
* :mod:`swapper.manager.jobs`: ``evict`` and ``prefetch`` requests on the mover threads,
  and ``flush``;
* :mod:`swapper.manager.stats`: bytes moved, speeds, stall time.

A fetch from NVMe to the device reads, in order: :meth:`TierManager.fetch` here (a tensor
already where it is wanted is pinned in one lock hold by
``ManagerContext.fetch_resident``), :meth:`~swapper.manager.mover.Mover.fetch` and
``bring``, :meth:`~swapper.manager.mover.Mover.obtain` (room on the device: the victims
that :meth:`~swapper.manager.placement.Placement.claim_victims` chooses, evicted by the
mover; placement decides and never calls back),
:meth:`~swapper.manager.mover.Mover.transfer` (staging, the read, the copy up), and
:meth:`tiers.nvme.NvmeStore.read` (see ``docs/architecture.md``).

Threads and locks
-----------------
One lock (with its condition) guards every :class:`SwapEntry`; it is held only for
bookkeeping, never across I/O, copies or ``allocate()``. Work happens in three places:

* the caller's thread: ``register``, ``fetch`` (including the room it makes), ``flush``;
* ``mover_threads`` worker threads: ``evict`` and ``prefetch`` requests;
* I/O completion callbacks (the AIO engine's threads): the end of every NVMe write, which
  frees the source memory only then.

A thread that needs room in a tier chooses victims under the lock, marks them WRITING or
MOVING, and evicts them itself: a host victim's write is issued and completes in a
callback; a device victim is copied down to the host tier inline (which may in turn evict
host victims). It then waits on the condition, which is notified whenever memory is freed
or an entry changes state. Nobody ever waits for a request still queued for a worker: an
entry is claimed only by a thread that works on it at once, so every wait is on progress
that is already under way (or on a caller's ``release``, bounded by ``timeout_s``).

Interrupts: every public call runs in a :mod:`tiers.signals` section, and a Ctrl-C is
delivered only at a wait point, where every transition has its undo; the table is in
:mod:`swapper.manager.mover`. A cut ``close()`` leaves the manager closing (new work
refused) with everything else open: ``close()`` again finishes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Iterable, Iterator
from concurrent.futures import Future

import torch

from swapper.manager.config import Kind, ManagerConfig, Tier
from swapper.manager.context import ManagerContext
from swapper.manager.entry import EntryInfo, EntryState, Prefetch, SwapEntry
from swapper.manager.errors import (
    EntryInUseError,
    KeyExistsError,
    ManagerClosedError,
    NotInUseError,
)
from swapper.manager.jobs import MoverJobs
from swapper.manager.mover import Mover
from swapper.manager.placement import Placement
from swapper.manager.policy import AccessOrder
from swapper.manager.shared import (
    BehindFuture,
    check_key,
    store_key_of,
    to_kind,
    to_tier,
    window_share,
)
from swapper.manager.stats import ManagerStats
from swapper.manager.wear import WearMonitor, WearVerdict, WriteBudgetWarning
from tiers.errors import SwapConfigError
from tiers.protocols import MemoryBlock
from tiers.signals import at_waits, held, undo_if_cut

__all__ = ["TierManager"]

log = logging.getLogger("swapper.manager")

_S = EntryState

#: Subtracted from the LRU clock of a tensor released ``cold``: below every clock value a
#: fetch, read-ahead or registration gives (the clock counts up from 0), so it is chosen
#: before any of them, and cold ones keep the order they were released in.
_COLD = 1 << 62


class TierManager:
    """Tensors by key across device, host and NVMe tiers under per-tier byte budgets.

    Thread-safe: any number of threads may call any method at once. Use as a context
    manager or call :meth:`close`, which leaves every tensor durable on NVMe with a saved
    manifest; :meth:`open` brings them back.

    Args:
        config: the settings; a new NVMe store is created in ``config.nvme_dirs``.

    Raises:
        SwapConfigError: the device is not usable, or an ``nvme_dirs`` entry is not a
            directory, or cannot be written or made (the message names nvme_dirs and the
            path; checked before anything is allocated).
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
        self.config = config
        self._ctx = ManagerContext(config, reopen=reopen)
        self._placement = Placement(self._ctx)
        self._mover = Mover(self._ctx, self._placement)
        self._jobs = MoverJobs(self._ctx, self._mover)
        self._last_log = time.monotonic()
        budget = config.write_budget_bytes_per_day
        self._wear = (
            None if budget is None else WearMonitor(budget, strict=config.write_budget_strict)
        )

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
            ManagerTimeout: the write to NVMe did not end within ``timeout_s``; the
                registration is undone when it ends (a new ``register`` of the key waits).
            ManagerClosedError: the manager is closed.
        """
        self._register(key, tensor, kind, None)

    def register_behind(self, key: str, tensor: torch.Tensor, kind: Kind | str) -> BehindFuture:
        """:meth:`register` without waiting for a write to NVMe: the bulk path of state
        made in a stream (the optimizer's initial state), several writes in flight.

        Where :meth:`register` would write ``tensor`` to NVMe and wait, this issues the
        write (from ``tensor`` itself when it is page-aligned and contiguous: no staging
        copy; checksums recorded as written) and returns; the key is registered but
        settling (a fetch or ``unregister`` of it waits) until the write is durable.
        ``tensor`` must not be changed or freed before the returned future's
        ``released`` is done: when the write's pieces have ended, before the flush that
        makes them durable (the manager keeps a reference to it until the future is done,
        but reads it no more). Placed in memory, the copy is taken at once and both are
        done already. When this raises, nothing reads ``tensor``.

        Returns:
            a :class:`~swapper.manager.shared.BehindFuture` that succeeds once the key is
            settled (in memory, or durable on NVMe), or fails with
            :class:`~tiers.errors.SwapIOError` (naming key and file) when the write or its
            flush failed: the key is then unregistered, nothing kept.

        Raises:
            as :meth:`register` (for what is decided before the write is issued).
        """
        behind = BehindFuture()
        behind.set_running_or_notify_cancel()
        if not self._register(key, tensor, kind, behind):
            behind.release()
            behind.set_result(None)
        return behind

    def _register(
        self, key: str, tensor: torch.Tensor, kind: Kind | str, behind: BehindFuture | None
    ) -> bool:
        """:meth:`register` (``behind`` None) or :meth:`register_behind`: whether a write
        was handed to ``behind``."""
        check_key(key)
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(f"register of key={key!r}: expected a dense torch.Tensor")
        kind = to_kind(kind)
        nbytes = tensor.numel() * tensor.element_size()
        with at_waits:
            deadline = time.monotonic() + self.config.timeout_s
            with self._ctx.cond:
                self._ctx.check_open()
                # A registration of the key that is still under way (one whose caller
                # was interrupted ends when its write does): wait for its outcome.
                while (old := self._ctx.entries.get(key)) is not None and old.state is _S.NEW:
                    self._ctx.wait(deadline, old)
                if key in self._ctx.entries:
                    raise KeyExistsError(
                        f"key={key!r} is already registered ({self._ctx.entries[key].kind.value}); "
                        "unregister it first"
                    )
                entry = SwapEntry(
                    key,
                    kind,
                    tensor.dtype,
                    tuple(tensor.shape),
                    nbytes,
                    self._ctx.home(kind, nbytes),
                )
                entry.last_use = next(self._ctx.clock)
                self._ctx.entries[key] = entry
            return self._mover.place_new(entry, tensor, deadline, behind) and (behind is not None)

    def fetch(
        self,
        key: str,
        tier: Tier | str | None = None,
        *,
        timeout_s: float | None = None,
        in_place: bool = False,
    ) -> torch.Tensor:
        """The tensor in memory tier ``tier`` (default: its home), marked in use; with
        ``in_place``, wherever it is in memory if it is (nothing moved), else in ``tier``.

        Waits only for what is missing: a transfer already under way (a prefetch) is
        waited for, else this thread moves the bytes itself, making room by evicting
        victims. Time spent waiting counts as stall. The tensor stays in place until
        :meth:`release`; a key may be fetched by several callers at once (into one tier).
        While its memory stays, every fetch returns the same tensor object: do not change
        its metadata (``resize_``, ``set_``, in-place ``unsqueeze_``).

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
            tensor = self._ctx.fetch_resident(key, tier, in_place)  # the common case
            if tensor is None:
                tensor = self._mover.fetch(key, tier, self._ctx.timeout(timeout_s), in_place)
            # Pinned: nothing may raise between here and the caller without undoing it.
            try:
                self._maybe_log()
            except BaseException:
                self._ctx.unpin_key(key)
                raise
            # A signal that arrived since is delivered as the section ends: pin undone.
            undo_if_cut(self._ctx.unpin_key, key)
        return tensor

    def assign(
        self,
        key: str,
        source: torch.Tensor,
        tier: Tier | str | None = None,
        *,
        timeout_s: float | None = None,
        convert: bool = False,
    ) -> None:
        """Replace ``key``'s whole value with a copy of ``source``, never reading the old
        one: what ``fetch`` + a copy of every element + ``release(modified=True)`` leave,
        without the fetch's read from NVMe (a parameter the optimizer has just computed
        anew need not be read first). Returns with the entry resident, modified (its NVMe
        copy stale) and not held by this call; ``source`` is not kept.

        In memory already (any tier, in use by others or not): a plain copy into it,
        nothing moved. On NVMe only: room is made in ``tier`` (default: its home) as
        :meth:`fetch` makes it (same budgets, victims, waits and timeout), and ``source``
        is copied into the new memory. With ``convert``, a floating ``source`` of another
        floating dtype is rounded into the key's as ``Tensor.copy_`` rounds (the optimizer
        publishes its fp32 master weights into 16-bit parameters so).
        A read-ahead or eviction of the key under way is waited for first. Counted in
        :meth:`stats` as a fetch (a hit when it was in memory, else a miss), with no read.

        Cut (Ctrl-C at a wait, an error) before the copy has ended, the new memory is
        freed and the entry is as it was: on NVMe with its old, valid copy.

        Raises:
            UnknownKeyError: ``key`` is not registered.
            TypeError: ``source`` is not a dense tensor of the key's dtype (or, with
                ``convert``, of a floating dtype when the key's is floating).
            ValueError: ``source`` has not the key's number of elements; ``tier`` is not a
                memory tier.
            BudgetExceededError: it can never fit ``tier``'s budget.
            BudgetTimeout, ManagerTimeout: no room, or another thread's transfer did not
                end, within ``timeout_s`` (default ``config.timeout_s``).
            SwapIOError: writing a victim out failed (names key and file).
            ManagerClosedError: the manager is closed.
        """
        with at_waits:
            self._mover.assign(key, source, tier, self._ctx.timeout(timeout_s), convert)
            self._maybe_log()

    def release(self, key: str, *, modified: bool = True, cold: bool = False) -> None:
        """The caller is done with a fetched tensor; when nobody holds it, it can be evicted.

        Pass ``modified=False`` when the tensor was only read: a clean NVMe copy then stays
        valid and evicting the tensor later writes nothing.

        Pass ``cold=True`` when the caller is scanning tensors once (each read, then not
        needed again soon: the optimizer's initial state read from every parameter, an
        export): the tensor becomes the first victim of the least-recently-used choice
        instead of the last (cold ones among themselves in the order released). Without
        it, a scan of more bytes than the memory tiers hold evicts, at every miss, the
        tensor the scan needs next (at 2.17 B parameters the optimizer's creation read
        and wrote the 16-bit parameters over again). A recorded access order still
        ranks first; this only orders entries it does not tell apart.

        Raises:
            UnknownKeyError: ``key`` is not registered.
            NotInUseError: ``key`` is not fetched.
        """
        with held, self._ctx.cond:
            self._release_locked(key, modified)
            if cold:
                self._ctx.get(key).last_use = next(self._ctx.clock) - _COLD

    def _release_locked(self, key: str, modified: bool) -> None:
        if self._ctx.closed:
            raise ManagerClosedError("the tier manager is closed")
        entry = self._ctx.get(key)
        if entry.users == 0:
            raise NotInUseError(f"release of key={key!r}, which no fetch is holding")
        if modified:
            entry.version += 1
        if entry.tier is Tier.DEVICE:
            # Copies out of it may run from other threads, on streams that know nothing
            # of the kernels this caller queued on its own.
            entry.ready = self._ctx.device.mark_ready()
        entry.users -= 1
        if entry.users == 0:
            self._ctx.set_state(entry, _S.RESIDENT)

    def fetch_resident_all(
        self, keys: list[str], tier: Tier | None = None
    ) -> list[torch.Tensor] | None:
        """:meth:`fetch` of every key into memory tier ``tier`` (None: ``in_place``,
        wherever each is in memory), when each is resident there now: all fetched, in one
        lock hold (nothing moves, nothing waits), or none (None: the caller fetches one at
        a time, by :meth:`fetch`). Each is released by :meth:`release` or
        :meth:`release_all`."""
        with at_waits:
            tensors = self._ctx.fetch_all_resident(keys, tier)
            if tensors is not None:
                undo_if_cut(self._ctx.unpin_keys, keys)  # as in fetch
            return tensors

    def release_all(self, keys: Iterable[str], *, modified: bool = True) -> None:
        """:meth:`release` of each key, in one lock hold (it stops at the first error,
        the keys before it released).

        Raises:
            as :meth:`release`.
        """
        with held, self._ctx.cond:
            for key in keys:
                self._release_locked(key, modified)

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
        with held, self._ctx.cond:
            self._ctx.check_open()
            entries = [self._ctx.get(key) for key in keys]
            for entry in entries:
                target = self._placement.fetch_tier(entry, tier)
                if (
                    entry.prefetch is not Prefetch.NONE
                    or entry.state is _S.IN_USE
                    or (entry.tier is target and not entry.state.transient)
                ):
                    continue
                budget = self._ctx.window_for(entry)
                window = budget.try_reserve(
                    window_share(budget, entry.nbytes), what=f"key={entry.key!r}"
                )
                if window is None:
                    self._ctx.stats.add(prefetch_dropped=1)
                    continue
                entry.prefetch = Prefetch.QUEUED
                queued.append(entry)
                self._jobs.submit(self._jobs.prefetch, entry, target, window)
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
        to = to_tier(to)
        if to is Tier.DEVICE:
            raise ValueError("evict moves a tensor down: to must be 'host' or 'nvme'")
        deadline = time.monotonic() + self._ctx.timeout(timeout_s)
        with held, self._ctx.cond:
            self._ctx.check_open()
            entry = self._ctx.get(key)
            if to is Tier.NVME and self._ctx.store is None:
                raise SwapConfigError(f"evict of key={key!r} to nvme: nvme_dirs is empty")
            if entry.state is _S.IN_USE:
                raise EntryInUseError(
                    f"evict of key={key!r}: it is in use ({entry.users} fetch(es) not released)"
                )
            future: Future[None] = Future()
            future.set_running_or_notify_cancel()
            self._jobs.submit(self._jobs.evict, entry, to, deadline, future)
        return future

    def reserve_room(
        self,
        tier: Tier | str,
        nbytes: int,
        *,
        what: str,
        timeout_s: float | None = None,
    ) -> MemoryBlock:
        """A block of ``nbytes`` bytes of memory tier ``tier`` for a caller's working
        buffer (not an entry): charged to the tier's budget, so :meth:`stats` peaks count
        it, until the caller calls ``block.release()``. Room is made as a fetch makes it,
        by evicting entries (never one in use), waiting up to ``timeout_s`` (default
        ``config.timeout_s``) seconds for bytes being moved out or released.

        Raises:
            ValueError: ``tier`` is not a memory tier.
            BudgetExceededError: ``nbytes`` exceeds the tier's whole budget.
            BudgetTimeout: no room came free in time (names what is in use there).
            SwapIOError: writing a victim out failed.
            ManagerClosedError: the manager is closed.
        """
        target = to_tier(tier)
        if target not in self._ctx.memory:
            raise ValueError(f"reserve_room: {target.value} is not a memory tier")
        deadline = time.monotonic() + self._ctx.timeout(timeout_s)
        with at_waits:
            with self._ctx.cond:
                self._ctx.check_open()
            return self._mover.obtain_now(target, nbytes, what=what, deadline=deadline)

    def unregister(self, key: str, *, timeout_s: float | None = None) -> None:
        """Forget ``key``: its memory is freed and its NVMe copy deleted.

        Raises:
            UnknownKeyError: ``key`` is not registered.
            EntryInUseError: it is in use.
            ManagerTimeout: a transfer of it did not end within ``timeout_s``.
            ManagerClosedError: the manager is closed.
        """
        deadline = time.monotonic() + self._ctx.timeout(timeout_s)
        with at_waits, self._ctx.cond:
            self._ctx.check_open()
            entry = self._ctx.get(key)
            self._ctx.await_idle(entry, deadline, "unregister")
            self._ctx.free_memory(entry, departed=False)
            store_key = store_key_of(entry)
            # Under the lock: a new registration of the key must not lose its bytes to this.
            if self._ctx.store is not None and store_key in self._ctx.store:
                self._ctx.store.delete(store_key)
            self._ctx.set_state(entry, _S.GONE)
            del self._ctx.entries[key]

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
        with self._ctx.cond:
            self._ctx.check_open()
        timeout = self.config.close_timeout_s if timeout_s is None else timeout_s
        with at_waits:
            self._jobs.flush(time.monotonic() + timeout, final=False)

    def close(self, *, remove: bool = False) -> None:
        """Make every tensor durable on NVMe, save the manifest, free everything. Idempotent.

        Waits for requests queued and writes in flight (up to ``config.close_timeout_s``).
        Tensors still in use are released first, as modified (logged as a warning).
        Without NVMe the tensors are simply dropped. With ``remove`` nothing is written:
        every tensor is dropped and the store's files are deleted (a scratch manager);
        evictions queued and not yet started are cancelled (their futures raise
        ManagerClosedError naming ``remove=True``), those started are waited for, and no
        memory is freed while a transfer still uses it.

        Raises:
            NotDurableError: some tensors could not be written (named): everything is
                closed anyway and their bytes are gone; or writes (with ``remove``: any
                transfer) were still in flight at the deadline (named): then nothing is
                closed, and calling ``close()`` again waits for them again.
        """
        with at_waits:
            self._jobs.shutdown(remove=remove)

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
        with self._ctx.cond:
            self._ctx.order = order

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the fetches made inside the ``with`` block as the access order.

        Example::

            with manager.recording():
                run_one_step()  # every fetch is noted, in order
        """
        with self._ctx.cond:
            self._ctx.recorded = []
        try:
            yield
        finally:
            with self._ctx.cond:
                keys, self._ctx.recorded = self._ctx.recorded or [], None
                self._ctx.order = AccessOrder.of(keys)

    def resident_stamp(self, keys: list[str], tier: Tier) -> int | None:
        """None unless every key is in memory tier ``tier`` now; then a stamp that stays
        equal to :attr:`departures` for as long as they all still are there."""
        with self._ctx.cond:
            return self._ctx.resident_stamp(keys, tier)

    @property
    def departures(self) -> int:
        """How many times an entry has left a memory tier while registered (evicted,
        moved); read without the lock (an int)."""
        return self._ctx.departures

    def info(self, key: str) -> EntryInfo:
        """A snapshot of ``key``'s entry.

        Raises:
            UnknownKeyError: ``key`` is not registered.
        """
        with self._ctx.cond:
            return self._ctx.get(key).info()

    def numel(self, key: str) -> int:
        """The number of elements of ``key``'s tensor, as registered.

        Raises:
            UnknownKeyError: ``key`` is not registered.
        """
        with self._ctx.cond:
            shape = self._ctx.get(key).shape
        return math.prod(shape)

    def keys(self) -> list[str]:
        """The registered keys, in registration order."""
        with self._ctx.cond:
            return list(self._ctx.entries)

    def __contains__(self, key: object) -> bool:
        with self._ctx.cond:
            return key in self._ctx.entries

    def __len__(self) -> int:
        with self._ctx.cond:
            return len(self._ctx.entries)

    def check_write_budget(self) -> WearVerdict | None:
        """Compare the NVMe write rate with ``config.write_budget_bytes_per_day``; the
        optimizer calls it at the end of each step (a training loop of its own may too).
        The first call sets the baseline; later ones project the bytes written since
        (tensors and metadata) over a day. Over the budget: one
        :class:`~swapper.manager.wear.WriteBudgetWarning` per manager;
        with ``write_budget_strict``, every tensor is made durable (:meth:`flush`) and it
        raises. None without a budget, at the baseline, or when no time has passed.

        Raises:
            WriteBudgetExceededError: strict, and the rate projects over the budget.
            NotDurableError: as :meth:`flush`, when making the tensors durable failed.
        """
        monitor = self._wear
        if monitor is None:
            return None
        verdict = monitor.check(self.stats().nvme_written_nbytes)
        if verdict is None or not verdict.over:
            return verdict
        if monitor.strict:
            self.flush()
            raise monitor.error(verdict)
        if not monitor.warned:
            monitor.warned = True
            warnings.warn(verdict.message, WriteBudgetWarning, stacklevel=2)
        return verdict

    def stats(self) -> ManagerStats:
        """Bytes moved per tier pair and their speed, stall time, read-ahead hits and misses,
        bytes and peak bytes per tier, and bytes written to NVMe by kind
        (:meth:`ManagerStats.nvme_written`: tensors and the store's metadata)."""
        return self._ctx.stats.snapshot(self._ctx.tier_stats(), self._ctx.metadata_written())

    def __repr__(self) -> str:
        state = "closed" if self._ctx.closed else f"{len(self._ctx.entries)} tensors"
        return f"<TierManager {self._ctx.device.device} ({state})>"

    def _maybe_log(self) -> None:
        """Lock not held."""
        interval = self.config.stats_interval_s
        now = time.monotonic()
        if interval is None or now - self._last_log < interval:
            return
        self._last_log = now
        log.info("swapper: %s", self.stats().summary())
