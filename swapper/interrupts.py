"""SIGINT, SIGTERM and SIGHUP as an exception that cleanup code can rely on.

The command-line tools create swap stores and temporary directories and hand buffers to
I/O threads. A signal must unwind through their ``finally`` blocks (engines closed first,
so the kernel is done with the buffers; then the buffers; then the files), so each of the
three raises :class:`Interrupted`, once: a second signal while that unwinds is recorded
and ignored (the exit code stays the first one's), so cleanup is never cut halfway.
A few short sections must not be cut in the middle (a directory created but not yet
registered for removal, a request half handed to the engine): inside :func:`critical` the
signal is held back and raised when the section ends.

This module imports nothing but the standard library: :mod:`swapper.console` installs the
handlers before torch is imported.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = [
    "SIGNALS",
    "Interrupted",
    "critical",
    "ignore_further",
    "install",
    "interrupts_raise",
]


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal; ``exit_code`` is 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _State:
    depth = 0  # critical sections open
    pending: int | None = None  # a signal held back by a critical section
    fired: int | None = None  # the signal already raised: the run is unwinding


_state = _State()
SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


def _handler(signum: int, frame: FrameType | None) -> None:
    if _state.fired is not None:
        return  # cleanup is under way: a second signal must not cut it
    if _state.depth:
        if _state.pending is None:
            _state.pending = signum  # raised when the critical section ends
        return
    _state.fired = signum
    raise Interrupted(signum)


def ignore_further() -> None:
    """The run is ending: from here on the three signals are ignored (a late one would
    otherwise kill the interpreter while it exits, with another exit status)."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def install() -> None:
    """Make SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` for the rest of the
    process (main thread only; elsewhere this does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        return
    _state.fired = _state.pending = None
    for sig in SIGNALS:
        signal.signal(sig, _handler)


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted`; the
    previous handlers come back after it. A no-op where :func:`install` has set them for
    the whole process.

    Only the main thread may set signal handlers; elsewhere this does nothing and the
    defaults apply.
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is _handler  # installed for the whole process
    ):
        yield
        return
    previous: dict[int, Any] = {sig: signal.getsignal(sig) for sig in SIGNALS}
    install()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _state.pending = _state.fired = None


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """Hold back an interrupt until the block ends, then raise it."""
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if not _state.depth and _state.pending is not None and _state.fired is None:
            signum, _state.pending = _state.pending, None
            _state.fired = signum
            raise Interrupted(signum)
