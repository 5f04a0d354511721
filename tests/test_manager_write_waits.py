"""The manager's waits on writes to NVMe: a waiter hurries the store's group commit, and a
registration's wait for its write ends at ``timeout_s``."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from swapper.manager import (
    EntryState,
    Kind,
    ManagerClosedError,
    ManagerConfig,
    ManagerTimeout,
    NotDurableError,
    Tier,
    TierManager,
)
from tiers.aio import IOFuture
from tiers.aio.engine import Op

KiB = 1024


def _config(tmp_path: Path, **overrides: Any) -> ManagerConfig:
    settings: dict[str, Any] = {
        "device_nbytes": 64 * KiB,
        "host_nbytes": 128 * KiB,
        "nvme_dirs": [tmp_path / "nvme"],
        "host_arena_nbytes": 64 * KiB,
        "timeout_s": 10.0,
        "close_timeout_s": 10.0,
        "device": "cpu",
    }
    settings.update(overrides)
    return ManagerConfig(**settings)


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[TierManager]:
    m = TierManager(_config(tmp_path))
    try:
        yield m
    finally:
        with contextlib.suppress(NotDurableError):
            m.close()


def _tensor(seed: int, numel: int = 1024) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


class _HeldWrites:
    """The engine's pwrite held (issued for real only at ``release``) while ``holding``."""

    def __init__(self, engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        self.real, self.holding, self.held = engine.pwrite, True, 0
        self.gate = threading.Event()
        monkeypatch.setattr(engine, "pwrite", self)

    def __call__(self, buffer: Any, file: Any, offset: int = 0, nbytes: int | None = None) -> Any:
        if not self.holding:
            return self.real(buffer, file, offset, nbytes)
        self.held += 1
        proxy = IOFuture(Op.WRITE, str(file.path), offset, buffer.numel())

        def later() -> None:
            self.gate.wait(20)
            try:
                proxy.set_result(self.real(buffer, file, offset, nbytes).result())
            except BaseException as exc:
                proxy.set_exception(exc)

        threading.Thread(target=later, daemon=True).start()
        return proxy

    def wait_held(self) -> None:
        deadline = time.monotonic() + 10
        while not self.held and time.monotonic() < deadline:
            time.sleep(0.001)
        assert self.held


def test_a_fetch_of_a_key_being_written_hurries_its_commit(
    manager: TierManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store's group commit waits (up to GATHER_S) for other writes in flight; a fetch
    waiting for a key's eviction to be durable must not wait for them."""
    store = manager._ctx.nvme()  # pyright: ignore[reportPrivateUsage]
    monkeypatch.setattr(store._committer, "_gather_s", 30.0)  # pyright: ignore[reportPrivateUsage]
    a, b = _tensor(1), _tensor(2)
    manager.register("a", a.clone(), Kind.OPTIM_STATE)
    manager.register("b", b.clone(), Kind.OPTIM_STATE)
    held = _HeldWrites(manager._ctx.engine, monkeypatch)  # pyright: ignore[reportPrivateUsage]
    slow = manager.evict("b", Tier.NVME)
    held.wait_held()
    time.sleep(0.1)  # the rest of b's pieces are issued in the same call
    held.holding = False
    start = time.monotonic()
    manager.evict("a", Tier.NVME)  # not waited for: the fetch below waits for it
    entry = manager._ctx.entries["a"]  # pyright: ignore[reportPrivateUsage]
    while entry.state is not EntryState.WRITING and time.monotonic() - start < 10:
        time.sleep(0.001)  # the eviction is a mover job: wait until it has started
    assert entry.state is EntryState.WRITING
    fetched = manager.fetch("a", Tier.HOST)
    assert time.monotonic() - start < 5
    assert torch.equal(fetched, a)
    manager.release("a")
    assert not slow.done()  # b's write is still in flight: a committed without it
    held.gate.set()
    slow.result(timeout=10)
    assert torch.equal(manager.fetch("b", Tier.HOST), b)
    manager.release("b")


def test_a_registration_written_to_nvme_waits_at_most_timeout_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = 8 * KiB
    m = TierManager(_config(tmp_path, timeout_s=0.5, host_nbytes=small, host_arena_nbytes=small))
    try:
        held = _HeldWrites(m._ctx.engine, monkeypatch)  # pyright: ignore[reportPrivateUsage]
        timer = threading.Timer(8, held.gate.set)  # ends the write if nothing else does
        timer.start()
        start = time.monotonic()
        with pytest.raises(ManagerTimeout, match=r"key='k'.*timeout_s=0\.5"):
            m.register("k", _tensor(3, 8192), Kind.OPTIM_STATE)  # fits no memory tier: to NVMe
        assert time.monotonic() - start < 4
        held.gate.set()
        timer.cancel()
        held.holding = False
        # The abandoned write ends and undoes the registration: the key is free again.
        deadline = time.monotonic() + 20
        while "k" in m and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "k" not in m
    finally:
        with contextlib.suppress(NotDurableError):
            m.close()


def test_close_remove_frees_nothing_while_a_write_is_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close(remove=True) past close_timeout_s with an eviction's write still in flight
    used to free the entry's memory (and close the store) under the write; it now raises,
    keeps everything open, and a second close() finishes once the write has ended."""
    m = TierManager(_config(tmp_path, close_timeout_s=0.3))
    m.register("b", _tensor(2), Kind.OPTIM_STATE)
    held = _HeldWrites(m._ctx.engine, monkeypatch)  # pyright: ignore[reportPrivateUsage]
    timer = threading.Timer(15, held.gate.set)  # ends the write if nothing else does
    timer.start()
    try:
        evicted = m.evict("b", Tier.NVME)
        held.wait_held()
        entry = m._ctx.entries["b"]  # pyright: ignore[reportPrivateUsage]
        block = entry.block
        assert entry.state is EntryState.WRITING and block is not None
        with pytest.raises(NotDurableError, match=r"remove=True.*'b'.*close\(\) again") as info:
            m.close(remove=True)
        assert info.value.keys == ["b"]
        assert entry.block is block and entry.state is EntryState.WRITING  # not freed
        assert (tmp_path / "nvme").exists() and any((tmp_path / "nvme").iterdir())
        held.gate.set()
        evicted.result(timeout=10)
        m.close(remove=True)
        assert entry.block is None
    finally:
        held.gate.set()
        timer.cancel()
        with contextlib.suppress(NotDurableError):
            m.close(remove=True)
    nvme = tmp_path / "nvme"  # the store deleted (its directory too, made by it)
    assert not nvme.exists() or not [p for p in nvme.iterdir() if p.suffix in (".bin", ".json")]


def test_close_remove_cancels_queued_evictions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Evictions queued behind busy mover threads when close(remove=True) begins are not
    run (their writes would go into a store about to be deleted): their futures fail
    naming remove=True, and nothing is written."""
    m = TierManager(_config(tmp_path, mover_threads=1))
    ctx = m._ctx  # pyright: ignore[reportPrivateUsage]
    for i in range(3):
        m.register(f"k{i}", _tensor(i), Kind.OPTIM_STATE)
    gate = threading.Event()
    with ctx.cond:  # the only mover thread busy: the evictions below stay queued
        m._jobs.submit(gate.wait, 20)  # pyright: ignore[reportPrivateUsage]
    writes: list[int] = []
    real = ctx.engine.pwrite  # type: ignore[union-attr]

    def counting(*args: Any, **kwargs: Any) -> Any:
        writes.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ctx.engine, "pwrite", counting)
    futures = [m.evict(f"k{i}", Tier.NVME) for i in range(3)]
    closer = threading.Thread(target=m.close, kwargs={"remove": True})
    closer.start()
    deadline = time.monotonic() + 10
    while not ctx.closing and time.monotonic() < deadline:
        time.sleep(0.001)
    assert ctx.closing
    gate.set()
    closer.join(20)
    assert not closer.is_alive()
    for future in futures:
        with pytest.raises(ManagerClosedError, match=r"cancelled: close\(remove=True\)"):
            future.result(timeout=10)
    assert writes == []
    assert ctx.closed
