"""The watchdog: an eviction whose write never completes fails its future at the deadline.

Why
---
A write to NVMe that the disk never completes (a stuck device, a hung network block
layer) would leave every waiter of its eviction's future (the optimizer step's
write-behind, a caller's ``evict(k).result()``) blocked for good. The request itself
cannot be cancelled: the kernel may still read its buffer, so the entry stays WRITING
and its memory stays allocated until the completion arrives (rule 1 of
:mod:`swapper.manager.mover`). What can end is the *wait*: at the eviction's deadline
(``ManagerConfig.timeout_s`` after the call) the watchdog fails the future with
:class:`~tiers.errors.IOTimeoutError` naming the file and offset of the piece still in
flight. The completion, if it ever comes, then settles the entry as usual and finds the
future already resolved.

How
---
One daemon thread per manager, started at the first watched write, sleeping until the
earliest deadline (a heap; writes that completed are dropped when they come up, or
when the heap has doubled since the last sweep). :meth:`Watchdog.close` stops it
(``TierManager.close``).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from concurrent.futures import Future, InvalidStateError

from tiers.nvme.futures import StoreFuture

__all__ = ["Watchdog", "resolve_once"]

#: Watched writes held before the ended ones are dropped (then twice those left).
_PRUNE_MIN = 1024


def resolve_once(future: Future[None], error: BaseException | None) -> None:
    """Resolve ``future`` unless it is already (by the watchdog, or the completion)."""
    if future.done():
        return
    try:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
    except InvalidStateError:  # the other side won the race: its outcome stands
        pass


class Watchdog:
    """Fails watched futures whose write is still in flight at their deadline."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, float, Future[None], StoreFuture, str]] = []
        self._order = itertools.count()  # ties: first come, first judged
        self._thread: threading.Thread | None = None
        self._closed = False
        self._prune_at = _PRUNE_MIN

    def watch(
        self, future: Future[None], io: StoreFuture, *, start: float, deadline: float, setting: str
    ) -> None:
        """Fail ``future`` with ``io``'s :class:`~tiers.errors.IOTimeoutError` at
        ``deadline`` (``time.monotonic()`` seconds) if ``io`` has not completed by then;
        ``start``: when the wait began; ``setting``: the timeout's name, for the message."""
        with self._cond:
            if self._closed:
                return
            if len(self._heap) >= self._prune_at:
                # Writes end long before their deadlines: drop the ended ones now and then,
                # so that the heap holds about what is in flight (amortized O(1) a write).
                self._heap = [item for item in self._heap if not item[4].done()]
                heapq.heapify(self._heap)
                self._prune_at = max(_PRUNE_MIN, 2 * len(self._heap))
            heapq.heappush(self._heap, (deadline, next(self._order), start, future, io, setting))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"swapper-watchdog-{self._name}", daemon=True
                )
                self._thread.start()
            elif self._heap[0][0] == deadline:
                self._cond.notify()  # an earlier deadline than the one slept for

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        break
                    self._cond.wait(self._heap[0][0] - now if self._heap else None)
                if self._closed:
                    return
                _, _, start, future, io, setting = heapq.heappop(self._heap)
            if not io.done() and not future.done():
                resolve_once(future, io.timed_out(time.monotonic() - start, setting))

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (watched futures not yet due are left to their writes)."""
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
