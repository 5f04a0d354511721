"""Memory measurements of a pressure run: the process's peak resident memory (``VmHWM``,
resettable), glibc set to return freed tensors to the OS at once, and the bytes autograd
saves for backward (activations).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

import torch

__all__ = ["SavedBytes", "peak_rss", "reset_peak_rss", "return_freed_memory"]


class SavedBytes:
    """Bytes of the tensors autograd saves for backward in one forward (activations;
    parameters excluded: they are the tiers'), the most over all forwards."""

    def __init__(self) -> None:
        self.peak_nbytes = 0
        self._storages: set[int] = set()
        self._nbytes = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self._storages:
                self._storages.add(storage.data_ptr())
                self._nbytes += storage.nbytes()
        return tensor

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        self._storages.clear()
        self._nbytes = 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
            yield
        self.peak_nbytes = max(self.peak_nbytes, self._nbytes)


def return_freed_memory() -> None:
    """Make glibc give freed tensors back to the OS at once.

    glibc raises its mmap threshold each time a large mmapped block is freed (up to 32
    MiB), after which large tensors come from the heap and stay resident once freed:
    the peak RSS would then measure the allocator's cache, not what the run holds. Fixed
    thresholds (as ``MALLOC_MMAP_THRESHOLD_`` would set) keep every block of 64 KiB or
    more in its own mapping. A no-op where glibc is not the C library.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 << 10)
    libc.mallopt(m_trim_threshold, 1 << 20)


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss() -> int:
    """The process's peak resident memory since the last reset, in bytes (VmHWM)."""
    return _status_kib("VmHWM")


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux ≥ 4.0: ``5`` into clear_refs)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")
