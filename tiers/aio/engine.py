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
"""

from __future__ import annotations

import collections
import concurrent.futures
import enum
import errno
import itertools
import logging
import operator
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

from tiers.aio._native import IOCB_CMD_PREAD, IOCB_CMD_PWRITE, KernelAio, LibAio, _Provider, ffi
from tiers.config import DIRECT_ALIGNMENT, AioConfig, Backend, check_timeout_s
from tiers.errors import (
    BackendUnavailableError,
    EngineClosedError,
    EngineCloseTimeout,
    InvalidArgumentError,
    SwapEOFError,
    SwapIOError,
)
from tiers.files import SwapFile

log = logging.getLogger("swapper.tiers.aio")

#: How often a worker with requests in flight wakes to look for new work (seconds).
_REAP_POLL_S = 0.02
#: Threads per worker of the thread backend, whatever the queue depth.
_MAX_POOL_THREADS = 64
#: The largest file offset the kernel takes (off_t is a signed 64-bit integer): a
#: request's ``offset + nbytes`` may not exceed it.
OFF_T_MAX = (1 << 63) - 1


class Op(str, enum.Enum):
    READ = "read"
    WRITE = "write"


class IOFuture(concurrent.futures.Future):
    """The outcome of one request: ``result()`` is the byte count transferred.

    A ``concurrent.futures.Future``, so ``asyncio.wrap_future(fut)`` awaits it.
    ``result()`` raises :class:`SwapIOError` (or its subclass :class:`SwapEOFError`) when
    the request failed; the buffer is no longer in use by then either way.
    """

    def __init__(self, op: Op, path: str, offset: int, nbytes: int) -> None:
        super().__init__()
        self.op = op
        self.path = path
        self.offset = offset
        self.nbytes = nbytes

    def describe(self) -> str:
        return f"{self.op.value} of {self.nbytes} bytes at offset {self.offset} of {self.path}"

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<IOFuture {self.describe()} ({state})>"


@dataclass(eq=False)
class _Request:
    op: Op
    file: SwapFile
    owns_file: bool
    future: IOFuture
    memory: _HostMemory | None
    on_done: Any
    pieces_left: int = 0
    error: BaseException | None = None
    completed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def finish_piece(self, error: BaseException | None = None) -> None:
        """Account one piece as finished (well or not); complete the future after the last.

        Never raises: it runs on worker threads, where an exception would strand every
        other request of the worker.
        """
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
            self.pieces_left -= 1
            last = self.pieces_left == 0 and not self.completed
            if last:
                self.completed = True
            extra = self.pieces_left < 0
        if extra:  # a bug elsewhere; the future is complete already, say so and go on
            log.error("a piece of %s was finished twice; ignored", self.future.describe())
        if last:
            self._complete()

    def _complete(self) -> None:
        """Release what the request held and complete its future. Never raises.

        Each step runs whatever the one before did: a future left pending would hang its
        waiter, and a request left outstanding would make close() time out.
        """
        error = self.error
        try:
            self.file.end_request()  # closes the descriptors if the file was closed
            if self.owns_file:
                self.file.close()
        except Exception as exc:
            # close() can report a failed write-back (e.g. NFS); after a read the bytes
            # are in the buffer already.
            if error is None and self.op is Op.WRITE:
                error = _failure(self.future, exc, "closing the file after a write")
            else:
                log.warning("closing %s failed: %s", self.file.path, exc)
        memory, self.memory = self.memory, None
        if memory is not None:
            try:
                memory.release()
            except Exception:
                log.exception("releasing the buffer of %s failed", self.future.describe())
        try:
            self.on_done(self)
        except Exception:
            log.exception("accounting for the end of %s failed", self.future.describe())
        try:
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(self.future.nbytes)
        except Exception:  # InvalidStateError: nothing else completes futures, so a bug
            log.exception("completing the future of %s failed", self.future.describe())


@dataclass(eq=False, slots=True)
class _Piece:
    request: _Request
    address: int
    offset: int
    nbytes: int  # still to transfer
    fd: int = -1
    direct: bool = False
    #: O_DIRECT refused this piece (EINVAL): it goes to the buffered descriptor from now.
    buffered_only: bool = False
    #: ... and the outcome of its buffered retry is still to be told to its file.
    einval_pending: bool = False


# ----------------------------------------------------------------------------------------
# Kernel contexts: one per worker. submit() takes a batch and says how many it accepted,
# from the first; it raises only when it accepted none. reap() returns (piece, res) with
# res the byte count, -errno, or the exception that failed the piece.

_Completion = tuple[_Piece, int | BaseException]


class _NativeContext:
    """A kernel AIO context with ``depth`` iocb slots, reused for every piece."""

    def __init__(self, provider: _Provider, depth: int, *, single_submit: bool) -> None:
        self._provider = provider
        self._depth = depth
        self._single_submit = single_submit
        self._ctx = provider.setup(depth)
        self._iocbs = ffi.new("struct iocb[]", depth)  # zeroed: key, rw_flags, flags stay 0
        self._ptrs = ffi.new("struct iocb *[]", depth)
        self._events = ffi.new("struct io_event[]", depth)
        self._free = list(range(depth))
        self._slots: list[_Piece | None] = [None] * depth

    def submit(self, pieces: list[_Piece]) -> int:
        used: list[int] = []
        n = 0
        try:
            for piece in pieces:
                slot = self._free.pop()
                used.append(slot)
                self._slots[slot] = piece
                cb = self._iocbs[slot]
                cb.aio_data = slot
                op = IOCB_CMD_PREAD if piece.request.op is Op.READ else IOCB_CMD_PWRITE
                cb.aio_lio_opcode = op
                cb.aio_fildes = piece.fd
                cb.aio_buf = piece.address
                cb.aio_nbytes = piece.nbytes
                cb.aio_offset = piece.offset  # OverflowError past int64: checked at submit
                self._ptrs[n] = self._iocbs + slot
                n += 1
        except Exception:
            if n == 0:
                self._release(used)
                raise
            # A piece that cannot be put in an iocb: submit those before it; next round
            # it comes first and fails alone.
        try:
            accepted = self._submit_iocbs(n)
        except BaseException:
            self._release(used)
            raise
        self._release(used[accepted:])
        return accepted

    def _submit_iocbs(self, n: int) -> int:
        """Submit ``self._ptrs[:n]``; returns how many the kernel took.

        Raises:
            OSError: the kernel refused the first one (or anything the provider raised
                for it: a provider that raises has accepted nothing in that call).
        """
        if not self._single_submit:
            return self._provider.submit(self._ctx, n, self._ptrs)
        for i in range(n):  # one per call: nothing for the block layer to plug and merge
            try:
                self._provider.submit(self._ctx, 1, self._ptrs + i)
            except Exception:
                if i == 0:
                    raise
                return i
        return n

    def _release(self, slots: list[int]) -> None:
        for slot in slots:
            self._slots[slot] = None
            self._free.append(slot)

    def reap(self, timeout_s: float) -> list[_Completion]:
        n = self._provider.getevents(self._ctx, 1, self._depth, self._events, timeout_s)
        done: list[_Completion] = []
        for i in range(n):
            event = self._events[i]
            slot = int(event.data)
            piece = self._slots[slot] if 0 <= slot < self._depth else None
            if piece is None:  # not ours: nothing to complete, and no slot to free
                log.error("AIO event for unknown iocb slot %d ignored (res=%d)", slot, event.res)
                continue
            self._slots[slot] = None
            self._free.append(slot)
            done.append((piece, int(event.res)))
        return done

    def close(self) -> None:
        self._provider.destroy(self._ctx)


class _ThreadContext:
    """The portable backend: blocking ``os.preadv``/``os.pwritev`` on a thread pool."""

    def __init__(self, depth: int, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(depth, _MAX_POOL_THREADS), thread_name_prefix=name
        )
        self._done: queue.SimpleQueue[_Completion] = queue.SimpleQueue()

    def submit(self, pieces: list[_Piece]) -> int:
        for i, piece in enumerate(pieces):
            try:
                self._pool.submit(self._run, piece)
            except Exception:
                if i == 0:
                    raise
                return i
        return len(pieces)

    def _run(self, piece: _Piece) -> None:
        res: int | BaseException
        try:
            view = ffi.buffer(ffi.cast("char *", piece.address), piece.nbytes)
            if piece.request.op is Op.READ:
                res = os.preadv(piece.fd, [view], piece.offset)
            else:
                res = os.pwritev(piece.fd, [view], piece.offset)
        except OSError as exc:
            res = -exc.errno if exc.errno else exc
        except BaseException as exc:  # whatever it is, the piece must come back failed
            res = exc
        self._done.put((piece, res))

    def reap(self, timeout_s: float) -> list[_Completion]:
        try:
            done = [self._done.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def close(self) -> None:
        self._pool.shutdown(wait=True)


# ----------------------------------------------------------------------------------------


class _Worker:
    """One thread that keeps up to ``depth`` pieces in flight on its own context."""

    def __init__(self, context: _NativeContext | _ThreadContext, depth: int, name: str) -> None:
        self._context = context
        self._depth = depth
        self._inbox: collections.deque[_Piece] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        #: The error of the last failed reap, until one works again (logged once).
        self._reap_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, pieces: list[_Piece]) -> None:
        with self._cv:
            self._inbox.extend(pieces)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join()
        self._context.close()

    def _run(self) -> None:
        ready: collections.deque[_Piece] = collections.deque()
        inflight = 0
        while True:
            with self._cv:
                if not ready and not inflight:
                    while not self._inbox and not self._stopping:
                        self._cv.wait()
                    if not self._inbox:
                        return  # stopping, and nothing left anywhere
                if self._inbox:
                    ready.extend(self._inbox)
                    self._inbox.clear()
            try:
                inflight += self._submit(ready, self._depth - inflight)
                if inflight:
                    inflight -= self._reap(ready)
            except Exception:  # pragma: no cover - _submit and _reap handle their own
                # Last resort: a worker that died would strand every request it holds.
                log.exception("AIO worker %s: unexpected error; it goes on", self._thread.name)
                time.sleep(_REAP_POLL_S)

    def _submit(self, ready: collections.deque[_Piece], room: int) -> int:
        """Submit up to ``room`` ready pieces; returns how many went in flight.

        A piece the context refuses fails its request; the others stay ready.
        """
        batch: list[_Piece] = []
        while ready and len(batch) < room:
            piece = ready.popleft()
            if piece.request.error is not None:
                piece.request.finish_piece()  # its request failed: do not start more of it
                continue
            _route(piece)
            batch.append(piece)
        if not batch:
            return 0
        try:
            accepted = self._context.submit(batch)
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno == errno.EAGAIN:
                ready.extendleft(reversed(batch))  # kernel busy: retry after a reap
                time.sleep(_REAP_POLL_S / 10)  # nothing may be in flight to reap: back off
                return 0
            # The first piece was refused (bad fd, bad address...). Fail it, keep the rest.
            first = batch[0]
            if not isinstance(exc, OSError):
                log.error("submitting %s failed", first.request.future.describe(), exc_info=exc)
            what = f"submitting the {first.request.op.value}"
            first.request.finish_piece(_failure(first, exc, what))
            ready.extendleft(reversed(batch[1:]))
            return 0
        ready.extendleft(reversed(batch[accepted:]))
        return accepted

    def _reap(self, ready: collections.deque[_Piece]) -> int:
        """Wait a little for completions and handle them; returns how many arrived.

        A failed wait is logged (once until it works again) and retried: the kernel keeps
        the completions, and the buffers of pieces in flight must stay untouched until
        they arrive, so no request can be failed for it.
        """
        try:
            completions = self._context.reap(_REAP_POLL_S)
        except Exception as exc:
            if self._reap_error is None:
                log.error(
                    "AIO worker %s: reaping completions failed; retrying: %r",
                    self._thread.name,
                    exc,
                    exc_info=exc,
                )
            self._reap_error = exc
            time.sleep(_REAP_POLL_S)
            return 0
        if self._reap_error is not None:
            log.warning("AIO worker %s: reaping works again", self._thread.name)
            self._reap_error = None
        for piece, res in completions:
            try:
                self._complete(piece, res, ready)
            except Exception as exc:  # never let one request stop the others
                what = f"completing the {piece.request.op.value}"
                log.error("%s of %s failed", what, piece.request.future.describe(), exc_info=exc)
                piece.request.finish_piece(_failure(piece, exc, what))
        return len(completions)

    def _complete(
        self, piece: _Piece, res: int | BaseException, ready: collections.deque[_Piece]
    ) -> None:
        """Act on one completion: finish the piece, or put it back in ``ready`` to go on.

        Putting it back is the last thing done: if anything here raises, the piece has
        been neither finished nor requeued, and the caller fails it.
        """
        request = piece.request
        op = request.op.value
        if isinstance(res, BaseException):
            request.finish_piece(_failure(piece, res, op))
            return
        if res < 0:
            code = -res
            if code == errno.EINVAL and piece.direct:
                # Retried on the buffered descriptor; how that goes tells whether the file
                # or this request is the cause (see the module's docstring).
                piece.buffered_only = piece.einval_pending = True
                ready.appendleft(piece)
                return
            request.finish_piece(_io_error(piece, code, op))
            return
        if piece.direct and res > 0:
            request.file.direct_worked = True
        elif piece.einval_pending:
            piece.einval_pending = False
            # One reason for reads and writes alike: it is logged once per directory.
            request.file.direct_failed("EINVAL from aligned O_DIRECT I/O that works buffered")
        if res == 0 and piece.nbytes:
            if request.op is Op.READ:
                size = request.file.size()
                request.finish_piece(
                    SwapEOFError(
                        errno.EIO,
                        f"read past end of file: {piece.nbytes} bytes missing at offset "
                        f"{piece.offset} (file is {size} bytes)",
                        str(request.file.path),
                    )
                )
            else:
                request.finish_piece(_io_error(piece, errno.EIO, "write (no progress)"))
        elif res < piece.nbytes:
            # Short transfer: continue from where it stopped, never ignore the rest.
            piece.address += res
            piece.offset += res
            piece.nbytes -= res
            ready.appendleft(piece)
        else:
            request.finish_piece()


def _route(piece: _Piece) -> None:
    """Send a piece to the O_DIRECT descriptor when it is aligned, else the buffered one."""
    direct_fd = piece.request.file.direct_fd
    mask = DIRECT_ALIGNMENT - 1
    aligned = not ((piece.address | piece.offset | piece.nbytes) & mask)
    if direct_fd is not None and aligned and not piece.buffered_only:
        piece.fd, piece.direct = direct_fd, True
    else:
        piece.fd, piece.direct = piece.request.file.fd, False


def _io_error(piece: _Piece, code: int, what: str) -> SwapIOError:
    return SwapIOError(
        code,
        f"{what} of {piece.nbytes} bytes at offset {piece.offset} failed: {os.strerror(code)}",
        str(piece.request.file.path),
    )


def _failure(where: _Piece | IOFuture, exc: BaseException, what: str) -> SwapIOError:
    """``exc``, which failed a piece (or a whole request), as the request's SwapIOError.

    The original is chained as ``__cause__``, without its traceback: a traceback holds the
    worker's frames, whose pieces hold other requests' buffers, for as long as the
    caller keeps the error (the traceback was logged where it was caught).
    """
    if isinstance(exc, SwapIOError):
        return exc
    if isinstance(where, IOFuture):
        nbytes, offset, path = where.nbytes, where.offset, where.path
    else:
        nbytes, offset, path = where.nbytes, where.offset, str(where.request.file.path)
    if isinstance(exc, OSError) and exc.errno:
        code, detail = exc.errno, os.strerror(exc.errno)
    else:
        code, detail = errno.EIO, f"{type(exc).__name__}: {exc}"
    error = SwapIOError(code, f"{what} of {nbytes} bytes at offset {offset} failed: {detail}", path)
    error.__cause__ = exc.with_traceback(None)
    return error


# ----------------------------------------------------------------------------------------
# Backend choice


_auto_choice: tuple[Backend, str] | None = None
_auto_resolved: dict[tuple[type, type], tuple[Backend, _Provider | None, str]] = {}
_auto_lock = threading.Lock()


def _probe(provider_cls: type[_Provider]) -> _Provider:
    provider = provider_cls()
    provider.destroy(provider.setup(1))  # seccomp or a kernel without AIO fails here
    return provider


def probe_backend(backend: Backend) -> tuple[_Provider | None, str]:
    """Check that ``backend`` can run here; returns its provider (None for threads) and why.

    Raises:
        BackendUnavailableError: it cannot; the message says why and what to do.
    """
    if backend is Backend.THREADS:
        return None, "asked for"
    if sys.platform != "linux":
        raise BackendUnavailableError(f"backend {backend.value!r} needs Linux; use 'threads'")
    hints = {
        Backend.LIBAIO: "install libaio (Debian/Ubuntu: apt-get install libaio1), or use "
        "backend 'kernel' or 'threads'",
        Backend.KERNEL: "kernel AIO is blocked or missing here (seccomp, gVisor, "
        "fs.aio-max-nr); use backend 'threads'",
    }
    cls = LibAio if backend is Backend.LIBAIO else KernelAio
    try:
        return _probe(cls), "available"
    except OSError as exc:
        raise BackendUnavailableError(
            f"backend {backend.value!r} unavailable: {exc}; {hints[backend]}"
        ) from exc


def resolve_backend(backend: Backend) -> tuple[Backend, _Provider | None]:
    """Resolve AUTO to the best backend available; log the choice once per process.

    The AUTO probe (creating and destroying a kernel context, ~30 ms) runs once per
    process: the machine's answer does not change while it runs.

    Raises:
        BackendUnavailableError: an explicitly named backend cannot run here.
    """
    if backend is not Backend.AUTO:
        return backend, probe_backend(backend)[0]
    key = (LibAio, KernelAio)  # tests swap these to simulate machines without them
    with _auto_lock:
        cached = _auto_resolved.get(key)
    if cached is None:
        cached = _probe_auto()
        with _auto_lock:
            _auto_resolved[key] = cached
    chosen, provider, why = cached
    _log_auto(chosen, why)
    return chosen, provider


def _probe_auto() -> tuple[Backend, _Provider | None, str]:
    reasons = []
    for candidate in (Backend.LIBAIO, Backend.KERNEL):
        try:
            provider, _ = probe_backend(candidate)
        except BackendUnavailableError as exc:
            reasons.append(str(exc.__cause__ or exc))
            continue
        why = "native Linux AIO" + (f" ({'; '.join(reasons)})" if reasons else "")
        return candidate, provider, why
    return Backend.THREADS, None, "; ".join(reasons)


def _log_auto(backend: Backend, why: str) -> None:
    global _auto_choice
    with _auto_lock:
        if _auto_choice == (backend, why):
            return
        _auto_choice = (backend, why)
    level = logging.INFO if backend is not Backend.THREADS else logging.WARNING
    log.log(level, "aio backend auto -> %s: %s", backend.value, why)


# ----------------------------------------------------------------------------------------


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


def _name_of(file: object) -> str:
    """The file a request names, for messages."""
    if isinstance(file, SwapFile):
        return str(file.path)
    try:
        name = os.fspath(file)  # type: ignore[arg-type]
    except TypeError:
        return repr(file)
    return os.fsdecode(name)


def _byte_count(name: str, value: object, op: Op, target: str) -> int:
    """``value`` as an int (numpy integers too); bools and floats are refused.

    Raises:
        TypeError: not an integer.
    """
    if not isinstance(value, bool):
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise TypeError(
        f"{name} must be an integer number of bytes, got {type(value).__name__} {value!r} "
        f"(a {op.value} of {target})"
    )


def _check_host_buffer(buffer: Any, *, writable: bool) -> int:
    """Byte size of a contiguous host buffer; raise if the engine cannot use it.

    Raises:
        TypeError: not a tensor or buffer object, a tensor not in host memory, or a
            read-only buffer given to a read.
        ValueError: not C-contiguous.
    """
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is imported
    if torch is not None and isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise TypeError(
                f"buffer is on {buffer.device}: the engine moves host memory only; stage "
                "through a host buffer (tiers.buffers) first"
            )
        if not buffer.is_contiguous():
            raise ValueError("buffer tensor is not contiguous; pass tensor.contiguous()")
        return buffer.numel() * buffer.element_size()
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TypeError(
            f"buffer of type {type(buffer).__name__} is neither a tensor nor a buffer object"
        ) from None
    with view:
        if not view.c_contiguous:
            raise ValueError("buffer is not C-contiguous; pass a contiguous copy")
        if writable and view.readonly:
            raise TypeError("cannot read into a read-only buffer")
        return view.nbytes


@dataclass(eq=False)
class _HostMemory:
    """The address of a request's buffer, and what keeps that memory alive until it ends.

    For buffer objects, cffi holds a buffer export on the object itself (not on a
    memoryview of ours): the owner cannot be resized or closed under the kernel, and no
    intermediate memoryview can be torn down by the garbage collector while exported.
    """

    address: int
    owner: Any
    export: Any = None

    @classmethod
    def of(cls, buffer: Any, nbytes: int) -> _HostMemory:
        torch = sys.modules.get("torch")
        if (torch is not None and isinstance(buffer, torch.Tensor)) or nbytes == 0:
            address = buffer.data_ptr() if nbytes else 0
            return cls(address, buffer)
        export = ffi.from_buffer(buffer)
        return cls(int(ffi.cast("uintptr_t", export)), buffer, export)

    def release(self) -> None:
        if self.export is not None:
            ffi.release(self.export)
            self.export = None
        self.owner = None
