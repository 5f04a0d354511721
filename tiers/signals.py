"""Signals held back where a cut would corrupt state, and a test hook at every wait.

Why
---
Python runs a signal's handler in the main thread between two bytecodes; the default
SIGINT handler raises :class:`KeyboardInterrupt` there. Code that hands memory to the
kernel, or changes a tensor's state and then records who owns it, can be cut at any of
those points: a block freed while a read still lands in it, an entry marked in use with no
holder. Rather than guard every line, the swap code runs in *sections* during which the
signals below are recorded, not handled, and delivers them at the places it chose:

* :data:`at_waits` (``with at_waits:``): a recorded signal is delivered at the next
  :func:`wait_point` (every place the code blocks: a condition, a future, a budget, a
  device copy; the code around each is written to be cut there) or when the outermost
  section ends. Ctrl-C still stops a wait within :data:`POLL_S` seconds.
* :data:`held` (``with held:``): delivered only when the outermost section ends, never at a
  wait (a kernel's result and the record that it ran must not be separated).

Sections nest; the signals are delivered in the order they came, by calling the handler
that was installed when they arrived (so a program's own SIGINT/SIGTERM/SIGHUP handlers
still run, only later). Other threads never receive signals: there a section costs one
``threading.get_ident()`` call and waits are not sliced.

How, and what it costs
----------------------
Swapping the handler per section would cost two ``sigaction`` calls (21 µs on the
development VM, more than a whole fetch-and-release hit). Instead the first section
wraps each of SIGINT, SIGTERM and SIGHUP whose handler is a Python callable in
:func:`_relay` (once; again only if a program installs a new handler later). The relay
passes a signal straight to the wrapped handler when no section is open. A section costs
a few attribute updates (~1 µs).

A call that hands the caller something it must give back (a pinned tensor) names its undo
with :func:`undo_if_cut` as the last thing inside its section: when the outermost section
ends by delivering a recorded signal whose handler raises, the undo runs first, with
signals still recorded, so the raise never leaves a pin without a holder.

What no code can close: a signal arriving in the few bytecodes between the end of the
outermost section and the caller storing the returned value (``t = manager.fetch(k)``)
is delivered there, and the value is lost. Callers that keep ownership in their own
records (the step pipeline, the offload hooks) call inside their own ``at_waits`` section
so that the signal waits until the record is made.

Test hook
---------
:func:`wait_point` calls the hook set by :func:`set_wait_hook` (none in production: one
global load and a test) with the wait's name, in whatever thread waits. A test raises
from it to cut the code at the n-th wait deterministically.
"""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = [
    "POLL_S",
    "at_waits",
    "deliver_pending",
    "held",
    "set_wait_hook",
    "undo_if_cut",
    "wait_cond",
    "wait_future",
    "wait_point",
    "wait_progressing",
]

#: Longest a wait in a section of the main thread sleeps before looking for a signal.
POLL_S = 0.05

# signal.getsignal wraps the C function in an int-to-enum conversion that costs ~3 µs a
# call (this runs at every outermost section); the C one, where the interpreter has it.
_getsignal: Callable[[int], Any] = getattr(
    getattr(signal, "_signal", None), "getsignal", signal.getsignal
)

_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)
_SIGINT = signal.SIGINT
_MAIN = threading.main_thread().ident

Handler = Callable[[int, FrameType | None], Any]
WaitHook = Callable[[str], None]


class _State:
    """Main-thread bookkeeping (only the main thread changes it; handlers run there too)."""

    __slots__ = ("depth", "hard", "pending", "undo", "undo_arg", "wrapped")

    def __init__(self) -> None:
        self.depth = 0  # sections open
        self.hard = 0  # of which ``held``
        self.pending: list[int] = []  # signals recorded, in order
        self.wrapped: dict[int, Handler] = {}  # signal → the handler the relay calls
        # ``undo_if_cut``'s undo of the outermost section (a function and its argument,
        # not a closure: no allocation on the fetch path).
        self.undo: Callable[[Any], None] | None = None
        self.undo_arg: Any = None


_state = _State()
_hook: WaitHook | None = None
_get_ident = threading.get_ident


def _relay(signum: int, frame: FrameType | None) -> None:
    """The installed handler: record the signal inside a section, else pass it on (with
    the ending section's undo, see :func:`undo_if_cut`, if it is still set)."""
    state = _state
    if state.depth:
        state.pending.append(signum)
        return
    if state.undo is not None:  # the outermost section's last lines, its result not out
        state.depth = 1
        state.pending.append(signum)
        _leave_delivering(undoable=True)
        return
    handler = state.wrapped.get(signum)
    if handler is not None:
        handler(signum, frame)


def _wrap_handlers() -> None:
    """Put the relay in front of each Python-level handler not yet behind it. Handlers
    that are not Python callables (SIG_DFL, SIG_IGN, or set from C) are left alone: such a
    signal never raises in Python code."""
    for signum in _SIGNALS:
        current = _getsignal(signum)
        if current is _relay or not callable(current):
            continue
        _state.wrapped[signum] = current
        signal.signal(signum, _relay)


def _deliver() -> None:
    """Hand the recorded signals to their handlers (which may raise)."""
    signums, _state.pending = _state.pending, []
    for signum in signums:
        handler = _state.wrapped.get(signum)
        if handler is not None:
            handler(signum, None)


class _Section:
    """``with`` block of :data:`at_waits` or :data:`held` (reentrant; state is global)."""

    __slots__ = ("_hard",)

    def __init__(self, *, hard: bool) -> None:
        self._hard = hard

    def __enter__(self) -> None:
        if _get_ident() != _MAIN:
            return
        state = _state
        # (SIGINT first: SIGTERM and SIGHUP handlers are set once, at a program's start.)
        if not state.depth and _getsignal(_SIGINT) is not _relay:
            _wrap_handlers()
        state.depth += 1
        if self._hard:
            state.hard += 1

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if _get_ident() != _MAIN:
            return
        state = _state
        if self._hard:
            state.hard -= 1
        if state.depth == 1:
            if state.pending:
                # Taken while still inside: a signal arriving now joins the list rather
                # than being handled between the two lines.
                _leave_delivering(undoable=exc_type is None)
                return
            state.depth = 0
            if state.pending:  # recorded between the check above and the line before
                state.depth = 1
                _leave_delivering(undoable=exc_type is None)
                return
            # Until this line a signal reaches the relay with the undo still set.
            state.undo = state.undo_arg = None
            return
        state.depth -= 1

    def __repr__(self) -> str:
        return "held" if self._hard else "at_waits"


def _deliver_last() -> None:
    """Leave the outermost section, handing over what it recorded."""
    signums, _state.pending = _state.pending, []
    _state.depth = 0
    for signum in signums:
        handler = _state.wrapped.get(signum)
        if handler is not None:
            handler(signum, None)


def _leave_delivering(*, undoable: bool) -> None:
    """Leave the outermost section (depth 1, signals pending), handing over what it
    recorded, with its undo if ``undoable`` (no exception is leaving it already)."""
    state = _state
    undo, arg = state.undo, state.undo_arg
    state.undo = state.undo_arg = None
    if undo is not None and undoable:
        _deliver_undoing(undo, arg)
    else:
        _deliver_last()


def _deliver_undoing(undo: Callable[[Any], None], arg: Any) -> None:
    """Leave the outermost section handing over what it recorded; if a handler raises,
    ``undo(arg)`` runs first, still inside (a signal arriving meanwhile is recorded, and
    delivered after it)."""
    try:
        _deliver()
    except BaseException:
        undo(arg)
        raise
    finally:
        if _state.pending:
            _deliver_last()
        else:
            _state.depth = 0


def undo_if_cut(undo: Callable[[Any], None], arg: Any) -> None:
    """Call ``undo(arg)`` if the outermost section open now ends by delivering a recorded
    signal whose handler raises (the value the section's call returns then never reaches
    its caller). Only the outermost section's own call may name one: nested inside
    another section (a caller that keeps its own records), or outside the main thread,
    nothing is recorded. Call it last in the section, after everything that can raise;
    one undo per section (a later call replaces it)."""
    state = _state
    if state.depth == 1 and _get_ident() == _MAIN:
        state.undo, state.undo_arg = undo, arg


#: Signals wait for the next :func:`wait_point` or the end of the outermost section.
at_waits = _Section(hard=False)
#: Signals wait for the end of the outermost section, waits or not.
held = _Section(hard=True)


def _deliverable() -> bool:
    return bool(_state.pending) and not _state.hard and _get_ident() == _MAIN


def deliver_pending() -> None:
    """Deliver a signal recorded in an :data:`at_waits` section now (its handler may
    raise :class:`KeyboardInterrupt`); nothing when none is, inside :data:`held`, or
    outside the main thread."""
    if _state.pending and _deliverable():
        _deliver()


def wait_point(name: str) -> None:
    """Mark a place where the caller is about to block: the test hook runs (and may
    raise), then a recorded signal is delivered (see :func:`deliver_pending`)."""
    hook = _hook
    if hook is not None:
        hook(name)
    if _state.pending and _deliverable():
        _deliver()


def set_wait_hook(hook: WaitHook | None) -> WaitHook | None:
    """Install ``hook(name)``, called at every :func:`wait_point` in every thread (None
    removes it); returns the previous one. For tests."""
    global _hook
    previous, _hook = _hook, hook
    return previous


def _sliced() -> bool:
    """Whether a wait must wake up now and then to look for a recorded signal."""
    return bool(_state.depth) and _get_ident() == _MAIN


def wait_cond(cond: threading.Condition, timeout_s: float | None, name: str) -> bool:
    """``cond.wait(timeout_s)`` (lock held) as a wait point: in a section of the main
    thread it sleeps at most :data:`POLL_S` (a spurious wake-up for the caller, who loops
    on its predicate anyway) and delivers a recorded signal afterwards, the lock held.

    Returns what ``Condition.wait`` returns.
    """
    wait_point(name)
    if not _sliced():
        return cond.wait(timeout_s)
    woken = cond.wait(POLL_S if timeout_s is None else min(timeout_s, POLL_S))
    deliver_pending()
    return woken


def wait_progressing(
    future: concurrent.futures.Future[Any],
    deadline: float,
    progress: Callable[[], float],
    name: str,
    *,
    window_s: float | None = None,
) -> bool:
    """Wait for an I/O request's ``future`` until it is done, or the disk looks stuck:
    ``deadline`` (``time.monotonic()`` seconds) has passed and ``progress()`` (when the
    disk last completed anything, same clock) is more than ``window_s`` old (default:
    ``deadline`` minus now at the call, the time this wait was granted). So a slow disk,
    whose requests keep ending (this one queued behind them), is waited on; a stuck one
    gives up within about ``window_s`` of its last completion. A wait point, as
    :func:`wait_future`. Returns whether ``future`` is done; never raises its exception.
    """
    window = max(0.0, deadline - time.monotonic()) if window_s is None else window_s
    while True:
        if wait_future(future, max(0.0, deadline - time.monotonic()), name):
            return True
        deadline = progress() + window
        if deadline <= time.monotonic():
            return future.done()


def wait_future(future: concurrent.futures.Future[Any], timeout_s: float | None, name: str) -> bool:
    """Wait until ``future`` is done or ``timeout_s`` (None: no limit) has passed, as a
    wait point (see :func:`wait_cond`). Returns whether it is done; never raises its
    exception."""
    wait_point(name)
    if not _sliced():
        concurrent.futures.wait([future], timeout=timeout_s)
        return future.done()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not future.done():
        slice_s = POLL_S
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            slice_s = min(left, POLL_S)
        concurrent.futures.wait([future], timeout=slice_s)
        deliver_pending()
    return True
