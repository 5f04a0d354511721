"""The resident fetch (issue 14): a tensor already where it is fetched to is pinned in one
lock hold, handed out as the same view while its memory stays, counted as a hit; with
``in_place`` it is used wherever it is in memory; ``departures`` and ``resident_stamp``
tell a caller when nothing can have left a tier. And (issue 29, hole 1) an interrupt or
error anywhere between a fetch's pin and its return leaves nothing pinned."""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

from swapper.manager import EntryState, Kind, ManagerConfig, NotDurableError, Tier, TierManager
from swapper.manager.context import ManagerContext
from swapper.manager.stats import StatsRecorder
from tiers import signals

KiB = 1024


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[TierManager]:
    m = TierManager(
        ManagerConfig(
            device_nbytes=64 * KiB,
            host_nbytes=128 * KiB,
            nvme_dirs=[tmp_path / "nvme"],
            host_arena_nbytes=64 * KiB,
            timeout_s=10.0,
            close_timeout_s=10.0,
            device="cpu",
        )
    )
    try:
        yield m
    finally:
        with contextlib.suppress(NotDurableError):
            m.close()


def _tensor(seed: int, numel: int = 1024) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_one_view_per_block_and_counted_as_hits(manager: TierManager) -> None:
    a = _tensor(0)
    manager.register("a", a, Kind.PARAM16)
    assert manager.info("a").tier is Tier.DEVICE
    before = manager.stats()
    first = manager.fetch("a")
    second = manager.fetch("a")  # a second user: no transition, the same tensor
    assert first is second and torch.equal(first, a)
    manager.release("a", modified=False)
    manager.release("a", modified=False)
    after = manager.stats()
    assert after.fetches - before.fetches == 2
    assert after.prefetch_hits - before.prefetch_hits == 2
    assert after.stall_s == before.stall_s
    # moved to the host and back: new blocks, new views, the same bytes
    manager.evict("a", Tier.HOST).result()
    on_host = manager.fetch("a", Tier.HOST)
    assert on_host is not first and torch.equal(on_host, a)
    manager.release("a", modified=False)
    back = manager.fetch("a", Tier.DEVICE)
    assert back is not first and torch.equal(back, a)
    manager.release("a", modified=False)
    assert manager.info("a").users == 0 and manager.info("a").state is EntryState.RESIDENT


def test_in_place_uses_the_tier_it_is_in(manager: TierManager) -> None:
    a, b = _tensor(1), _tensor(2)
    manager.register("a", a, Kind.PARAM16)
    manager.register("b", b, Kind.PARAM16)
    before = manager.stats().moved(Tier.DEVICE, Tier.HOST).nbytes
    tensor = manager.fetch("a", Tier.HOST, in_place=True)  # in the device tier: stays
    tensor.add_(1)
    manager.release("a", modified=True)
    assert manager.info("a").tier is Tier.DEVICE
    assert manager.stats().moved(Tier.DEVICE, Tier.HOST).nbytes == before
    plain = manager.fetch("a", Tier.HOST)  # without in_place: moved to the host
    assert torch.equal(plain, a + 1)
    manager.release("a", modified=False)
    assert manager.info("a").tier is Tier.HOST
    manager.evict("b", Tier.NVME).result()  # in no memory tier: brought into the one asked
    assert torch.equal(manager.fetch("b", Tier.HOST, in_place=True), b)
    manager.release("b", modified=False)
    assert manager.info("b").tier is Tier.HOST


def test_departures_and_resident_stamp(manager: TierManager) -> None:
    for i, key in enumerate("abc"):
        manager.register(key, _tensor(i), Kind.PARAM16)
    keys = ["a", "b", "c"]
    stamp = manager.resident_stamp(keys, Tier.DEVICE)
    assert stamp is not None and stamp == manager.departures
    manager.fetch("b")  # fetches and releases in place move nothing
    manager.release("b")
    assert manager.departures == stamp
    manager.evict("b", Tier.HOST).result()
    assert manager.departures == stamp + 1
    assert manager.resident_stamp(keys, Tier.DEVICE) is None
    assert manager.resident_stamp(["a", "missing"], Tier.DEVICE) is None
    manager.fetch("b", Tier.DEVICE)
    manager.release("b")
    assert manager.departures == stamp + 2  # (it left the host tier)
    assert manager.resident_stamp(keys, Tier.DEVICE) == stamp + 2
    manager.register("tmp", _tensor(9), Kind.PARAM16)
    manager.unregister("tmp")  # forgotten, not departed
    assert manager.departures == stamp + 2


def test_signal_during_a_resident_fetch_leaves_nothing_pinned(
    manager: TierManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C arriving as the entry is pinned is delivered as the fetch ends, with the
    pin undone (as the full fetch does): nothing stays in use, the next fetch works."""
    manager.register("a", _tensor(3), Kind.PARAM16)
    real = ManagerContext.set_state

    def set_state(self: ManagerContext, entry: Any, new: EntryState) -> None:
        real(self, entry, new)
        if new is EntryState.IN_USE:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(ManagerContext, "set_state", set_state)
    with pytest.raises(KeyboardInterrupt):
        manager.fetch("a")
    monkeypatch.setattr(ManagerContext, "set_state", real)
    info = manager.info("a")
    assert info.users == 0 and info.state is EntryState.RESIDENT
    assert manager.stats().fetches == 0
    assert torch.equal(manager.fetch("a"), _tensor(3))
    manager.release("a", modified=False)


def test_fetch_resident_all_pins_every_key_or_none(manager: TierManager) -> None:
    """All keys resident: one call pins them all where they are (counted as hits), and
    release_all releases them (modified: a version bump each). One key on NVMe: None,
    and nothing is left pinned."""
    a, b = _tensor(1), _tensor(2)
    manager.register("a", a, Kind.PARAM16)
    manager.register("b", b, Kind.GRAD16)
    before = manager.stats()
    versions = [manager._ctx.entries[k].version for k in ("a", "b")]
    got = manager.fetch_resident_all(["a", "b"])
    assert got is not None
    assert torch.equal(got[0], a) and torch.equal(got[1], b)
    assert [manager.info(k).users for k in ("a", "b")] == [1, 1]
    assert manager.stats().fetches - before.fetches == 2
    assert manager.stats().prefetch_hits - before.prefetch_hits == 2
    manager.release_all(["a", "b"], modified=True)
    assert [manager.info(k).users for k in ("a", "b")] == [0, 0]
    assert [manager._ctx.entries[k].version for k in ("a", "b")] == [v + 1 for v in versions]
    manager.evict("b", Tier.NVME).result()
    assert manager.info("b").state is EntryState.ON_NVME
    assert manager.fetch_resident_all(["a", "b"]) is None
    assert [manager.info(k).users for k in ("a", "b")] == [0, 0]  # a's pin undone
    assert manager.info("a").state is EntryState.RESIDENT


# -- issue 29, hole 1: an interrupt as fetch() returns ------------------------------------
#
# Between the pin of a fetched entry and the caller receiving its tensor, the manager
# counts the fetch, may log, and ends its signal section. A Ctrl-C delivered anywhere there
# used to leave the entry IN_USE with no holder (evict/unregister then raised
# EntryInUseError for good). These tests deliver a real SIGINT at *every* line the main
# thread runs after the pin (a trace function counts the lines and raises the signal at
# the n-th, for n = 1, 2, ... until a fetch completes untouched), on every fetch path, and
# also make the post-pin steps raise; after each cut nothing may stay pinned and the key
# fetches, evicts and unregisters normally.

#: No path runs anywhere near this many lines after its pin: the sweep must end by
#: itself (a fetch that ran to the end without reaching the n-th line).
_MAX_LINES = 5000


class _SigintAtLine:
    """A trace function that raises a real SIGINT at the ``n``-th line run in the main
    thread once ``pinned()`` holds, while a signal section is open (outside one the
    signal would be raised in the caller's own bytecodes after the return: the window
    no code can close, see :mod:`tiers.signals`)."""

    def __init__(self, n: int, pinned: Callable[[], bool]) -> None:
        self.n = n
        self.pinned = pinned
        self.lines = 0
        self.fired = False
        self.where = ""

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        # Only inside a section (a test-only peek at its depth): the signal is then
        # recorded, as a real Ctrl-C arriving there is.
        if event == "line" and not self.fired and self.pinned() and signals._state.depth > 0:
            self.lines += 1
            if self.lines == self.n:
                self.fired = True
                self.where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
                signal.raise_signal(signal.SIGINT)
        return self


def _users(manager: TierManager, keys: list[str]) -> list[int]:
    return [manager.info(k).users for k in keys]


def _sweep(
    manager: TierManager,
    keys: list[str],
    prepare: Callable[[], None],
    fetch: Callable[[], list[torch.Tensor]],
    expected: list[torch.Tensor],
) -> int:
    """Cut ``fetch`` at the 1st, 2nd, ... post-pin line until it completes; returns how
    many cuts raised. After each: nothing pinned; after a completed one, the right data."""
    cuts = 0
    for n in range(1, _MAX_LINES):
        prepare()
        assert _users(manager, keys) == [0] * len(keys)
        tracer = _SigintAtLine(n, lambda: any(u > 0 for u in _users_raw(manager, keys)))
        sys.settrace(tracer)
        try:
            got = fetch()
        except KeyboardInterrupt:
            sys.settrace(None)
            assert tracer.fired
            cuts += 1
            for key in keys:
                info = manager.info(key)
                assert info.users == 0, (
                    f"cut at post-pin line {n} ({tracer.where}): {key} left pinned"
                )
                assert info.state is not EntryState.IN_USE
            continue
        finally:
            sys.settrace(None)
        if tracer.fired:  # recorded, but neither delivered nor left for the caller's code
            pytest.fail(f"SIGINT at post-pin line {n} ({tracer.where}) was not delivered")
        for tensor, want in zip(got, expected, strict=True):
            assert torch.equal(tensor, want)
        manager.release_all(keys, modified=False)
        return cuts
    pytest.fail(f"the fetch still ran after {_MAX_LINES} post-pin lines")


def _users_raw(manager: TierManager, keys: list[str]) -> list[int]:
    # (Without the manager's lock: info() takes it, and a trace function runs while the
    # fetch may hold it.)
    return [manager._ctx.entries[k].users for k in keys]


def _after(manager: TierManager, key: str, want: torch.Tensor) -> None:
    """The key fetches, evicts and unregisters normally after the cuts."""
    assert torch.equal(manager.fetch(key), want)
    manager.release(key, modified=False)
    manager.evict(key, Tier.NVME).result(timeout=10)
    assert manager.info(key).state is EntryState.ON_NVME
    assert torch.equal(manager.fetch(key, Tier.HOST), want)
    manager.release(key)
    manager.unregister(key)
    assert key not in manager


@pytest.mark.parametrize("path", ["resident", "from_nvme", "between_tiers"])
def test_sigint_at_every_post_pin_line_leaves_nothing_pinned(
    manager: TierManager, path: str
) -> None:
    a = _tensor(1)
    manager.register("a", a, Kind.PARAM16)

    def prepare() -> None:
        if path == "from_nvme":
            manager.evict("a", Tier.NVME).result(timeout=10)
        elif path == "between_tiers" and manager.info("a").tier is not Tier.HOST:
            manager.evict("a", Tier.HOST).result(timeout=10)

    target = Tier.DEVICE if path == "between_tiers" else Tier.HOST
    if path == "resident":
        manager.fetch("a", Tier.HOST)
        manager.release("a", modified=False)
    cuts = _sweep(manager, ["a"], prepare, lambda: [manager.fetch("a", target)], [a])
    assert cuts >= 3  # the counting, the log line and the section's end at least
    _after(manager, "a", a)


def test_sigint_at_every_post_pin_line_of_fetch_resident_all(manager: TierManager) -> None:
    a, b = _tensor(1), _tensor(2)
    manager.register("a", a, Kind.PARAM16)
    manager.register("b", b, Kind.GRAD16)

    def fetch() -> list[torch.Tensor]:
        got = manager.fetch_resident_all(["a", "b"])
        assert got is not None
        return got

    cuts = _sweep(manager, ["a", "b"], lambda: None, fetch, [a, b])
    assert cuts >= 2
    _after(manager, "a", a)
    _after(manager, "b", b)


@pytest.mark.parametrize("step", ["add", "hit", "log"])
@pytest.mark.parametrize("path", ["resident", "from_nvme"])
def test_post_pin_step_that_raises_undoes_the_pin(
    manager: TierManager, monkeypatch: pytest.MonkeyPatch, step: str, path: str
) -> None:
    """The counting and the log line raising (KeyboardInterrupt straight from them, as
    a handler run there would) leave the entry unpinned."""
    a = _tensor(3)
    manager.register("a", a, Kind.PARAM16)
    manager.fetch("a", Tier.HOST)
    manager.release("a", modified=False)
    if path == "from_nvme":
        manager.evict("a", Tier.NVME).result(timeout=10)

    def boom(*args: object, **kwargs: object) -> None:
        if manager._ctx.entries["a"].users > 0:
            raise KeyboardInterrupt

    if step == "log":
        monkeypatch.setattr(TierManager, "_maybe_log", boom)
    else:
        real = getattr(StatsRecorder, step)

        def counted(self: StatsRecorder, *args: Any, **kwargs: Any) -> None:
            boom()
            real(self, *args, **kwargs)

        monkeypatch.setattr(StatsRecorder, step, counted)
    reached = step == "log" or (step == "hit") == (path == "resident")
    if reached:
        with pytest.raises(KeyboardInterrupt):
            manager.fetch("a", Tier.HOST)
    else:
        manager.fetch("a", Tier.HOST)
        manager.release("a", modified=False)
    assert manager.info("a").users == 0
    monkeypatch.undo()
    _after(manager, "a", a)
