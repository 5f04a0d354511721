"""Ctrl-C and errors at every point where the manager or the step pipeline waits.

First the three failures an adversarial user found (issue 10), each reproduced with a real
SIGINT (``signal.raise_signal``) at the moment it did harm:

* Ctrl-C while a fetch waits for its read: the host block went back to the tier while the
  kernel was still reading into it, and the next tensor placed there was overwritten;
* Ctrl-C right after a fetch marked its entry in use: the entry stayed IN_USE with no
  holder, and every later ``OffloadAdamW.step()`` failed;
* Ctrl-C while a fetch evicted a victim: the victim stayed WRITING with nothing in flight.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from swapper.manager import EntryState, Kind, ManagerConfig, Tier, TierManager
from swapper.manager.context import ManagerContext
from swapper.step import OffloadAdamW, StepConfig
from tiers import signals
from tiers.config import AioConfig
from tiers.nvme import NvmeStore

KiB = 1024


def _config(tmp_path: Path, **overrides: Any) -> ManagerConfig:
    settings: dict[str, Any] = {
        "device_nbytes": 64 * KiB,
        "host_nbytes": 32 * KiB,
        "nvme_dirs": [tmp_path / "swap"],
        "aio": AioConfig(block_size=64 * KiB, close_timeout_s=20),
        "stripe_nbytes": 8 * KiB,
        "host_arena_nbytes": 64 * KiB,
        "timeout_s": 10.0,
        "close_timeout_s": 10.0,
        "device": "cpu",
    }
    settings.update(overrides)
    return ManagerConfig(**settings)


def _rand(numel: int, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs and all): only a byte-exact copy compares equal."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (numel * 4,), dtype=torch.uint8, generator=g).view(torch.float32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.detach().cpu().contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _settled(m: TierManager) -> bool:
    """No I/O in flight, no mover job queued or running (a read-ahead holds its share of
    the window from ``prefetch`` on, before its entry changes state), no entry transient."""
    engine = m._ctx.engine
    if engine is not None and engine.pending():
        return False
    if m._ctx.jobs:
        return False
    keys = m.keys()
    return not any(m.info(k).state.transient for k in keys)


def _assert_not_wedged(m: TierManager, holders: dict[str, int] | None = None) -> None:
    """Once idle: no entry transient, none in use beyond ``holders`` (key → fetches the
    test holds), every in-use entry held."""
    assert _until(lambda: _settled(m)), [(k, m.info(k).state) for k in m.keys()]  # noqa: SIM118
    holders = holders or {}
    keys = m.keys()
    for key in keys:
        info = m.info(key)
        assert info.users == holders.get(key, 0), (key, info)
        assert (info.state is EntryState.IN_USE) == (info.users > 0), (key, info)


def _check(m: TierManager, key: str, expected: torch.Tensor) -> None:
    got = m.fetch(key)
    try:
        assert _same(got, expected), f"{key}: bytes differ"
    finally:
        m.release(key, modified=False)


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt here, whatever the test runner set."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_idle_waits_for_a_read_ahead_not_yet_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-ahead queued behind busy mover threads holds its window share while its
    entry is still ON_NVME: idle (for the checks after a cut) means it has run."""
    from swapper.manager.jobs import MoverJobs

    real = MoverJobs.prefetch
    go = threading.Event()

    def late(self: MoverJobs, *args: Any) -> None:
        go.wait(10)  # as if every mover thread were busy
        real(self, *args)

    t = _rand(NUMEL, 5)
    with TierManager(_config(tmp_path, prefetch_window_nbytes=NBYTES)) as m:
        m.register("a", t, Kind.OPTIM_STATE)
        m.evict("a").result()
        monkeypatch.setattr(MoverJobs, "prefetch", late)
        assert m.prefetch(["a"]) == 1
        threading.Timer(0.3, go.set).start()
        _assert_not_wedged(m)
        _assert_budgets_exact(m)
        _check(m, "a", t)


# -- the three failures of issue 10, reproduced with a real SIGINT ------------------------


def test_ctrl_c_during_a_read_never_frees_the_block_the_kernel_reads_into(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sigint_raises: None
) -> None:
    """The read is held in flight (its bytes land only when the test opens the gate);
    Ctrl-C arrives while the fetch waits for it; a second tensor is registered; then the
    read lands. The second tensor must be untouched, the first still readable."""
    a, b = _rand(4096, 1), _rand(4096, 2)  # 16 KiB each; the host holds two
    with TierManager(_config(tmp_path, host_nbytes=16 * KiB)) as m:
        m.register("a", a, Kind.OPTIM_STATE)
        m.evict("a").result()
        gate = threading.Event()
        reader: list[threading.Thread] = []
        real_read = NvmeStore.read

        def slow_read(store: NvmeStore, key: str, out: torch.Tensor) -> Any:
            future: concurrent.futures.Future[int] = concurrent.futures.Future()

            def land() -> None:
                gate.wait(20)
                try:
                    future.set_result(real_read(store, key, out).result())
                except BaseException as exc:  # handed to the waiter
                    future.set_exception(exc)

            reader.append(threading.Thread(target=land, daemon=True))
            reader[0].start()
            signal.raise_signal(signal.SIGINT)  # Ctrl-C while the read is in flight
            return future

        monkeypatch.setattr(NvmeStore, "read", slow_read)
        with pytest.raises(KeyboardInterrupt):
            m.fetch("a")
        monkeypatch.setattr(NvmeStore, "read", real_read)
        m.register("b", b, Kind.OPTIM_STATE)  # where the block went, if it was freed
        gate.set()
        reader[0].join(20)
        _assert_not_wedged(m)
        _check(m, "b", b)
        _check(m, "a", a)
        m.fetch("a")  # the interrupted call, retried
        m.release("a", modified=False)
    assert m.info  # closed without error


def test_ctrl_c_while_a_victim_is_written_leaves_no_entry_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sigint_raises: None
) -> None:
    """A fetch needs room, claims a victim (WRITING) and issues its write; Ctrl-C arrives
    as the write is issued. The victim must end durable (or back in memory), never stay
    WRITING with nothing in flight."""
    a, b = _rand(4096, 3), _rand(4096, 4)
    with TierManager(_config(tmp_path, host_nbytes=16 * KiB)) as m:
        m.register("a", a, Kind.OPTIM_STATE)  # in host, never written
        m.register("b", b, Kind.OPTIM_STATE)  # no room: straight to NVMe
        assert m.info("b").tier is None
        real_write = NvmeStore.write
        calls: list[str] = []

        def write(store: NvmeStore, key: str, tensor: torch.Tensor) -> Any:
            calls.append(key)
            signal.raise_signal(signal.SIGINT)  # Ctrl-C as the victim's write starts
            return real_write(store, key, tensor)

        monkeypatch.setattr(NvmeStore, "write", write)
        with pytest.raises(KeyboardInterrupt):
            m.fetch("b")  # a is the victim
        monkeypatch.setattr(NvmeStore, "write", real_write)
        assert calls == ["optim_state/a"]
        _assert_not_wedged(m)
        _check(m, "b", b)  # the interrupted call, retried
        _check(m, "a", a)
        m.flush()


def _tiny_model(seed: int) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 8)).to(torch.bfloat16)


def _grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


#: 3 656 parameters in sub-groups of 1024 elements: four sub-groups (12 KiB of state each)
SUB_GROUP = 1024
SG_STATE = 12 * SUB_GROUP


def _optimizer(model: nn.Module, tmp_path: Path, name: str) -> OffloadAdamW:
    config = ManagerConfig(
        device_nbytes=0,
        host_nbytes=2 * SG_STATE,  # two of four sub-groups: the step streams
        nvme_dirs=[tmp_path / name],
        aio=AioConfig(block_size=64 * KiB, close_timeout_s=20),
        stripe_nbytes=8 * KiB,
        host_arena_nbytes=64 * KiB,
        timeout_s=10.0,
        close_timeout_s=10.0,
        device="cpu",
    )
    return OffloadAdamW(
        model.parameters(),
        lr=1e-2,
        tiers=config,
        config=StepConfig(sub_group_numel=SUB_GROUP),
    )


def _assert_same_optimizer(opt: OffloadAdamW, ref: OffloadAdamW) -> None:
    for p, q in zip(opt.param_groups[0]["params"], ref.param_groups[0]["params"], strict=True):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16)), "parameters differ"
    for index in range(len(opt.sub_groups)):
        assert torch.equal(
            opt._pipeline.read(index).view(torch.int32), ref._pipeline.read(index).view(torch.int32)
        ), f"state of sub-group {index} differs"
    assert opt.step_count == ref.step_count


def test_ctrl_c_as_a_fetch_marks_its_entry_in_use_leaves_no_holderless_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sigint_raises: None
) -> None:
    """SIGINT lands just after a sub-group's state was marked IN_USE (inside the
    notification that follows the change): the step must fail with KeyboardInterrupt and
    leave no entry in use; step() again finishes it, bit-exact with an uninterrupted run."""
    model, twin = _tiny_model(7), _tiny_model(7)
    _grads(model, 1)
    _grads(twin, 1)
    opt, ref = _optimizer(model, tmp_path, "a"), _optimizer(twin, tmp_path, "b")
    try:
        assert len(opt.sub_groups) == 4
        real = ManagerContext.set_state
        marked = {"n": 0}

        def set_state(self: ManagerContext, entry: Any, new: EntryState) -> None:
            real(self, entry, new)
            if new is EntryState.IN_USE and self is opt.manager._ctx:
                marked["n"] += 1
                if marked["n"] == 2:
                    signal.raise_signal(signal.SIGINT)

        monkeypatch.setattr(ManagerContext, "set_state", set_state)
        with pytest.raises(KeyboardInterrupt):
            opt.step()
        monkeypatch.setattr(ManagerContext, "set_state", real)
        _assert_not_wedged(opt.manager)
        opt.step()  # the interrupted call, retried
        ref.step()
        _assert_same_optimizer(opt, ref)
        opt.zero_grad()
        _grads(model, 2)
        _grads(twin, 2)
        opt.step()
        ref.step()
        _assert_same_optimizer(opt, ref)
    finally:
        opt.close()
        ref.close()


# -- every wait point, one at a time ------------------------------------------------------
#
# Each case builds a fresh manager, runs one operation with a hook that raises at the n-th
# wait point the main thread passes (n = 1 .. the number a first, uninjected run passed),
# then checks: no wedged entry once the I/O has ended, no byte lost or overwritten (a
# canary is registered right after the cut, where a freed block would be reused), the
# budgets hold exactly what the entries hold, the operation retried succeeds, close()
# succeeds. Reads are gated: a read issued before the cut lands only after the canary is
# placed, so a buffer freed too early is always caught.

NBYTES = 16 * KiB  # one tensor: the host tier holds two, the device tier one
NUMEL = NBYTES // 4


class Injected(Exception):
    """The error the error cases raise at a wait point."""


class Injector:
    """The wait hook: records the wait points passed (the main thread's only, unless
    ``any_thread``) and raises ``make()`` at ``at``: the n-th time (from 1) the one of
    that name is passed; or, given ``first_of``, at the first wait point passed whose
    name it holds."""

    def __init__(
        self,
        at: tuple[str, int] | None,
        make: Callable[[], BaseException],
        *,
        any_thread: bool = False,
        first_of: frozenset[str] = frozenset(),
    ) -> None:
        self.at = at
        self.first_of = first_of
        self.make = make
        self.any_thread = any_thread
        self.names: list[str] = []
        self.injected: str | None = None
        self.injected_in_main = False
        self.armed = True  # False: only releases held requests
        self._lock = threading.Lock()

    def __call__(self, name: str) -> None:
        main = threading.current_thread() is threading.main_thread()
        if self.armed and (self.any_thread or main):
            with self._lock:
                self.names.append(name)
                hit = self.at == (name, self.names.count(name)) or (
                    name in self.first_of and self.injected is None
                )
            if hit:
                self.injected = name
                self.injected_in_main = main
                if name == "store.read" and main:
                    gates.cut_mine()  # lands only after the canaries are placed
                raise self.make()
        if main:
            gates.release_held()


@dataclasses.dataclass(eq=False)
class _Request:
    go: threading.Event
    held: bool  # waits for a wait point of the main thread (``Gates.hold_others``)
    cut: bool = False  # its wait was the one cut: waits for the test


class Gates:
    """``NvmeStore.read`` and ``write`` replaced: each request reaches the store (and the
    kernel touches the buffer) a little later, from a thread of its own; the one whose
    wait is cut only when the test says so, after the canary is placed, so that a buffer
    freed or reused before its request ends is always caught."""

    real_read = staticmethod(NvmeStore.read)
    real_write = staticmethod(NvmeStore.write)
    DELAY_S = 0.001

    def __init__(self) -> None:
        self.local = threading.local()
        self.requests: list[_Request] = []
        self.threads: list[threading.Thread] = []
        #: requests of other threads wait for a wait point of the main thread
        self.hold_others = False

    def gated(self, real: Callable[..., Any], store: NvmeStore, *args: Any) -> Any:
        main = threading.current_thread() is threading.main_thread()
        request = _Request(threading.Event(), held=self.hold_others and not main)
        self.local.request = request
        self.requests.append(request)
        future: concurrent.futures.Future[int] = concurrent.futures.Future()

        def land() -> None:
            deadline = time.monotonic() + 20
            while not request.go.wait(self.DELAY_S):
                if not (request.held or request.cut) or time.monotonic() > deadline:
                    break
            try:
                future.set_result(real(store, *args).result())
            except BaseException as exc:  # handed to the waiter
                future.set_exception(exc)

        thread = threading.Thread(target=land, daemon=True, name=f"gate {real.__name__} {args[0]}")
        thread.start()
        self.threads.append(thread)
        return future

    def cut_mine(self) -> None:
        """The calling thread's last request is the one whose wait is cut."""
        request = getattr(self.local, "request", None)
        if request is not None and not request.go.is_set():
            request.cut = True

    def release_held(self) -> None:
        for request in self.requests:
            if not request.cut:
                request.go.set()

    def open_all(self) -> None:
        """Let every request go and wait (20 s at most) until their threads have ended,
        including those of requests issued meanwhile: the manager may still be working
        (an eviction's write waits for the write-behind window that a request landing
        here frees), and such a request starts after a first look at the threads."""
        deadline = time.monotonic() + 20
        while True:
            for request in list(self.requests):
                request.go.set()
            alive = [t for t in list(self.threads) if t.is_alive()]
            if not alive or time.monotonic() > deadline:
                break
            for thread in alive:
                thread.join(max(0.0, deadline - time.monotonic()))
        # Every thread's stack in the message: where the stuck request waits, and on what.
        assert not alive, (
            f"{len(alive)} request(s) did not end 20 s after their gates opened:\n{_stacks()}"
        )


def _stacks() -> str:
    """Every thread's current stack, named."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(
        f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
        for ident, frame in sys._current_frames().items()
    )


gates = Gates()


def test_open_all_waits_for_requests_issued_while_it_waits() -> None:
    """A request that lands can let another be issued (an eviction's write waits for the
    write-behind window the landing one frees): open_all must wait for that one too, not
    judge it stuck because it started after open_all looked at the threads."""
    g = Gates()
    landed = []

    def real(store: Any, key: str) -> concurrent.futures.Future[int]:
        if key == "first":  # as it lands, the next request is issued
            g.gated(real, store, "second")
        else:
            time.sleep(0.2)  # still under way when the first's thread has ended
        landed.append(key)
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        future.set_result(0)
        return future

    g.gated(real, None, "first")
    g.open_all()
    assert landed == ["first", "second"]
    assert not any(t.is_alive() for t in g.threads)


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gates]:
    global gates
    gates = current = Gates()

    def read(store: NvmeStore, key: str, out: torch.Tensor) -> Any:
        return current.gated(Gates.real_read, store, key, out)

    def write(store: NvmeStore, key: str, tensor: torch.Tensor) -> Any:
        return current.gated(Gates.real_write, store, key, tensor)

    monkeypatch.setattr(NvmeStore, "read", read)
    monkeypatch.setattr(NvmeStore, "write", write)
    try:
        yield current
    finally:
        current.open_all()


def _assert_budgets_exact(m: TierManager) -> None:
    """Once idle, every byte a budget counts belongs to an entry: nothing leaked."""
    entries = list(m._ctx.entries.values())
    for tier, memory in ((Tier.HOST, m._ctx.host), (Tier.DEVICE, m._ctx.device)):
        held_nbytes = sum(e.block.charged_nbytes for e in entries if e.tier is tier and e.block)
        assert memory.budget.used_nbytes == held_nbytes, (tier, memory.budget)
    assert m._ctx.writebehind.used_nbytes == 0
    windows = sum(e.readahead.nbytes for e in entries if e.readahead is not None)
    assert m._ctx.readahead.used_nbytes + m._ctx.state_readahead.used_nbytes == windows


class Case:
    """One operation on a manager set up for it."""

    name = ""
    config: dict[str, Any] = {}  # noqa: RUF012 - read only

    def setup(self, m: TierManager) -> dict[str, torch.Tensor]:
        """Register what the operation needs; returns key → expected bytes."""
        raise NotImplementedError

    def op(self, m: TierManager, expected: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def after(self, expected: dict[str, torch.Tensor]) -> None:
        """What ``expected`` is once the operation has succeeded."""


def _fetch_and_check(
    m: TierManager, key: str, want: torch.Tensor, tier: Tier | None = None
) -> None:
    got = m.fetch(key, tier)
    try:
        assert _same(got, want), f"{key}: bytes differ"
    finally:
        m.release(key, modified=False)


class FetchNvmeToHost(Case):
    """The host is full of tensors never written: the fetch evicts one (a write) and
    reads into its room."""

    name = "fetch nvme->host, evicting"

    def setup(self, m: TierManager) -> dict[str, torch.Tensor]:
        ts = {k: _rand(NUMEL, i) for i, k in enumerate("abc")}
        for k, t in ts.items():
            m.register(k, t, Kind.OPTIM_STATE)
        assert m.info("c").tier is None
        return ts

    def op(self, m: TierManager, expected: dict[str, torch.Tensor]) -> None:
        _fetch_and_check(m, "c", expected["c"])


class FetchBehindAWrite(Case):
    """The write-behind window is taken by an eviction staged from the device (its host
    staging block is not counted as leaving the host): the fetch must evict a victim, and
    the victim's write waits for room in the window (``budget.reserve`` on the caller's
    thread, before the write is issued), then the fetch reads into the room."""

    name = "fetch nvme->host, victim behind a write"

    def setup(self, m: TierManager) -> dict[str, torch.Tensor]:
        ts = {k: _rand(NUMEL, 110 + i) for i, k in enumerate(("d", "h", "x"))}
        m.register("d", ts["d"], Kind.PARAM16)
        m.register("h", ts["h"], Kind.OPTIM_STATE)
        m.register("x", ts["x"], Kind.OPTIM_STATE)
        m.evict("x").result()
        assert [m.info(k).tier for k in ts] == [Tier.DEVICE, Tier.HOST, None]
        self.first = True
        return ts

    def op(self, m: TierManager, expected: dict[str, torch.Tensor]) -> None:
        first, self.first = self.first, False  # (retried: only the fetch)
        gates.hold_others = True  # d's write lands once the victim's write waits for it
        try:
            if first:
                evicting = m.evict("d")  # (it fails, cut in its mover, in any thread)
                assert _until(lambda: m._ctx.writebehind.used_nbytes > 0 or evicting.done())
            _fetch_and_check(m, "x", expected["x"])
        finally:
            gates.hold_others = False


class FetchNvmeToDevice(Case):
    """Device and host full: the fetch demotes the device tensor to the host (which
    evicts a host tensor to NVMe), stages the read in the host (evicting again) and copies
    it to the device."""

    name = "fetch nvme->device, evicting"

    def setup(self, m: TierManager) -> dict[str, torch.Tensor]:
        ts = {k: _rand(NUMEL, 10 + i) for i, k in enumerate(("d", "h0", "h1", "n"))}
        for k, t in ts.items():
            m.register(k, t, Kind.PARAM16)
        assert [m.info(k).tier for k in ts] == [Tier.DEVICE, Tier.HOST, Tier.HOST, None]
        return ts

    def op(self, m: TierManager, expected: dict[str, torch.Tensor]) -> None:
        _fetch_and_check(m, "n", expected["n"], Tier.DEVICE)


class AssignNvmeToDevice(Case):
    """As ``FetchNvmeToDevice``, but the tensor on NVMe is assigned a new value (never
    read): room is made on the device (demoting, evicting) and the value copied in."""

    name = "assign nvme->device, evicting"

    def setup(self, m: TierManager) -> dict[str, torch.Tensor]:
        ts = {k: _rand(NUMEL, 100 + i) for i, k in enumerate(("d", "h0", "h1", "n"))}
        for k, t in ts.items():
            m.register(k, t, Kind.PARAM16)
        assert [m.info(k).tier for k in ts] == [Tier.DEVICE, Tier.HOST, Tier.HOST, None]
        self.new = _rand(NUMEL, 109)
        return ts

    def op(self, m: TierManager, expected: dict[str, torch.Tensor]) -> None:
        try:
            m.assign("n", self.new.clone(), Tier.DEVICE)
        except BaseException:
            # Cut: as before (on NVMe, its old copy valid), or, cut in a mover after
            # the copy, assigned; never resident with a clean mark and other bytes.
            info = m.info("n")
            assert info.state is not EntryState.RESIDENT or not info.clean, info
            raise
        expected["n"] = self.new  # (the checks between the cut and the retry read it)

    def after(self, expected: dict[str, torch.Tensor]) -> None:
        expected["n"] = self.new


class FetchHostToDevice(Case):
    name = "fetch host->device, demoting"

    def setup(self, m: TierManager) -> dict[str, torch.Tensor]:
        ts = {k: _rand(NUMEL, 20 + i) for i, k in enumerate(("d", "h"))}
        for k, t in ts.items():
            m.register(k, t, Kind.PARAM16)
        assert [m.info(k).tier for k in ts] == [Tier.DEVICE, Tier.HOST]
        return ts

    def op(self, m: TierManager, expected: dict[str, torch.Tensor]) -> None:
        _fetch_and_check(m, "h", expected["h"], Tier.DEVICE)


class Evict(Case):
    """Write-behind of a device tensor (staged in the host) and of a host one; the caller
    waits for both futures."""

    name = "evict"

    def setup(self, m: TierManager) -> dict[str, torch.Tensor]:
        ts = {k: _rand(NUMEL, 30 + i) for i, k in enumerate(("d", "h"))}
        for k, t in ts.items():
            m.register(k, t, Kind.PARAM16)
        return ts

    def op(self, m: TierManager, expected: dict[str, torch.Tensor]) -> None:
        futures = [m.evict(k) for k in ("d", "h")]
        for future in futures:
            signals.wait_future(future, None, "test.evict")
            future.result()
        assert all(m.info(k).tier is None for k in ("d", "h"))


class PrefetchFetch(Case):
    """Fetches wait for the read-aheads under way."""

    name = "prefetch + fetch"
    config = {"prefetch_window_nbytes": 2 * NBYTES}  # noqa: RUF012

    def setup(self, m: TierManager) -> dict[str, torch.Tensor]:
        ts = {k: _rand(NUMEL, 40 + i) for i, k in enumerate(("p0", "p1"))}
        for k, t in ts.items():
            m.register(k, t, Kind.OPTIM_STATE)
            m.evict(k).result()
        return ts

    def op(self, m: TierManager, expected: dict[str, torch.Tensor]) -> None:
        gates.hold_others = True  # the reads land once the fetch waits
        try:
            assert m.prefetch(["p0", "p1"]) == 2
            assert _until(lambda: all(m.info(k).state is not EntryState.ON_NVME for k in expected))
            for k in ("p0", "p1"):
                _fetch_and_check(m, k, expected[k])
        finally:
            gates.hold_others = False


class Flush(Case):
    name = "flush"

    def setup(self, m: TierManager) -> dict[str, torch.Tensor]:
        ts = {k: _rand(NUMEL, 50 + i) for i, k in enumerate(("d", "h0", "h1"))}
        for k, t in ts.items():
            m.register(k, t, Kind.PARAM16)
        return ts

    def op(self, m: TierManager, expected: dict[str, torch.Tensor]) -> None:
        m.flush()
        assert all(m.info(k).clean for k in expected)


class RegisterToNvme(Case):
    """No room in memory: the tensor is written to NVMe from the caller's memory."""

    name = "register to nvme"

    def setup(self, m: TierManager) -> dict[str, torch.Tensor]:
        ts = {k: _rand(NUMEL, 60 + i) for i, k in enumerate(("a", "b"))}
        for k, t in ts.items():
            m.register(k, t, Kind.OPTIM_STATE)
        self.new = _rand(NUMEL, 69)
        return ts

    def op(self, m: TierManager, expected: dict[str, torch.Tensor]) -> None:
        source = self.new.clone()
        m.register("new", source, Kind.OPTIM_STATE)
        assert m.info("new").tier is None
        source.fill_(0)  # the caller's tensor is not kept

    def after(self, expected: dict[str, torch.Tensor]) -> None:
        expected["new"] = self.new


class RegisterBehindAWrite(Case):
    """The write-behind window is taken by an eviction: the registration's write waits
    for room in it."""

    name = "register to nvme, window full"
    config = {"write_behind_nbytes": NBYTES}  # noqa: RUF012

    def setup(self, m: TierManager) -> dict[str, torch.Tensor]:
        ts = {k: _rand(NUMEL, 65 + i) for i, k in enumerate(("a", "b"))}
        for k, t in ts.items():
            m.register(k, t, Kind.OPTIM_STATE)
        self.new = _rand(NUMEL, 68)
        return ts

    def op(self, m: TierManager, expected: dict[str, torch.Tensor]) -> None:
        gates.hold_others = True  # a's write lands once the registration waits
        try:
            if m.info("a").tier is not None:
                m.evict("a")
                assert _until(lambda: m.info("a").state is EntryState.WRITING)
            m.register("new", self.new, Kind.OPTIM_STATE)
        finally:
            gates.hold_others = False

    def after(self, expected: dict[str, torch.Tensor]) -> None:
        expected["new"] = self.new


class RegisterEvicting(Case):
    """A kind that lives in the host only: registering it evicts victims to make room."""

    name = "register, evicting"
    config = {"placement": {"grad32": ["host"]}}  # noqa: RUF012

    def setup(self, m: TierManager) -> dict[str, torch.Tensor]:
        ts = {k: _rand(NUMEL, 70 + i) for i, k in enumerate(("a", "b"))}
        for k, t in ts.items():
            m.register(k, t, Kind.OPTIM_STATE)
        self.new = _rand(NUMEL, 79)
        return ts

    def op(self, m: TierManager, expected: dict[str, torch.Tensor]) -> None:
        m.register("g", self.new, Kind.GRAD32)
        assert m.info("g").tier is Tier.HOST

    def after(self, expected: dict[str, torch.Tensor]) -> None:
        expected["g"] = self.new


class Unregister(Case):
    """Unregister waits for the read-ahead of the tensor under way."""

    name = "unregister"

    def setup(self, m: TierManager) -> dict[str, torch.Tensor]:
        ts = {k: _rand(NUMEL, 80 + i) for i, k in enumerate(("a", "b"))}
        for k, t in ts.items():
            m.register(k, t, Kind.OPTIM_STATE)
        m.evict("a").result()
        return ts

    def op(self, m: TierManager, expected: dict[str, torch.Tensor]) -> None:
        if "a" not in m:
            return  # the cut call had finished its work
        gates.hold_others = True  # the read-ahead lands only once unregister waits
        try:
            if m.prefetch(["a"]):
                assert _until(lambda: m.info("a").state is EntryState.READING)
            m.unregister("a")
        finally:
            gates.hold_others = False

    def after(self, expected: dict[str, torch.Tensor]) -> None:
        del expected["a"]


CASES = [
    FetchNvmeToHost(),
    FetchBehindAWrite(),
    FetchNvmeToDevice(),
    AssignNvmeToDevice(),
    FetchHostToDevice(),
    Evict(),
    PrefetchFetch(),
    Flush(),
    RegisterToNvme(),
    RegisterBehindAWrite(),
    RegisterEvicting(),
    Unregister(),
]


def _case_config(tmp_path: Path, case: Case) -> ManagerConfig:
    return _config(
        tmp_path,
        device_nbytes=NBYTES,
        host_nbytes=2 * NBYTES,
        nvme_dirs=[tmp_path / "swap0", tmp_path / "swap1"],
        **case.config,
    )


def _run_case(
    tmp_path: Path, case: Case, injector: Injector, gates: Gates
) -> tuple[BaseException | None, Injector]:
    """One run; returns what the operation raised (None: nothing was injected)."""
    injector.armed = False
    previous = signals.set_wait_hook(injector)
    try:
        return _run_case_hooked(tmp_path, case, injector, gates)
    finally:
        signals.set_wait_hook(previous)


def _run_case_hooked(
    tmp_path: Path, case: Case, injector: Injector, gates: Gates
) -> tuple[BaseException | None, Injector]:
    with TierManager(_case_config(tmp_path, case)) as m:
        expected = case.setup(m)
        raised: BaseException | None = None
        injector.armed = True
        try:
            case.op(m, expected)
        except AssertionError:
            raise
        except (KeyboardInterrupt, Exception) as exc:  # the injected one, or what it caused
            raised = exc
        finally:
            injector.armed = False
        if injector.injected is None:
            assert raised is None, f"{case.name}: raised {raised!r} with nothing injected"
        elif injector.injected_in_main:
            assert raised is not None, f"{case.name}: cut at {injector.injected}, nothing raised"
        # (Cut in a mover, an operation may succeed: a read-ahead that fails is dropped.)
        # The next allocations, where a block freed too early would be handed out again;
        # then the cut read lands.
        canaries = {f"canary{i}": _rand(NUMEL, 90 + i) for i in range(2)}
        for key, t in canaries.items():
            m.register(key, t, Kind.OPTIM_STATE)
        gates.open_all()
        _assert_not_wedged(m)
        _assert_budgets_exact(m)
        for key, t in {**expected, **canaries}.items():
            if key in m:
                _fetch_and_check(m, key, t)
        if raised is not None:
            case.op(m, expected)  # the cut call, retried
        case.after(expected)
        _assert_not_wedged(m)
        _assert_budgets_exact(m)
        assert sorted(m.keys()) == sorted({**expected, **canaries})
        for key, t in {**expected, **canaries}.items():
            _fetch_and_check(m, key, t)
    return raised, injector


def _wait_points(tmp_path: Path, case: Case, gates: Gates, *, any_thread: bool) -> list[str]:
    """The wait points a run passes (a few tries: whether a thread must wait for another
    depends on timing)."""
    names: list[str] = []
    for attempt in range(3):
        counter = Injector(None, Injected, any_thread=any_thread)
        _run_case(tmp_path / f"count{attempt}", case, counter, gates)
        names = counter.names
        if names:
            break
    return names


def _every_wait_point(
    tmp_path: Path,
    case: Case,
    gates: Gates,
    make: Callable[[], BaseException],
    *,
    any_thread: bool = False,
) -> dict[str, int]:
    """Cut ``case`` at each wait point in turn; returns name → times cut there."""
    names = _wait_points(tmp_path, case, gates, any_thread=any_thread)
    assert names, f"{case.name}: passes no wait point"
    return _cut_each(
        names, lambda at, run: _run_case(tmp_path / run, case, at, gates), make, any_thread
    )


def _cut_each(
    names: list[str],
    run: Callable[[Injector, str], object],
    make: Callable[[], BaseException],
    any_thread: bool,
    *,
    timing: frozenset[str] = frozenset(),
) -> dict[str, int]:
    """``run`` cut at each wait point that ``names`` lists (the k-th one of a name; how
    many times a thread waits for another can vary with timing, so a point that a run
    does not reach is tried again: once more, three times more for those in ``timing``,
    which alone may be missed for good). Returns name → times cut there."""
    cut: dict[str, int] = {}
    points = [(name, names[: i + 1].count(name)) for i, name in enumerate(names)]
    for name, k in points:
        for attempt in range(4 if name in timing else 2):
            injector = Injector((name, k), make, any_thread=any_thread)
            run(injector, f"{name}-{k}-{attempt}")
            if injector.injected is not None:
                cut[name] = cut.get(name, 0) + 1
                break
    assert set(cut) >= set(names) - timing, (names, cut)
    return cut


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_ctrl_c_at_every_wait_point(tmp_path: Path, case: Case, gated: Gates) -> None:
    _every_wait_point(tmp_path, case, gated, KeyboardInterrupt)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_an_error_at_every_wait_point(tmp_path: Path, case: Case, gated: Gates) -> None:
    _every_wait_point(tmp_path, case, gated, lambda: Injected("injected at a wait point"))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_an_error_at_every_wait_point_of_any_thread(
    tmp_path: Path, case: Case, gated: Gates
) -> None:
    """Movers and completions too (where a signal never lands, an error may)."""
    _every_wait_point(
        tmp_path, case, gated, lambda: OSError(5, "injected at a wait point"), any_thread=True
    )


# -- OffloadAdamW.step --------------------------------------------------------------------


def _snapshot(opt: OffloadAdamW) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    params = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    states = [opt._pipeline.read(i) for i in range(len(opt.sub_groups))]
    return params, states, opt.step_count


def _assert_snapshot(
    opt: OffloadAdamW, want: tuple[list[torch.Tensor], list[torch.Tensor], int]
) -> None:
    params, states, count = _snapshot(opt)
    assert count == want[2]
    for got, expected in zip(params, want[0], strict=True):
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), "parameters differ"
    for index, (got, expected) in enumerate(zip(states, want[1], strict=True)):
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), f"state {index}"


def _reference_steps(tmp_path: Path) -> list[tuple[list[torch.Tensor], list[torch.Tensor], int]]:
    model = _tiny_model(7)
    opt = _optimizer(model, tmp_path, "reference")
    try:
        out = []
        for seed in (1, 2):
            _grads(model, seed)
            opt.step()
            out.append(_snapshot(opt))
            opt.zero_grad()
        return out
    finally:
        opt.close()


def _cut_step(
    tmp_path: Path,
    injector: Injector,
    gates: Gates,
    reference: list[tuple[list[torch.Tensor], list[torch.Tensor], int]],
) -> BaseException | None:
    """Step 1 cut by ``injector``, retried; step 2; both bit-exact with ``reference``."""
    model = _tiny_model(7)
    opt = _optimizer(model, tmp_path, "cut")
    injector.armed = False
    previous = signals.set_wait_hook(injector)
    try:
        _grads(model, 1)
        raised: BaseException | None = None
        injector.armed = True
        try:
            opt.step()
        except AssertionError:
            raise
        except (KeyboardInterrupt, Exception) as exc:
            raised = exc
        finally:
            injector.armed = False
        if injector.injected is None or injector.injected_in_main:
            assert (raised is None) == (injector.injected is None), (injector.injected, raised)
        m = opt.manager
        canaries = {f"canary{i}": _rand(3 * SUB_GROUP, 90 + i) for i in range(2)}
        for key, t in canaries.items():
            m.register(key, t, Kind.OPTIM_STATE)
        gates.open_all()
        _assert_not_wedged(m)
        _assert_budgets_exact(m)
        for key, t in canaries.items():
            _check(m, key, t.view(torch.float32))
        if raised is not None:
            opt.step()  # the cut call, retried
        _assert_snapshot(opt, reference[0])
        opt.zero_grad()
        _grads(model, 2)
        opt.step()
        _assert_snapshot(opt, reference[1])
        _assert_not_wedged(m)
        _assert_budgets_exact(m)
        for key, t in canaries.items():
            _check(m, key, t)
        return raised
    finally:
        signals.set_wait_hook(previous)
        opt.close()


@pytest.mark.parametrize(
    ("make", "any_thread"),
    [
        (KeyboardInterrupt, False),
        (lambda: Injected("injected at a wait point"), False),
        (lambda: OSError(5, "injected at a wait point"), True),
    ],
    ids=["ctrl-c", "error", "error in any thread"],
)
def test_offload_adamw_step_cut_at_every_wait_point(
    tmp_path: Path, gated: Gates, make: Callable[[], BaseException], any_thread: bool
) -> None:
    """State on NVMe under a host budget of two of four sub-groups: the step streams.
    Cut at each wait point in turn, step() again finishes it bit-exact."""
    reference = _reference_steps(tmp_path)
    counter = Injector(None, make, any_thread=any_thread)
    _cut_step(tmp_path / "count", counter, gated, reference)
    names = counter.names
    assert "step.write" in names, names
    cut = _cut_each(
        names,
        lambda at, run: _cut_step(tmp_path / run, at, gated, reference),
        make,
        any_thread,
        # Timing: whether a fetch finds its sub-group being read ahead (it waits for it),
        # not yet started (it reads it itself), or its room taken by a write under way;
        # and whether a victim's write finds the write-behind window still held by the
        # write before it (not yet durable: the group commit gathers for up to 1 s). A
        # cut at that ``budget.reserve`` is proven deterministically by the case
        # "fetch nvme->host, victim behind a write".
        timing=frozenset({"manager.room", "manager.transfer", "store.read", "budget.reserve"}),
    )
    # Some fetch was cut. Which fetch waits a run passes, and how many times, is timing:
    # if no run reached the n-th one of those counted, cut the first one a run passes
    # (every run passes one: its first fetch of a sub-group on NVMe).
    fetch_waits = frozenset({"manager.transfer", "store.read"})
    for attempt in range(4):
        if fetch_waits & set(cut):
            break
        injector = Injector(None, make, any_thread=any_thread, first_of=fetch_waits)
        _cut_step(tmp_path / f"first-fetch-{attempt}", injector, gated, reference)
        if injector.injected is not None:
            cut[injector.injected] = cut.get(injector.injected, 0) + 1
    assert fetch_waits & set(cut), cut


# -- close ----------------------------------------------------------------------------------


def _cut_close(tmp_path: Path, injector: Injector, gates: Gates) -> None:
    """close() cut by ``injector`` (an eviction under way, tensors in every tier, never
    written): close() again finishes, and a reopened store has every tensor."""
    config = _config(
        tmp_path,
        device_nbytes=NBYTES,
        host_nbytes=2 * NBYTES,
        nvme_dirs=[tmp_path / "swap0", tmp_path / "swap1"],
        write_behind_nbytes=NBYTES,
    )
    expected = {k: _rand(NUMEL, 100 + i) for i, k in enumerate(("d", "h0", "h1", "n"))}
    injector.armed = False
    previous = signals.set_wait_hook(injector)
    try:
        m = TierManager(config)
        for k, t in expected.items():
            m.register(k, t, Kind.PARAM16)
        m.evict("h0")  # under way as close starts
        injector.armed = True
        try:
            m.close()
        except KeyboardInterrupt:
            assert injector.injected is not None
        finally:
            injector.armed = False
        gates.open_all()
        m.close()  # again: finishes
        m.close()  # idempotent
    finally:
        signals.set_wait_hook(previous)
    with TierManager.open(config) as reopened:
        assert sorted(reopened.keys()) == sorted(expected)
        for k, t in expected.items():
            _fetch_and_check(reopened, k, t)


def test_ctrl_c_at_every_wait_point_of_close(tmp_path: Path, gated: Gates) -> None:
    counter = Injector(None, KeyboardInterrupt)
    _cut_close(tmp_path / "count", counter, gated)
    names = counter.names
    assert {"manager.flush", "device.copy"} <= set(names), names
    _cut_each(
        names,
        lambda at, run: _cut_close(tmp_path / run, at, gated),
        KeyboardInterrupt,
        False,
        timing=frozenset({"manager.close", "manager.drain", "manager.room", "budget.reserve"}),
    )
