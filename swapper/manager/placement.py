"""Placement: which tier a tensor goes to, and room made there by evicting victims.

Decisions only; the bytes are moved by :class:`~swapper.manager.mover.Mover` (through the
:class:`Transfers` protocol, bound once both exist).

Invariants:

* A tier's bytes never pass its budget: room is taken with ``try_alloc``, and when there
  is none, victims are *claimed* under the lock (RESIDENT → WRITING for NVMe, MOVING for a
  slower memory tier) and evicted by the thread that claimed them, at once. Nobody waits
  for a claimed victim that is not already being worked on, so every wait in
  :meth:`Placement.obtain` is on progress under way (or on a caller's ``release``, bounded
  by the deadline).
* Entries a fetch waits for (``waiters > 0``) are victims only when nothing else frees
  enough; a read-ahead never takes them, nor anything needed sooner than what it reads.
* A clean victim bound for NVMe is dropped without a write.
* A claim cut before its eviction starts is undone (the victim is RESIDENT again, with
  its data).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Protocol

import torch

from swapper.manager.config import Tier
from swapper.manager.context import ManagerContext
from swapper.manager.entry import EntryState, Prefetch, SwapEntry
from swapper.manager.policy import choose_victims
from swapper.manager.shared import to_tier
from tiers.budget import BudgetExceededError, BudgetTimeout
from tiers.protocols import MemoryBlock
from tiers.signals import deliver_pending, wait_cond
from tiers.units import format_size

__all__ = ["Placement", "Transfers"]

_S = EntryState


class Transfers(Protocol):
    """What placement asks of the mover."""

    def evict_claimed(
        self, entry: SwapEntry, dest: Tier, version: int, deadline: float
    ) -> Future[None]: ...

    def write_new(
        self,
        entry: SwapEntry,
        tensor: torch.Tensor,
        deadline: float,
        behind: Future[None] | None = None,
    ) -> None: ...

    def drop_new(self, entry: SwapEntry, *, wrote: bool) -> None: ...


class Placement:
    """Tier choice and room for one manager's entries (see the module docstring)."""

    def __init__(self, ctx: ManagerContext) -> None:
        self._ctx = ctx
        self._mover: Transfers | None = None

    def bind(self, mover: Transfers) -> None:
        """Give placement the mover that evicts its victims (set once, at setup)."""
        self._mover = mover

    def _transfers(self) -> Transfers:
        mover = self._mover
        if mover is None:
            raise RuntimeError("Placement used before bind(): the manager is not set up")
        return mover

    # -- where ----------------------------------------------------------------------------

    def fetch_tier(self, entry: SwapEntry, tier: Tier | str | None) -> Tier:
        """The memory tier a fetch of ``entry`` brings it to (default: its home).

        Raises:
            ValueError: ``tier`` is not a memory tier.
        """
        if tier is None:
            if entry.home is not Tier.NVME:
                return entry.home
            memory = [t for t in self._ctx.placement[entry.kind] if t is not Tier.NVME]
            return memory[0] if memory else Tier.HOST
        tier = to_tier(tier)
        if tier is Tier.NVME:
            raise ValueError(
                f"key={entry.key!r}: fetch brings a tensor into memory: tier must "
                "be 'device' or 'host'"
            )
        return tier

    def destination(self, entry: SwapEntry, tier: Tier) -> Tier | None:
        """Lock held. Where a victim in ``tier`` goes: the next slower tier of its placement
        that can hold it; None when it cannot leave."""
        ctx = self._ctx
        for candidate in ctx.placement[entry.kind]:
            if candidate.rank <= tier.rank:
                continue
            if candidate is Tier.NVME:
                # A device tensor reaches NVMe through a host staging block.
                staged = tier is Tier.HOST or ctx.fits_ever(Tier.HOST, entry.nbytes)
                return candidate if ctx.store is not None and staged else None
            if ctx.fits_ever(candidate, entry.nbytes):
                return candidate
        return None

    def place_new(
        self,
        entry: SwapEntry,
        tensor: torch.Tensor,
        deadline: float,
        behind: Future[None] | None = None,
    ) -> bool:
        """Settle a NEW entry: RESIDENT in the first memory tier with room, else ON_NVME
        (with ``behind``: the write issued, the completion settles it and resolves
        ``behind``, see ``Mover.write_new``). Returns whether a write to NVMe was issued.

        On any failure, and on a signal that came meanwhile, the entry is dropped (GONE)
        and this raises; a signal is delivered here rather than after the key is visible.
        """
        ctx = self._ctx
        placement = ctx.placement[entry.kind]
        memory_tiers = [t for t in placement if t is not Tier.NVME]
        block: MemoryBlock | None = None
        tier: Tier | None = None
        view: torch.Tensor | None = None
        try:
            too_large: BudgetExceededError | None = None
            for tier in memory_tiers:
                try:
                    block = ctx.memory[tier].try_alloc(entry.nbytes, what=f"key={entry.key!r}")
                except BudgetExceededError as exc:
                    too_large = exc
                    continue
                if block is not None:
                    break
            if block is None and Tier.NVME not in placement:
                fitting = [t for t in memory_tiers if ctx.fits_ever(t, entry.nbytes)]
                if not fitting and too_large is not None:
                    raise too_large
                tier = fitting[0]
                block = self.obtain(
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
                self._transfers().drop_new(entry, wrote=False)
            raise
        if block is None:
            self._transfers().write_new(entry, tensor, deadline, behind)
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
    ) -> MemoryBlock | None:
        """A block of ``nbytes`` in ``tier``, evicting victims until it fits.

        ``moving`` is the entry the block is for, if any: None is returned as soon as it no
        longer needs moving into ``tier`` (it got there, or another thread took it over).
        A ``read_ahead`` evicts only victims nobody waits for and, with an access order,
        only those needed later than ``moving``; and returns None rather than waiting for
        users or timing out. Without ``moving`` and ``read_ahead`` it never returns None.

        Raises:
            BudgetExceededError: it can never fit.
            BudgetTimeout: no room by ``deadline``.
            SwapIOError, BudgetTimeout: evicting a victim failed (the victim keeps its data).
        """
        ctx = self._ctx
        memory = ctx.memory[tier]
        charge = memory.charge(nbytes)
        evictions: list[Future[None]] = []
        waited_s = max(0.0, deadline - time.monotonic())  # the most this call waits
        while True:
            with ctx.cond:
                epoch = ctx.epoch
                if moving is not None and not self._needs_move(moving, tier, read_ahead):
                    return None
            block = memory.try_alloc(nbytes, what=what)
            if block is not None:
                return block
            for future in evictions:
                error = future.exception() if future.done() else None
                if error is not None:
                    raise error
            with ctx.cond:
                if read_ahead and ctx.closing:
                    return None
                if ctx.epoch != epoch:
                    continue  # something changed since try_alloc: look again
                plans = self._pick_victims(tier, charge, moving, read_ahead)
                if plans is None:
                    return None
                if not plans and ctx.epoch == epoch:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        if read_ahead:
                            return None
                        raise self._room_timeout(tier, nbytes, what, waited_s)
                    ctx.hurry_writes()  # the room may be held by writes not yet durable
                    wait_cond(ctx.cond, left, "manager.room")
            issued = 0
            try:
                for victim, dest, version in plans:
                    evictions.append(
                        self._transfers().evict_claimed(victim, dest, version, deadline)
                    )
                    issued += 1
            finally:
                if issued < len(plans):
                    # Cut while evicting one (which settled itself): the victims claimed
                    # after it were never started and go back to RESIDENT.
                    with ctx.cond:
                        for victim, _, _ in plans[issued + 1 :]:
                            ctx.set_state(victim, _S.RESIDENT)

    def obtain_now(self, tier: Tier, nbytes: int, *, what: str, deadline: float) -> MemoryBlock:
        """:meth:`obtain` for a caller that needs the block whatever happens (staging,
        demotion): never None.

        Raises:
            as :meth:`obtain`.
        """
        block = self.obtain(tier, nbytes, what=what, deadline=deadline)
        if block is None:  # obtain() returns None only for a moving entry or a read-ahead
            raise RuntimeError(f"no block for {what}: obtain() gave up without a reason")
        return block

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
        ctx = self._ctx
        budget = ctx.memory[tier].budget
        if budget.limit_nbytes is None:
            return []
        leaving = sum(
            charged(e)
            for e in ctx.entries.values()
            if e.tier is tier and e.state in (_S.MOVING, _S.WRITING)
        )
        available = budget.available_nbytes
        deficit = charge - (0 if available is None else available) - leaving
        if deficit <= 0:
            return []
        candidates = [
            e
            for e in ctx.entries.values()
            if e.tier is tier
            and e.state is _S.RESIDENT
            and e is not moving
            and e.prefetch is not Prefetch.RUNNING
            and self.destination(e, tier) is not None
        ]
        order = ctx.order_in_use()
        free = [e for e in candidates if e.waiters == 0]
        if read_ahead:
            chosen = choose_victims(
                free,
                deficit,
                charged,
                order=order,
                speculative=True,
                not_before=order.distance(moving.key) if order and moving else None,
            )
            if not chosen:
                return None
        else:
            chosen = choose_victims(free, deficit, charged, order=order)
            short = deficit - sum(charged(e) for e in chosen)
            if short > 0:
                wanted = [e for e in candidates if e.waiters > 0]
                chosen += choose_victims(wanted, short, charged, order=order)
        plans: list[tuple[SwapEntry, Tier, int]] = []
        for victim in chosen:
            dest = self.destination(victim, tier)
            if dest is None:  # candidates all have one; kept for the type checker
                continue
            if victim.readahead is not None:
                victim.readahead.release()  # read ahead for nothing
                victim.readahead = None
                ctx.stats.add(prefetch_wasted=1)
            if dest is Tier.NVME and victim.clean:
                ctx.free_memory(victim)
                ctx.set_state(victim, _S.ON_NVME)
                continue
            ctx.set_state(victim, _S.WRITING if dest is Tier.NVME else _S.MOVING)
            plans.append((victim, dest, victim.version))
        return plans

    def _room_timeout(self, tier: Tier, nbytes: int, what: str, waited_s: float) -> BudgetTimeout:
        """Lock held."""
        ctx = self._ctx
        budget = ctx.memory[tier].budget
        in_use = sorted(e.key for e in ctx.entries.values() if e.tier is tier and e.users)
        shown = ", ".join(repr(k) for k in in_use[:5]) + (" ..." if len(in_use) > 5 else "")
        limit = "unlimited" if budget.limit_nbytes is None else format_size(budget.limit_nbytes)
        return BudgetTimeout(
            f"{what} needs {format_size(nbytes)} of the {tier.value} tier "
            f"({format_size(budget.used_nbytes)} of {limit} held) "
            f"and none came free within {waited_s:.3g}s; in use there: "
            f"{shown or 'nothing'}: release tensors or raise {tier.value}_nbytes",
            what=what,
            nbytes=nbytes,
            budget=budget.name,
            used_nbytes=budget.used_nbytes,
            timeout_s=waited_s,
        )


def charged(entry: SwapEntry) -> int:
    """Bytes evicting ``entry`` frees in its tier (0 when it holds no memory)."""
    return 0 if entry.block is None else entry.block.charged_nbytes
