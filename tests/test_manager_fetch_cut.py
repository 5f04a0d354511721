"""Hole 1 of issue 29: an interrupt as ``fetch()`` returns.

Between the pin of a fetched entry and the caller receiving its tensor, the manager
counts the fetch, may log, and ends its signal section. A Ctrl-C delivered anywhere there
used to leave the entry IN_USE with no holder (``evict``/``unregister`` then raised
``EntryInUseError`` for good). These tests deliver a real SIGINT at *every* line the
main thread runs after the pin (a trace function counts the lines and raises the signal at
the n-th, for n = 1, 2, ... until a fetch completes untouched), on every fetch path, and
also make the post-pin steps raise; after each cut nothing may stay pinned and the key
fetches, evicts and unregisters normally.
"""

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
from swapper.manager.stats import StatsRecorder
from tiers import signals

KiB = 1024

#: No path runs anywhere near this many lines after its pin: the sweep must end by
#: itself (a fetch that ran to the end without reaching the n-th line).
_MAX_LINES = 5000


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
            stats_interval_s=1e-9,  # the log line runs on every fetch: one more step cut
        )
    )
    try:
        yield m
    finally:
        with contextlib.suppress(NotDurableError):
            m.close()


def _tensor(seed: int, numel: int = 1024) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


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
