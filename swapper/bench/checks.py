"""Whether ``swapper-bench``'s arguments can work here, checked before any file is made.

Each check raises :class:`~swapper.cli_args.UsageError` (exit 2) with a message that
names the flag at fault and what to do.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from swapper.cli_args import UsageError, check_dirs
from tiers.aio import resolve_backend
from tiers.config import Backend
from tiers.errors import BackendUnavailableError
from tiers.units import format_size

__all__ = [
    "check_backends",
    "check_dirs",
    "check_free_space",
    "check_memory",
    "default_sweep_backends",
    "filesystem_type",
]


def check_free_space(dirs: Sequence[Path], file_nbytes: int) -> None:
    """Each directory must have room for its file.

    Raises:
        UsageError: one has not.
    """
    for d in dirs:
        free_nbytes = shutil.disk_usage(d).free
        if free_nbytes < file_nbytes:
            raise UsageError(
                f"--dir {d}: {format_size(free_nbytes)} free, the test file needs "
                f"{format_size(file_nbytes)}; use a smaller --size"
            )


def _meminfo_nbytes() -> dict[str, int]:
    """/proc/meminfo in bytes (page counts such as HugePages_Free stay counts)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    scale = 1024 if len(fields) > 1 and fields[1] == "kB" else 1
                    out[name] = int(fields[0]) * scale
    except OSError:
        pass
    return out


def check_memory(total_nbytes: int) -> None:
    """The host buffer must fit in memory: a buffer that is prefaulted beyond what is
    available would bring the OOM killer instead of an error message.

    Free reserved huge pages count too (they are not part of MemAvailable). Machines
    without /proc/meminfo are let through.

    Raises:
        UsageError: it does not fit.
    """
    info = _meminfo_nbytes()
    if "MemAvailable" not in info:
        return
    huge_free = info.get("HugePages_Free", 0) * info.get("Hugepagesize", 0)
    room = max(int(info["MemAvailable"] * 0.9), huge_free)
    if total_nbytes > room:
        raise UsageError(
            f"--size {format_size(total_nbytes)} needs a host buffer that large, but only "
            f"about {format_size(room)} of memory is available; use a smaller --size"
        )


def filesystem_type(path: Path) -> str:
    """The filesystem type of ``path`` from /proc/self/mountinfo ("?" if unknown)."""
    best_mount, best_type = "", "?"
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return best_type
    target = str(path)
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = fields[4].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best_mount):
            best_mount, best_type = mount, right.split()[0]
    return best_type


def check_backends(backends: Sequence[Backend]) -> list[Backend]:
    """Resolve AUTO and check each backend can run here; duplicates dropped.

    Raises:
        UsageError: a named backend is unavailable.
    """
    out: list[Backend] = []
    for b in backends:
        try:
            resolved = resolve_backend(b)[0]
        except BackendUnavailableError as exc:
            raise UsageError(str(exc)) from None
        if resolved not in out:
            out.append(resolved)
    return out


def default_sweep_backends() -> list[Backend]:
    """Native AIO (libaio, else kernel) where available, and the thread backend."""
    native = resolve_backend(Backend.AUTO)[0]
    return [native, Backend.THREADS] if native is not Backend.THREADS else [Backend.THREADS]
