"""Memory measurements of a pressure run: the process's peak resident memory (``VmHWM``,
resettable), glibc set to return freed tensors to the OS at once, and the bytes autograd
saves for backward (activations).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

import torch

__all__ = [
    "RSS_SLACK_NBYTES",
    "SavedBytes",
    "freed_memory_returned",
    "peak_rss",
    "reset_peak_rss",
    "return_freed_memory",
    "rss_bound_nbytes",
]

#: Slack of the peak RSS bound beyond the budgets and activations (issue 23): torch, the
#: AIO engine, the optimizer's sub-group scratch and the allocator.
RSS_SLACK_NBYTES = 3 << 29

#: The process that last called :func:`return_freed_memory` (None: none has). A pid, not
#: a flag, so that a forked child does not inherit its parent's call as its own.
_returned_in_pid: int | None = None


def rss_bound_nbytes(budget_bytes: dict[str, int], activation_nbytes: int) -> int:
    """The peak RSS a run (one process, or one rank) may reach, in bytes: its device and
    host budgets + 2 x its activations (saved, and their gradients) + RSS_SLACK_NBYTES."""
    return sum(budget_bytes.values()) + 2 * activation_nbytes + RSS_SLACK_NBYTES


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
    global _returned_in_pid
    _returned_in_pid = os.getpid()  # (asked for; see freed_memory_returned)
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 << 10)
    libc.mallopt(m_trim_threshold, 1 << 20)


def freed_memory_returned() -> bool:
    """Whether this process has called :func:`return_freed_memory` (a rank's report says
    so: without the call its peak RSS measures glibc's cache of freed tensors)."""
    return _returned_in_pid == os.getpid()


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
