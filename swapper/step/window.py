"""How many optimizer sub-groups a step reads ahead: ``StepConfig.readahead``.

A fixed int reads that many sub-groups ahead. ``"auto"`` (:func:`auto_readahead`) works
it out at the start of every step from what the manager's host tier can give the step
without evicting what the forward and backward will fetch next, then bounds it by what
keeps the disk busy:

* **room**: the host budget, less the sub-groups kept in memory (``host_fraction``) and
  the bytes other keys hold in host memory now (the 16-bit parameters and gradients, and
  any other optimizer's state: what the next forward and this step's gradients need),
  divided by the largest streamed sub-group's stored state. One slot is the sub-group
  computing and one the sub-group being written behind; the rest may be read ahead (with
  exactly two, one: the write-behind gives its room back as it ends, as ``None`` does).
  With room for fewer than two, nothing is read ahead: one sub-group at a time, the step
  still finishes (a read-ahead could only be dropped, or take the room of the sub-group
  about to compute and be read twice).
* **the manager's read-ahead window** (``prefetch_window_nbytes``, which the
  parameters' read-ahead shares): a read-ahead beyond it is dropped by the manager, so
  asking for more only costs a lock round trip.
* **the disk**: :data:`IO_WINDOW` sub-groups, one being read while the current one
  computes and one queued behind it, so that the disk never waits for the next fetch to
  issue a read. More only holds memory: a step bound by the disk reads at the disk's
  rate whatever the depth. (That is the reasoning; docs/benchmarks.md, "Read-ahead
  window of the optimizer step", has the measurement, taken under load: not conclusive.)

Budgets and the parameters' share change between steps (an offloaded model moves its
parameters and gradients between tiers), so the pipeline calls :func:`auto_readahead`
again at the start of each step; the value holds for that step. Counting the others'
bytes takes one :meth:`~swapper.manager.TierManager.info` per key (a lock round trip,
microseconds each) once per step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from swapper.manager import Tier, TierManager
from swapper.manager.errors import UnknownKeyError
from swapper.step.config import AUTO, check_readahead

__all__ = ["AUTO", "IO_WINDOW", "Room", "auto_readahead", "budget_readahead", "check_readahead"]

#: The most sub-groups ``"auto"`` reads ahead: one read in flight while the current one
#: computes, one queued behind it.
IO_WINDOW = 2


@dataclasses.dataclass(frozen=True)
class Room:
    """What :func:`auto_readahead` decided from, for reports and tests.

    Attributes:
        readahead: sub-groups to read ahead this step.
        slots: streamed sub-groups the host budget left holds at once (``None``: no
            host budget).
        others_nbytes: bytes held in host memory by keys other than this optimizer's.
    """

    readahead: int
    slots: int | None
    others_nbytes: int


def auto_readahead(
    manager: TierManager,
    own_keys: Collection[str],
    *,
    kept_nbytes: int,
    largest_nbytes: int,
    streamed: int,
) -> Room:
    """The read-ahead for the next step (see the module docstring).

    Args:
        manager: the tiers the state streams through.
        own_keys: this optimizer's state keys (not counted as others' bytes).
        kept_nbytes: bytes of the sub-groups kept in memory for the optimizer's life.
        largest_nbytes: stored bytes of the largest streamed sub-group (> 0).
        streamed: how many sub-groups stream (0: nothing to read ahead).

    Returns:
        the decision and what it was made from.
    """
    others = _others_in_host(manager, own_keys)
    if streamed <= 1:
        return Room(0, None, others)
    config = manager.config
    bound = min(IO_WINDOW, streamed - 1)
    window = config.prefetch_window_nbytes
    if window is None and config.host_nbytes is not None:
        window = config.host_nbytes // 2  # the manager's own default
    if window is not None:
        # a tensor larger than the window goes alone (manager.context.window_share)
        bound = min(bound, max(1, window // largest_nbytes))
    if config.host_nbytes is None:
        return Room(bound, None, others)
    slots = max(0, config.host_nbytes - kept_nbytes - others) // largest_nbytes
    if slots < 2:
        return Room(0, slots, others)
    return Room(min(bound, max(1, slots - 2)), slots, others)


def budget_readahead(host_nbytes: int | None, kept_nbytes: int, largest_nbytes: int) -> int:
    """``readahead=None``: as many as the host budget holds besides the kept sub-groups,
    the one computing and the one being written behind (2 with no host budget); at least
    1 when it holds two, 0 when it holds only one (a read-ahead would evict the
    sub-group about to compute). Fixed for the optimizer's life; the parameters' share is
    not counted (``"auto"`` counts it)."""
    if host_nbytes is None:
        return 2
    slots = (host_nbytes - kept_nbytes) // largest_nbytes
    return 0 if slots < 2 else max(1, slots - 2)


def _others_in_host(manager: TierManager, own_keys: Collection[str]) -> int:
    total = 0
    keys = manager.keys()  # a copy: other threads may register meanwhile
    for key in keys:
        if key in own_keys:
            continue
        try:
            info = manager.info(key)
        except UnknownKeyError:  # unregistered meanwhile (another thread): holds nothing
            continue
        if info.tier is Tier.HOST:
            total += info.nbytes
    return total
