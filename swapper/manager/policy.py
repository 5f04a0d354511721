"""Victim choice: LRU, or Belady's "next use furthest away" over a recorded access order.

Training touches tensors in the same order every step, so once one step's order is
recorded the next use of every tensor is known, as in ColossalAI Gemini's auto placement
policy. The order is treated as cyclic: after its last key comes its first again.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from swapper.manager.entry import SwapEntry

__all__ = ["AccessOrder", "choose_victims"]


@dataclass
class AccessOrder:
    """A recorded sequence of fetches and where the current step is in it.

    Attributes:
        keys: the order, one key per fetch (a key may appear several times).
        positions: key → its sorted positions in ``keys``.
        cursor: position of the next expected fetch.
    """

    keys: tuple[str, ...]
    positions: dict[str, list[int]] = field(default_factory=dict)
    cursor: int = 0

    @classmethod
    def of(cls, keys: Sequence[str]) -> AccessOrder:
        """The order of ``keys``, with the cursor at its start.

        Raises:
            TypeError: a key is not a str.
        """
        order = cls(tuple(keys))
        for i, key in enumerate(order.keys):
            if not isinstance(key, str):
                raise TypeError(f"access order keys must be str, got {key!r} at position {i}")
            order.positions.setdefault(key, []).append(i)
        return order

    def advance(self, key: str) -> None:
        """Note a fetch of ``key``: the cursor moves just past its next occurrence.

        A key not in the order leaves the cursor where it is.
        """
        if not self.keys:
            return
        position = self._next_position(key)
        if position is not None:
            self.cursor = (position + 1) % len(self.keys)

    def distance(self, key: str) -> float:
        """Fetches from the cursor until ``key``'s next use (0: it is next); ``inf`` when
        it is not in the order."""
        position = self._next_position(key)
        if position is None:
            return math.inf
        return (position - self.cursor) % len(self.keys)

    def _next_position(self, key: str) -> int | None:
        positions = self.positions.get(key)
        if not positions:
            return None
        i = bisect.bisect_left(positions, self.cursor)
        return positions[i] if i < len(positions) else positions[0]


def choose_victims(
    candidates: list[SwapEntry],
    deficit_nbytes: int,
    charge: Callable[[SwapEntry], int],
    *,
    order: AccessOrder | None,
    speculative: bool = False,
    not_before: float | None = None,
) -> list[SwapEntry]:
    """The entries to evict to free ``deficit_nbytes`` bytes, best victim first.

    With an ``order``: next use furthest away first (entries not in it first of all), ties
    by LRU. Without: least recently used first. ``charge(entry)`` is what evicting it frees.

    ``speculative`` (read-ahead): if the candidates cannot free the whole deficit none is
    chosen: evicting for a read-ahead that still cannot happen would only cost. With an
    order, ``not_before`` then admits only entries whose next use is strictly later than
    that distance (the tensor being read ahead is needed sooner than they are).

    Returns the shortest prefix of the ranking that covers the deficit; all candidates
    when they do not (demand fetches free what they can and wait for the rest).
    """
    if order is None:
        ranked = sorted(candidates, key=lambda e: e.last_use)
    else:
        ranked = sorted(candidates, key=lambda e: (-order.distance(e.key), e.last_use))
        if speculative and not_before is not None:
            ranked = [e for e in ranked if order.distance(e.key) > not_before]
    chosen: list[SwapEntry] = []
    freed = 0
    for entry in ranked:
        if freed >= deficit_nbytes:
            break
        chosen.append(entry)
        freed += charge(entry)
    if speculative and freed < deficit_nbytes:
        return []
    return chosen
