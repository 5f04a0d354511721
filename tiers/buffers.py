"""Page-aligned host buffers (placeholder: a helper is replacing this with the full version).

API contract used elsewhere:
    allocate(nbytes, *, huge=None, lock=None, pin=None) -> HostBuffer
    HostBuffer.tensor (torch.uint8, nbytes long), .nbytes, .address, .close(), context manager
"""

from __future__ import annotations

import mmap

import torch


class HostBuffer:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()

    def close(self) -> None:
        self.tensor = None

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def allocate(nbytes: int, *, huge: bool | None = None, lock: bool | None = None, pin: bool | None = None) -> HostBuffer:
    return HostBuffer(nbytes)
