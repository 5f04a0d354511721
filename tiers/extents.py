"""First-fit allocation of aligned byte ranges, shared by the NVMe store and the host arena."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tiers.config import DIRECT_ALIGNMENT

__all__ = ["RangeAllocator", "pad"]


def pad(nbytes: int) -> int:
    """``nbytes`` rounded up to the O_DIRECT alignment (4 KiB)."""
    return -(-nbytes // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT


@dataclass
class RangeAllocator:
    """First-fit allocation of 4 KiB-aligned ranges of one file or arena; sizes in bytes.

    ``holes`` are the free ranges below ``end_nbytes`` as sorted ``(offset, nbytes)``
    pairs, never touching each other nor the end (freeing coalesces them).
    """

    holes: list[tuple[int, int]] = field(default_factory=list)
    end_nbytes: int = 0
    used_nbytes: int = 0

    def allocate(self, nbytes: int, align: int = DIRECT_ALIGNMENT) -> int:
        """Offset of ``nbytes`` (a positive multiple of 4 KiB) newly allocated bytes, a
        multiple of ``align`` (a multiple of 4 KiB). The space skipped to reach an aligned
        offset stays free (a hole), for smaller allocations."""
        for i, (offset, size) in enumerate(self.holes):
            start = -(-offset // align) * align
            if start + nbytes <= offset + size:
                rest = offset + size - start - nbytes
                pieces = [(offset, start - offset)] if start > offset else []
                if rest:
                    pieces.append((start + nbytes, rest))
                self.holes[i : i + 1] = pieces
                self.used_nbytes += nbytes
                return start
        start = -(-self.end_nbytes // align) * align
        if start > self.end_nbytes:  # (no hole touches the end: this one stands alone)
            self.holes.append((self.end_nbytes, start - self.end_nbytes))
        self.end_nbytes = start + nbytes
        self.used_nbytes += nbytes
        return start

    def free(self, offset: int, nbytes: int) -> None:
        """Return ``[offset, offset + nbytes)``, merging it with neighbouring free space.

        Raises:
            RuntimeError: the range is not wholly allocated (a bookkeeping bug: a double
                free would hand the same bytes to two tensors, so it must not pass).
        """
        end = offset + nbytes
        i = bisect.bisect_left(self.holes, (offset,))
        prev = self.holes[i - 1] if i > 0 else None
        nxt = self.holes[i] if i < len(self.holes) else None
        if (
            end > self.end_nbytes
            or (prev is not None and prev[0] + prev[1] > offset)
            or (nxt is not None and nxt[0] < end)
        ):
            raise RuntimeError(f"freeing [{offset}, {end}) which is not allocated")
        self.used_nbytes -= nbytes
        if prev is not None and prev[0] + prev[1] == offset:
            offset = prev[0]
            i -= 1
            del self.holes[i]
        if nxt is not None and nxt[0] == end:
            end = nxt[0] + nxt[1]
            del self.holes[i]
        if end == self.end_nbytes:
            self.end_nbytes = offset  # the file's tail is free again: no hole, just a lower end
        else:
            self.holes.insert(i, (offset, end - offset))

    @classmethod
    def rebuild(cls, used: list[tuple[int, int]]) -> RangeAllocator:
        """The allocator whose allocated ranges are exactly ``used`` ``(offset, nbytes)``.

        Raises:
            ValueError: two ranges overlap.
        """
        allocator = cls()
        for offset, nbytes in sorted(used):
            if offset < allocator.end_nbytes:
                raise ValueError(f"extent at offset {offset} overlaps the one before it")
            if offset > allocator.end_nbytes:
                allocator.holes.append((allocator.end_nbytes, offset - allocator.end_nbytes))
            allocator.end_nbytes = offset + nbytes
            allocator.used_nbytes += nbytes
        return allocator
