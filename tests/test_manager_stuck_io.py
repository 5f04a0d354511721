"""A stuck I/O request is not a hang (issue 29).

A backend call that never returns (injected: the thread backend's worker blocks on a
gate before doing the read or write) must make the waiting fetch, evict, optimizer step
and close() give up within their configured timeouts with a typed error naming the file
and offset, while the request's buffer stays owned by it (never freed or reused) until
the gate opens and the request really completes; afterwards everything works as before.

Every call that could hang runs in a daemon thread joined with a limit (:func:`_within`),
so a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from swapper import OffloadAdamW, StepConfig, StepFailedError
from swapper.manager import (
    EntryState,
    Kind,
    ManagerConfig,
    ManagerIOTimeout,
    ManagerTimeout,
    NotDurableError,
    Tier,
    TierManager,
)
from swapper.manager.watchdog import Watchdog
from tiers.aio.contexts import _ThreadContext
from tiers.aio.requests import Op, _Piece
from tiers.config import AioConfig, Backend
from tiers.errors import IOTimeoutError
from tiers.nvme.futures import StoreFuture
from tiers.signals import wait_progressing

KiB = 1024
TIMEOUT_S = 1.0
#: What a bounded call may take beyond its timeout on a loaded 2-core machine.
SLACK_S = 4.0
#: The longest any call in these tests may run before the test calls it a hang.
HANG_S = 30.0


class Gate:
    """Blocks the thread backend's reads or writes (``arm``) until ``release``; or, with
    ``slow``, makes each of them take that many seconds (a slow disk, not a stuck one)."""

    def __init__(self) -> None:
        self.op: Op | None = None
        self.opened = threading.Event()
        self.stuck: list[tuple[str, int, int]] = []  # (file, offset, nbytes) blocked
        self.slow: dict[Op, float] = {}

    def arm(self, op: Op) -> None:
        self.op = op
        self.opened.clear()

    def release(self) -> None:
        self.op = None
        self.opened.set()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    real = _ThreadContext._run

    def run(self: _ThreadContext, piece: _Piece) -> None:
        if piece.request.op in g.slow:
            time.sleep(g.slow[piece.request.op])
        if g.op is not None and piece.request.op is g.op:
            g.stuck.append((str(piece.request.file.path), piece.offset, piece.nbytes))
            g.opened.wait(HANG_S)
        real(self, piece)

    monkeypatch.setattr(_ThreadContext, "_run", run)
    try:
        yield g
    finally:
        g.release()  # the blocked workers finish, so the engine can close


def _config(tmp_path: Path, **overrides: Any) -> ManagerConfig:
    settings: dict[str, Any] = {
        "device_nbytes": 64 * KiB,
        "host_nbytes": 256 * KiB,
        "nvme_dirs": [tmp_path / "nvme"],
        "host_arena_nbytes": 64 * KiB,
        "timeout_s": TIMEOUT_S,
        "close_timeout_s": TIMEOUT_S,
        "device": "cpu",
        "aio": AioConfig(backend=Backend.THREADS),
    }
    settings.update(overrides)
    return ManagerConfig(**settings)


@pytest.fixture
def manager(tmp_path: Path, gate: Gate) -> Iterator[TierManager]:
    m = TierManager(_config(tmp_path))
    try:
        yield m
    finally:
        gate.release()
        with contextlib.suppress(NotDurableError):
            m.close()


def _within(call: Callable[[], Any], limit_s: float = HANG_S) -> tuple[Any, float]:
    """``call()`` in a daemon thread: (its result or the exception it raised, seconds);
    fails the test if it runs past ``limit_s``."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # the test judges what came out
            outcome["value"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert not thread.is_alive(), f"hung for {limit_s} s"
    return outcome["value"], time.monotonic() - start


def _settles(manager: TierManager, key: str, state: EntryState) -> None:
    deadline = time.monotonic() + HANG_S
    while manager.info(key).state is not state:
        assert time.monotonic() < deadline, f"{key} never became {state}"
        time.sleep(0.01)


def _all_settle(manager: TierManager) -> None:
    """Every entry's requests ended (none transient), within HANG_S."""
    deadline = time.monotonic() + HANG_S
    while any(info.state.transient for info in map(manager.info, manager.keys())):
        assert time.monotonic() < deadline, "an entry never settled"
        time.sleep(0.01)


def _tensor(seed: int, numel: int = 4096) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _stuck_read_ahead(manager: TierManager, gate: Gate, key: str, seed: int) -> torch.Tensor:
    """``key`` registered, written to NVMe, and read ahead with the read blocked (issued):
    its tensor."""
    t = _tensor(seed)
    manager.register(key, t, Kind.OPTIM_STATE)
    manager.evict(key, Tier.NVME).result(timeout=HANG_S)
    gate.arm(Op.READ)
    assert manager.prefetch([key], Tier.HOST) == 1
    deadline = time.monotonic() + HANG_S
    while not gate.stuck:  # the read-ahead's read is issued (and blocked)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return t


def _names_the_stuck_piece(error: IOTimeoutError, gate: Gate, key: str) -> None:
    path, offset, nbytes = gate.stuck[0]
    assert (error.path, error.offset, error.nbytes) == (path, offset, nbytes)
    assert path in str(error) and f"offset {offset}" in str(error)
    # (The store's key: the manager's, under its kind.)
    assert error.key.endswith(f"/{key}") and f"key={error.key!r}" in str(error)
    assert "ManagerConfig.timeout_s" in str(error)


def test_stuck_read_times_out_fetch_and_the_buffer_waits_for_it(
    manager: TierManager, gate: Gate
) -> None:
    a = _tensor(1)
    manager.register("a", a, Kind.OPTIM_STATE)
    manager.evict("a", Tier.NVME).result(timeout=HANG_S)
    gate.arm(Op.READ)
    error, took = _within(lambda: manager.fetch("a", Tier.HOST))
    assert isinstance(error, IOTimeoutError), repr(error)
    assert TIMEOUT_S * 0.9 <= took <= TIMEOUT_S + SLACK_S
    assert error.op == "read"
    _names_the_stuck_piece(error, gate, "a")
    # The read is still in flight: the entry stays READING (its buffer the read's).
    assert manager.info("a").state is EntryState.READING
    gate.release()
    _settles(manager, "a", EntryState.ON_NVME)
    assert torch.equal(manager.fetch("a", Tier.HOST), a)
    manager.release("a", modified=False)


def test_stuck_write_fails_the_eviction_future_and_keeps_the_data(
    manager: TierManager, gate: Gate
) -> None:
    b = _tensor(2)
    manager.register("b", b, Kind.OPTIM_STATE)
    gate.arm(Op.WRITE)
    future = manager.evict("b", Tier.NVME)
    error, took = _within(lambda: future.exception(timeout=HANG_S))
    assert isinstance(error, IOTimeoutError), repr(error)
    assert took <= TIMEOUT_S + SLACK_S
    assert error.op == "write"
    _names_the_stuck_piece(error, gate, "b")
    # Still being written: its memory is kept until the write ends.
    assert manager.info("b").state is EntryState.WRITING
    gate.release()
    _settles(manager, "b", EntryState.ON_NVME)
    assert torch.equal(manager.fetch("b", Tier.HOST), b)
    manager.release("b")


def test_a_stuck_registration_write_names_the_file_and_offset(tmp_path: Path, gate: Gate) -> None:
    """A registration that goes straight to NVMe and whose write never ends raises a
    ManagerIOTimeout: a ManagerTimeout (as documented) and an IOTimeoutError naming the
    file and offset; once the write ends, the registration is undone and the key free."""
    m = TierManager(_config(tmp_path, host_nbytes=8 * KiB, host_arena_nbytes=8 * KiB))
    try:
        gate.arm(Op.WRITE)
        error, took = _within(lambda: m.register("r", _tensor(5, 8192), Kind.OPTIM_STATE))
        assert isinstance(error, ManagerIOTimeout), repr(error)
        assert isinstance(error, ManagerTimeout) and isinstance(error, IOTimeoutError)
        assert TIMEOUT_S * 0.9 <= took <= TIMEOUT_S + SLACK_S
        assert error.op == "write" and "register of key='r'" in str(error)
        _names_the_stuck_piece(error, gate, "r")
        gate.release()
        deadline = time.monotonic() + HANG_S
        while "r" in m:
            assert time.monotonic() < deadline, "the abandoned registration was not undone"
            time.sleep(0.01)
    finally:
        gate.release()
        with contextlib.suppress(NotDurableError):
            m.close()


def test_a_fetch_waiting_for_a_stuck_read_ahead_names_the_file_and_offset(
    manager: TierManager, gate: Gate
) -> None:
    """The fetch waits for another thread's transfer (a read-ahead whose read never
    ends): its timeout names the read's file and offset, not only the key."""
    e = _stuck_read_ahead(manager, gate, "e", 6)
    error, took = _within(lambda: manager.fetch("e", Tier.HOST))
    assert isinstance(error, ManagerIOTimeout), repr(error)
    assert took <= TIMEOUT_S + SLACK_S
    assert error.op == "read" and "key='e'" in str(error)
    _names_the_stuck_piece(error, gate, "e")
    gate.release()
    _settles(manager, "e", EntryState.RESIDENT)
    assert torch.equal(manager.fetch("e", Tier.HOST), e)
    manager.release("e", modified=False)


def _slow_manager(tmp_path: Path) -> TierManager:
    """One worker, one request at a time: requests queue behind each other."""
    aio = AioConfig(backend=Backend.THREADS, num_threads=1, queue_depth=1)
    return TierManager(_config(tmp_path, aio=aio, write_behind_nbytes=None))


def test_a_slow_disk_does_not_fail_evictions_queued_behind_each_other(
    tmp_path: Path, gate: Gate
) -> None:
    """Writes that each take 0.3 s, one at a time: six evictions issued together end
    after ~1.8 s, past timeout_s (1 s) for the later ones, but the disk keeps completing
    writes, so none is failed (a stuck one is: the tests above)."""
    m = _slow_manager(tmp_path)
    try:
        tensors = {f"s{i}": _tensor(10 + i) for i in range(6)}
        for key, t in tensors.items():
            m.register(key, t, Kind.OPTIM_STATE)
        gate.slow[Op.WRITE] = 0.3
        start = time.monotonic()
        futures = [m.evict(key, Tier.NVME) for key in tensors]
        errors, took = _within(lambda: [f.exception(timeout=HANG_S) for f in futures])
        assert took > TIMEOUT_S * 1.2  # it really ran past the timeout
        assert errors == [None] * len(tensors), errors
        assert time.monotonic() - start < HANG_S
        gate.slow.clear()
        for key, t in tensors.items():
            assert torch.equal(m.fetch(key, Tier.HOST), t)
            m.release(key, modified=False)
    finally:
        gate.slow.clear()
        with contextlib.suppress(NotDurableError):
            m.close()


def test_a_slow_disk_does_not_fail_a_fetch_waiting_behind_read_ahead(
    tmp_path: Path, gate: Gate
) -> None:
    """Reads that each take 0.3 s, one at a time: a fetch of the last of six keys read
    ahead together waits ~1.8 s for another thread's read, past timeout_s (1 s), and gets
    its tensor, since the disk keeps completing reads."""
    m = _slow_manager(tmp_path)
    try:
        tensors = {f"r{i}": _tensor(20 + i) for i in range(6)}
        for key, t in tensors.items():
            m.register(key, t, Kind.OPTIM_STATE)
            m.evict(key, Tier.NVME).result(timeout=HANG_S)
        gate.slow[Op.READ] = 0.3
        keys = list(tensors)
        assert m.prefetch(keys, Tier.HOST) == len(keys)
        last = keys[-1]
        deadline = time.monotonic() + HANG_S
        while m.info(last).state is not EntryState.READING:  # its read is queued
            assert time.monotonic() < deadline
            time.sleep(0.005)
        got, took = _within(lambda: m.fetch(last, Tier.HOST))
        assert isinstance(got, torch.Tensor), repr(got)
        assert took > TIMEOUT_S  # it really waited past the timeout
        assert torch.equal(got, tensors[last])
        m.release(last, modified=False)
    finally:
        gate.slow.clear()
        with contextlib.suppress(NotDurableError):
            m.close()


def test_wait_progressing_waits_while_the_disk_moves_and_stops_when_it_stops() -> None:
    """The rule every wait for a request uses: past the deadline it waits on while
    ``progress()`` is within the window, and gives up a window after the last one."""
    future: Future[int] = Future()
    last = [time.monotonic()]
    stop = threading.Event()

    def disk() -> None:  # completes something every 0.1 s for 1.5 s, then nothing
        end = time.monotonic() + 1.5
        while time.monotonic() < end and not stop.is_set():
            time.sleep(0.1)
            last[0] = time.monotonic()

    thread = threading.Thread(target=disk, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        done = wait_progressing(future, start + 0.5, lambda: last[0], "test")
        took = time.monotonic() - start
        assert not done
        assert 1.5 + 0.5 * 0.9 <= took <= 1.5 + 0.5 + SLACK_S  # a window after the last
        future.set_result(1)
        assert wait_progressing(future, time.monotonic(), lambda: last[0], "test")
    finally:
        stop.set()
        thread.join(HANG_S)


def test_close_returns_within_its_timeout_naming_what_is_not_durable(
    manager: TierManager, gate: Gate
) -> None:
    c = _tensor(3)
    manager.register("c", c, Kind.OPTIM_STATE)
    gate.arm(Op.WRITE)
    manager.evict("c", Tier.NVME)
    error, took = _within(manager.close)
    assert isinstance(error, NotDurableError), repr(error)
    assert took <= TIMEOUT_S + SLACK_S
    assert error.keys == ["c"] and "'c'" in str(error) and "again to keep waiting" in str(error)
    path, offset, _ = gate.stuck[0]  # and where it is stuck
    assert path in str(error) and f"offset {offset}" in str(error), str(error)
    gate.release()
    _settles(manager, "c", EntryState.ON_NVME)
    result, _ = _within(manager.close)
    assert result is None


def test_close_with_a_stuck_read_ahead_returns_within_its_timeout(
    manager: TierManager, gate: Gate
) -> None:
    _stuck_read_ahead(manager, gate, "d", 4)
    error, took = _within(manager.close)
    assert isinstance(error, NotDurableError), repr(error)
    assert took <= TIMEOUT_S + SLACK_S
    assert "still running" in str(error) and "again to keep waiting" in str(error)
    path, offset, _ = gate.stuck[0]  # and where it is stuck
    assert path in str(error) and f"offset {offset}" in str(error), str(error)
    gate.release()
    result, _ = _within(manager.close)
    assert result is None


def test_a_step_with_a_stuck_request_raises_a_typed_timeout(tmp_path: Path, gate: Gate) -> None:
    """The optimizer step: a stuck write-behind fails the step (StepFailedError caused by
    the IOTimeoutError, naming the file), a stuck read raises the IOTimeoutError; once
    the disk answers, step() again finishes the step."""
    model = nn.Linear(64, 64).to(torch.bfloat16)
    config = _config(tmp_path, device_nbytes=0, host_nbytes=3 * 12 * 4096)
    with OffloadAdamW(
        model.parameters(), tiers=config, config=StepConfig(sub_group_numel=1024)
    ) as opt:

        def grads() -> None:
            for p in model.parameters():
                p.grad = torch.full_like(p, 0.01)

        grads()
        opt.step()
        for step, op in ((2, Op.WRITE), (3, Op.READ)):
            opt.zero_grad()
            grads()
            gate.arm(op)
            error, took = _within(opt.step)
            assert took <= 2 * TIMEOUT_S + SLACK_S
            cause = error.__cause__ if isinstance(error, StepFailedError) else error
            assert isinstance(cause, IOTimeoutError), (op, repr(error))
            assert cause.op == op.value
            assert cause.path is not None and cause.path in str(error)
            gate.release()
            _all_settle(opt.manager)
            result, _ = _within(opt.step)  # finishes the step
            assert result is None and opt.step_count == step


def test_the_watchdog_keeps_about_what_is_in_flight() -> None:
    """Ended writes are swept from the watchdog's heap as it grows (not held for their
    whole timeout); one still in flight is failed at its deadline."""
    dog = Watchdog("test")
    try:
        ended = StoreFuture(Op.WRITE, "k", 1)
        ended.set_result(1)
        for _ in range(5000):
            dog.watch(Future(), ended, start=0.0, deadline=time.monotonic() + 60, setting="s")
        assert len(dog._heap) <= 1024
        stuck: Future[None] = Future()
        now = time.monotonic()
        dog.watch(stuck, StoreFuture(Op.WRITE, "k", 1), start=now, deadline=now + 0.2, setting="s")
        error, took = _within(lambda: stuck.exception(timeout=HANG_S))
        assert isinstance(error, IOTimeoutError) and error.path is None and took < SLACK_S
        assert "waits for the flush" in str(error)
    finally:
        dog.close()
