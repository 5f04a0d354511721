"""The asynchronous I/O engine: one future per request, pieces in flight per worker.

Life of a request::

    pread/pwrite (caller's thread)
      │  check buffer, offset and length (refused at once: InvalidArgumentError, TypeError),
      │  open the file if given a path, reserve space (writes)
      │  cut [offset, offset+nbytes) into pieces: block_size boundaries in file space,
      │  plus the 4 KiB boundaries of an unaligned head and tail
      ▼
    pieces → num_threads workers (contiguous runs, so each worker streams sequentially)
      │
      ▼  worker loop, one per thread, own kernel context, ≤ queue_depth in flight
    READY ──submit──▶ IN FLIGHT ──complete──▶ DONE ─┐
      ▲                   │                          │ last piece of the request:
      └──short transfer───┘ (rest resubmitted)      │ future.set_result(nbytes)
      └──EINVAL on O_DIRECT (this piece retried buffered; see "O_DIRECT refused" below)
                          │ error / EOF / an exception anywhere in submit, reap or complete
                          ▼
                       FAILED: the request's pieces not yet submitted are dropped, those
                       in flight are awaited (the kernel may still write the buffer), then
                       future.set_exception(...)

A piece goes to the file's O_DIRECT descriptor when its address, offset and length are
all 4 KiB-aligned, and to the buffered descriptor otherwise, so unaligned requests work
(their aligned body still goes direct when address and offset share a phase); they are
never refused for their alignment.

Bounds, checked at submit: ``0 <= offset`` and ``offset + nbytes <= 2**63 - 1`` (the
kernel's off_t; larger values cannot even be put in an iocb), ``0 <= nbytes <=`` the
buffer's size. ``nbytes == 0`` is a request that succeeds at once with 0 (as
``os.pread(fd, 0, offset)`` does), touching nothing but opening (a write: creating) a
file given by path.

No exception kills a worker. A failure while submitting, reaping or completing one piece
fails that piece's request (``SwapIOError``, the cause chained) and the worker goes on
with the others; a failed reap (no completion lost: the kernel keeps them) is retried.
``close()`` therefore always sees every request end.

O_DIRECT refused: an aligned piece that fails with EINVAL on the O_DIRECT descriptor is
retried on the buffered one. If that works and no O_DIRECT I/O on the file has worked
yet, the file cannot use O_DIRECT and stops trying (that file only, reason logged once);
if O_DIRECT has worked on it before, the cause was that request, and only that piece went
buffered. Other files, and other requests, keep O_DIRECT.

The engine keeps every request's buffer referenced until its future completes; a buffer
must not be resized or freed by the caller before then.

The parts, one module each: :mod:`tiers.aio.requests` (futures, requests, pieces,
submit-time checks, failures), :mod:`tiers.aio.contexts` (the native and thread kernel
contexts), :mod:`tiers.aio.worker` (the worker loop and the O_DIRECT fallback per file),
:mod:`tiers.aio.backend` (backend choice); this module is the facade, :class:`AioEngine`.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
from collections.abc import Iterator
from typing import Any, SupportsIndex

from tiers.aio.backend import probe_backend, resolve_backend
from tiers.aio.contexts import _NativeContext, _ThreadContext
from tiers.aio.requests import (
    OFF_T_MAX,
    IOFuture,
    Op,
    Progress,
    _byte_count,
    _check_host_buffer,
    _HostMemory,
    _name_of,
    _Piece,
    _Request,
)
from tiers.aio.worker import _Worker
from tiers.config import DIRECT_ALIGNMENT, AioConfig, check_timeout_s
from tiers.errors import (
    BackendUnavailableError,
    EngineClosedError,
    EngineCloseTimeout,
    InvalidArgumentError,
    SwapIOError,
)
from tiers.files import SwapFile

__all__ = ["OFF_T_MAX", "AioEngine", "IOFuture", "Op", "probe_backend", "resolve_backend"]


class AioEngine:
    """Reads and writes host buffers from and to files asynchronously.

    ``pread``/``pwrite`` return at once with an :class:`IOFuture` per request. Large
    requests are cut into ``block_size`` pieces, spread over ``num_threads`` workers, each
    keeping at most ``queue_depth`` pieces in flight. Use as a context manager, or call
    :meth:`close`.

    Example::

        with AioEngine(AioConfig(block_size=8 << 20)) as engine:
            engine.pwrite(tensor, "/nvme/swap/x.bin").result()
            engine.pread(tensor, "/nvme/swap/x.bin").result()

    Raises:
        BackendUnavailableError: at construction, when the configured backend cannot run.
    """

    _ids = itertools.count()

    def __init__(self, config: AioConfig | None = None) -> None:
        self.config = config if config is not None else AioConfig()
        self.backend, provider = resolve_backend(self.config.backend)
        engine_id = next(self._ids)
        self._workers: list[_Worker] = []
        try:
            for i in range(self.config.num_threads):
                name = f"swapper-aio-{engine_id}.{i}"
                context: _NativeContext | _ThreadContext
                if provider is None:
                    context = _ThreadContext(self.config.queue_depth, name)
                else:
                    context = _NativeContext(
                        provider, self.config.queue_depth, single_submit=self.config.single_submit
                    )
                self._workers.append(_Worker(context, self.config.queue_depth, name))
        except OSError as exc:
            for worker in self._workers:
                worker.stop()
            raise BackendUnavailableError(
                f"cannot create an AIO context of depth {self.config.queue_depth}: {exc} "
                "(raise /proc/sys/fs/aio-max-nr, or lower queue_depth / num_threads)"
            ) from exc
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._outstanding: set[_Request] = set()
        self._next_worker = 0
        self._closing = False
        self._closed = False
        self._stop_lock = threading.Lock()
        #: When a piece of any request last ended (see :class:`Progress`).
        self.progress = Progress()

    # -- requests ---------------------------------------------------------------------

    def open(
        self, path: str | os.PathLike[str], *, create: bool = False, readonly: bool = False
    ) -> SwapFile:
        """Open a swap file with this engine's direct setting; see :meth:`SwapFile.open`."""
        return SwapFile.open(path, create=create, direct=self.config.direct, readonly=readonly)

    def pread(
        self,
        buffer: Any,
        file: SwapFile | str | os.PathLike[str],
        offset: SupportsIndex = 0,
        nbytes: SupportsIndex | None = None,
    ) -> IOFuture:
        """Read ``nbytes`` (default: the buffer's size) at byte ``offset`` into ``buffer``.

        ``buffer`` is a contiguous CPU tensor, numpy array or writable buffer object.
        ``file`` is an open :class:`SwapFile` or a path (opened for this request only).
        Any offset, length and buffer address work; unaligned ones go through the page
        cache, aligned ones through O_DIRECT where the file allows it. ``nbytes=0``
        completes at once with 0.

        Raises (at once, before anything is queued):
            EngineClosedError: the engine is closed or closing.
            InvalidArgumentError (a ValueError): ``offset < 0``, ``nbytes`` outside
                ``[0, buffer size]``, or ``offset + nbytes > 2**63 - 1`` (the largest
                file offset); the message names the bound and the file.
            TypeError: ``offset``/``nbytes`` not integers, or a buffer that is not usable
                (not a buffer object, not in host memory, read-only for a read).
            ValueError: a buffer that is not contiguous.
            FileNotFoundError, SwapIOError: a path that cannot be opened.
        The future raises :class:`SwapIOError` for a failed read (the cause chained when
        it was not an OS error) and :class:`SwapEOFError` for one past the end of the file.
        """
        return self._submit(Op.READ, buffer, file, offset, nbytes)

    def pwrite(
        self,
        buffer: Any,
        file: SwapFile | str | os.PathLike[str],
        offset: SupportsIndex = 0,
        nbytes: SupportsIndex | None = None,
    ) -> IOFuture:
        """Write ``nbytes`` (default: the buffer's size) of ``buffer`` at byte ``offset``.

        A path is created (mode 0600) if missing. Disk space is reserved before anything
        is queued. Data is durable against a crash only after :func:`os.fsync`; the future
        completes when the kernel has taken the bytes (O_DIRECT: written to the device).

        Raises (at once, before anything is queued):
            EngineClosedError, InvalidArgumentError, TypeError, ValueError: as for
                :meth:`pread`.
            SwapNoSpaceError: the filesystem has no room for ``offset + nbytes`` bytes.
            SwapIOError: a path that cannot be opened or created, or space that cannot
                be reserved (e.g. EFBIG: past the filesystem's largest file).
        The future raises :class:`SwapIOError` for a failed write.
        """
        return self._submit(Op.WRITE, buffer, file, offset, nbytes)

    def _submit(
        self,
        op: Op,
        buffer: Any,
        file: SwapFile | str | os.PathLike[str],
        offset: SupportsIndex,
        nbytes: SupportsIndex | None,
    ) -> IOFuture:
        if self._closing:
            raise EngineClosedError("the AIO engine is closed; no new requests are accepted")
        target = _name_of(file)
        offset = _byte_count("offset", offset, op, target)
        if offset < 0:
            raise InvalidArgumentError(
                f"file offset must be >= 0, got {offset} (a {op.value} of {target})"
            )
        if offset > OFF_T_MAX:
            raise InvalidArgumentError(
                f"file offset {offset} is past the largest one, 2**63 - 1 = {OFF_T_MAX} "
                f"(off_t), for a {op.value} of {target}"
            )
        size = _check_host_buffer(buffer, writable=op is Op.READ)
        if nbytes is None:
            nbytes = size
        else:
            nbytes = _byte_count("nbytes", nbytes, op, target)
            if not 0 <= nbytes <= size:
                raise InvalidArgumentError(
                    f"nbytes={nbytes} does not fit the {size}-byte buffer (a {op.value} of "
                    f"{target}): give 0 <= nbytes <= {size}"
                )
        if offset + nbytes > OFF_T_MAX:
            raise InvalidArgumentError(
                f"offset + nbytes = {offset} + {nbytes} ends past the largest file offset, "
                f"2**63 - 1 = {OFF_T_MAX} (off_t), for a {op.value} of {target}"
            )
        owns_file = not isinstance(file, SwapFile)
        if owns_file:
            is_write = op is Op.WRITE
            swap_file = self.open(file, create=is_write, readonly=not is_write)
        else:
            swap_file = file
        began = False
        try:
            # Refuses a closed file, and keeps its descriptors open until the request
            # ends (a closed number could be reused by another file meanwhile).
            swap_file.begin_request()
            began = True
            if op is Op.WRITE and nbytes:
                swap_file.reserve(offset + nbytes)
            with self._lock:
                if self._closing:
                    raise EngineClosedError(
                        "the AIO engine is closed; no new requests are accepted"
                    )
                # Nothing below raises before the request is queued, so the buffer export
                # taken here is always handed to a request that releases it.
                memory = _HostMemory.of(buffer, size)
                future = IOFuture(op, str(swap_file.path), offset, nbytes)
                # A running future cannot be cancelled: the kernel may already own the buffer.
                future.set_running_or_notify_cancel()
                request = _Request(op, swap_file, owns_file, future, memory, self._request_done)
                request.progress = self.progress
                pieces = list(self._cut(request, memory.address, offset, nbytes))
                request.pieces_left = max(1, len(pieces))
                self._outstanding.add(request)
                start = self._next_worker
                self._next_worker = (start + 1) % len(self._workers)
        except BaseException:
            if began:
                swap_file.end_request()
            if owns_file:
                swap_file.close()
            raise
        if not pieces:
            request.finish_piece()
            return future
        # Contiguous runs per worker keep each worker's stream sequential on disk.
        n_workers = min(len(self._workers), len(pieces))
        queued = 0
        try:
            for i in range(n_workers):
                run = pieces[i * len(pieces) // n_workers : (i + 1) * len(pieces) // n_workers]
                self._workers[(start + i) % len(self._workers)].put(run)
                queued += len(run)
        except BaseException as exc:
            # Interrupted (Ctrl-C) half-way: account for the pieces never queued so the
            # request still completes (with an error) once the queued ones are done.
            interrupted = SwapIOError(
                errno.EINTR, f"request interrupted before it was queued: {exc!r}", future.path
            )
            for _ in range(len(pieces) - queued):
                request.finish_piece(interrupted)
            raise
        return future

    def _cut(self, request: _Request, address: int, offset: int, nbytes: int) -> Iterator[_Piece]:
        """Pieces at block_size boundaries of file space, plus 4 KiB-aligned head and tail cuts."""
        end = offset + nbytes
        block = self.config.block_size
        align = DIRECT_ALIGNMENT
        head_end = min(end, -(-offset // align) * align)
        tail_start = max(offset, end // align * align)
        cuts = {offset, end, head_end, tail_start}
        cuts.update(range(-(-offset // block) * block, end, block))
        points = sorted(c for c in cuts if offset <= c <= end)
        for lo, hi in itertools.pairwise(points):
            yield _Piece(request, address + (lo - offset), lo, hi - lo)

    def _request_done(self, request: _Request) -> None:
        with self._lock:
            self._outstanding.discard(request)
            if not self._outstanding:
                self._idle.notify_all()

    # -- lifecycle --------------------------------------------------------------------

    def pending(self) -> list[IOFuture]:
        """Futures of the requests not yet complete."""
        with self._lock:
            return [r.future for r in self._outstanding]

    def close(self, timeout_s: float | None = None) -> None:
        """Stop accepting requests, wait for those in flight, release the kernel contexts.

        Waits at most ``timeout_s`` seconds (default ``config.close_timeout_s``; 0: not
        at all). Idempotent.

        Raises:
            InvalidArgumentError: ``timeout_s`` is not a finite number >= 0.
            EngineCloseTimeout: requests were still in flight at the deadline; they are
                named, their futures stay pending and the engine stays open for them:
                call ``close()`` again to wait longer.
        """
        if self._closed:
            return
        if timeout_s is None:
            timeout = self.config.close_timeout_s
        elif type(timeout_s) in (int, float) and timeout_s == 0:
            timeout = 0.0  # do not wait: close now if nothing is in flight
        else:
            timeout = check_timeout_s("timeout_s", timeout_s, InvalidArgumentError)
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closing = True
            while self._outstanding:
                left = deadline - time.monotonic()
                if left <= 0:
                    unfinished = sorted(r.future.describe() for r in self._outstanding)
                    raise EngineCloseTimeout(
                        f"{len(unfinished)} request(s) still in flight after {timeout:g}s: "
                        + "; ".join(unfinished[:5])
                        + (" ..." if len(unfinished) > 5 else ""),
                        unfinished,
                    )
                self._idle.wait(left)
        # One thread stops the workers; a concurrent close() waits for it to finish so
        # that no kernel context is destroyed twice.
        with self._stop_lock:
            if not self._closed:
                for worker in self._workers:
                    worker.stop()
                self._closed = True

    def __enter__(self) -> AioEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<AioEngine {self.backend.value} {self.config.describe()} ({state})>"
