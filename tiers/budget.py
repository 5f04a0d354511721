"""Byte budgets with blocking reservation.

A :class:`ByteBudget` caps how many bytes a tier may hold (device memory, pinned host
memory, ...). Callers :meth:`~ByteBudget.reserve` bytes before they allocate and release
the :class:`Reservation` after they free; a reservation that does not fit waits until
enough is released.

Fairness: waiters are served strictly first come, first served. A request is granted only
when it is at the head of the queue and fits, and :meth:`~ByteBudget.try_reserve` fails
while anyone is waiting, even if its bytes would fit. A large request is therefore never
starved by a stream of small ones; the price is head-of-line blocking: small requests
queued behind a large one wait with it, although their bytes might fit now. For a swap
tier this is the right trade: the large request is usually the tensor the training step
needs next, and letting small ones barge past it forever would stall the step.

Life of a reservation::

    reserve(n) ──fits, nobody queued──────────────────────▶ HELD ──release()──▶ RELEASED
        │                                                    ▲  │                (idempotent)
        │ n > limit: BudgetExceededError at once             │  └─shrink(m): returns n - m
        ▼                                                    │
     QUEUED ──head of queue and fits────────────────────────┘
        │
        └──timeout: BudgetTimeout (the queue moves on without it)
"""

from __future__ import annotations

import collections
import threading
import time

from tiers.errors import SwapError
from tiers.signals import wait_cond
from tiers.units import format_size

__all__ = ["BudgetExceededError", "BudgetTimeout", "ByteBudget", "Reservation"]


class BudgetExceededError(SwapError, ValueError):
    """A request is larger than the budget's whole limit: it could never be granted.

    Attributes:
        what: the name of what the bytes are for (a tensor's key).
        nbytes: the size requested, in bytes.
        budget: the budget's name.
        limit_nbytes: the budget's limit, in bytes.
    """

    def __init__(
        self, message: str, *, what: str, nbytes: int, budget: str, limit_nbytes: int
    ) -> None:
        super().__init__(message)
        self.what = what
        self.nbytes = nbytes
        self.budget = budget
        self.limit_nbytes = limit_nbytes


class BudgetTimeout(SwapError, TimeoutError):
    """A reservation did not fit within its timeout.

    Attributes:
        what: the name of what the bytes are for.
        nbytes: the size requested, in bytes.
        budget: the budget's name.
        used_nbytes: bytes reserved by others when the wait gave up.
        timeout_s: the timeout, in seconds.
    """

    def __init__(
        self,
        message: str,
        *,
        what: str,
        nbytes: int,
        budget: str,
        used_nbytes: int,
        timeout_s: float,
    ):
        super().__init__(message)
        self.what = what
        self.nbytes = nbytes
        self.budget = budget
        self.used_nbytes = used_nbytes
        self.timeout_s = timeout_s


class _Ticket:
    """A waiter's place in the queue (compared by identity)."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class ByteBudget:
    """At most ``limit_nbytes`` bytes reserved at any time; ``None`` means unlimited.

    Thread-safe. Waiters are served in arrival order (see the module docstring).
    An unlimited budget never blocks but still counts ``used_nbytes`` and ``peak_nbytes``.

    Raises (constructor):
        ValueError: ``limit_nbytes`` is negative.
        TypeError: ``limit_nbytes`` is not an int or None.
    """

    def __init__(self, name: str, limit_nbytes: int | None) -> None:
        if limit_nbytes is not None:
            _check_nbytes(limit_nbytes, "limit_nbytes")
        self._name = name
        self._limit = limit_nbytes
        self._used = 0
        self._peak = 0
        self._cv = threading.Condition(threading.Lock())
        self._queue: collections.deque[_Ticket] = collections.deque()

    # -- properties -------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The budget's name, used in error messages."""
        return self._name

    @property
    def limit_nbytes(self) -> int | None:
        """The limit in bytes, or None when unlimited."""
        return self._limit

    @property
    def used_nbytes(self) -> int:
        """Bytes currently reserved."""
        return self._used

    @property
    def peak_nbytes(self) -> int:
        """The most bytes reserved at once since construction or :meth:`reset_peak`."""
        return self._peak

    @property
    def available_nbytes(self) -> int | None:
        """Bytes not reserved (None when unlimited). Queued waiters may claim them first."""
        return None if self._limit is None else self._limit - self._used

    @property
    def waiting(self) -> int:
        """How many reservations are queued, waiting for room."""
        with self._cv:
            return len(self._queue)

    def reset_peak(self) -> None:
        """Restart the high-water mark from the bytes reserved now."""
        with self._cv:
            self._peak = self._used

    # -- reserving --------------------------------------------------------------------

    def reserve(self, nbytes: int, *, what: str, timeout_s: float | None = None) -> Reservation:
        """Reserve ``nbytes`` bytes for ``what``, waiting until they fit.

        ``timeout_s`` is in seconds; None waits forever, 0 does not wait at all.

        Raises:
            BudgetExceededError: at once, when ``nbytes`` exceeds the whole limit.
            BudgetTimeout: the bytes did not fit within ``timeout_s``.
            ValueError: ``nbytes`` or ``timeout_s`` is negative.
            TypeError: ``nbytes`` is not an int.
        """
        _check_nbytes(nbytes, "nbytes")
        if timeout_s is not None and not timeout_s >= 0:
            raise ValueError(f"timeout_s must be >= 0 or None, got {timeout_s}")
        self._check_fits_limit(nbytes, what)
        with self._cv:
            if self._grantable_now(nbytes):
                return self._grant(nbytes, what)
            if timeout_s == 0:
                raise self._timeout(nbytes, what, 0.0)
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            ticket = _Ticket(nbytes)
            self._queue.append(ticket)
            try:
                while not (self._queue[0] is ticket and self._fits(nbytes)):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise self._timeout(nbytes, what, timeout_s or 0.0, queued=True)
                    # A wait point: Ctrl-C (or a test) may cut it; the queue is left below.
                    wait_cond(self._cv, left, "budget.reserve")
            finally:
                # Granted, timed out or interrupted: leave the queue either way, and wake the
                # others since the head (or what fits) may have changed.
                self._queue.remove(ticket)
                self._cv.notify_all()
            return self._grant(nbytes, what)

    def try_reserve(self, nbytes: int, *, what: str) -> Reservation | None:
        """Reserve ``nbytes`` bytes if they fit now and nobody is queued; else None.

        Raises:
            BudgetExceededError: ``nbytes`` exceeds the whole limit (it would never fit).
            ValueError, TypeError: ``nbytes`` is negative or not an int.
        """
        _check_nbytes(nbytes, "nbytes")
        self._check_fits_limit(nbytes, what)
        with self._cv:
            if self._grantable_now(nbytes):
                return self._grant(nbytes, what)
            return None

    # -- internals (call with the lock held unless noted) -------------------------------

    def _check_fits_limit(self, nbytes: int, what: str) -> None:
        """Lock-free: the limit never changes."""
        if self._limit is not None and nbytes > self._limit:
            raise BudgetExceededError(
                f"{what} needs {format_size(nbytes)} ({nbytes} bytes) but budget "
                f"{self._name!r} has a limit of {format_size(self._limit)} "
                f"({self._limit} bytes): it can never fit; raise the limit or place "
                f"{what} in another tier",
                what=what,
                nbytes=nbytes,
                budget=self._name,
                limit_nbytes=self._limit,
            )

    def _fits(self, nbytes: int) -> bool:
        return self._limit is None or self._used + nbytes <= self._limit

    def _grantable_now(self, nbytes: int) -> bool:
        # Zero bytes take nothing from anyone, so they never queue.
        return nbytes == 0 or (not self._queue and self._fits(nbytes))

    def _grant(self, nbytes: int, what: str) -> Reservation:
        self._used += nbytes
        self._peak = max(self._peak, self._used)
        return Reservation(self, nbytes, what)

    def _timeout(
        self, nbytes: int, what: str, timeout_s: float, *, queued: bool = False
    ) -> BudgetTimeout:
        limit = "unlimited" if self._limit is None else format_size(self._limit)
        others_waiting = len(self._queue) - (1 if queued else 0)
        return BudgetTimeout(
            f"{what} needs {format_size(nbytes)} ({nbytes} bytes) from budget {self._name!r} "
            f"(limit {limit}, {format_size(self._used)} in use, {others_waiting} others waiting) "
            f"and none came free within {timeout_s:g}s",
            what=what,
            nbytes=nbytes,
            budget=self._name,
            used_nbytes=self._used,
            timeout_s=timeout_s,
        )

    def _give_back(self, nbytes: int) -> None:
        """Return ``nbytes`` (lock not held by the caller)."""
        if nbytes == 0:
            return
        with self._cv:
            self._used -= nbytes
            self._cv.notify_all()

    def __repr__(self) -> str:
        limit = "unlimited" if self._limit is None else format_size(self._limit)
        return (
            f"<ByteBudget {self._name!r} {format_size(self._used)}/{limit} "
            f"peak={format_size(self._peak)} waiting={len(self._queue)}>"
        )


class Reservation:
    """Bytes held in a :class:`ByteBudget` until :meth:`release` (or the ``with`` block ends).

    Attributes:
        budget: the budget the bytes come from.
        what: what the bytes are for.
    """

    def __init__(self, budget: ByteBudget, nbytes: int, what: str) -> None:
        self.budget = budget
        self.what = what
        self._nbytes = nbytes
        self._lock = threading.Lock()
        self._released = False

    @property
    def nbytes(self) -> int:
        """Bytes still held (0 once released)."""
        return self._nbytes

    @property
    def released(self) -> bool:
        """Whether :meth:`release` was called."""
        return self._released

    def release(self) -> None:
        """Give the bytes back to the budget, waking waiters. Idempotent."""
        with self._lock:
            if self._released:
                return
            self._released = True
            nbytes, self._nbytes = self._nbytes, 0
        self.budget._give_back(nbytes)

    def shrink(self, nbytes: int) -> None:
        """Keep only ``nbytes`` bytes of this reservation and give the rest back.

        For callers that reserve an upper bound and learn the real size later.

        Raises:
            ValueError: ``nbytes`` is negative or more than is held, or the reservation
                was released.
            TypeError: ``nbytes`` is not an int.
        """
        _check_nbytes(nbytes, "nbytes")
        with self._lock:
            if self._released:
                raise ValueError(f"reservation for {self.what} was released; cannot shrink it")
            if nbytes > self._nbytes:
                raise ValueError(
                    f"cannot shrink the reservation for {self.what} from {self._nbytes} "
                    f"to {nbytes} bytes: shrink only makes it smaller"
                )
            freed, self._nbytes = self._nbytes - nbytes, nbytes
        self.budget._give_back(freed)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else format_size(self._nbytes)
        return f"<Reservation {self.what} {state} of {self.budget.name!r}>"


def _check_nbytes(nbytes: int, name: str) -> None:
    # bool is an int subclass but a size of True is certainly a mistake.
    if not isinstance(nbytes, int) or isinstance(nbytes, bool):
        raise TypeError(f"{name} must be an int number of bytes, got {type(nbytes).__name__}")
    if nbytes < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {nbytes}")
