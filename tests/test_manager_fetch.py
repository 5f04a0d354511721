"""The resident fetch (issue 14): a tensor already where it is fetched to is pinned in one
lock hold, handed out as the same view while its memory stays, counted as a hit; with
``in_place`` it is used wherever it is in memory; ``departures`` and ``resident_stamp``
tell a caller when nothing can have left a tier."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from swapper.manager import EntryState, Kind, ManagerConfig, NotDurableError, Tier, TierManager
from swapper.manager.context import ManagerContext

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
