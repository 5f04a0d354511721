"""SIGINT, SIGTERM and SIGHUP as an exception that cleanup code can rely on.

The command-line tools create swap stores and temporary directories and hand buffers to
I/O threads. A signal must unwind through their ``finally`` blocks (engines closed first,
so the kernel is done with the buffers; then the buffers; then the files), so each of the
three raises :class:`Interrupted`, and the tool exits with 128 + the signal number.

The states while the handlers are in (:func:`install` for the whole process, or
:func:`interrupts_raise` for a block; main thread only)::

    RUNNING ──signal──▶ raise Interrupted ─────────────────────────────────▶ STOPPING
      │  in critical():  HELD, raised when the outermost critical() ends ──▶ STOPPING
      │  in a spot that would swallow the exception (a C extension module being
      │  imported: torch's calls numpy's import and clears any error; a __del__
      │  or weakref finalizer: "Exception ignored"): HELD, the signal is sent to
      │  the main thread again every 20 ms until the spot is left, then raised
      │  in nothing_to_undo() with the handlers in for the whole process (a tool
      │  importing torch before it has made anything): the process ends at once,
      │  one line on stderr, exit code 128 + the signal number
    STOPPING ──a later signal, or the watchdog's (1 s after the raise, then every
      │         0.5 s)──▶ an Interrupted is being handled (an except/finally/__exit__
      │                   of the cleanup is running): ignored, the cleanup runs on, the
      │                   exit code stays the first signal's;
      │                   none is (some code caught and dropped it): raised again
      ▼ the tool's top level caught it (settle())
    SETTLED ──any signal──▶ ignored
    leaving interrupts_raise(): the watchdog stops, the previous handlers come back

SIGKILL (and SIGQUIT, left alone) still stop a tool at once. The one cleanup the watchdog
would cut is one that runs outside every except/finally/__exit__ of the Interrupted (code
that stores the exception, cleans up, then raises it) for more than a second; none of
swapper's does. Inside the swap code's own sections (:mod:`tiers.signals`, which puts its
relay in front of these handlers) a signal is recorded there first and reaches
:func:`_handler` at the next wait point or when the section ends.

This module imports nothing but the standard library: :mod:`swapper.console` installs the
handlers before torch is imported.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = [
    "SIGNALS",
    "Interrupted",
    "critical",
    "fired",
    "ignore_further",
    "install",
    "interrupts_raise",
    "nothing_to_undo",
    "settle",
]

#: The signals that stop a tool cleanly.
SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)
#: How often a HELD signal is sent again to see whether the spot has been left.
RESEND_HELD_S = 0.02
#: When the watchdog first checks that the Interrupted is still being handled, then how often.
WATCHDOG_FIRST_S = 1.0
WATCHDOG_EVERY_S = 0.5


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
    pending: int | None = None  # HELD: a signal not raised yet
    fired: int | None = None  # STOPPING: the signal raised
    settled = False  # SETTLED, or handlers on their way out: ignore everything
    stop: threading.Event | None = None  # ends the resending thread of these handlers
    resender: threading.Thread | None = None
    whole_process = False  # install() set the handlers for the rest of the process
    exit_prog: str | None = None  # in nothing_to_undo(): the tool whose line is printed


_state = _State()


def _handler(signum: int, frame: FrameType | None) -> None:
    if _state.settled:
        return
    if _state.fired is not None:
        if _handling_interrupted():
            return  # the cleanup is under way: it must not be cut
        raise Interrupted(_state.fired)  # caught and dropped on the way: again
    if _state.pending is not None:
        signum = _state.pending  # HELD: the first signal decides, whichever comes again
    if _state.exit_prog is not None:
        _exit_at_once(_state.exit_prog, signum)
    if _state.depth:
        _state.pending = signum  # raised when the critical section ends
        return
    if _would_swallow(frame):
        _state.pending = signum
        _start_resending()
        return
    _state.pending = None
    _raise(signum)


def _raise(signum: int) -> None:
    _state.fired = signum
    _start_resending()  # from now on: the watchdog
    raise Interrupted(signum)


def _exit_at_once(prog: str, signum: int) -> None:
    """End the process now: the line, then ``os._exit`` (no exception unwinds through
    whatever C++ code is on the stack)."""
    with contextlib.suppress(Exception):  # closed, a broken pipe, or a print cut by us
        sys.stdout.flush()
    line = f"{prog}: interrupted ({signal.Signals(signum).name})\n"
    with contextlib.suppress(OSError):  # not sys.stderr: the signal may have cut its write
        os.write(2, line.encode())
    os._exit(128 + signum)


def _handling_interrupted() -> bool:
    """Whether an Interrupted is the exception being handled, or in its context chain."""
    exc: BaseException | None = sys.exc_info()[1]
    for _ in range(100):  # a context chain can loop
        if exc is None:
            return False
        if isinstance(exc, Interrupted):
            return True
        exc = exc.__context__
    return False


def _would_swallow(frame: FrameType | None) -> bool:
    """Whether an exception raised at ``frame`` would be dropped by a caller: a C
    extension's initialisation (it may clear errors of what it imports), a ``__del__`` or
    a weakref finalizer (their exceptions are printed and ignored)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or code.co_filename.endswith("weakref.py"):
            return True
        if code.co_name in ("create_module", "exec_module") and isinstance(
            frame.f_locals.get("self"), importlib.machinery.ExtensionFileLoader
        ):
            return True
        frame = frame.f_back
    return False


def _start_resending() -> None:
    """One thread per installation sends the signal to the main thread again: while HELD
    (has the spot been left?), and while STOPPING (the watchdog: is the Interrupted still
    being handled?)."""
    if (_state.resender is not None and _state.resender.is_alive()) or _state.stop is None:
        return
    _state.resender = threading.Thread(
        target=_resend,
        args=(_state.stop, threading.main_thread().ident),
        name="swapper-interrupts",
        daemon=True,
    )
    _state.resender.start()


def _resend(stop: threading.Event, main_ident: int | None) -> None:
    watched = False
    while main_ident is not None:
        if _state.fired is None:
            wait = RESEND_HELD_S
        else:
            wait = WATCHDOG_EVERY_S if watched else WATCHDOG_FIRST_S
            watched = True
        if stop.wait(wait) or _state.settled:
            return
        signum = _state.fired if _state.fired is not None else _state.pending
        if signum is None:  # taken by a critical section, which raises it itself
            return
        signal.pthread_kill(main_ident, signum)


def fired() -> int | None:
    """The signal that stopped the run, once one has raised :class:`Interrupted` (``None``
    before, and again after :func:`interrupts_raise` ends)."""
    return _state.fired


def settle() -> None:
    """The tool's top level has caught the :class:`Interrupted`: later signals (and the
    watchdog) are ignored until the handlers are reset."""
    _state.settled = True


def ignore_further() -> None:
    """The run is ending: from here on the three signals are ignored (a late one would
    otherwise kill the interpreter while it exits, with another exit status)."""
    if threading.current_thread() is threading.main_thread():
        _state.settled = True
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def install() -> None:
    """Make SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` for the rest of the
    process (main thread only; elsewhere this does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        return
    _install()
    _state.whole_process = True


def _install() -> None:
    _reset(armed=True)
    for sig in SIGNALS:
        signal.signal(sig, _handler)


def _reset(*, armed: bool) -> None:
    """Back to RUNNING, the resending thread of the last installation gone; ``armed``:
    a new one may start."""
    if _state.stop is not None:
        _state.settled = True  # a signal the resender sends meanwhile is ignored
        _state.stop.set()
        if _state.resender is not None:
            _state.resender.join()
    _state.depth = 0
    _state.pending = _state.fired = None
    _state.whole_process = False
    _state.exit_prog = None
    _state.settled = False
    _state.stop = threading.Event() if armed else None
    _state.resender = None


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
    _install()
    try:
        yield
    finally:
        _reset(armed=False)  # the resender is gone before the previous handlers are back
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
            _raise(signum)


@contextlib.contextmanager
def nothing_to_undo(prog: str) -> Iterator[None]:
    """Within the block a signal ends the process at once: the line ``{prog}: interrupted
    (SIGNAME)`` on stderr, exit code 128 + the signal number, no exception raised.

    For a tool importing torch before it has made anything a cleanup must undo. torch's
    C++ initialisers call back into Python, and an :class:`Interrupted` raised from there
    cannot unwind through them: ``torch._C._c10d_init`` (run by ``import
    torch.distributed``) turns it into a C++ exception that ends the process with
    ``std::terminate`` (SIGABRT, exit status -6). Holding the signal until the import
    ends would keep the tool running for seconds after it.

    Only where :func:`install` set the handlers for the whole process (the console entry
    points, whose process is the tool's own). Elsewhere (a tool's ``main`` called in
    another program, where ending the process is not the tool's to do) the block is a
    :func:`critical` section: the signal is held until it ends, then raised.
    """
    if not _state.whole_process or threading.current_thread() is not threading.main_thread():
        with critical():
            yield
        return
    previous, _state.exit_prog = _state.exit_prog, prog
    try:
        yield
    finally:
        _state.exit_prog = previous
