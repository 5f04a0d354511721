"""The device tier: accelerator memory under a byte budget, copied on a side stream.

With CUDA, blocks are CUDA tensors from torch's caching allocator and :meth:`DeviceTier.copy`
runs on the tier's own stream, so transfers overlap the caller's kernels:

    caller's stream ──(side stream waits for it: the bytes to copy are final)──┐
                                                                             ▼
    side stream:  dst.copy_(src, non_blocking=True) ── event recorded ─▶ DeviceCopy
                                                                             │
    DeviceCopy.wait(): the host waits for the event (then the source may be freed and
    the destination read on any stream); DeviceCopy.done() polls it.

Host memory on the other side should be pinned (:mod:`tiers.host` pins its arenas when
CUDA is present) or the copy is synchronous. Every CUDA tensor a copy touches is marked
with ``record_stream`` so the caching allocator does not hand its memory out again before
the side stream is done with it.

Without CUDA (or with ``device="cpu"``), CPU tensors under the same kind of byte budget
stand in for device memory and copies are plain synchronous ``copy_`` calls: the swap
logic above runs unchanged, which is how the CPU-only tests exercise it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from tiers.blocks import TierBlock
from tiers.budget import ByteBudget, Reservation
from tiers.errors import SwapConfigError
from tiers.units import format_size

__all__ = ["DeviceBlock", "DeviceCopy", "DeviceTier", "resolve_device"]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device a tier uses: ``None`` means CUDA when available, else the CPU stand-in.

    Raises:
        SwapConfigError: the name is not a device, or names CUDA where there is none, or a
            device type other than ``cuda`` and ``cpu``.
    """
    if device is None:
        return torch.device("cuda" if _cuda_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise SwapConfigError(f"device={device!r} is not a torch device: {exc}") from None
    if resolved.type == "cuda" and not _cuda_available():
        raise SwapConfigError(
            f"device={device!r}: CUDA is not available here; use None (auto) or 'cpu'"
        )
    if resolved.type not in ("cuda", "cpu"):
        raise SwapConfigError(f"device={device!r}: only 'cuda' and 'cpu' (stand-in) are supported")
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # a broken driver install reads as "no CUDA"
        return False


class DeviceCopy:
    """One copy between device and host memory; :meth:`wait` until the bytes have arrived.

    Without CUDA the copy has already happened when this is returned.
    """

    def __init__(self, event: torch.cuda.Event | None) -> None:
        self._event = event

    def done(self) -> bool:
        """Whether the copy has finished (never blocks)."""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Block the calling thread until the copy has finished."""
        if self._event is not None:
            self._event.synchronize()


class DeviceBlock(TierBlock):
    """``nbytes`` bytes of device memory held from a :class:`DeviceTier` until :meth:`release`.

    Attributes:
        nbytes: the size, in bytes.
        charged_nbytes: what the tier's budget counts for it (``nbytes``).
    """

    _released_message = "device block was released"

    def __init__(
        self,
        tensor: torch.Tensor,
        reservation: Reservation,
        side_stream: Callable[[], torch.cuda.Stream] | None = None,
    ) -> None:
        self._tensor: torch.Tensor | None = tensor
        self._reservation = reservation
        self._side_stream = side_stream
        self._lock = threading.Lock()
        self.nbytes = tensor.numel()
        self.charged_nbytes = reservation.nbytes

    def release(self, after: torch.cuda.Event | None = None) -> None:
        """Drop the memory (back to torch's caching allocator) and the budget's bytes.

        Idempotent. Copies still running on the side stream keep the memory, through
        ``record_stream``, until they finish. ``after`` (from :meth:`DeviceTier.mark_ready`)
        is the end of a user's work on the block on some other stream: the allocator
        then hands the memory out again only once that work is done too.
        """
        with self._lock:
            tensor, self._tensor = self._tensor, None
        if tensor is None:
            return
        if after is not None and self._side_stream is not None and tensor.is_cuda:
            # The allocator reuses a block once every stream recorded on it has passed the
            # point of the free; the side stream passes it only after ``after``.
            stream = self._side_stream()
            stream.wait_event(after)
            tensor.record_stream(stream)
        del tensor
        self._reservation.release()

    def __repr__(self) -> str:
        state = "released" if self._tensor is None else "held"
        return f"<DeviceBlock {format_size(self.nbytes)} ({state})>"


class DeviceTier:
    """Accelerator memory (or its CPU stand-in) under a byte budget. Thread-safe.

    Args:
        limit_nbytes: the budget, in bytes (``None``: unlimited).
        device: see :func:`resolve_device`.
        name: the budget's name, used in error messages.

    Attributes:
        device: the resolved device.
        is_cuda: whether blocks are CUDA memory (False: the CPU stand-in).
        budget: the :class:`~tiers.budget.ByteBudget`.

    Raises:
        SwapConfigError: a bad limit or device.
    """

    def __init__(
        self,
        limit_nbytes: int | None,
        *,
        device: str | torch.device | None = None,
        name: str = "device",
    ) -> None:
        if limit_nbytes is not None and (
            isinstance(limit_nbytes, bool) or not isinstance(limit_nbytes, int) or limit_nbytes < 0
        ):
            raise SwapConfigError(f"limit_nbytes={limit_nbytes!r} must be an int >= 0 or None")
        self.device = resolve_device(device)
        self.is_cuda = self.device.type == "cuda"
        self.budget = ByteBudget(name, limit_nbytes)
        # Made on first copy, not here: constructing stays free of CUDA calls.
        self._stream: torch.cuda.Stream | None = None
        self._stream_lock = threading.Lock()

    def charge(self, nbytes: int) -> int:
        """Bytes the budget counts for a block of ``nbytes`` bytes."""
        return nbytes

    def try_alloc(self, nbytes: int, *, what: str) -> DeviceBlock | None:
        """A block of ``nbytes`` bytes if the budget has room now, else None at once.

        Raises:
            BudgetExceededError: ``nbytes`` exceeds the whole limit.
            torch.OutOfMemoryError: the device itself is out of memory (the budget is
                larger than what is free on it).
        """
        reservation = self.budget.try_reserve(nbytes, what=what)
        return None if reservation is None else self._make(nbytes, reservation)

    def alloc(self, nbytes: int, *, what: str, timeout_s: float | None = None) -> DeviceBlock:
        """A block of ``nbytes`` bytes, waiting up to ``timeout_s`` seconds for room.

        Raises:
            BudgetExceededError: at once, when ``nbytes`` exceeds the whole limit.
            BudgetTimeout: no room came free within ``timeout_s``.
            torch.OutOfMemoryError: as for :meth:`try_alloc`.
        """
        reservation = self.budget.reserve(nbytes, what=what, timeout_s=timeout_s)
        return self._make(nbytes, reservation)

    def _make(self, nbytes: int, reservation: Reservation) -> DeviceBlock:
        try:
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except BaseException:
            reservation.release()
            raise
        return DeviceBlock(tensor, reservation, self._side_stream if self.is_cuda else None)

    def mark_ready(self) -> torch.cuda.Event | None:
        """An event after everything queued so far on the calling thread's current stream
        (None without CUDA): pass it as ``after`` to a later :meth:`copy` made from another
        thread, whose own current stream knows nothing of this one's kernels."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()  # typed as the cuda Event the copies wait on
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(
        self, dst: torch.Tensor, src: torch.Tensor, *, after: torch.cuda.Event | None = None
    ) -> DeviceCopy:
        """Copy ``src`` into ``dst`` (same shape and dtype; one on this device, or both).

        With CUDA the copy is queued on the side stream after everything queued so far on
        the caller's current stream, and after the event ``after`` (from
        :meth:`mark_ready`); :meth:`DeviceCopy.wait` before reading ``dst`` on the host or
        freeing ``src``. Without CUDA it is done when this returns.

        Raises:
            RuntimeError: shapes or dtypes differ (from ``torch.Tensor.copy_``).
        """
        if not self.is_cuda:
            dst.copy_(src)
            return DeviceCopy(None)
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        for tensor in (dst, src):
            if tensor.is_cuda:
                tensor.record_stream(stream)
        return DeviceCopy(event)

    def _side_stream(self) -> torch.cuda.Stream:
        with self._stream_lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            return self._stream

    def close(self) -> None:
        """Wait for copies still on the side stream. Idempotent; blocks stay usable."""
        stream = self._stream
        if stream is not None:
            stream.synchronize()

    def __enter__(self) -> DeviceTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<DeviceTier {self.device} {self.budget!r}>"
