"""Tests of tiers.signals: sections hold signals back and deliver them at wait points or at
the end, in order, to the handler that was installed; waits stay interruptible; the test
hook sees every wait point in every thread."""

from __future__ import annotations

import concurrent.futures
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from tiers import signals
from tiers.budget import ByteBudget


@pytest.fixture(autouse=True)
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt here, whatever the test runner set; SIGTERM as
    it was."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_outside_a_section_a_signal_raises_at_once() -> None:
    with signals.at_waits:
        pass  # the relay is installed now
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
        time.sleep(1)  # never reached
    assert signal.getsignal(signal.SIGINT) is signals._relay


def test_held_delivers_at_the_end_only() -> None:
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with signals.held:
            signal.raise_signal(signal.SIGINT)
            done.append("after the signal")
            signals.wait_point("test")  # no delivery at a wait inside held
            signals.deliver_pending()
            done.append("after the wait point")
        done.append("never")
    assert done == ["after the signal", "after the wait point"]


def test_at_waits_delivers_at_the_next_wait_point() -> None:
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt), signals.at_waits:
        signal.raise_signal(signal.SIGINT)
        done.append("after the signal")
        signals.wait_point("test")
        done.append("never")
    assert done == ["after the signal"]
    with signals.at_waits:
        pass  # nothing left pending


def test_at_waits_delivers_at_the_end_without_a_wait() -> None:
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        with signals.at_waits:
            signal.raise_signal(signal.SIGINT)
            done.append("after the signal")
        done.append("never")
    assert done == ["after the signal"]


def test_nesting_an_inner_end_does_not_deliver_and_held_wins() -> None:
    done: list[str] = []
    with pytest.raises(KeyboardInterrupt), signals.at_waits:
        with signals.held:
            with signals.at_waits:
                signal.raise_signal(signal.SIGINT)
                signals.wait_point("inner wait, inside held")
            done.append("inner at_waits ended")
        done.append("held ended")
        signals.wait_point("outer wait")
        done.append("never")
    assert done == ["inner at_waits ended", "held ended"]


def test_a_programs_own_handlers_run_later_in_order() -> None:
    """A handler that does not raise (a flag) is called once per signal, in order, with
    SIGTERM wrapped like SIGINT."""
    seen: list[int] = []
    signal.signal(signal.SIGINT, lambda s, f: seen.append(s))
    signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    with signals.held:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        assert seen == []
    assert seen == [signal.SIGTERM, signal.SIGINT]
    signal.raise_signal(signal.SIGINT)  # outside: straight through
    assert seen == [signal.SIGTERM, signal.SIGINT, signal.SIGINT]


def test_ignored_signal_stays_ignored() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with signals.held:
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_wait_on_a_condition_is_cut_within_the_poll_interval_with_the_lock_held() -> None:
    cond = threading.Condition(threading.Lock())
    timer = threading.Timer(0.1, signal.raise_signal, (signal.SIGINT,))
    start = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt), signals.at_waits, cond:
        while True:  # nobody notifies
            signals.wait_cond(cond, None, "test")
    assert time.monotonic() - start < 0.1 + 5 * signals.POLL_S
    assert cond.acquire(blocking=False), "the lock was left held"
    cond.release()


def test_a_wait_on_a_future_is_cut_and_the_future_is_untouched() -> None:
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    timer = threading.Timer(0.1, signal.raise_signal, (signal.SIGINT,))
    timer.start()
    with pytest.raises(KeyboardInterrupt), signals.at_waits:
        signals.wait_future(future, None, "test")
    assert not future.done()
    future.set_result(1)
    assert signals.wait_future(future, 0, "test")


def test_wait_future_times_out_without_raising() -> None:
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    start = time.monotonic()
    with signals.at_waits:
        assert not signals.wait_future(future, 0.12, "test")
    assert 0.1 < time.monotonic() - start < 2


def test_sections_in_other_threads_change_nothing_and_the_hook_sees_every_thread() -> None:
    names: list[tuple[str, bool]] = []
    previous = signals.set_wait_hook(
        lambda name: names.append((name, threading.current_thread() is threading.main_thread()))
    )
    try:

        def worker() -> None:
            with signals.held:
                assert signals._state.depth == 0  # the main thread's only
                signals.wait_point("worker")

        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        signals.wait_point("main")
    finally:
        signals.set_wait_hook(previous)
    assert names == [("worker", False), ("main", True)]


def test_budget_wait_cut_leaves_the_queue_and_the_bytes_exact() -> None:
    """A reservation cut while queued leaves the queue; the one behind it is served and
    no byte is lost."""
    budget = ByteBudget("b", 100)
    first = budget.reserve(80, what="first")
    behind: list[object] = []

    def later() -> None:
        behind.append(budget.reserve(50, what="behind", timeout_s=10))

    def cut(name: str) -> None:
        if threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt

    previous = signals.set_wait_hook(cut)
    try:
        with pytest.raises(KeyboardInterrupt):
            budget.reserve(60, what="cut")
    finally:
        signals.set_wait_hook(previous)
    assert budget.waiting == 0
    thread = threading.Thread(target=later)
    thread.start()
    time.sleep(0.05)
    first.release()
    thread.join(10)
    assert len(behind) == 1
    assert budget.used_nbytes == 50
