"""Which parameters to read ahead after each fetch, along the recorded fetch order.

Job: given the order in which one training step fetched the parameters (recorded on the
first step; it repeats every step) and each one's size, answer, at every fetch, which keys
to ask the manager to read ahead: those that come next in the order, up to a window of
``window_nbytes`` bytes and ``max_tensors`` tensors (whichever is reached first), wrapping
around into the next step.

Cost: each call is O(log n + keys returned), and over a whole step the keys returned number
at most ``(1 + RETRY) * n`` (plus ``max_tensors`` per repeated use of a key): a key enters
the window once (the *frontier* remembers how far
read-ahead has been asked for), and only the next :data:`RETRY` keys are asked for again
at every fetch (a read-ahead the manager dropped for want of room gets another chance just
before it is needed). The earlier scheme walked the whole window at every fetch, which
without a window meant the whole order: a per-hook cost growing with the model's tensor
count (18.9 x plain PyTorch at 388 tensors, ``tools/hook_overhead.py``).

Positions are *unrolled*: position ``i`` of the next step is ``i + n``, so the window may
run past the end of the order; the cursor (the position of the last fetch) is in
``[0, n)``, the frontier in ``[cursor + 1, cursor + n]``.

:class:`FetchPlan` is what an offloaded model keeps of it: the order being recorded (first
step), then the :class:`ReadAhead` along it, and the manager's own recording (its eviction
order). When every parameter is in the tier it is used from and none has left it since
(``TierManager.departures`` unchanged: budgets that hold everything), there is nothing to
read ahead, and a fetch asks for nothing: no plan walked, no manager call.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from tiers.errors import SwapConfigError

if TYPE_CHECKING:
    from swapper.manager import Tier, TierManager

__all__ = ["DEFAULT_MAX_TENSORS", "RETRY", "FetchPlan", "ManagerRecording", "ReadAhead"]

log = logging.getLogger("swapper.zero.local.offload")

#: Tensors read ahead at most (besides the byte window). Enough to keep a deep model's next
#: few modules in flight; small enough that one fetch never asks for a whole model.
DEFAULT_MAX_TENSORS = 64

#: The next keys asked for again at every fetch (their read-ahead may have been dropped).
RETRY = 2


class ReadAhead:
    """The read-ahead plan of one recorded order (not thread-safe: the caller's lock).

    Args:
        order: keys in fetch order (a key may appear several times: tied weights).
        nbytes: each key's size in bytes.
        window_nbytes: at most this many bytes ahead of the current fetch (``None``: no
            byte bound).
        max_tensors: at most this many positions ahead (>= 0).

    Raises:
        SwapConfigError: ``max_tensors`` is negative, ``window_nbytes`` is negative, or a
            key of ``order`` has no size.
    """

    def __init__(
        self,
        order: Sequence[str],
        nbytes: Mapping[str, int],
        *,
        window_nbytes: int | None,
        max_tensors: int = DEFAULT_MAX_TENSORS,
    ) -> None:
        if max_tensors < 0:
            raise SwapConfigError(f"read-ahead max_tensors={max_tensors} must be >= 0")
        if window_nbytes is not None and window_nbytes < 0:
            raise SwapConfigError(f"read-ahead window_nbytes={window_nbytes} must be >= 0")
        missing = [k for k in order if k not in nbytes]
        if missing:
            raise SwapConfigError(f"read-ahead order names keys without a size: {missing[:5]}")
        self._order = list(order)
        self._window = window_nbytes
        self._max_tensors = max_tensors
        self._positions: dict[str, list[int]] = {}
        for i, key in enumerate(self._order):
            self._positions.setdefault(key, []).append(i)
        n = len(self._order)
        # prefix[j] = bytes of unrolled positions [0, j), over two steps.
        self._prefix = [0]
        for j in range(2 * n):
            self._prefix.append(self._prefix[-1] + nbytes[self._order[j % n]])
        self._cursor = -1
        self._frontier = 0

    @property
    def order(self) -> list[str]:
        """The recorded order (a copy)."""
        return list(self._order)

    def after(self, key: str) -> list[str]:
        """``key`` is being fetched: the keys to read ahead now (distinct, never ``key``),
        nearest first. A key not in the order returns nothing and moves nothing."""
        positions = self._positions.get(key)
        if not positions:
            return []
        n = len(self._order)
        i = bisect.bisect_right(positions, self._cursor)
        cursor = positions[i] if i < len(positions) else positions[0]
        if cursor <= self._cursor:  # a new step: unrolled positions move back by n
            self._frontier -= n
        self._cursor = cursor
        start = cursor + 1
        end = min(start + self._max_tensors, cursor + n)  # never the fetch itself again
        if self._window is not None:
            # The furthest end whose bytes from start fit the window.
            limit = self._prefix[start] + self._window
            end = min(end, bisect.bisect_right(self._prefix, limit, start, end + 1) - 1)
        end = max(end, start)
        frontier = max(self._frontier, start)
        retry_end = min(start + RETRY, end)
        ahead: dict[str, None] = {}
        reached = max(frontier, end)
        for j in (*range(start, retry_end), *range(max(frontier, retry_end), end)):
            next_key = self._order[j % n]
            if next_key != key:
                ahead[next_key] = None
            elif j >= frontier:
                # A later use of the key being fetched (a tied weight): ask for it from the
                # next fetch on, once this one may have released it.
                reached = min(reached, j)
        self._frontier = reached
        return list(ahead)


class ManagerRecording:
    """The manager's recording of one training step's accesses (its Belady eviction
    order: :meth:`~swapper.manager.TierManager.recording`), begun and ended once.

    :meth:`boundary` is called at each step boundary (the first module hook of a
    forward): the first call starts the recording, the first call once ``order_known``
    (the step's own fetch order recorded, so a whole forward and backward and the
    optimizer's step lie between the two calls) ends it, for good. The one-process
    plan (:class:`FetchPlan`) and the N-rank model each own one.
    """

    def __init__(self, manager: TierManager) -> None:
        self._manager = manager
        self._recording: contextlib.AbstractContextManager[None] | None = None
        self.recorded = False  #: ended: set once, never unset (read without a lock)

    @property
    def active(self) -> bool:
        """Whether a recording is under way."""
        return self._recording is not None

    def start(self) -> None:
        """Begin recording (none under way)."""
        self._recording = self._manager.recording()
        self._recording.__enter__()

    def end(self, *, keep: bool = True) -> None:
        """End the recording under way, if any: its order becomes the manager's
        (``keep=False``: dropped, to be started again; ``recorded`` stays False)."""
        recording, self._recording = self._recording, None
        if keep:
            self.recorded = True
        if recording is not None:
            recording.__exit__(None, None, None)

    def boundary(self, order_known: bool) -> None:
        """A step boundary: start the recording (the first), or end it once
        ``order_known`` (class docstring)."""
        if self._recording is None and not self.recorded:
            self.start()
        elif self._recording is not None and order_known:
            self.end()


class FetchPlan:
    """The recorded fetch order of an offloaded model's parameters and the read-ahead
    along it (the callers hold ``lock`` or run on the thread of the forward/backward).

    Args:
        manager: where the parameters live.
        tier: the tier they are fetched into (the use tier).
        window_nbytes: the read-ahead window (``prefetch_window_nbytes``).
        nbytes_of: a parameter key's size in bytes.
        lock: the model's lock (the step boundary may run on several threads).
    """

    def __init__(
        self,
        manager: TierManager,
        tier: Tier,
        window_nbytes: int | None,
        nbytes_of: Callable[[str], int],
        lock: threading.RLock,
    ) -> None:
        self._manager = manager
        self._tier = tier
        self._window = window_nbytes
        self._nbytes_of = nbytes_of
        self._lock = lock
        self.readahead: ReadAhead | None = None  # along the fetch order, once recorded
        self._recording: list[str] | None = []  # being recorded (the first step)
        self._manager_recording = ManagerRecording(manager)  # the eviction order's
        #: an overlapped optimizer's steps started (None: not overlapped), and their
        #: count when the manager's recording began (see :meth:`overlapped`)
        self._steps: int | None = None
        self._steps_at_start = 0
        self._keys: list[str] = []  # the order's distinct keys
        #: ``manager.departures`` when every key was last seen in ``tier`` (None: not)
        self._resident_stamp: int | None = None
        #: the read-ahead of the first step, along the modules' order (see :meth:`guess`)
        self._guess: ReadAhead | None = None

    def guess(self, modules: Sequence[Sequence[str]]) -> None:
        """Before the first step: the keys of each module's parameters, modules in their
        registration order. Until an order is recorded, read ahead along the forward
        these give (the modules in order) and the backward after it (the reverse), so the
        first step does not fetch every parameter on demand (at 2.17 B parameters, 1 GiB
        of device budget: 658 of 873 fetches missed and 34 % of the first forward and
        backward stalled, against 3.5-5.9 % once the recorded order read ahead). Where the
        guess is wrong (a module called out of order, twice, or not at all) it reads
        ahead what is not used next, as a stale window would; the recorded order replaces
        it at the end of the first backward."""
        forward = [key for keys in modules for key in keys]
        if not forward:
            return
        order = forward + forward[::-1]
        with self._lock:
            self._guess = ReadAhead(
                order, {key: self._nbytes_of(key) for key in forward}, window_nbytes=self._window
            )

    def step_boundary(self) -> None:
        """At the first forward, start recording every fetch of the manager; at the first
        forward after a backward, stop: the manager's eviction order then covers a whole
        training step (forward, backward, and the optimizer's fetches of state,
        gradients and parameters), so the step's read-ahead does not evict what it is
        about to use, nor keep what is needed last."""
        if self._manager_recording.recorded:
            return  # (set once, never unset: no lock needed to see it)
        with self._lock:
            if self._steps is not None:
                return  # overlapped: the boundaries are the steps' starts (step_started)
            self._manager_recording.boundary(self.readahead is not None)

    def overlapped(self) -> None:
        """An overlapped optimizer (:mod:`swapper.step.deferred`) steps this model: its updates run
        beside the next forward, so the manager's eviction order is recorded over one whole
        overlapped cycle instead, from the start of the first step's update to the start of the next
        one's (the update interleaved with the forward, then the backward and the next ``step()``'s
        global part). Both ends are marked by ``step()`` in the training's thread before the
        update's thread starts, so the update's first fetch is always inside (ended at the next
        forward's first hook, the recording raced with that fetch: a state was left out of the
        order, ranked as never used again, when the update's thread started a little later).
        Recorded over the first forward and backward as without overlap, the order held none of the
        update's fetches but the first (measured at 2M parameters: 105 parameter fetches and one of
        state, against 254 with the update's state, gradients and parameters): its state and
        gradients ranked as never used again, so they were evicted first (the gradients written to
        NVMe and read back) and no read-ahead of a sub-group found room.

        A recording already under way is dropped (started again at the next step)."""
        with self._lock:
            if self._manager_recording.recorded or self._steps is not None:
                return
            self._steps = 0
            self._manager_recording.end(keep=False)  # (its order is replaced later)

    def step_started(self) -> None:
        """An overlapped optimizer starts a step's update, before its thread does (see
        :meth:`overlapped`)."""
        if self._manager_recording.recorded:
            return
        with self._lock:
            if self._steps is not None:
                self._steps += 1
                self._overlapped_boundary(self._steps)

    def _overlapped_boundary(self, steps: int) -> None:
        """Start or end the recording of an overlapped cycle (lock held)."""
        recording = self._manager_recording
        if recording.recorded:
            return
        if not recording.active:
            if steps >= 1:
                recording.start()
                self._steps_at_start = steps
        elif steps > self._steps_at_start:
            recording.end()

    def fetched(self, key: str) -> None:
        """Record the fetch order (first step), or read ahead along it (later steps)."""
        if self._recording is not None:
            self._recording.append(key)
            guess = self._guess
            if guess is not None:  # the first step: along the modules' order
                ahead = guess.after(key)
                if ahead:
                    self._manager.prefetch(ahead, self._tier)
            return
        readahead = self.readahead
        if readahead is None or self._resident_stamp == self._manager.departures:
            return  # nothing recorded yet, or everything is where it is used
        # At most a window's bytes and DEFAULT_MAX_TENSORS tensors ahead, each key asked
        # for once as it enters the window: a hook's cost does not grow with the model's
        # tensor count.
        ahead = readahead.after(key)
        if ahead:
            self._manager.prefetch(ahead, self._tier)

    def backward_ended(self) -> None:
        """The end of a backward: the first one turns the recording into the plan; each
        one looks whether every parameter is now in the use tier (O(parameters), once per
        step), so that the fetches of the next step can skip the read-ahead."""
        if self._recording is not None and self._recording:
            order, self._recording = self._recording, None
            self._guess = None
            self._keys = list(dict.fromkeys(order))
            self.readahead = ReadAhead(
                order, {key: self._nbytes_of(key) for key in self._keys}, window_nbytes=self._window
            )
            log.info("offload: recorded a fetch order of %d parameters", len(order))
        if self.readahead is not None:
            self._resident_stamp = self._manager.resident_stamp(self._keys, self._tier)
