"""What every part of a :class:`~swapper.manager.TierManager` shares: its tiers and its
entry table, under one lock.

The parts (:mod:`~swapper.manager.placement`, :mod:`~swapper.manager.mover`,
:mod:`~swapper.manager.jobs`, the facade in :mod:`~swapper.manager.core`) hold one
:class:`ManagerContext` and nothing else of each other's state.

Invariants (checked by the tests in ``tests/test_manager.py`` and
``tests/test_interrupts.py``):

* ``cond`` guards ``entries`` and every field of every :class:`SwapEntry` but the first
  six; it is held only for bookkeeping, never across I/O, copies or ``try_alloc``.
* Every change of an entry's state goes through :meth:`ManagerContext.set_state`, which
  notifies ``cond``; ``epoch`` grows with every notification, so a thread that looked at
  the table, let go of the lock and came back can tell whether anything changed.
* An entry's memory is in ``entry.block`` of ``entry.tier`` or nowhere; it is freed only
  by :meth:`ManagerContext.free_memory` (or by the part that owned it while transient).
* ``jobs`` counts requests queued for the mover threads and not yet ended: ``close``
  waits for it to reach 0 before it shuts the pool.
* Bounds: each tier's bytes by its budget; bytes being written by ``write_behind_nbytes``;
  bytes read ahead and not yet fetched by ``prefetch_window_nbytes``, once for optimizer
  state and once for every other kind (:meth:`ManagerContext.window_for`). Every byte in flight
  to or from NVMe sits in a host block (a device tensor is staged through one), so I/O never
  holds more than the host budget.
"""

from __future__ import annotations

import concurrent.futures
import errno
import itertools
import threading
import time

import torch

from swapper.manager.config import Kind, ManagerConfig, Policy, Tier
from swapper.manager.entry import EntryState, Prefetch, SwapEntry
from swapper.manager.errors import (
    EntryInUseError,
    ManagerClosedError,
    ManagerIOTimeout,
    ManagerTimeout,
    UnknownKeyError,
)
from swapper.manager.policy import AccessOrder
from swapper.manager.shared import entry_view, forget_view
from swapper.manager.stats import StatsRecorder, TierStats
from swapper.manager.watchdog import Watchdog
from tiers.aio import AioEngine
from tiers.budget import ByteBudget
from tiers.config import check_swap_dirs
from tiers.device import DeviceTier
from tiers.errors import SwapConfigError
from tiers.host import HostTier
from tiers.nvme import ManifestError, NvmeStore, StoreExistsError
from tiers.nvme.futures import StoreFuture
from tiers.protocols import MemoryTier
from tiers.signals import deliver_pending, wait_cond

__all__ = ["ManagerContext"]

_S = EntryState

#: States in which a fetch finds the tensor where it is and pins it (see ``pin_resident``).
_HIT_STATES = frozenset({_S.RESIDENT, _S.IN_USE})
# Transfers that end when a write to NVMe is durable: a waiter for one hurries the commit.
_DURABLE_PENDING = frozenset({_S.NEW, _S.WRITING, _S.CLEANING})


class ManagerContext:
    """The tiers, budgets, store and entry table of one manager (see the module docstring).

    Raises (constructor):
        SwapConfigError: the device is not usable, ``reopen`` with no ``nvme_dirs``, or
            (a new store) an ``nvme_dirs`` entry that is not a directory, or cannot be
            written or made (named, with the path).
        StoreExistsError: a new store's files exist already.
        ManifestError: ``reopen`` found no manifest, or one not written by a TierManager.
        BackendUnavailableError, SwapIOError: the AIO engine or the store cannot be set up.
    """

    def __init__(self, config: ManagerConfig, *, reopen: bool) -> None:
        if reopen and not config.nvme_dirs:
            raise SwapConfigError("nothing to reopen: nvme_dirs is empty")
        if not reopen:
            # before anything is allocated: a bad directory is named as nvme_dirs here,
            # not found by the store's first mkdir or write
            check_swap_dirs(config.nvme_dirs)
        self.config = config
        self.placement = config.tier_order
        self.device = DeviceTier(config.device_nbytes, device=config.device)
        self.host = HostTier(config.host_nbytes, arena_nbytes=config.host_arena_nbytes)
        self.memory: dict[Tier, MemoryTier] = {Tier.DEVICE: self.device, Tier.HOST: self.host}
        self.readahead = ByteBudget("read-ahead", config.prefetch_window_nbytes)
        self.state_readahead = ByteBudget("state read-ahead", config.prefetch_window_nbytes)
        self.writebehind = ByteBudget("write-behind", config.write_behind_nbytes)
        self.entries: dict[str, SwapEntry] = {}
        self.cond = threading.Condition(threading.Lock())
        self.epoch = 0  # bumped on every notify: "something changed since I looked"
        self.clock = itertools.count(1)  # LRU time
        self.order: AccessOrder | None = None
        self.recorded: list[str] | None = None
        self.stats = StatsRecorder()
        #: fails an eviction's future when its write is still in flight at its deadline
        self.watchdog = Watchdog(config.store_name)
        self.closing = False
        self.removing = False  # close(remove=True) began: queued evictions are cancelled
        self.closed = False
        self.jobs = 0  # evict and prefetch requests submitted and not yet ended
        #: entries that left a memory tier so far (freed, or moved to another tier): while
        #: it does not change, what was resident in a tier still is (``resident_stamp``)
        self.departures = 0
        self.engine: AioEngine | None = None
        self.store: NvmeStore | None = None
        if config.nvme_dirs:
            self.engine = AioEngine(config.aio)
            try:
                if reopen:
                    self.store = NvmeStore.open(
                        config.nvme_dirs, self.engine, name=config.store_name, verify=config.verify
                    )
                    self._load_entries(self.store)
                else:
                    self.store = NvmeStore(
                        config.nvme_dirs,
                        self.engine,
                        stripe_nbytes=config.stripe_nbytes,
                        checksum=config.checksum,
                        verify=config.verify,
                        name=config.store_name,
                    )
            except BaseException as exc:
                if self.store is not None:
                    self.store.close()
                self.engine.close()
                self.host.close()
                if isinstance(exc, StoreExistsError) and "cannot be reopened" not in str(exc):
                    raise StoreExistsError(
                        exc.errno or errno.EEXIST,
                        f"{exc.strerror} (a manager that was not closed, or a crash, left "
                        "it: TierManager.open(config) reopens it with every tensor it holds)",
                        exc.filename,
                    ) from exc
                raise
        # Threads start on the first submit, not here.
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=config.mover_threads, thread_name_prefix="swapper-mover"
        )
        # Futures handed to callers are resolved here, never on an AIO worker: a caller's
        # done-callback may call the manager, and a read it issues needs those workers.
        self.notifier = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="swapper-notify"
        )

    def _load_entries(self, store: NvmeStore) -> None:
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
                key, kind, stored.dtype, stored.shape, stored.nbytes, self.home(kind, stored.nbytes)
            )
            entry.nvme_version = entry.version
            entry.transition(_S.ON_NVME)
            self.entries[key] = entry

    def nvme(self) -> NvmeStore:
        """The store; only called where an entry is on (or bound for) NVMe, which exists
        only with a store.

        Raises:
            SwapConfigError: there is no NVMe tier (a bug in the caller, named).
        """
        store = self.store
        if store is None:
            raise SwapConfigError("no NVMe tier: nvme_dirs is empty")
        return store

    def release_all(self, *, remove: bool = False) -> None:
        """Free every entry's memory and close the store, engine and tiers (lock not held)."""
        with self.cond:
            for entry in self.entries.values():
                self.free_memory(entry, departed=False)
            self.closed = True
        self.notifier.shutdown(wait=True)  # every caller's future is resolved by now
        self.watchdog.close()
        if self.store is not None:
            self.store.close(remove=remove)
        if self.engine is not None:
            self.engine.close()
        self.host.close()
        self.device.close()

    def metadata_written(self) -> dict[str, int]:
        """The store's metadata bytes written since it opened: journal, manifest, snapshot
        files (empty without a store)."""
        if self.store is None:
            return {}
        w = self.store.written()
        return {
            "journal": w.journal_nbytes,
            "manifest": w.manifest_nbytes,
            "snapshot": w.snapshot_nbytes,
        }

    def tier_stats(self) -> dict[Tier, TierStats]:
        """Budget, bytes held and peak of each memory tier; bytes allocated on NVMe."""
        tiers = {
            tier: TierStats(m.budget.limit_nbytes, m.budget.used_nbytes, m.budget.peak_nbytes)
            for tier, m in self.memory.items()
        }
        stored = (
            0 if self.store is None else sum(u.allocated_nbytes for u in self.store.dir_usage())
        )
        tiers[Tier.NVME] = TierStats(None, stored, None)
        return tiers

    # -- where an entry belongs (no lock needed: budgets' limits never change) ----------

    def fits_ever(self, tier: Tier, nbytes: int) -> bool:
        memory = self.memory[tier]
        limit = memory.budget.limit_nbytes
        return limit is None or memory.charge(nbytes) <= limit

    def home(self, kind: Kind, nbytes: int) -> Tier:
        """The fastest tier of ``kind``'s placement that can ever hold ``nbytes``."""
        for tier in self.placement[kind]:
            if tier is Tier.NVME or self.fits_ever(tier, nbytes):
                return tier
        return self.placement[kind][-1]

    # -- the table (lock held) ------------------------------------------------------------

    def window_for(self, entry: SwapEntry) -> ByteBudget:
        """The read-ahead window an entry's read-ahead takes its share of: optimizer state
        has its own. One window for both let a model's parameters, read ahead along the
        next forward while an optimizer step streams its state (or beside an overlapped
        step's update), hold the window a sub-group needs whole (a sub-group larger than
        the window takes all of it), and every read-ahead of a sub-group was dropped (the
        100M pressure run: 111 of them over one overlapped forward, each sub-group then
        read only when its turn came)."""
        return self.state_readahead if entry.kind is Kind.OPTIM_STATE else self.readahead

    def check_open(self) -> None:
        if self.closing:
            raise ManagerClosedError("the tier manager is closed")

    def get(self, key: str) -> SwapEntry:
        entry = self.entries.get(key) if isinstance(key, str) else None
        if entry is None:
            raise UnknownKeyError(f"no tensor registered under key={key!r}")
        return entry

    def notify(self) -> None:
        self.epoch += 1
        # Nobody waits, most of the time: Condition.notify_all is Python code (its
        # ownership check alone tries the lock), ~3 µs twice per fetch and release. Read
        # under the lock, as every waiter enters the list under it before it waits.
        if self.cond._waiters:  # type: ignore[attr-defined]
            self.cond.notify_all()

    def set_state(self, entry: SwapEntry, new: EntryState) -> None:
        entry.transition(new)
        self.notify()

    def wait(self, deadline: float, entry: SwapEntry) -> None:
        """Wait on the condition for ``entry``'s transfer (a wait point). Past
        ``deadline``, while the transfer is a read or write of the disk still in flight and
        the disk completed something within the last ``timeout_s`` (slow, not stuck: see
        :mod:`swapper.manager.watchdog`), it waits on (the caller loops).

        Raises:
            ManagerIOTimeout: ``deadline`` passed, the entry's read or write on NVMe is
                still in flight and the disk completed nothing for ``timeout_s``: names
                the file and offset.
            ManagerTimeout: ``deadline`` passed (another kind of transfer).
        """
        left = deadline - time.monotonic()
        io = entry.io
        if left <= 0 and isinstance(io, StoreFuture) and not io.done() and self.store is not None:
            window = self.config.timeout_s
            left = self.store.last_progress_s() + window - time.monotonic()
            if left <= 0:
                raise io.timed_out(
                    window - left,
                    f"ManagerConfig.timeout_s={window}",
                    cls=ManagerIOTimeout,
                    then=f"the wait for key={entry.key!r}'s {entry.state.value} transfer "
                    "gives up; the request stays in flight (its buffer is kept until it ends)",
                )
        if left <= 0:
            raise ManagerTimeout(
                f"key={entry.key!r}: waited too long for its {entry.state.value} transfer "
                f"(prefetch {entry.prefetch.value}) to end"
            )
        if entry.state in _DURABLE_PENDING:
            self.hurry_writes()
        wait_cond(self.cond, left, "manager.transfer")

    def hurry_writes(self) -> None:
        """A thread is about to wait for a transfer or for memory that writes to NVMe free:
        their group commit goes ahead without waiting for the store's other writes in
        flight (see :meth:`~tiers.nvme.store.NvmeStore.hurry`)."""
        if self.store is not None:
            self.store.hurry()

    def await_idle(self, entry: SwapEntry, deadline: float, doing: str) -> None:
        """Wait until no transfer of ``entry`` runs; it must be neither unregistered nor in
        use by then.

        Raises:
            UnknownKeyError: it was unregistered meanwhile.
            EntryInUseError: it is (or was fetched again and is) in use.
            ManagerTimeout: a transfer did not end by ``deadline``.
        """
        while entry.state.transient or entry.prefetch is Prefetch.RUNNING:
            self.wait(deadline, entry)
        if entry.state is _S.GONE:
            raise UnknownKeyError(f"{doing} of key={entry.key!r}: it is no longer registered")
        if entry.state is _S.IN_USE:
            raise EntryInUseError(
                f"{doing} of key={entry.key!r}: it is in use ({entry.users} fetch(es) not released)"
            )

    def await_settled(self, entry: SwapEntry, target: Tier, deadline: float) -> tuple[bool, bool]:
        """Wait out transfers of ``entry``. Returns (it is in ``target`` now, waited)."""
        waited = False
        while True:
            if entry.state is _S.GONE:
                raise UnknownKeyError(f"key={entry.key!r} was unregistered during the fetch")
            if entry.tier is target and entry.state in (_S.RESIDENT, _S.IN_USE):
                return True, waited
            if entry.state.transient or entry.prefetch is Prefetch.RUNNING:
                waited = True
                self.wait(deadline, entry)
                continue
            if entry.state is _S.IN_USE:
                where = "memory" if entry.tier is None else entry.tier.value
                raise EntryInUseError(
                    f"fetch of key={entry.key!r} into {target.value}: it is in use in "
                    f"{where}; release it first"
                )
            return False, waited

    def pin(self, entry: SwapEntry) -> torch.Tensor:
        entry.users += 1
        if entry.users == 1:
            self.set_state(entry, _S.IN_USE)
        if entry.readahead is not None:
            entry.readahead.release()
            entry.readahead = None
        return entry_view(entry)

    def pin_resident(
        self, key: str, tier: Tier | str | None, in_place: bool = False
    ) -> torch.Tensor | None:
        """Lock held. The whole of a fetch whose tensor is resident where it is fetched to
        (``tier``, default its home; with ``in_place``, any memory tier) and that nothing
        moves: the access noted, the entry pinned, its tensor returned. None for anything
        else (unknown key, closing, a tier given as a str, elsewhere, in transfer): the
        full fetch then decides, waits or raises, as it always did."""
        entry = self.entries.get(key) if type(key) is str else None
        if entry is None or self.closing:
            return None
        target = entry.home if tier is None else tier
        if in_place and entry.tier is not None:
            target = entry.tier
        if (
            type(target) is not Tier
            or target is Tier.NVME
            or entry.tier is not target
            or entry.state not in _HIT_STATES
        ):
            return None
        self.note_access(entry)
        if entry.prefetch is Prefetch.QUEUED:
            entry.prefetch = Prefetch.NONE  # as the full fetch does: nothing left to read ahead
        return self.pin(entry)

    def fetch_resident(
        self, key: str, tier: Tier | str | None, in_place: bool = False
    ) -> torch.Tensor | None:
        """Lock not held. :meth:`pin_resident` under the lock, then a signal that came
        meanwhile delivered with the pin undone (as the full fetch does), and the hit
        counted; None when the full fetch must run."""
        with self.cond:
            tensor = self.pin_resident(key, tier, in_place)
        if tensor is None:
            return None
        try:
            deliver_pending()
            self.stats.hit()
        except BaseException:
            self.unpin(self.entries[key])
            raise
        return tensor

    def fetch_all_resident(
        self, keys: list[str], tier: Tier | None = None
    ) -> list[torch.Tensor] | None:
        """Lock not held. :meth:`fetch_resident` of every key in one lock hold, into
        ``tier`` (None: ``in_place``, wherever each is in memory): all pinned, or none
        (None: some key is not resident there, or is moving); a signal that came
        meanwhile is delivered with every pin undone."""
        with self.cond:
            tensors: list[torch.Tensor] = []
            for key in keys:
                tensor = self.pin_resident(key, tier, tier is None)
                if tensor is None:
                    for done in keys[: len(tensors)]:
                        self.unpin_locked(self.entries[done])
                    return None
                tensors.append(tensor)
        try:
            deliver_pending()
            self.stats.hit(len(keys))
        except BaseException:
            self.unpin_keys(keys)
            raise
        return tensors

    def unpin_key(self, key: str) -> None:
        """:meth:`unpin` of a pinned key (lock not held): an undo for
        :func:`~tiers.signals.undo_if_cut`."""
        self.unpin(self.entries[key])

    def unpin_keys(self, keys: list[str]) -> None:
        """:meth:`unpin` of each pinned key in one lock hold (lock not held)."""
        with self.cond:
            for key in keys:
                self.unpin_locked(self.entries[key])

    def resident_stamp(self, keys: list[str], tier: Tier) -> int | None:
        """Lock held. If every key is in memory tier ``tier`` now, ``departures``: while
        it stays the same, they all still are (only a departure takes an entry out of a
        tier); else None. Unknown keys count as not resident."""
        for key in keys:
            entry = self.entries.get(key)
            if entry is None or entry.tier is not tier:
                return None
        return self.departures

    def unpin(self, entry: SwapEntry) -> None:
        """Undo a :meth:`pin` whose tensor never reached the caller (lock not held)."""
        with self.cond:
            self.unpin_locked(entry)

    def unpin_locked(self, entry: SwapEntry) -> None:
        """:meth:`unpin`, lock held."""
        entry.users -= 1
        if entry.users == 0:
            self.set_state(entry, _S.RESIDENT)

    def wait_for_transfers(self, deadline: float) -> None:
        """Wait until no entry is transient, or until ``deadline``."""
        while any(e.state.transient for e in self.entries.values()):
            left = deadline - time.monotonic()
            if left <= 0:
                return
            wait_cond(self.cond, left, "manager.drain")

    def free_memory(self, entry: SwapEntry, *, departed: bool = True) -> None:
        """Free ``entry``'s memory and read-ahead window; it is then in no memory tier.
        ``departed``: it stays registered (an eviction), counted in ``departures``."""
        if entry.block is not None:
            # On the device a user's kernels may still read it on their own stream (CUDA):
            # the memory is reused only once they are done (``ready``).
            entry.block.release(after=entry.ready if entry.tier is Tier.DEVICE else None)
        if entry.readahead is not None:
            entry.readahead.release()
        entry.block, entry.tier, entry.readahead = None, None, None
        forget_view(entry)
        self.departures += departed
        self.notify()

    def note_access(self, entry: SwapEntry) -> None:
        entry.last_use = next(self.clock)
        if self.order is not None:
            self.order.advance(entry.key)
        if self.recorded is not None:
            self.recorded.append(entry.key)

    def order_in_use(self) -> AccessOrder | None:
        if self.config.policy is Policy.LRU or self.order is None:
            return None
        return self.order

    def timeout(self, timeout_s: float | None) -> float:
        return self.config.timeout_s if timeout_s is None else timeout_s
