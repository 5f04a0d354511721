"""Tests of tiers.budget: limits, blocking, fairness, timeouts, and random concurrent use."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiers.budget import BudgetExceededError, BudgetTimeout, ByteBudget, Reservation
from tiers.errors import SwapError

KiB = 1024
MiB = 1024 * KiB


def _wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.001)


class _Reserver(threading.Thread):
    """Reserves in the background; records the reservation or the error."""

    def __init__(self, budget: ByteBudget, nbytes: int, what: str, timeout_s: float = 10.0):
        super().__init__(daemon=True)
        self.budget, self.nbytes, self.what, self.timeout_s = budget, nbytes, what, timeout_s
        self.reservation: Reservation | None = None
        self.error: BaseException | None = None
        self.granted_at = 0.0

    def run(self) -> None:
        try:
            self.reservation = self.budget.reserve(
                self.nbytes, what=self.what, timeout_s=self.timeout_s
            )
            self.granted_at = time.monotonic()
        except BaseException as exc:
            self.error = exc


# -- basics -------------------------------------------------------------------------------


def test_reserve_release_counts_used_and_peak() -> None:
    budget = ByteBudget("host", 10 * KiB)
    a = budget.reserve(4 * KiB, what="a")
    b = budget.reserve(6 * KiB, what="b")
    assert budget.used_nbytes == 10 * KiB
    assert budget.available_nbytes == 0
    a.release()
    a.release()  # idempotent: does not give the bytes back twice
    assert budget.used_nbytes == 6 * KiB
    assert a.released and a.nbytes == 0
    assert budget.peak_nbytes == 10 * KiB
    budget.reset_peak()
    assert budget.peak_nbytes == 6 * KiB
    with b:
        pass
    assert budget.used_nbytes == 0
    assert budget.name == "host" and budget.limit_nbytes == 10 * KiB


def test_context_manager_releases_on_error() -> None:
    budget = ByteBudget("host", 100)
    with pytest.raises(RuntimeError), budget.reserve(60, what="t"):
        raise RuntimeError("boom")
    assert budget.used_nbytes == 0


def test_too_large_fails_at_once_with_names_and_sizes() -> None:
    budget = ByteBudget("pinned", 1 * MiB)
    hold = budget.reserve(512 * KiB, what="other")
    start = time.monotonic()
    with pytest.raises(BudgetExceededError) as info:
        budget.reserve(3 * MiB, what="layer3.weight", timeout_s=30)
    assert time.monotonic() - start < 1.0
    message = str(info.value)
    assert "layer3.weight" in message
    assert "3 MiB" in message and "1 MiB" in message and "'pinned'" in message
    assert isinstance(info.value, SwapError) and isinstance(info.value, ValueError)
    assert (info.value.what, info.value.nbytes, info.value.limit_nbytes) == (
        "layer3.weight",
        3 * MiB,
        MiB,
    )
    with pytest.raises(BudgetExceededError):
        budget.try_reserve(MiB + 1, what="x")
    assert budget.used_nbytes == 512 * KiB  # nothing leaked by the failures
    hold.release()


def test_timeout_names_what_size_budget_use_and_timeout() -> None:
    budget = ByteBudget("device", 8 * KiB)
    hold = budget.reserve(6 * KiB, what="holder")
    start = time.monotonic()
    with pytest.raises(BudgetTimeout) as info:
        budget.reserve(4 * KiB, what="opt.exp_avg", timeout_s=0.2)
    elapsed = time.monotonic() - start
    assert 0.15 <= elapsed < 2.0
    message = str(info.value)
    for part in ("opt.exp_avg", "4 KiB", "'device'", "8 KiB", "6 KiB in use", "0.2s"):
        assert part in message, (part, message)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, SwapError)
    assert budget.waiting == 0  # the timed-out waiter left the queue
    assert budget.used_nbytes == 6 * KiB
    with pytest.raises(BudgetTimeout):
        budget.reserve(4 * KiB, what="now", timeout_s=0)  # 0: no waiting at all
    hold.release()
    budget.reserve(8 * KiB, what="now", timeout_s=0).release()


def test_blocking_reserve_is_woken_by_release_from_another_thread() -> None:
    budget = ByteBudget("host", 100)
    hold = budget.reserve(70, what="holder")
    waiter = _Reserver(budget, 50, "waiter")
    waiter.start()
    _wait_until(lambda: budget.waiting == 1)
    time.sleep(0.05)
    assert waiter.reservation is None  # still blocked
    released_at = time.monotonic()
    hold.release()
    waiter.join(5)
    assert waiter.error is None and waiter.reservation is not None
    assert waiter.granted_at >= released_at
    assert budget.used_nbytes == 50
    waiter.reservation.release()
    assert budget.used_nbytes == 0


def test_big_waiter_is_not_starved_by_small_ones() -> None:
    """FIFO: once a big request waits, small ones queue behind it instead of barging."""
    budget = ByteBudget("host", 100)
    small = budget.reserve(10, what="small-0")
    big = _Reserver(budget, 100, "big")
    big.start()
    _wait_until(lambda: budget.waiting == 1)
    # 10 bytes would fit, but the big request is queued first.
    assert budget.try_reserve(10, what="small-1") is None
    late = _Reserver(budget, 10, "small-2")
    late.start()
    _wait_until(lambda: budget.waiting == 2)
    small.release()
    big.join(5)
    assert big.reservation is not None and big.reservation.nbytes == 100
    time.sleep(0.05)
    assert late.reservation is None  # still behind the big one
    big.reservation.release()
    late.join(5)
    assert late.reservation is not None
    assert late.granted_at >= big.granted_at
    late.reservation.release()
    assert budget.used_nbytes == 0 and budget.peak_nbytes == 100


def test_timed_out_head_lets_the_next_waiter_through() -> None:
    budget = ByteBudget("host", 100)
    hold = budget.reserve(60, what="holder")
    head = _Reserver(budget, 90, "head", timeout_s=0.2)
    head.start()
    _wait_until(lambda: budget.waiting == 1)
    second = _Reserver(budget, 30, "second")
    second.start()
    # second fits (60 + 30 <= 100) but waits behind head until head gives up.
    head.join(5)
    assert isinstance(head.error, BudgetTimeout)
    second.join(5)
    assert second.reservation is not None
    second.reservation.release()
    hold.release()


def test_zero_bytes_never_wait() -> None:
    budget = ByteBudget("host", 0)
    with budget.reserve(0, what="empty", timeout_s=0) as r:
        assert r.nbytes == 0
    full = ByteBudget("host", 10)
    hold = full.reserve(10, what="all")
    assert full.try_reserve(0, what="empty") is not None
    hold.release()


def test_unlimited_budget_never_blocks_and_counts() -> None:
    budget = ByteBudget("nvme", None)
    held = [budget.reserve(1 << 40, what=f"t{i}", timeout_s=0) for i in range(4)]
    assert budget.used_nbytes == 4 << 40 and budget.peak_nbytes == 4 << 40
    assert budget.limit_nbytes is None and budget.available_nbytes is None
    assert budget.try_reserve(1 << 50, what="huge") is not None
    for r in held:
        r.release()
    assert "unlimited" in repr(budget)


def test_shrink_returns_bytes_and_wakes_waiters() -> None:
    budget = ByteBudget("host", 100)
    r = budget.reserve(100, what="upper-bound")
    waiter = _Reserver(budget, 40, "waiter")
    waiter.start()
    _wait_until(lambda: budget.waiting == 1)
    r.shrink(60)
    waiter.join(5)
    assert waiter.reservation is not None
    assert r.nbytes == 60 and budget.used_nbytes == 100
    with pytest.raises(ValueError, match="only makes it smaller"):
        r.shrink(61)
    r.release()
    with pytest.raises(ValueError, match="released"):
        r.shrink(0)
    waiter.reservation.release()
    assert budget.used_nbytes == 0


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda b: b.reserve(-1, what="neg"), ValueError),
        (lambda b: b.try_reserve(-5, what="neg"), ValueError),
        (lambda b: b.reserve(1.5, what="float"), TypeError),
        (lambda b: b.reserve(True, what="bool"), TypeError),
        (lambda b: b.reserve(1, what="t", timeout_s=-1), ValueError),
        (lambda b: ByteBudget("x", -1), ValueError),
        (lambda b: ByteBudget("x", 2.0), TypeError),
    ],
)
def test_bad_input(call: Callable[[ByteBudget], object], error: type[Exception]) -> None:
    budget = ByteBudget("host", 100)
    with pytest.raises(error):
        call(budget)
    assert budget.used_nbytes == 0 and budget.waiting == 0


def test_waiting_interrupted_leaves_queue() -> None:
    """An exception while waiting (here a timeout) never leaves a ticket that blocks others."""
    budget = ByteBudget("host", 10)
    hold = budget.reserve(10, what="all")
    with pytest.raises(BudgetTimeout):
        budget.reserve(5, what="a", timeout_s=0.01)
    hold.release()
    assert budget.try_reserve(10, what="b") is not None


# -- properties ---------------------------------------------------------------------------


class _CheckedBudget(ByteBudget):
    """Records every violation of the limit seen at grant time (under the budget's lock)."""

    def __init__(self, name: str, limit_nbytes: int | None) -> None:
        super().__init__(name, limit_nbytes)
        self.violations: list[int] = []

    def _grant(self, nbytes: int, what: str) -> Reservation:
        reservation = super()._grant(nbytes, what)
        if self.limit_nbytes is not None and self.used_nbytes > self.limit_nbytes:
            self.violations.append(self.used_nbytes)
        return reservation


@settings(max_examples=25, deadline=None)
@given(
    limit=st.integers(min_value=1, max_value=1000),
    programs=st.lists(
        st.lists(st.tuples(st.floats(0, 1), st.booleans()), min_size=1, max_size=25),
        min_size=2,
        max_size=5,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_concurrent_use_never_exceeds_limit(
    limit: int, programs: list[list[tuple[float, bool]]], seed: int
) -> None:
    """Threads reserve (blocking when they hold nothing, else try_reserve) and release at
    random; the limit is never exceeded, peak <= limit, and everything returns to 0."""
    budget = _CheckedBudget("prop", limit)
    errors: list[BaseException] = []

    def run(program: list[tuple[float, bool]], rng: random.Random) -> None:
        held: list[Reservation] = []
        try:
            for fraction, release_first in program:
                if release_first and held:
                    held.pop(rng.randrange(len(held))).release()
                nbytes = round(fraction * limit)
                if held:
                    # Blocking while holding could deadlock (hold-and-wait): only try.
                    r = budget.try_reserve(nbytes, what="t")
                    if r is not None:
                        held.append(r)
                else:
                    held.append(budget.reserve(nbytes, what="t", timeout_s=20))
                if rng.random() < 0.3:
                    time.sleep(0)
        except BaseException as exc:
            errors.append(exc)
        finally:
            for r in held:
                r.release()

    threads = [
        threading.Thread(target=run, args=(p, random.Random(seed + i)), daemon=True)
        for i, p in enumerate(programs)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    assert errors == []
    assert budget.violations == []
    assert budget.peak_nbytes <= limit
    assert budget.used_nbytes == 0 and budget.waiting == 0


class BudgetMachine(RuleBasedStateMachine):
    """Single-threaded model check of used/peak through reserve, shrink, release, reset."""

    def __init__(self) -> None:
        super().__init__()
        self.limit = 1000
        self.budget = ByteBudget("model", self.limit)
        self.held: list[Reservation] = []
        self.model_peak = 0

    def model_used(self) -> int:
        return sum(r.nbytes for r in self.held)

    @rule(nbytes=st.integers(0, 1200))
    def reserve_now(self, nbytes: int) -> None:
        fits = self.model_used() + nbytes <= self.limit
        if nbytes > self.limit:
            with pytest.raises(BudgetExceededError):
                self.budget.reserve(nbytes, what="x", timeout_s=0)
        elif fits:
            self.held.append(self.budget.reserve(nbytes, what="x", timeout_s=0))
        else:
            with pytest.raises(BudgetTimeout):
                self.budget.reserve(nbytes, what="x", timeout_s=0)
        self.model_peak = max(self.model_peak, self.model_used())

    @rule(nbytes=st.integers(0, 1000))
    def try_reserve(self, nbytes: int) -> None:
        r = self.budget.try_reserve(nbytes, what="y")
        assert (r is not None) == (self.model_used() + nbytes <= self.limit)
        if r is not None:
            self.held.append(r)
        self.model_peak = max(self.model_peak, self.model_used())

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 100), twice=st.booleans())
    def release(self, index: int, twice: bool) -> None:
        r = self.held.pop(index % len(self.held))
        r.release()
        if twice:
            r.release()

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 100), fraction=st.floats(0, 1))
    def shrink(self, index: int, fraction: float) -> None:
        r = self.held[index % len(self.held)]
        r.shrink(int(r.nbytes * fraction))

    @rule()
    def reset_peak(self) -> None:
        self.budget.reset_peak()
        self.model_peak = self.model_used()

    @invariant()
    def counts_match(self) -> None:
        assert self.budget.used_nbytes == self.model_used()
        assert self.budget.peak_nbytes == self.model_peak
        assert self.budget.peak_nbytes <= self.limit

    def teardown(self) -> None:
        for r in self.held:
            r.release()
        assert self.budget.used_nbytes == 0


TestBudgetMachine = BudgetMachine.TestCase
TestBudgetMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
