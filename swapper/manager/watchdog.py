"""The watchdog: an eviction whose write never completes fails its future; a slow one does not.

Why
---
A write to NVMe that the disk never completes (a stuck device, a hung network block
layer) would leave every waiter of its eviction's future (the optimizer step's
write-behind, a caller's ``evict(k).result()``) blocked for good. The request itself
cannot be cancelled: the kernel may still read its buffer, so the entry stays WRITING
and its memory stays allocated until the completion arrives (rule 1 of
:mod:`swapper.manager.mover`). What can end is the *wait*: the watchdog fails the future
with :class:`~tiers.errors.IOTimeoutError` naming the file and offset of the piece still
in flight. The completion, if it ever comes, then settles the entry as usual and finds
the future already resolved.

Stuck, not slow: a write queued behind many others on a slow disk can take longer than
``ManagerConfig.timeout_s`` without anything being wrong, and failing it would fail a
training step for nothing. So at the eviction's deadline (``timeout_s`` after the call)
the watchdog asks the store when the disk last completed anything
(``NvmeStore.last_progress_s``): within the last ``timeout_s``, the disk is moving and the
deadline moves to that completion plus ``timeout_s``; only a disk that completed nothing
for ``timeout_s`` fails the future. (A request stuck alone while the disk keeps completing
others fails once the others stop: a waiter's own pipeline stops issuing while it waits.)

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
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError

from tiers.nvme.futures import StoreFuture

__all__ = ["Watchdog", "resolve_once"]

#: Watched writes held before the ended ones are dropped (then twice those left).
_PRUNE_MIN = 1024

#: (deadline, order, start, window, future, the write, the setting's name, progress or None)
_Watched = tuple[
    float, int, float, float, Future[None], StoreFuture, str, Callable[[], float] | None
]


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
        self._heap: list[_Watched] = []
        self._order = itertools.count()  # ties: first come, first judged
        self._thread: threading.Thread | None = None
        self._closed = False
        self._prune_at = _PRUNE_MIN

    def watch(
        self,
        future: Future[None],
        io: StoreFuture,
        *,
        start: float,
        deadline: float,
        setting: str,
        progress: Callable[[], float] | None = None,
    ) -> None:
        """Fail ``future`` with ``io``'s :class:`~tiers.errors.IOTimeoutError` at
        ``deadline`` (``time.monotonic()`` seconds) if ``io`` has not completed by then
        and, given ``progress`` (when the disk last completed anything, same clock), the
        disk completed nothing in the last ``deadline - start`` seconds (else the deadline
        moves on: see the module docstring); ``start``: when the wait began; ``setting``:
        the timeout's name, for the message."""
        with self._cond:
            if self._closed:
                return
            if len(self._heap) >= self._prune_at:
                # Writes end long before their deadlines: drop the ended ones now and then,
                # so that the heap holds about what is in flight (amortized O(1) a write).
                self._heap = [item for item in self._heap if not item[5].done()]
                heapq.heapify(self._heap)
                self._prune_at = max(_PRUNE_MIN, 2 * len(self._heap))
            window = deadline - start
            item = (deadline, next(self._order), start, window, future, io, setting, progress)
            heapq.heappush(self._heap, item)
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
                item = heapq.heappop(self._heap)
                _, order, start, window, future, io, setting, progress = item
                if not io.done() and not future.done() and progress is not None:
                    later = progress() + window
                    if later > time.monotonic():  # the disk is moving: judge it again then
                        item = (later, order, start, window, future, io, setting, progress)
                        heapq.heappush(self._heap, item)
                        continue
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
