"""Placement: which tier a tensor goes to, and which victims leave to make room there.

Decisions only: placement decides, the mover moves. :class:`~swapper.manager.mover.Mover`
asks (where a fetch brings a tensor, where a new one goes, which victims to evict) and
does the moving and the waiting; nothing here calls back into the mover, so one fetch
enters this file at most twice: its tier (``fetch_tier``), and, when it must make room,
the whole room at once (``claim_room``: the victims in its tier *and* the host room
their eviction and the read's staging need, claimed before anything moves). A test
traces it, ``tests/test_manager_fetch_path.py``.

Invariants:

* A tier's bytes never pass its budget: room is taken with ``try_alloc``, and when there
  is none, victims are *claimed* under the lock (RESIDENT → WRITING for NVMe, MOVING for a
  slower memory tier) and evicted by the thread that claimed them, at once
  (:meth:`~swapper.manager.mover.Mover.obtain`). Nobody waits for a claimed victim that is
  not already being worked on, so every wait for room is on progress under way (or on a
  caller's ``release``, bounded by the deadline).
* Entries a fetch waits for (``waiters > 0``) are victims only when nothing else frees
  enough; a read-ahead never takes them, nor anything needed sooner than what it reads.
* A clean victim bound for NVMe is dropped without a write.
* A claim cut before its eviction starts is undone (the victim is RESIDENT again, with
  its data).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from swapper.manager.config import TIER_RANK as _RANK
from swapper.manager.config import Kind, Tier
from swapper.manager.context import ManagerContext
from swapper.manager.entry import EntryState, Prefetch, SwapEntry
from swapper.manager.policy import choose_victims
from swapper.manager.shared import charged, to_tier
from tiers.budget import BudgetExceededError, BudgetTimeout
from tiers.protocols import MemoryBlock
from tiers.units import format_size

__all__ = ["Placement"]

_S = EntryState

#: A claimed victim: (entry, the tier it goes to, the version being written).
Plan = tuple[SwapEntry, Tier, int]


class Placement:
    """Tier choice and victims for one manager's entries (see the module docstring)."""

    def __init__(self, ctx: ManagerContext) -> None:
        self._ctx = ctx
        #: per kind and tier, the slower tiers of its placement a victim there may go to,
        #: fastest first: read once here (the placement is fixed for the manager's life),
        #: so choosing a victim's destination asks the tiers' ranks nothing per victim
        #: (30 calls of ``Tier.rank`` per fetch that made room in two tiers, before)
        self._slower: dict[Kind, dict[Tier, tuple[Tier, ...]]] = {
            kind: {
                tier: tuple(t for t in order if _RANK[t] > _RANK[tier])
                for tier in (Tier.DEVICE, Tier.HOST, Tier.NVME)
            }
            for kind, order in ctx.placement.items()
        }

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
        for candidate in self._slower[entry.kind][tier]:
            if candidate is Tier.NVME:
                # A device tensor reaches NVMe through a host staging block.
                staged = tier is Tier.HOST or ctx.fits_ever(Tier.HOST, entry.nbytes)
                return candidate if ctx.store is not None and staged else None
            if ctx.fits_ever(candidate, entry.nbytes):
                return candidate
        return None

    def new_home(self, entry: SwapEntry) -> tuple[MemoryBlock | None, Tier | None]:
        """Where a NEW entry goes, and its memory if it can be had now: (block, its tier)
        in the first memory tier of its placement with room; (None, a memory tier) when
        its placement has no NVMe and it must wait for room there (evicting victims to
        slower memory); (None, None) when it goes to NVMe. Takes nothing else.

        Raises:
            BudgetExceededError: it fits no memory tier and its placement has no NVMe.
        """
        ctx = self._ctx
        placement = ctx.placement[entry.kind]
        memory_tiers = [t for t in placement if t is not Tier.NVME]
        too_large: BudgetExceededError | None = None
        for tier in memory_tiers:
            try:
                block = ctx.memory[tier].try_alloc(entry.nbytes, what=f"key={entry.key!r}")
            except BudgetExceededError as exc:
                too_large = exc
                continue
            if block is not None:
                return block, tier
        if Tier.NVME in placement:
            return None, None
        fitting = [t for t in memory_tiers if ctx.fits_ever(t, entry.nbytes)]
        if not fitting and too_large is not None:
            raise too_large
        return None, fitting[0]

    # -- room -------------------------------------------------------------------------------

    def claim_room(
        self,
        tier: Tier,
        charge: int,
        moving: SwapEntry | None,
        read_ahead: bool,
        *,
        reads: bool,
    ) -> tuple[list[Plan], list[Plan]] | None:
        """Lock held. One room's whole cascade, planned and claimed at once before anything
        moves: the victims that free ``charge`` bytes of ``tier`` (chosen as
        :meth:`claim_victims` chooses them) and, when ``tier`` is the device, the host's
        victims for what the cascade then takes there: each device victim's block (demoted
        to the host) or staging block (written to NVMe through the host), and, with
        ``reads``, the staging block of ``moving``'s read from NVMe. (A victim's staging
        block is freed when its write ends, which is before its device block is free, so
        the read's staging reuses it: the host must hold the larger of the two.)

        The host's victims are chosen by the policy from what is in the host *and* the
        device victims that would be demoted there, as if they were already there: a
        device victim that is the host's best victim goes straight to NVMe (staged, or
        dropped if clean), as the one-room-at-a-time cascade wrote it out right after
        demoting it, without the demotion. Host victims are claimed as any host room of
        a fetch was (not speculatively), never ``moving`` itself; host victims are
        claimed only with victims in the device (a caller that must wait for room there
        holds no claim while it waits).

        Returns:
            (victims in ``tier``, victims in the host), each as :meth:`claim_victims`
            returns them; None when a read-ahead should give up (nothing claimed).
        """
        chosen = self._choose(tier, charge, moving, read_ahead)
        host = self._ctx.memory.get(Tier.HOST)
        if chosen is None:
            return None
        if not chosen or tier is Tier.HOST or host is None:
            return self._claim(tier, chosen, ()), []
        in_host = host.charge
        demoted = [v for v in chosen if self.destination(v, tier) is Tier.HOST]
        written = [v for v in chosen if v not in demoted and not v.clean]
        read = in_host(moving.nbytes) if reads and moving is not None and moving.tier is None else 0
        need = sum(in_host(v.nbytes) for v in demoted) + max(
            sum(in_host(v.nbytes) for v in written), read
        )
        direct_ok = [v for v in demoted if self._reaches_nvme(v, tier)]
        in_order = self._choose(Tier.HOST, need, moving, False, also=direct_ok)
        direct = [v for v in in_order or () if v in direct_ok]
        leaving_host = [v for v in in_order or () if v not in direct_ok]
        return self._claim(tier, chosen, direct), self._claim(Tier.HOST, leaving_host, ())

    def claim_victims(
        self, tier: Tier, charge: int, moving: SwapEntry | None, read_ahead: bool
    ) -> list[Plan] | None:
        """Lock held. Choose and claim victims to free ``charge`` bytes of ``tier`` for a
        block (for ``moving``, if any; ``read_ahead``: speculative), which the caller then
        evicts at once (:meth:`~swapper.manager.mover.Mover.obtain`).

        Entries that fetches wait for come last (a read-ahead never takes them): evicting
        one wastes a transfer, but two fetches each protecting what the other must evict
        would otherwise wait for each other forever.

        Clean victims bound for NVMe are dropped at once; the others are returned as
        (entry, destination, version) to be evicted by the caller. Returns [] when the
        bytes already on their way out cover the need, or (demand) when nothing can be
        evicted now; None when a read-ahead should give up.
        """
        chosen = self._choose(tier, charge, moving, read_ahead)
        return None if chosen is None else self._claim(tier, chosen, ())

    def _choose(
        self,
        tier: Tier,
        charge: int,
        moving: SwapEntry | None,
        read_ahead: bool,
        *,
        also: list[SwapEntry] | None = None,
    ) -> list[SwapEntry] | None:
        """Lock held. The victims :meth:`claim_victims` claims, chosen but not claimed;
        ``also``: entries in another tier that count as candidates in ``tier`` (each
        freeing there what its block would take). None when a read-ahead should give
        up."""
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
        cost: Callable[[SwapEntry], int] = charged
        if also:
            candidates += also
            memory = ctx.memory[tier]
            # (A table, not a function of this file: the fetch path's trace counts
            # every call into it from the policy.)
            cost = {e: memory.charge(e.nbytes) for e in candidates}.__getitem__
        order = ctx.order_in_use()
        free = [e for e in candidates if e.waiters == 0]
        if read_ahead:
            chosen = choose_victims(
                free,
                deficit,
                cost,
                order=order,
                speculative=True,
                not_before=order.distance(moving.key) if order and moving else None,
            )
            return chosen or None
        chosen = choose_victims(free, deficit, cost, order=order)
        short = deficit - sum(cost(e) for e in chosen)
        if short > 0:
            wanted = [e for e in candidates if e.waiters > 0]
            chosen += choose_victims(wanted, short, cost, order=order)
        return chosen

    def _reaches_nvme(self, entry: SwapEntry, tier: Tier) -> bool:
        """Lock held. Whether ``entry`` in ``tier`` can be written straight to NVMe (its
        placement has NVMe, there is a store, and a device tensor's staging block fits
        the host)."""
        ctx = self._ctx
        if Tier.NVME not in ctx.placement[entry.kind] or ctx.store is None:
            return False
        return tier is Tier.HOST or ctx.fits_ever(Tier.HOST, entry.nbytes)

    def _claim(
        self, tier: Tier, chosen: list[SwapEntry], direct: Sequence[SwapEntry]
    ) -> list[Plan]:
        """Lock held. Claim the ``chosen`` victims in ``tier``: each bound for its
        destination (NVMe for those in ``direct``); a clean one bound for NVMe is dropped
        at once. Returns the others as (entry, destination, version) to be evicted."""
        ctx = self._ctx
        plans: list[Plan] = []
        for victim in chosen:
            dest = Tier.NVME if victim in direct else self.destination(victim, tier)
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

    def room_timeout(self, tier: Tier, nbytes: int, what: str, waited_s: float) -> BudgetTimeout:
        """Lock held. The error for ``what``, which waited ``waited_s`` seconds in vain for
        ``nbytes`` of ``tier``: it names what is in use there."""
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
