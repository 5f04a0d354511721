"""One swapped tensor's record, its states, and the one place its state changes.

State diagram (``SwapEntry.transition`` checks every change against ``_ALLOWED``)::

    register ─▶ NEW ─┬─ copied into the fastest memory tier with room ──────▶ RESIDENT
                     ├─ no tier has room, or it fits none: written to NVMe ─▶ ON_NVME
                     └─ registration failed ─────────────────────────────────▶ GONE

                      fetch (first user)
    RESIDENT ───────────────────────────────────────▶ IN_USE
     │ ▲ ▲ ▲ ◀──────────────────────────────────────── │  release (last user; modified=False
     │ │ │ │                                              keeps a clean NVMe copy clean)
     │ │ │ └── done ── CLEANING ◀── flush of a dirty entry: written, memory kept
     │ │ │
     │ │ └──── copied (into the new tier) or failed (still in the old one)
     │ │         │
     │ │       MOVING ◀── copy to another memory tier: a fetch, a prefetch, or a victim's
     │ │         │        demotion device → host
     │ │         └── the fetch's own move ─────────────▶ IN_USE
     │ │
     │ └── failed: memory kept, data intact
     │         │
     ├─ evict / victim, NVMe copy stale ─▶ WRITING ── durable: memory freed ──▶ ON_NVME
     └─ evict / victim, NVMe copy clean: memory dropped, nothing written ────▶ ON_NVME

    ON_NVME ── fetch / prefetch ──▶ READING ─┬─ read ahead ─▶ RESIDENT
                                             ├─ the fetch's own read ─▶ IN_USE
                                             └─ failed ─▶ ON_NVME

    RESIDENT, ON_NVME ── unregister ──▶ GONE

NEW, MOVING, READING, WRITING and CLEANING are "transient": exactly one thread (or one I/O
completion) owns the entry until it leaves them, and everyone else waits on the manager's
condition. A thread whose wait for a read (READING) or a registration's write (NEW) is cut
by Ctrl-C or an error hands the entry to the I/O's completion, which ends it (ON_NVME;
GONE) once the kernel is done with the buffer. IN_USE entries are never victims; a second
fetch of an IN_USE entry only adds a user (no transition).

An entry's bytes are in at most one memory tier (``tier``) at a time; NVMe may also hold a
copy, which is clean while ``nvme_version == version`` (``version`` counts releases that
said the tensor was modified), so evicting a clean entry writes nothing.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from swapper.manager.config import Kind, Tier
from swapper.manager.errors import IllegalTransitionError
from tiers.budget import Reservation
from tiers.nvme.futures import StoreFuture
from tiers.protocols import MemoryBlock

__all__ = ["EntryInfo", "EntryState", "MemoryBlock", "Prefetch", "SwapEntry"]


class EntryState(str, enum.Enum):
    NEW = "new"  #: being registered
    RESIDENT = "resident"  #: bytes in a memory tier; a possible victim
    IN_USE = "in_use"  #: resident and fetched by at least one caller
    MOVING = "moving"  #: being copied to another memory tier (source still held)
    READING = "reading"  #: being read from NVMe into a memory tier
    WRITING = "writing"  #: being written to NVMe; its memory is freed once durable
    CLEANING = "cleaning"  #: being written to NVMe; its memory is kept (flush)
    ON_NVME = "on_nvme"  #: on NVMe only
    GONE = "gone"  #: unregistered

    @property
    def transient(self) -> bool:
        """Owned by a transfer: others wait for it to end."""
        return self in _TRANSIENT


_TRANSIENT = frozenset(
    {
        EntryState.NEW,
        EntryState.MOVING,
        EntryState.READING,
        EntryState.WRITING,
        EntryState.CLEANING,
    }
)

_S = EntryState
_ALLOWED: dict[EntryState, frozenset[EntryState]] = {
    _S.NEW: frozenset({_S.RESIDENT, _S.ON_NVME, _S.GONE}),
    _S.RESIDENT: frozenset({_S.IN_USE, _S.MOVING, _S.WRITING, _S.CLEANING, _S.ON_NVME, _S.GONE}),
    _S.IN_USE: frozenset({_S.RESIDENT}),
    _S.MOVING: frozenset({_S.RESIDENT, _S.IN_USE}),
    _S.READING: frozenset({_S.RESIDENT, _S.IN_USE, _S.ON_NVME}),
    _S.WRITING: frozenset({_S.ON_NVME, _S.RESIDENT}),
    _S.CLEANING: frozenset({_S.RESIDENT}),
    _S.ON_NVME: frozenset({_S.READING, _S.GONE}),
    _S.GONE: frozenset(),
}


class Prefetch(str, enum.Enum):
    """Where a read-ahead request for the entry stands."""

    NONE = "none"
    QUEUED = "queued"  #: submitted, not started: a fetch does not wait for it
    RUNNING = "running"  #: making room or transferring: a fetch waits for it


@dataclass(eq=False)
class SwapEntry:
    """One tensor. Fields other than the first six change only under the manager's lock.

    Attributes:
        key, kind, dtype, shape: as registered; ``nbytes`` is its size in bytes.
        home: the fastest tier of its placement that can ever hold it (NVMe if none):
            where ``fetch`` puts it by default.
        state: see the module docstring.
        tier: the memory tier holding its bytes, or None when only NVMe does.
        block: its memory in ``tier``.
        version: bumped by every ``release(modified=True)``.
        nvme_version: the ``version`` whose bytes NVMe holds; None when NVMe has none.
        users: fetches not yet released.
        waiters: fetches waiting for it or making room for it (it is then no victim).
        prefetch: read-ahead request state.
        readahead: its share of the read-ahead window while prefetched and not fetched.
        last_use: LRU clock value of its last fetch, prefetch or registration.
        ready: with CUDA, an event after the last user's kernels (recorded at release on
            its stream), which copies out of device memory wait for.
        view, view_block: the typed view of ``block`` that fetches hand out, made once per
            block (``view_block`` is the block it views: a new block makes a new view).
        io: its latest read or write on NVMe (done or not), so that a wait for its
            transfer that gives up can name the file and offset still in flight; set
            without the lock by the thread that issues the request (the entry is
            transient then, so that thread is its only writer), read under it.
    """

    key: str
    kind: Kind
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    home: Tier
    state: EntryState = EntryState.NEW
    tier: Tier | None = None
    block: MemoryBlock | None = None
    version: int = 0
    nvme_version: int | None = None
    users: int = 0
    waiters: int = 0
    prefetch: Prefetch = Prefetch.NONE
    readahead: Reservation | None = None
    last_use: int = 0
    ready: torch.cuda.Event | None = None
    view: torch.Tensor | None = None
    view_block: MemoryBlock | None = None
    io: StoreFuture | None = None

    @property
    def clean(self) -> bool:
        """Whether NVMe holds its current bytes."""
        return self.nvme_version == self.version

    def transition(self, new: EntryState) -> None:
        """Move to state ``new``: the only place ``state`` is assigned.

        Raises:
            IllegalTransitionError: the table does not allow it (a manager bug); the
                state is unchanged.
        """
        if new not in _ALLOWED[self.state]:
            raise IllegalTransitionError(
                f"key={self.key!r}: illegal state change {self.state.value} -> {new.value}"
            )
        self.state = new

    def info(self) -> EntryInfo:
        """A frozen snapshot of the public fields."""
        return EntryInfo(
            key=self.key,
            kind=self.kind,
            dtype=self.dtype,
            shape=self.shape,
            nbytes=self.nbytes,
            home=self.home,
            state=self.state,
            tier=self.tier,
            on_nvme=self.nvme_version is not None,
            clean=self.clean,
            users=self.users,
        )


@dataclass(frozen=True)
class EntryInfo:
    """What :meth:`~swapper.manager.TierManager.info` reports of one tensor.

    ``tier`` is the memory tier holding its bytes (None: NVMe only); ``on_nvme`` whether
    NVMe holds a copy, and ``clean`` whether that copy is current.
    """

    key: str
    kind: Kind
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    home: Tier
    state: EntryState
    tier: Tier | None
    on_nvme: bool
    clean: bool
    users: int
