"""Where a tensor's bytes go: extents in the data files of the swap directories.

Job: cut a tensor of ``nbytes`` into chunks and give each chunk an extent of one data file;
take extents back when a version is freed; rebuild the free lists from the extents a
manifest names. No I/O and no locking: the store calls it under its lock.

Every tensor is cut into stripes of ``stripe_nbytes`` (the last one shorter), and each
stripe into chunks of at most :data:`CHUNK_NBYTES`. A chunk is an extent: the unit of I/O
requests and of checksums, so a read can verify one chunk while the others are still in
flight, and swapped chunks are caught. A tensor of one stripe goes to the directory with
the fewest bytes allocated; a larger one is spread stripe by stripe round-robin over the
directories from that one, so that several drives add their bandwidth, with all of its
chunks in one directory placed back to back in one region (each drive streams its share
sequentially; in a single directory the tensor is contiguous and its only padding is at the
end).

Allocation is first fit in 4 KiB units (:class:`~tiers.extents.RangeAllocator`), so every
extent starts O_DIRECT-aligned and the padding between one tensor's last byte and the next
extent is never read.

Invariant: the extents handed out and not yet freed never overlap.
"""

from __future__ import annotations

from tiers.config import DIRECT_ALIGNMENT
from tiers.extents import RangeAllocator, pad
from tiers.nvme.records import Extent

__all__ = ["CHUNK_NBYTES", "REGION_ALIGN_NBYTES", "Placement"]

#: The largest extent: the unit of I/O requests and of checksums. A read's future waits,
#: after its last extent lands, for that extent's hash (~0.3 ms for 4 MiB at 13 GB/s);
#: smaller chunks shorten that tail but cost a request and a manifest entry each.
CHUNK_NBYTES = 4 << 20
#: A tensor's region of at least this many bytes in one file starts on a multiple of it.
#: The engine cuts requests at ``block_size`` boundaries of the file (1 MiB by default):
#: with regions placed at any 4 KiB offset, every 4 MiB chunk of a large tensor (an
#: optimizer sub-group's state) became five pieces, two of them partial, instead of four
#: whole ones (tools/step_trace.py counted 330 of a step's 368 reads unaligned). The
#: space skipped stays free for smaller tensors.
REGION_ALIGN_NBYTES = 1 << 20


class Placement:
    """Extent allocation over ``n_dirs`` data files, striped in chunks of ``stripe_nbytes``."""

    def __init__(self, n_dirs: int, stripe_nbytes: int) -> None:
        self.stripe_nbytes = stripe_nbytes
        #: A stripe is cut into chunks of at most this (an extent, a request, a checksum).
        self.chunk_nbytes = min(stripe_nbytes, CHUNK_NBYTES)
        self.allocators = [RangeAllocator() for _ in range(n_dirs)]

    def place(self, nbytes: int) -> tuple[Extent, ...]:
        """Allocate the extents (without checksums) for ``nbytes`` bytes, in tensor order."""
        if nbytes == 0:
            return ()
        n_dirs = len(self.allocators)
        first = min(range(n_dirs), key=lambda i: self.allocators[i].used_nbytes)
        stripe, chunk = self.stripe_nbytes, self.chunk_nbytes
        chunks = [
            ((first + i) % n_dirs, min(chunk, nbytes - at))
            for i, start in enumerate(range(0, nbytes, stripe))
            for at in range(start, min(nbytes, start + stripe), chunk)
        ]
        region = [0] * n_dirs
        for dir_index, size in chunks:
            region[dir_index] += pad(size)
        cursor = [
            self.allocators[i].allocate(region[i], _align(region[i])) if region[i] else 0
            for i in range(n_dirs)
        ]
        extents = []
        for dir_index, size in chunks:
            extents.append(Extent(dir_index, cursor[dir_index], size))
            cursor[dir_index] += pad(size)
        return tuple(extents)

    def free(self, extents: tuple[Extent, ...]) -> None:
        """Give the extents' space back (coalesced with the free space around it).

        Raises:
            RuntimeError: an extent is not wholly allocated (a bookkeeping bug).
        """
        for e in extents:
            self.allocators[e.dir_index].free(e.offset, e.allocated_nbytes)

    @classmethod
    def rebuild(cls, n_dirs: int, stripe_nbytes: int, extents: list[Extent]) -> Placement:
        """The placement whose allocated ranges are exactly ``extents``.

        Raises:
            ValueError: two extents of one file overlap (the message names the offset).
        """
        placement = cls(n_dirs, stripe_nbytes)
        for i in range(n_dirs):
            used = [(e.offset, e.allocated_nbytes) for e in extents if e.dir_index == i]
            try:
                placement.allocators[i] = RangeAllocator.rebuild(used)
            except ValueError as exc:
                raise ValueError(f"data file {i}: {exc}") from None
        return placement

    def used_nbytes(self, dir_index: int) -> int:
        return self.allocators[dir_index].used_nbytes

    def end_nbytes(self, dir_index: int) -> int:
        return self.allocators[dir_index].end_nbytes


def _align(region_nbytes: int) -> int:
    """The alignment of a region of ``region_nbytes`` (see :data:`REGION_ALIGN_NBYTES`)."""
    return REGION_ALIGN_NBYTES if region_nbytes >= REGION_ALIGN_NBYTES else DIRECT_ALIGNMENT
