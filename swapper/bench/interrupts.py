"""Ctrl-C and SIGTERM as an exception that cleanup code can rely on.

The benchmark creates temporary directories and hands buffers to I/O threads. An
interrupt must unwind through ``finally`` blocks (engine closed first, so the kernel is
done with the buffer; then the buffer; then the files), so both SIGINT and SIGTERM raise
:class:`Interrupted`. A few short sections must not be cut in the middle (a directory
created but not yet registered for removal, a request half handed to the engine):
inside :func:`critical` the signal is held back and raised when the section ends.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _State:
    depth = 0
    pending: int | None = None


_state = _State()
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _handler(signum: int, frame: FrameType | None) -> None:
    if _state.depth:
        _state.pending = signum  # raised when the critical section ends
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise :class:`Interrupted`.

    Only the main thread may set signal handlers; elsewhere this does nothing and the
    defaults apply.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {sig: signal.signal(sig, _handler) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _state.pending = None


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """Hold back an interrupt until the block ends, then raise it."""
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if not _state.depth and _state.pending is not None:
            signum, _state.pending = _state.pending, None
            raise Interrupted(signum)
