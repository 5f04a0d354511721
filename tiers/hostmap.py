"""Host memory as the kernel hands it out: mappings, huge pages, mlock, CUDA pinning.

Job: the system calls and system facts behind :func:`tiers.buffers.allocate` (see that
module's header for the order in which backings are tried and why): anonymous and
hugetlb mappings, transparent huge pages made and prefaulted, ``mlock``/``munlock``
through libc, ``cudaHostRegister``/``cudaHostUnregister`` through torch, and how much of
a range huge pages really back (``/proc/self/smaps``).

Invariants:

* Nothing here raises for a facility that is merely absent (no hugetlb pool, no THP, no
  libc, no CUDA): each answers "not available" with the reason, and the caller decides
  whether that is worth a warning. Real failures (a mapping that cannot be faulted in)
  raise.
* Every CUDA call is guarded and never reached on a machine without CUDA.
* No function here keeps a reference to the memory it maps: the ``_Region`` returned owns
  it, and the buffer class (:mod:`tiers.buffers`) decides when it is unmapped.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
from typing import Any, Literal

import torch

from tiers.config import DIRECT_ALIGNMENT
from tiers.errors import SwapConfigError
from tiers.units import format_size

log = logging.getLogger("swapper.tiers.buffers")

_LINUX = sys.platform.startswith("linux")

#: Buffers start on, and their lengths are multiples of, this many bytes: the O_DIRECT
#: alignment, or the system page size where that is larger (16/64 KiB pages on arm64).
PAGE_NBYTES = max(mmap.PAGESIZE, DIRECT_ALIGNMENT)


def _read_int(path: str, default: int) -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


#: Size of a transparent huge page (the PMD size): 2 MiB on x86-64.
HUGE_PAGE_NBYTES = _read_int("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size", 2 << 20)

#: Linux mmap flag for memory from the hugetlb pool (Python's mmap module lacks it).
_MAP_HUGETLB = 0x40000
#: Linux madvise advice (5.14+): fault in the range writable now; EINVAL where unknown.
_MADV_POPULATE_WRITE = 23
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
#: cudaHostRegisterPortable: pinned for every CUDA context, not only the current device's.
_CUDA_HOST_REGISTER_PORTABLE = 1

Backing = Literal["hugetlb", "thp", "pages"]
HugeMode = bool | Literal["hugetlb", "thp"] | None


# -- logging once ---------------------------------------------------------------------

_logged: set[str] = set()
_logged_lock = threading.Lock()


def _log_once(level: int, key: str, message: str, *args: object) -> None:
    """Log ``message`` the first time ``key`` is seen: a pool of many buffers says it once."""
    with _logged_lock:
        if key in _logged:
            return
        _logged.add(key)
    log.log(level, message, *args)


# -- system facts ---------------------------------------------------------------------


def thp_mode() -> str:
    """The transparent huge page mode: ``"always"``, ``"madvise"``, ``"never"``, or
    ``"unsupported"`` where the kernel has none (or this is not Linux)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unsupported"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unsupported"


def _meminfo() -> dict[str, int]:
    """Selected /proc/meminfo fields: hugetlb page counts and Hugepagesize in bytes."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.startswith("HugePages_") or name == "Hugepagesize":
                    fields = rest.split()
                    value = int(fields[0])
                    out[name] = value * 1024 if fields[1:] == ["kB"] else value
    except (OSError, ValueError, IndexError):
        pass
    return out


def _hugetlb_room(nbytes: int) -> tuple[int, str | None]:
    """(hugetlb page size, None) when ``nbytes`` fits the free reserved pool, else a reason."""
    info = _meminfo()
    page = info.get("Hugepagesize", 0)
    if page <= 0:
        return 0, "the kernel has no hugetlb pages"
    needed = -(-nbytes // page)
    free = info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0)
    if free >= needed:
        return page, None
    # Surplus pages can be made on demand when overcommit is allowed; mmap then tells.
    if _read_int("/proc/sys/vm/nr_overcommit_hugepages", 0) > 0:
        return page, None
    return page, (
        f"{needed} hugetlb pages needed, {max(free, 0)} free "
        f"(reserve more in /proc/sys/vm/nr_hugepages)"
    )


# -- libc -----------------------------------------------------------------------------

_libc_handle: ctypes.CDLL | None = None
_libc_failed = False


def _libc() -> ctypes.CDLL | None:
    global _libc_handle, _libc_failed
    if _libc_handle is None and not _libc_failed:
        try:
            _libc_handle = ctypes.CDLL(None, use_errno=True)
            for name in ("mlock", "munlock"):
                fn = getattr(_libc_handle, name)
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                fn.restype = ctypes.c_int
        except (OSError, AttributeError, TypeError):
            # No C library to bind (Windows) or no mlock in it: locking is unavailable.
            _libc_failed = True
            _libc_handle = None
    return _libc_handle


def _mlock(address: int, nbytes: int) -> None:
    """Lock ``nbytes`` at ``address`` in memory. Raises OSError (EPERM, ENOMEM, ENOSYS...)."""
    libc = _libc()
    if libc is None:
        raise OSError(errno.ENOSYS, "mlock is not available on this platform")
    if libc.mlock(address, nbytes) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mlock: {os.strerror(code)}")


def _munlock(address: int, nbytes: int) -> None:
    """Undo :func:`_mlock`. Raises OSError."""
    libc = _libc()
    if libc is None:
        raise OSError(errno.ENOSYS, "munlock is not available on this platform")
    if libc.munlock(address, nbytes) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"munlock: {os.strerror(code)}")


# -- CUDA (every call guarded: never reached without CUDA) ----------------------------


def _cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # a broken driver install reads as "no CUDA"
        return False


def _cudart() -> Any:
    """torch's CUDA runtime binding (an untyped pybind module, hence Any).

    Raises RuntimeError where torch has none (no CUDA build).
    """
    runtime = torch.cuda.cudart()
    if runtime is None:
        raise RuntimeError("torch.cuda.cudart() is None: this torch has no CUDA runtime")
    return runtime


def _cuda_register(address: int, nbytes: int) -> str | None:
    """Pin host memory with cudaHostRegister; None on success, else the reason it failed."""
    try:
        code = int(_cudart().cudaHostRegister(address, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    except Exception as exc:
        # The runtime binding fails in several ways (no libcudart symbol, CUDA not
        # re-initializable in a forked child, ...); each one just means "not pinned".
        return f"{type(exc).__name__}: {exc}"
    return None if code == 0 else f"cudaHostRegister returned cudaError {code}"


def _cuda_unregister(address: int) -> None:
    try:
        code = int(_cudart().cudaHostUnregister(address))
    except Exception as exc:
        log.warning("cudaHostUnregister(%#x) failed: %s", address, exc)
        return
    if code != 0:
        log.warning("cudaHostUnregister(%#x) returned cudaError %d", address, code)


# -- mappings -------------------------------------------------------------------------


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _Region:
    """One mmap and the aligned range of it a buffer uses."""

    def __init__(self, mm: mmap.mmap, offset: int, length: int, backing: Backing) -> None:
        self.mm = mm
        self.view = memoryview(mm)
        self.offset = offset  # bytes from the start of the mapping to the used range
        self.length = length  # bytes in the used range (>= the buffer's nbytes)
        self.backing: Backing = backing
        # The mapping's base address, read through a short-lived ctypes export.
        anchor = ctypes.c_char.from_buffer(mm)
        self.address = ctypes.addressof(anchor) + offset
        del anchor

    def discard(self) -> None:
        """Unmap, unless a tensor still views it (then its last reference unmaps it)."""
        # Not view.release(): a tensor made from the memoryview holds a reference to it,
        # not a buffer export, so releasing it would let close() unmap under the tensor.
        self.view = None  # type: ignore[assignment]
        with contextlib.suppress(BufferError):
            self.mm.close()


def _anonymous(length: int, extra_flags: int = 0) -> mmap.mmap:
    if not _LINUX:
        # Other platforms: page-aligned anonymous memory is all we ask for.
        return mmap.mmap(-1, length)
    # MAP_PRIVATE, not Python's default MAP_SHARED: shared anonymous memory is shmem,
    # which ignores MADV_HUGEPAGE (it follows shmem_enabled instead).
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | extra_flags
    return mmap.mmap(-1, length, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _map_hugetlb(nbytes: int, *, check_room: bool) -> tuple[_Region | None, str]:
    page, why_not = _hugetlb_room(nbytes)
    if page <= 0 or (check_room and why_not is not None):
        return None, why_not or "no hugetlb pages"
    length = _round_up(nbytes, page)
    try:
        mm = _anonymous(length, _MAP_HUGETLB)
    except OSError as exc:
        return None, f"mmap(MAP_HUGETLB) of {format_size(length)} failed: {exc.strerror}"
    return _Region(mm, 0, length, "hugetlb"), ""


def _map_thp(nbytes: int) -> tuple[_Region | None, str]:
    mode = thp_mode()
    if mode not in ("always", "madvise"):
        return None, f"transparent huge pages are {mode!r} here"
    huge = HUGE_PAGE_NBYTES
    length = _round_up(nbytes, huge)
    try:
        mm = _anonymous(length + huge)
    except OSError as exc:
        return None, f"mmap of {format_size(length + huge)} failed: {exc.strerror}"
    anchor = ctypes.c_char.from_buffer(mm)
    base = ctypes.addressof(anchor)
    del anchor
    offset = (-base) % huge
    try:
        mm.madvise(_MADV_HUGEPAGE, offset, length)
    except (OSError, ValueError) as exc:
        mm.close()
        return None, f"madvise(MADV_HUGEPAGE) failed: {exc}"
    return _Region(mm, offset, length, "thp"), ""


def _map_pages(nbytes: int) -> _Region:
    return _Region(
        _anonymous(_round_up(nbytes, PAGE_NBYTES)), 0, _round_up(nbytes, PAGE_NBYTES), "pages"
    )


def _prefault(region: _Region) -> None:
    """Fault the whole used range in now, writable (this is when huge pages are chosen).

    Raises:
        MemoryError: the kernel could not provide the memory.
    """
    try:
        region.mm.madvise(_MADV_POPULATE_WRITE, region.offset, region.length)
        return
    except OSError as exc:
        if exc.errno in (errno.ENOMEM, errno.EFAULT):
            raise MemoryError(
                f"cannot fault in {format_size(region.length)} of {region.backing} memory: "
                f"{exc.strerror}"
            ) from exc
        # EINVAL: kernel older than 5.14. Fall through to touching.
    except ValueError:
        pass
    # One write per page. Writing zero keeps the (zero-filled) contents the same.
    touch = torch.frombuffer(
        region.view, dtype=torch.uint8, count=region.length, offset=region.offset
    )
    touch[:: mmap.PAGESIZE].zero_()
    del touch


def _huge_planned(huge: HugeMode, nbytes: int) -> tuple[bool, str]:
    """Whether :func:`allocate` will try huge pages for ``nbytes`` under ``huge``; if not, why."""
    if huge is False or nbytes == 0:
        return False, "not asked for"
    if not _LINUX:
        return False, f"huge pages are not supported on {sys.platform}"
    if huge is None and nbytes < HUGE_PAGE_NBYTES:
        # Automatic mode leaves small buffers on plain pages: rounding up to 2 MiB would
        # waste more than it gains.
        return False, f"{nbytes} bytes is less than one huge page"
    thp = thp_mode()
    thp_ok = thp in ("always", "madvise")
    if huge == "thp":
        return thp_ok, f"transparent huge pages are {thp!r} here"
    if huge == "hugetlb":
        return True, ""
    hugetlb_why = _hugetlb_room(nbytes)[1]
    return thp_ok or hugetlb_why is None, f"{hugetlb_why}; transparent huge pages are {thp!r}"


def _check_huge(huge: object) -> HugeMode:
    if huge is None or isinstance(huge, bool) or huge in ("hugetlb", "thp"):
        return huge  # type: ignore[return-value]
    raise SwapConfigError(f"huge={huge!r} must be None (auto), True, False, 'hugetlb' or 'thp'")


def _check_flag(name: str, value: object) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    raise SwapConfigError(f"{name}={value!r} must be None (auto), True or False")


# -- smaps ----------------------------------------------------------------------------

_SMAPS_HUGE_FIELDS = ("AnonHugePages:", "Private_Hugetlb:", "Shared_Hugetlb:")


def hugepage_bytes_at(address: int, nbytes: int) -> int:
    """Bytes of huge pages (THP or hugetlb) backing ``[address, address + nbytes)``.

    Read from ``/proc/self/smaps`` per mapping (VMA): a VMA that only partly overlaps the
    range counts in full, so the result is capped at ``nbytes``. 0 where smaps is not
    readable (not Linux). The file lists VMAs by ascending address and the kernel makes
    each as it is read (walking its page tables), so reading stops at the first VMA past
    the range: ``allocate`` calls this for every THP buffer, and reading the whole file of
    a process holding gigabytes took ~0.2 s a call under load (issue 23's materialisation).
    """
    end = address + nbytes
    total = 0
    overlaps = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0] if line.strip() else ""
                if head and not head.endswith(":"):
                    lo, _, hi = head.partition("-")
                    try:
                        start = int(lo, 16)
                        overlaps = start < end and int(hi, 16) > address
                    except ValueError:
                        overlaps = False
                        continue
                    if start >= end:
                        break  # (ascending: no later VMA overlaps)
                elif overlaps and head in _SMAPS_HUGE_FIELDS:
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return min(total, nbytes)
