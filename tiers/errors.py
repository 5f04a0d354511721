"""Typed errors raised by the tiers layer.

Every error that reaches a user names what it concerns (file, offset, setting) and, where
one exists, what to do about it. ``swapper`` re-exports these.
"""

from __future__ import annotations


class SwapError(Exception):
    """Base class of every error swapper raises on purpose."""


class SwapConfigError(SwapError, ValueError):
    """A setting has a value that cannot work; the message names the setting and the fix."""


class UnsafeSwapDirError(SwapConfigError):
    """A swap directory another user could tamper with: owned by someone else, or
    writable by group or others. The message names the directory, its owner and mode,
    and what to do; ``path``, ``owner_uid`` and ``mode`` hold them."""

    def __init__(self, message: str, path: str, owner_uid: int, mode: int) -> None:
        super().__init__(message)
        self.path = path
        self.owner_uid = owner_uid
        self.mode = mode


class InvalidArgumentError(SwapError, ValueError):
    """An argument of a call cannot work: a file offset or length outside what the
    request, its buffer or a file can hold, or a timeout that is not a finite positive
    number of seconds. Raised at once, before anything is queued; the message names the
    argument, the bound and the file."""


class SwapIOError(SwapError, OSError):
    """An I/O request failed. ``errno``, ``strerror`` and ``filename`` are set as for OSError."""


class SwapEOFError(SwapIOError):
    """A read reached the end of the file before the requested bytes were read."""


class SwapNoSpaceError(SwapIOError):
    """Space for a swap file could not be reserved (ENOSPC); nothing was written."""


class EngineClosedError(SwapError, RuntimeError):
    """A request was made on an engine that is closed or closing."""


class EngineCloseTimeout(SwapError, TimeoutError):
    """``close()`` gave up waiting; ``unfinished`` lists the requests still in flight.

    Their buffers stay referenced by the engine and their futures stay pending: call
    ``close()`` again to keep waiting.
    """

    def __init__(self, message: str, unfinished: list[str]) -> None:
        super().__init__(message)
        self.unfinished = unfinished


class IOTimeoutError(SwapError, TimeoutError):
    """A request to a swap file did not complete within the configured timeout: the disk
    (or a layer under it) is stuck. The request is still in flight: its buffer stays
    owned by it, never freed or reused, until the kernel completes it, and the tensor's
    state settles then. Unset attributes are None.

    Attributes:
        op: "read" or "write".
        key: the tensor's key.
        path: the data file of the first piece still in flight (None: every piece is
            done, and the write waits for the flush that makes it durable).
        offset: that piece's byte offset in ``path``.
        nbytes: that piece's length in bytes.
        waited_s: seconds waited before giving up.
    """

    def __init__(
        self,
        message: str,
        *,
        op: str,
        key: str,
        waited_s: float,
        path: str | None = None,
        offset: int | None = None,
        nbytes: int | None = None,
    ) -> None:
        super().__init__(message)
        self.op = op
        self.key = key
        self.path = path
        self.offset = offset
        self.nbytes = nbytes
        self.waited_s = waited_s


class BackendUnavailableError(SwapError, RuntimeError):
    """The asked-for I/O backend cannot run here; the message says why."""


# -- NVMe store: integrity and ownership ----------------------------------------------------


class SwapCorruptionError(SwapError):
    """Bytes read back from a swap file are not the bytes written there.

    Raised by a read's future when a chunk's XXH3-64 digest differs from the one recorded
    when it was written: the file was changed or damaged on disk. The tensor stays stored
    (every later read fails the same way) so the caller can decide: delete it and write it
    again from another copy, or give up. Unset attributes are None.

    Attributes:
        key: the tensor's key.
        path: the data file.
        offset: byte offset of the damaged chunk in ``path``.
        nbytes: the chunk's length in bytes.
        expected: the digest recorded at write time.
        actual: the digest of the bytes read now.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str,
        expected: int,
        actual: int,
        path: str | None = None,
        offset: int | None = None,
        nbytes: int | None = None,
    ) -> None:
        super().__init__(message)
        self.key = key
        self.path = path
        self.offset = offset
        self.nbytes = nbytes
        self.expected = expected
        self.actual = actual


class StoreLockedError(SwapError, RuntimeError):
    """Another open store (in this or another live process) holds the swap directory.

    Attributes:
        directory: the swap directory whose lock is held.
        pid: the holder's process id as it wrote it in the lock file, or None if unknown.
    """

    def __init__(self, message: str, *, directory: str, pid: int | None) -> None:
        super().__init__(message)
        self.directory = directory
        self.pid = pid
