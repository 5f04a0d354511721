"""Page-aligned host buffers with physically contiguous backing.

Why the layout matters
----------------------
An O_DIRECT request is handed to the device as a list of physical segments. Memory from
``malloc`` is scattered page by page, so a 1 MiB request into it needs 256 segments of
4 KiB; a virtio-blk disk allowing 254 splits it in two and the halves never merge again,
which halves read throughput on the development VMs (see MACHINE.md). A buffer made of
2 MiB huge pages needs one segment per 2 MiB, keeps requests whole and lets neighbours
merge. So :func:`allocate` asks, in order, for:

1. ``hugetlb``: ``mmap(MAP_HUGETLB)`` from the reserved pool (``/proc/sys/vm/nr_hugepages``),
   tried only where enough reserved pages are free. Size rounded up to the huge page size.
2. ``thp``: transparent huge pages. Map ``size + 2 MiB`` of private anonymous memory, use
   the 2 MiB-aligned sub-range (the kernel can only back an aligned 2 MiB range with a
   huge page), ``madvise(MADV_HUGEPAGE)`` it and prefault it at once with
   ``MADV_POPULATE_WRITE`` (or one write per page where the kernel lacks it): huge pages
   are allocated at first touch, and touching now, not inside the first I/O, is what
   makes them huge and keeps the fault cost out of the I/O path. The up to 2 MiB of
   slack around the aligned range is virtual address space only; it is never touched.
3. ``pages``: plain page-aligned anonymous memory, not prefaulted (like ``malloc``).

Then, where permitted, ``mlock`` (no swapping out, pages stay put) and, where CUDA is
available, ``cudaHostRegister`` (pinned, so host-device copies can be asynchronous).
Every step falls back quietly under the automatic settings (``None``) and with a warning
when the caller asked for it explicitly (``True``). What was obtained is reported on the
buffer (``backing``, ``locked``, ``pinned``); :func:`hugepage_bytes` reads
``/proc/self/smaps`` to tell how much of a buffer huge pages really back.

Lifetime
--------
The memory is a Python :class:`mmap.mmap`; tensors are made with :func:`torch.frombuffer`
over a ``memoryview`` of it, and every tensor (and every view of a tensor) keeps that
memoryview, hence the mapping, alive. :meth:`HostBuffer.close` unpins and unlocks at once
and unmaps at once when no tensor views the memory any more; otherwise the mapping stays
valid and is unmapped when the last tensor viewing it is garbage-collected. Using a view
after ``close()`` therefore never crashes, but the memory is no longer pinned or locked:
drop views (and finish transfers from them) before closing. Nothing is done in
``__del__``: a buffer that is never closed is unmapped with its last reference, but a
pinned one stays registered with CUDA until the process ends, so close pinned buffers.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import math
import mmap
import os
import sys
import threading
from typing import Any, Literal

import torch

from tiers.config import DIRECT_ALIGNMENT
from tiers.errors import EngineClosedError, SwapConfigError
from tiers.units import format_size

log = logging.getLogger("swapper.tiers.buffers")

__all__ = [
    "HUGE_PAGE_NBYTES",
    "Backing",
    "BufferClosedError",
    "HostBuffer",
    "HugeMode",
    "allocate",
    "hugepage_bytes",
    "thp_mode",
]

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


class BufferClosedError(EngineClosedError):
    """A host buffer was used after ``close()``."""


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


# -- buffers --------------------------------------------------------------------------


def allocate(
    nbytes: int,
    *,
    huge: HugeMode = None,
    lock: bool | None = None,
    pin: bool | None = None,
) -> HostBuffer:
    """Allocate ``nbytes`` of page-aligned host memory, as contiguous as the system allows.

    Args:
        nbytes: size in bytes; 0 gives an empty buffer (``address`` 0, nothing mapped).
        huge: ``None`` (auto): for ``nbytes >= 2 MiB``, hugetlb pages if enough are
            reserved, else transparent huge pages, else plain pages, quietly. ``True``:
            the same for any size, warning when no huge pages were obtained. ``"hugetlb"``
            or ``"thp"``: only that kind, else plain pages with a warning. ``False``:
            plain pages, not prefaulted (like ``malloc``).
        lock: ``None`` (auto): ``mlock`` where permitted, quietly not otherwise.
            ``True``: the same but warn when refused. ``False``: do not lock.
        pin: ``None`` (auto): ``cudaHostRegister`` when ``torch.cuda.is_available()``.
            ``True``: the same but warn when not possible. ``False``: do not pin.

    Huge-page backings round the memory used up to a multiple of the huge page size
    (at most 2 MiB more, prefaulted); ``tensor`` is still exactly ``nbytes`` long.

    Raises:
        TypeError: ``nbytes`` is not an int.
        ValueError: ``nbytes`` is negative.
        SwapConfigError: ``huge``, ``lock`` or ``pin`` has a value other than those above.
        MemoryError: the memory cannot be mapped or faulted in.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise TypeError(f"nbytes must be an int (bytes), got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes} must be >= 0")
    huge = _check_huge(huge)
    lock = _check_flag("lock", lock)
    pin = _check_flag("pin", pin)
    if nbytes == 0:
        return HostBuffer(None, 0)

    region: _Region | None = None
    reasons: list[str] = []
    planned, not_planned_why = _huge_planned(huge, nbytes)
    if planned:
        if huge in (None, True, "hugetlb"):
            # Auto mode skips the syscall when /proc/meminfo says the pool is short.
            region, why = _map_hugetlb(nbytes, check_room=huge is None)
            if region is None:
                reasons.append(why)
        if region is None and huge in (None, True, "thp"):
            region, why = _map_thp(nbytes)
            if region is None:
                reasons.append(why)
    elif huge in (True, "hugetlb", "thp"):
        reasons.append(not_planned_why)
    if region is None:
        try:
            region = _map_pages(nbytes)
        except OSError as exc:
            raise MemoryError(f"cannot map {format_size(nbytes)}: {exc.strerror}") from exc
        if huge not in (None, False):
            _log_once(
                logging.WARNING,
                f"huge:{reasons}",
                "huge=%r: no huge pages for a %s buffer, using plain pages (%s)",
                huge,
                format_size(nbytes),
                "; ".join(reasons),
            )
        elif reasons:
            _log_once(logging.DEBUG, f"huge:{reasons}", "no huge pages: %s", "; ".join(reasons))

    try:
        if region.backing != "pages":
            _prefault(region)
            if region.backing == "thp" and _LINUX:
                got = hugepage_bytes_at(region.address, region.length)
                if got == 0:
                    # madvise was taken but the kernel had no free 2 MiB blocks.
                    _log_once(
                        logging.DEBUG if huge is None else logging.WARNING,
                        f"thp:none:{huge}",
                        "MADV_HUGEPAGE region got no transparent huge pages "
                        "(memory fragmented?); it is backed by plain pages",
                    )
                    region.backing = "pages"
        locked = lock is not False and _try_lock(region, warn=lock is True)
    except BaseException:
        region.discard()
        raise
    buffer = HostBuffer(region, nbytes)
    buffer.locked = locked
    if pin is True or (pin is None and _cuda_available()):
        buffer._pin(warn=pin is True)
    return buffer


def _try_lock(region: _Region, *, warn: bool) -> bool:
    try:
        _mlock(region.address, region.length)
    except OSError as exc:
        # Partial locks are possible on some errors; unlocking an unlocked range is harmless.
        with contextlib.suppress(OSError):
            _munlock(region.address, region.length)
        _log_once(
            logging.WARNING if warn else logging.DEBUG,
            f"mlock:{exc.errno}",
            "mlock of %s refused (%s); buffers stay unlocked (raise RLIMIT_MEMLOCK, "
            "`ulimit -l`, or grant CAP_IPC_LOCK)",
            format_size(region.length),
            exc.strerror or exc,
        )
        return False
    return True


class HostBuffer:
    """One anonymous memory mapping and a ``torch.uint8`` tensor over it.

    Make with :func:`allocate`; release with :meth:`close` or ``with``.

    Attributes:
        tensor: ``torch.uint8``, exactly ``nbytes`` long, CPU, contiguous, page-aligned.
        nbytes: the size asked for, in bytes.
        address: ``tensor.data_ptr()``; a multiple of 4096 (of 2 MiB for huge backings),
            0 for an empty buffer.
        backing: ``"hugetlb"``, ``"thp"`` or ``"pages"``: what was obtained.
        region_nbytes: bytes mapped, locked and pinned from ``address`` on: ``nbytes``
            rounded up to the page or huge page size.
        locked: ``mlock`` succeeded (False again after close).
        pinned: ``cudaHostRegister`` succeeded (False again after close).
    """

    def __init__(self, region: _Region | None, nbytes: int) -> None:
        self._region = region
        self.nbytes = nbytes
        self.backing: Backing = region.backing if region is not None else "pages"
        self.region_nbytes = region.length if region is not None else 0
        self.locked = False
        self.pinned = False
        self._closed = False
        self._lock = threading.Lock()
        if region is None:
            self._tensor: torch.Tensor | None = torch.empty(0, dtype=torch.uint8)
            self.address = 0
        else:
            # frombuffer over the memoryview, not the mmap: the tensor then holds the
            # memoryview, whose buffer export keeps mmap.close() from unmapping under it.
            self._tensor = torch.frombuffer(
                region.view, dtype=torch.uint8, count=nbytes, offset=region.offset
            )
            self.address = self._tensor.data_ptr()

    @property
    def tensor(self) -> torch.Tensor:
        """The whole buffer as ``torch.uint8``.

        Raises:
            BufferClosedError: the buffer is closed.
        """
        tensor = self._tensor
        if tensor is None:
            raise BufferClosedError(f"host buffer of {format_size(self.nbytes)} is closed")
        return tensor

    @property
    def closed(self) -> bool:
        return self._closed

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A ``dtype`` tensor over the first bytes of the buffer (shares its memory).

        Args:
            dtype: element type.
            shape: the view's shape; ``None`` gives a 1-D view of as many whole elements
                as fit in ``nbytes``.

        Raises:
            TypeError: ``dtype`` is not a ``torch.dtype`` or ``shape`` is not a tuple of ints.
            ValueError: a dimension is negative, or the view needs more than ``nbytes``.
            BufferClosedError: the buffer is closed.
        """
        return _typed_view(self.tensor, dtype, shape, f"host buffer of {self.nbytes} bytes")

    def _pin(self, *, warn: bool) -> None:
        why = "CUDA is not available" if not _cuda_available() else None
        if why is None and self._region is not None:
            why = _cuda_register(self._region.address, self._region.length)
        if why is None:
            self.pinned = True
            return
        _log_once(
            logging.WARNING if warn else logging.DEBUG,
            f"pin:{why}",
            "cannot pin a %s host buffer (%s); host-device copies from it will be synchronous",
            format_size(self.nbytes),
            why,
        )

    def close(self) -> None:
        """Unpin, unlock and drop the memory. Idempotent; never raises.

        The mapping is unmapped now if no tensor views it, else when the last tensor
        viewing it is garbage-collected (views stay valid, but unpinned and unlocked).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        region = self._region
        self._region = None
        self._tensor = None
        if region is None:
            return
        if self.pinned:
            _cuda_unregister(region.address)
            self.pinned = False
        if self.locked:
            try:
                _munlock(region.address, region.length)
            except OSError as exc:
                log.debug("munlock of %s failed: %s", format_size(region.length), exc)
            self.locked = False
        view, mm = region.view, region.mm
        region.view = None  # type: ignore[assignment]
        del region
        del view  # our reference; tensors still alive keep the memoryview (and mapping)
        try:
            mm.close()
        except BufferError:
            log.debug(
                "host buffer of %s closed while tensors still view it: unmapped when they go",
                format_size(self.nbytes),
            )

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"at {self.address:#x}"
        flags = "".join((" locked" if self.locked else "", " pinned" if self.pinned else ""))
        return f"<HostBuffer {format_size(self.nbytes)} {self.backing}{flags} {state}>"


def _typed_view(
    tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | None, what: str
) -> torch.Tensor:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    itemsize = dtype.itemsize
    nbytes = tensor.numel()
    if shape is None:
        dims: tuple[int, ...] = (nbytes // itemsize,)
    else:
        if isinstance(shape, int) or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in shape
        ):
            raise TypeError(f"shape must be a tuple of ints, got {shape!r}")
        dims = tuple(shape)
        if any(d < 0 for d in dims):
            raise ValueError(f"shape {dims} has a negative dimension")
    need = math.prod(dims) * itemsize
    if need > nbytes:
        raise ValueError(
            f"a {dtype} view of shape {dims} needs {need} bytes; the {what} holds {nbytes}"
        )
    return tensor[:need].view(dtype).view(dims)


# -- smaps ----------------------------------------------------------------------------

_SMAPS_HUGE_FIELDS = ("AnonHugePages:", "Private_Hugetlb:", "Shared_Hugetlb:")


def hugepage_bytes_at(address: int, nbytes: int) -> int:
    """Bytes of huge pages (THP or hugetlb) backing ``[address, address + nbytes)``.

    Read from ``/proc/self/smaps`` per mapping (VMA): a VMA that only partly overlaps the
    range counts in full, so the result is capped at ``nbytes``. 0 where smaps is not
    readable (not Linux). Costs a few milliseconds: for tests and tools, not hot paths.
    """
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return 0
    end = address + nbytes
    total = 0
    overlaps = False
    for line in text.splitlines():
        head = line.split(None, 1)[0] if line else ""
        if head and not head.endswith(":"):
            lo, _, hi = head.partition("-")
            try:
                overlaps = int(lo, 16) < end and int(hi, 16) > address
            except ValueError:
                overlaps = False
        elif overlaps and head in _SMAPS_HUGE_FIELDS:
            total += int(line.split()[1]) * 1024
    return min(total, nbytes)


def hugepage_bytes(buffer: HostBuffer) -> int:
    """Bytes of ``buffer``'s memory backed by huge pages, per ``/proc/self/smaps``.

    Covers the whole used region (``region_nbytes``). See :func:`hugepage_bytes_at`.

    Raises:
        BufferClosedError: the buffer is closed.
    """
    if buffer.closed:
        raise BufferClosedError("hugepage_bytes() of a closed host buffer")
    return hugepage_bytes_at(buffer.address, buffer.region_nbytes) if buffer.nbytes else 0
