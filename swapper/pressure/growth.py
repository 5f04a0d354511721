"""Does a long run grow? The process figures a leak would move, sampled and judged.

Job: :func:`sample` reads what a leak in the swap path would grow (open descriptors,
threads, locked memory, RSS, the host tier's bytes, the swap directory's files and
bytes); :func:`growth` compares the samples after a warm-up with those of the warm-up
window. Used by ``tests/test_leaks.py`` (200 steps) and ``tools/long_run.py`` (2,000).

The store's journal is reported apart (``journal_bytes``): it grows by a record per write
until it is compacted into a manifest (``tiers.nvme.core.JOURNAL_COMPACT_NBYTES``), so it
is bounded, not flat.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

__all__ = ["FLAT_FIELDS", "growth", "sample"]

#: Figures that must not grow at all after the warm-up (their late maximum is at most
#: their warm-up maximum); RSS gets a tolerance instead (the allocator rounds).
FLAT_FIELDS = (
    "fds",
    "threads",
    "os_threads",
    "locked_bytes",
    "host_used_bytes",
    "swap_files",
    "swap_file_bytes",
    "swap_disk_bytes",
)


def _status(field: str) -> int:
    """A ``/proc/self/status`` figure: kB fields in bytes, counts as they are.

    Raises:
        KeyError: the field is not there (not Linux, or an old kernel).
    """
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                parts = line.split()
                return int(parts[1]) * (1024 if parts[-1] == "kB" else 1)
    raise KeyError(f"/proc/self/status has no {field!r} line")


def sample(swap_dir: Path, host_used_nbytes: int) -> dict[str, int]:
    """One row: this process's descriptors, Python and OS threads, locked and resident
    bytes, ``host_used_nbytes`` (the host tier's bytes in use), and the files directly in
    ``swap_dir``: how many, their sizes and their blocks on disk (the journal apart)."""
    entries = [e for e in os.scandir(swap_dir) if e.is_file(follow_symlinks=False)]
    journal = [e for e in entries if e.name.endswith(".journal")]
    files = [e for e in entries if not e.name.endswith(".journal")]
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "os_threads": _status("Threads"),
        "locked_bytes": _status("VmLck"),
        "host_used_bytes": host_used_nbytes,
        "rss_bytes": _status("VmRSS"),
        "swap_files": len(files),
        "swap_file_bytes": sum(e.stat(follow_symlinks=False).st_size for e in files),
        "swap_disk_bytes": sum(e.stat(follow_symlinks=False).st_blocks * 512 for e in files),
        "journal_bytes": sum(e.stat(follow_symlinks=False).st_size for e in journal),
    }


def growth(
    rows: Sequence[dict[str, int]],
    warmup: int,
    *,
    rss_slack_nbytes: int,
    file_slack_nbytes: int = 0,
) -> dict[str, int]:
    """What grew after the warm-up: field → late maximum minus warm-up maximum, for each
    of :data:`FLAT_FIELDS` that grew at all, ``rss_bytes`` if it grew by more than
    ``rss_slack_nbytes``, and the swap files' bytes by more than ``file_slack_nbytes``
    (a data file is never shrunk: first-fit allocation can push its high-water mark up
    by a few blocks now and then as holes fragment, where a leak of one extent a step
    would add an extent a step). The warm-up window is ``rows[warmup:middle]``, the late
    one ``rows[middle:]`` (``middle``: half-way between ``warmup`` and the end). Empty:
    flat.

    Raises:
        ValueError: too few rows after ``warmup`` for two windows.
    """
    middle = (warmup + len(rows)) // 2
    warm, late = rows[warmup:middle], rows[middle:]
    if not warm or not late:
        raise ValueError(f"{len(rows)} rows leave no two windows after a warm-up of {warmup}")
    grew = {}
    slack = {"rss_bytes": rss_slack_nbytes}
    slack |= {"swap_file_bytes": file_slack_nbytes, "swap_disk_bytes": file_slack_nbytes}
    for name in (*FLAT_FIELDS, "rss_bytes"):
        delta = max(r[name] for r in late) - max(r[name] for r in warm)
        if delta > slack.get(name, 0):
            grew[name] = delta
    return grew
