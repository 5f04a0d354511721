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

This module holds the buffer class and the allocation policy above; the system calls and
system facts it rests on (mappings, huge pages, mlock, CUDA pinning, smaps) are in
:mod:`tiers.hostmap`. Invariant: a buffer is unpinned and unlocked exactly once, and its
mapping outlives every tensor that views it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading

import torch

from tiers.errors import EngineClosedError
from tiers.hostmap import (
    _LINUX,
    HUGE_PAGE_NBYTES,
    Backing,
    HugeMode,
    _check_flag,
    _check_huge,
    _cuda_available,
    _cuda_register,
    _cuda_unregister,
    _huge_planned,
    _log_once,
    _map_hugetlb,
    _map_pages,
    _map_thp,
    _mlock,
    _munlock,
    _prefault,
    _Region,
    hugepage_bytes_at,
    thp_mode,
)
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


class BufferClosedError(EngineClosedError):
    """A host buffer was used after ``close()``."""


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


def hugepage_bytes(buffer: HostBuffer) -> int:
    """Bytes of ``buffer``'s memory backed by huge pages, per ``/proc/self/smaps``.

    Covers the whole used region (``region_nbytes``). See :func:`hugepage_bytes_at`.

    Raises:
        BufferClosedError: the buffer is closed.
    """
    if buffer.closed:
        raise BufferClosedError("hugepage_bytes() of a closed host buffer")
    return hugepage_bytes_at(buffer.address, buffer.region_nbytes) if buffer.nbytes else 0
