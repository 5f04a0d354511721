"""Requests and their pieces: the futures, the submit-time checks, the failure messages.

Job: what one ``pread``/``pwrite`` is (:class:`IOFuture` for the caller, ``_Request`` for
the engine, cut into ``_Piece`` s for the workers), the checks a request passes before
anything is queued (buffer, offset, length: refused at once with InvalidArgumentError or
TypeError), and how any failure becomes that request's :class:`SwapIOError`.

Invariants:

* A request keeps its buffer referenced (``_HostMemory``) until its future completes: a
  buffer with I/O in flight is never freed or reused.
* A request's future is completed exactly once, after its last piece ends (in flight
  pieces are awaited even when another piece failed: the kernel may still write them).
* A failure fails only that request's future (``_failure`` / ``_io_error``), never the
  worker or another request.
"""

from __future__ import annotations

import concurrent.futures
import enum
import errno
import logging
import operator
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tiers.aio._native import ffi
from tiers.errors import SwapIOError
from tiers.files import SwapFile

log = logging.getLogger("swapper.tiers.aio")


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


class Progress:
    """When an engine last saw a piece of any of its requests end, in ``time.monotonic()``
    seconds (its creation until then): how a waiter tells a slow disk, whose requests
    keep ending, from a stuck one, where none does (``tiers.signals.wait_progressing``)."""

    __slots__ = ("last_s",)

    def __init__(self) -> None:
        self.last_s = time.monotonic()

    def mark(self) -> None:
        self.last_s = time.monotonic()  # one float store: atomic under the GIL


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
    progress: Progress | None = None  # the engine's, marked as each piece ends

    def finish_piece(self, error: BaseException | None = None) -> None:
        """Account one piece as finished (well or not); complete the future after the last.

        Never raises: it runs on worker threads, where an exception would strand every
        other request of the worker.
        """
        if self.progress is not None:
            self.progress.mark()
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
