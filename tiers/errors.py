"""Typed errors raised by the tiers layer.

Every error that reaches a user names what it concerns (file, offset, setting) and, where
one exists, what to do about it. ``swapper`` re-exports these.
"""

from __future__ import annotations


class SwapError(Exception):
    """Base class of every error swapper raises on purpose."""


class SwapConfigError(SwapError, ValueError):
    """A setting has a value that cannot work; the message names the setting and the fix."""


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


class BackendUnavailableError(SwapError, RuntimeError):
    """The asked-for I/O backend cannot run here; the message says why."""


class BufferPoolTimeout(SwapError, TimeoutError):
    """No buffer slot became free within the timeout."""
