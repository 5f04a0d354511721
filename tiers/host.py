"""The host tier: page-aligned (pinned when CUDA is present) memory under a byte budget.

Why an arena
------------
:func:`tiers.buffers.allocate` maps fresh memory, and a fresh mapping costs page faults:
prefaulted up front for huge-page backings, or taken on first touch for plain pages. A
swap tier hands out and takes back buffers for the same tensors every training step, so
the tier keeps a few large ``allocate()`` buffers ("arenas", ``arena_nbytes`` each, made
when first needed and kept until :meth:`HostTier.close`) and carves blocks out of them
first-fit, in 4 KiB units so every block is O_DIRECT-aligned, coalescing holes on free.
Carving is a list walk under a lock, and the pages are already faulted in (and locked, and
pinned once per arena rather than once per tensor: ``cudaHostRegister`` costs milliseconds
a call). Measured on the development VM (2 cores, best of 5; "touch" = one ``fill_``)::

    block      allocate() + touch + close    arena block + touch + release    touch alone
    64 KiB          66 µs                          8 µs                            2 µs
    1 MiB          271 µs                         17 µs                           11 µs
    4 MiB          5.7 ms (huge pages)            66 µs                           56 µs
    16 MiB          11 ms (huge pages)           ~350 µs                         ~350 µs

Size-class pools (a :class:`~tiers.buffers.BufferPool` per power of two) would also avoid
the faults, but waste up to half of the budget on rounding; tensors of a model repeat the
same few sizes, which first-fit serves with little fragmentation.

What the budget counts: the bytes of each block rounded up to 4 KiB (what the block
really takes from an arena). The arenas together map at most the budget's limit (the last
one is made smaller to fit); a block that finds no hole large enough, because the arenas are
full of holes (fragmentation) or the block is larger than ``arena_nbytes``, gets its own
``allocate()`` buffer ("dedicated"; each new one counted in
``HostTier.dedicated_allocations``). The budget still bounds the bytes held by blocks; the
memory mapped can then exceed it by the holes in the arenas.

Released dedicated buffers are kept ("spares") and handed to the next block of about their
size (at most 1/8 larger than it; counted in
``HostTier.dedicated_reuses``), because the blocks that need them come back every step: an
optimizer sub-group's state larger than an arena is read into one at every fetch, and
mapping, prefaulting and unmapping 384 MB of huge pages for each took a third of a
256M-parameter step in system time (issue 24). Spares are bounded: they are kept only
while the arenas, the dedicated buffers in use and the spares together map no more than
the limit (without a limit: no more than the most dedicated bytes ever in use at once),
and dropped, oldest first, before anything new is mapped that would pass that bound.
:meth:`HostTier.close` unmaps them.

Life of a block::

    try_alloc / alloc ─ budget reserved ─ carved from an arena (or a spare, or its own
        │                                    allocate())
        ▼ HELD: ``block.tensor`` is exactly ``nbytes`` uint8, 4 KiB-aligned
        │
        └─ release() ─▶ RELEASED: its range goes back to the arena (a dedicated buffer
                       becomes a spare, or is unmapped), its bytes to the budget
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from tiers.blocks import TierBlock
from tiers.budget import ByteBudget, Reservation
from tiers.buffers import HostBuffer, HugeMode, allocate
from tiers.config import DIRECT_ALIGNMENT
from tiers.errors import SwapConfigError

# The store's first-fit allocator of 4 KiB-aligned ranges is exactly what an arena needs.
from tiers.extents import RangeAllocator, pad
from tiers.units import format_size

__all__ = ["HostBlock", "HostTier"]

#: Default arena size: large enough that a step's tensors fit in a few, small enough that
#: making one (prefaulting it) takes milliseconds, not seconds.
DEFAULT_ARENA_NBYTES = 64 << 20


def _spare_fits(spare_nbytes: int, padded: int) -> bool:
    """Whether a spare buffer of ``spare_nbytes`` serves a block of ``padded`` bytes without
    wasting much: at most 1/8 of the block more."""
    return padded <= spare_nbytes <= padded + padded // 8


@dataclass(eq=False)
class _Arena:
    """One ``allocate()`` buffer and the allocator of its 4 KiB-aligned ranges."""

    buffer: HostBuffer
    allocator: RangeAllocator


class HostBlock(TierBlock):
    """``nbytes`` bytes of host memory held from a :class:`HostTier` until :meth:`release`.

    Attributes:
        nbytes: the size asked for, in bytes.
        charged_nbytes: what the tier's budget counts for it (``nbytes`` padded to 4 KiB).
    """

    _released_message = "host block was released; its memory may belong to another"

    def __init__(
        self,
        tier: HostTier,
        tensor: torch.Tensor,
        reservation: Reservation,
        arena: _Arena | None,
        offset: int,
        dedicated: HostBuffer | None,
    ) -> None:
        self._tier = tier
        self._tensor: torch.Tensor | None = tensor
        self._reservation = reservation
        self._arena = arena
        self._offset = offset
        self._dedicated = dedicated
        self.nbytes = tensor.numel()
        self.charged_nbytes = reservation.nbytes

    def release(self, after: torch.cuda.Event | None = None) -> None:
        """Give the memory back to the tier and the bytes to its budget. Idempotent.

        Views of the block must not be used afterwards: the range is handed out again.
        ``after`` is accepted for the :class:`~tiers.protocols.MemoryBlock` protocol and
        ignored: host memory is only touched by copies that were waited for already.
        """
        self._tier._release(self)

    def __repr__(self) -> str:
        state = "released" if self._tensor is None else "held"
        return f"<HostBlock {format_size(self.nbytes)} ({state})>"


class HostTier:
    """Host memory under a byte budget, carved from a few large aligned buffers.

    Thread-safe. Close with :meth:`close` or use as a context manager.

    Args:
        limit_nbytes: the budget, in bytes (``None``: unlimited).
        arena_nbytes: size of each arena in bytes, a positive multiple of 4096; blocks
            larger than this get their own buffer.
        huge, lock, pin: as for :func:`tiers.buffers.allocate` (pinned by default when
            CUDA is available).
        name: the budget's name, used in error messages.

    Raises:
        SwapConfigError: ``limit_nbytes`` or ``arena_nbytes`` is not a valid byte count.
    """

    def __init__(
        self,
        limit_nbytes: int | None,
        *,
        arena_nbytes: int = DEFAULT_ARENA_NBYTES,
        huge: HugeMode = None,
        lock: bool | None = None,
        pin: bool | None = None,
        name: str = "host",
    ) -> None:
        if limit_nbytes is not None and (
            isinstance(limit_nbytes, bool) or not isinstance(limit_nbytes, int) or limit_nbytes < 0
        ):
            raise SwapConfigError(f"limit_nbytes={limit_nbytes!r} must be an int >= 0 or None")
        if (
            isinstance(arena_nbytes, bool)
            or not isinstance(arena_nbytes, int)
            or arena_nbytes <= 0
            or arena_nbytes % DIRECT_ALIGNMENT
        ):
            raise SwapConfigError(
                f"arena_nbytes={arena_nbytes!r} must be a positive multiple of "
                f"{DIRECT_ALIGNMENT} bytes"
            )
        self.budget = ByteBudget(name, limit_nbytes)
        self._arena_nbytes = arena_nbytes
        # Arenas never map more than the limit, rounded down to whole 4 KiB units.
        self._cap = (
            None if limit_nbytes is None else limit_nbytes // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT
        )
        self._alloc_options = {"huge": huge, "lock": lock, "pin": pin}
        self._arenas: list[_Arena] = []
        # Released dedicated buffers kept for reuse, oldest first (see the module header).
        self._spares: list[HostBuffer] = []
        #: bytes of dedicated buffers held by blocks now, and the most ever held at once
        self._dedicated_nbytes = 0
        self._dedicated_peak_nbytes = 0
        self._lock = threading.Lock()
        self._closed = False
        #: dedicated buffers mapped (a spare handed out again is not counted)
        self.dedicated_allocations = 0
        #: blocks served by a spare instead of a new mapping
        self.dedicated_reuses = 0

    @property
    def mapped_nbytes(self) -> int:
        """Bytes of arena memory mapped (blocks with their own buffer not included)."""
        with self._lock:
            return sum(a.buffer.nbytes for a in self._arenas)

    @property
    def dedicated_nbytes(self) -> int:
        """Bytes of dedicated buffers (blocks with their own buffer) held by blocks now."""
        with self._lock:
            return self._dedicated_nbytes

    @property
    def spare_nbytes(self) -> int:
        """Bytes of released dedicated buffers kept mapped for reuse."""
        with self._lock:
            return sum(b.nbytes for b in self._spares)

    @property
    def arena_count(self) -> int:
        with self._lock:
            return len(self._arenas)

    def charge(self, nbytes: int) -> int:
        """Bytes the budget counts for a block of ``nbytes`` bytes."""
        return pad(nbytes)  # what a host block costs: 4 KiB-aligned

    def try_alloc(self, nbytes: int, *, what: str) -> HostBlock | None:
        """A block of ``nbytes`` bytes if the budget has room now, else None at once.

        ``what`` names the bytes' owner (a tensor's key) in error messages.

        Raises:
            BudgetExceededError: ``nbytes`` (padded) exceeds the whole limit.
            RuntimeError: the tier is closed.
            MemoryError: a new arena or buffer cannot be mapped.
        """
        reservation = self.budget.try_reserve(self.charge(nbytes), what=what)
        return None if reservation is None else self._carve(nbytes, reservation)

    def alloc(self, nbytes: int, *, what: str, timeout_s: float | None = None) -> HostBlock:
        """A block of ``nbytes`` bytes, waiting up to ``timeout_s`` seconds for room.

        Raises:
            BudgetExceededError: at once, when ``nbytes`` (padded) exceeds the whole limit.
            BudgetTimeout: no room came free within ``timeout_s``.
            RuntimeError: the tier is closed.
            MemoryError: a new arena or buffer cannot be mapped.
        """
        reservation = self.budget.reserve(self.charge(nbytes), what=what, timeout_s=timeout_s)
        return self._carve(nbytes, reservation)

    def _carve(self, nbytes: int, reservation: Reservation) -> HostBlock:
        padded = reservation.nbytes
        dropped: list[HostBuffer] = []
        try:
            with self._lock:
                if self._closed:
                    raise RuntimeError("host tier is closed")
                if padded == 0:
                    return HostBlock(
                        self, torch.empty(0, dtype=torch.uint8), reservation, None, 0, None
                    )
                for arena in self._arenas:
                    block = self._carve_from(arena, nbytes, padded, reservation)
                    if block is not None:
                        return block
                spare = self._take_spare(padded)
                if spare is not None:
                    self.dedicated_reuses += 1
                    return HostBlock(self, spare.tensor[:nbytes], reservation, None, 0, spare)
                mapped = sum(a.buffer.nbytes for a in self._arenas)
                size = self._arena_nbytes
                if self._cap is not None:
                    size = min(size, self._cap - mapped)
                if size >= padded:
                    # Spares past the bound go first (under the lock: this is rare).
                    for old in self._drop_spares_for(size):
                        old.close()
                    # Made under the lock: a second thread must not map a second arena
                    # for the same shortage. Milliseconds, once per arena.
                    arena = _Arena(allocate(size, **self._alloc_options), RangeAllocator())
                    self._arenas.append(arena)
                    block = self._carve_from(arena, nbytes, padded, reservation)
                    if block is not None:
                        return block
                dropped = self._drop_spares_for(padded)
                self.dedicated_allocations += 1
                # counted before it is mapped, so that a concurrent release keeps no spare
                # past the bound meanwhile
                self._add_dedicated(padded)
            # Unmapped before the new buffer is mapped, outside the lock (munmap of huge
            # pages takes milliseconds).
            for old in dropped:
                old.close()
            dropped = []
            try:
                buffer = allocate(padded, **self._alloc_options)
            except BaseException:
                with self._lock:
                    self._dedicated_nbytes -= padded
                raise
            return HostBlock(self, buffer.tensor[:nbytes], reservation, None, 0, buffer)
        except BaseException:
            reservation.release()
            raise
        finally:
            for old in dropped:
                old.close()

    def _add_dedicated(self, nbytes: int) -> None:
        """Lock held. Count ``nbytes`` more of dedicated buffers held by blocks."""
        self._dedicated_nbytes += nbytes
        self._dedicated_peak_nbytes = max(self._dedicated_peak_nbytes, self._dedicated_nbytes)

    def _take_spare(self, padded: int) -> HostBuffer | None:
        """Lock held. The smallest spare that serves a block of ``padded`` bytes, taken off
        the list and counted as held, or None."""
        fits = [b for b in self._spares if _spare_fits(b.nbytes, padded)]
        if not fits:
            return None
        spare = min(fits, key=lambda b: b.nbytes)
        self._spares.remove(spare)
        self._add_dedicated(spare.nbytes)
        return spare

    def _spares_bound(self, new_nbytes: int) -> int:
        """Lock held. The most bytes arenas, dedicated buffers and spares may map together
        once ``new_nbytes`` more are mapped."""
        if self._cap is not None:
            return self._cap
        arenas = sum(a.buffer.nbytes for a in self._arenas)
        return arenas + max(self._dedicated_peak_nbytes, self._dedicated_nbytes + new_nbytes)

    def _spare_fits_bound(self, nbytes: int) -> bool:
        """Lock held. Whether a released buffer of ``nbytes`` may join the spares."""
        arenas = sum(a.buffer.nbytes for a in self._arenas)
        spares = sum(b.nbytes for b in self._spares)
        return arenas + self._dedicated_nbytes + spares + nbytes <= self._spares_bound(0)

    def _drop_spares_for(self, new_nbytes: int) -> list[HostBuffer]:
        """Lock held. Take spares off the list, oldest first, until mapping ``new_nbytes``
        more keeps everything mapped within the bound; the caller unmaps what is returned
        (outside the lock)."""
        bound = self._spares_bound(new_nbytes)
        held = sum(a.buffer.nbytes for a in self._arenas) + self._dedicated_nbytes + new_nbytes
        spare_total = sum(b.nbytes for b in self._spares)
        dropped: list[HostBuffer] = []
        while self._spares and held + spare_total > bound:
            old = self._spares.pop(0)
            spare_total -= old.nbytes
            dropped.append(old)
        return dropped

    def _carve_from(
        self, arena: _Arena, nbytes: int, padded: int, reservation: Reservation
    ) -> HostBlock | None:
        """Lock held. A block from ``arena``, or None when no hole there fits."""
        offset = arena.allocator.allocate(padded)
        if offset + padded > arena.buffer.nbytes:
            arena.allocator.free(offset, padded)  # it grew past the end: no room here
            return None
        tensor = arena.buffer.tensor[offset : offset + nbytes]
        return HostBlock(self, tensor, reservation, arena, offset, None)

    def _release(self, block: HostBlock) -> None:
        with self._lock:
            if block._tensor is None:
                return
            block._tensor = None
            if block._arena is not None and not self._closed:
                block._arena.allocator.free(block._offset, block.charged_nbytes)
            dedicated, block._dedicated = block._dedicated, None
            if dedicated is not None:
                self._dedicated_nbytes -= dedicated.nbytes
                if not self._closed and self._spare_fits_bound(dedicated.nbytes):
                    # Kept: the next block of about its size takes it, not a new mapping.
                    self._spares.append(dedicated)
                    dedicated = None
        if dedicated is not None:
            dedicated.close()
        block._reservation.release()

    def close(self) -> None:
        """Unmap the arenas and the spares (each once no tensor views it any more).
        Idempotent.

        Blocks still held stay readable (their views keep the mapping alive) but are no
        longer pinned; releasing them afterwards is allowed and unmaps a dedicated buffer.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            arenas, self._arenas = self._arenas, []
            spares, self._spares = self._spares, []
        for arena in arenas:
            arena.buffer.close()
        for spare in spares:
            spare.close()

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<HostTier {self.budget!r} arenas={len(self._arenas)}x"
            f"{format_size(self._arena_nbytes)} dedicated={self.dedicated_allocations}>"
        )
