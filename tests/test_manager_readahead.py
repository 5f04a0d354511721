"""Read-ahead from NVMe into host memory is asynchronous: a mover thread issues the read and
goes on; the read's completion settles the entry. Held reads (a store whose ``read``
futures the test completes by hand) show what is in flight at each moment."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from swapper.manager import EntryState, Kind, ManagerConfig, NotDurableError, Tier, TierManager
from tiers.config import AioConfig
from tiers.errors import SwapCorruptionError, SwapIOError

KiB = 1024


def _config(tmp_path: Path, **overrides: Any) -> ManagerConfig:
    settings: dict[str, Any] = {
        "device_nbytes": 0,
        "host_nbytes": 256 * KiB,
        "nvme_dirs": [tmp_path / "a", tmp_path / "b"],
        "aio": AioConfig(block_size=64 * KiB, close_timeout_s=20),
        "placement": {Kind.OPTIM_STATE: (Tier.HOST, Tier.NVME)},
        "stripe_nbytes": 8 * KiB,
        "host_arena_nbytes": 64 * KiB,
        "timeout_s": 10.0,
        "close_timeout_s": 10.0,
        "device": "cpu",
        "mover_threads": 1,
    }
    settings.update(overrides)
    return ManagerConfig(**settings)


def _tensor(seed: int, numel: int = 4 * KiB) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


class HeldReads:
    """Wraps a store's ``read``: every read is issued to the disk, but the future the
    manager sees completes only when the test lets it go (or fails it)."""

    def __init__(self, store: Any) -> None:
        self._real = store.read
        self.issued: list[tuple[str, Future[int], Future[int]]] = []
        self.lock = threading.Lock()
        store.read = self.read

    def read(self, key: str, out: torch.Tensor) -> Future[int]:
        held: Future[int] = Future()
        held.set_running_or_notify_cancel()
        real = self._real(key, out)
        with self.lock:
            self.issued.append((key, real, held))
        return held

    def count(self) -> int:
        with self.lock:
            return len(self.issued)

    def release(self, *, fail: BaseException | None = None) -> None:
        """Complete every held read: as the disk did, or with ``fail``."""
        with self.lock:
            issued, self.issued = self.issued, []
        for _key, real, held in issued:
            error = real.exception(timeout=10)
            if fail is not None or error is not None:
                held.set_exception(fail if fail is not None else error)  # type: ignore[arg-type]
            else:
                held.set_result(real.result())


def _wait_for(predicate: Any, timeout_s: float = 10.0) -> None:
    event = threading.Event()
    for _ in range(int(timeout_s / 0.005)):
        if predicate():
            return
        event.wait(0.005)
    raise AssertionError("condition not reached in time")


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[TierManager]:
    m = TierManager(_config(tmp_path))
    try:
        yield m
    finally:
        with contextlib.suppress(NotDurableError):
            m.close()


def _on_nvme(m: TierManager, n: int) -> dict[str, torch.Tensor]:
    tensors = {f"k{i}": _tensor(i) for i in range(n)}
    for key, t in tensors.items():
        m.register(key, t, "optim_state")
    for key in tensors:
        m.evict(key).result(timeout=10)
        assert m.info(key).state is EntryState.ON_NVME
    return tensors


def test_one_mover_thread_keeps_every_read_ahead_in_flight(manager: TierManager) -> None:
    """With one mover thread and reads that do not complete, all three read-aheads are
    issued: the thread does not wait for a read before taking the next request."""
    tensors = _on_nvme(manager, 3)
    held = HeldReads(manager._ctx.nvme())
    assert manager.prefetch(list(tensors), Tier.HOST) == 3
    _wait_for(lambda: held.count() == 3)
    for key in tensors:
        assert manager.info(key).state is EntryState.READING
    held.release()
    for key, t in tensors.items():
        got = manager.fetch(key, Tier.HOST)
        assert torch.equal(got, t)
        manager.release(key, modified=False)
    stats = manager.stats()
    assert stats.prefetch_hits + stats.prefetch_misses == 3 and stats.prefetch_dropped == 0
    assert manager._ctx.state_readahead.used_nbytes == 0  # windows given back at fetch


def test_a_fetch_waits_for_the_read_ahead_of_its_key(manager: TierManager) -> None:
    tensors = _on_nvme(manager, 1)
    held = HeldReads(manager._ctx.nvme())
    manager.prefetch(["k0"], Tier.HOST)
    _wait_for(lambda: held.count() == 1)
    result: dict[str, torch.Tensor] = {}
    fetcher = threading.Thread(target=lambda: result.update(t=manager.fetch("k0", Tier.HOST)))
    fetcher.start()
    fetcher.join(0.2)
    assert fetcher.is_alive() and held.count() == 1  # waiting, not reading it again
    held.release()
    fetcher.join(10)
    assert torch.equal(result["t"], tensors["k0"])
    manager.release("k0", modified=False)


def test_a_failed_read_ahead_leaves_the_entry_on_nvme_and_frees_everything(
    manager: TierManager,
) -> None:
    tensors = _on_nvme(manager, 2)
    held = HeldReads(manager._ctx.nvme())
    host_before = manager._ctx.host.budget.used_nbytes
    manager.prefetch(list(tensors), Tier.HOST)
    _wait_for(lambda: held.count() == 2)
    held.release(fail=SwapIOError(5, "injected read error", "x"))
    _wait_for(lambda: all(manager.info(k).state is EntryState.ON_NVME for k in tensors))
    assert manager._ctx.state_readahead.used_nbytes == 0
    assert manager._ctx.host.budget.used_nbytes == host_before
    assert manager.stats().prefetch_dropped == 2
    # The next fetch reads it again, from the real store.
    manager._ctx.nvme().read = held._real  # type: ignore[method-assign]
    for key, t in tensors.items():
        assert torch.equal(manager.fetch(key, Tier.HOST), t)
        manager.release(key)


def test_close_waits_for_read_aheads_in_flight(tmp_path: Path) -> None:
    m = TierManager(_config(tmp_path))
    tensors = _on_nvme(m, 2)
    held = HeldReads(m._ctx.nvme())
    m.prefetch(list(tensors), Tier.HOST)
    _wait_for(lambda: held.count() == 2)
    closer = threading.Thread(target=m.close)
    closer.start()
    closer.join(0.3)
    assert closer.is_alive()  # the buffers still belong to the reads
    held.release()
    closer.join(20)
    assert not closer.is_alive()
    reopened = TierManager.open(_config(tmp_path))
    try:
        for key, t in tensors.items():
            assert torch.equal(reopened.fetch(key, Tier.HOST), t)
            reopened.release(key, modified=False)
    finally:
        reopened.close(remove=True)


def test_a_corrupted_chunk_read_ahead_is_refused_and_the_fetch_raises(
    manager: TierManager,
) -> None:
    """A read-ahead that fails verification is dropped (the entry stays on NVMe); the
    fetch that follows reads it again and raises the corruption, naming the key."""
    _on_nvme(manager, 1)
    store = manager._ctx.nvme()
    extent = store.info("optim_state/k0").extents[0]
    path = store.dirs[extent.dir_index] / f"{store.name}.bin"
    with open(path, "r+b") as f:
        f.seek(extent.offset + 5)
        byte = f.read(1)
        f.seek(extent.offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    manager.prefetch(["k0"], Tier.HOST)
    _wait_for(lambda: manager.stats().prefetch_dropped == 1)
    assert manager.info("k0").state is EntryState.ON_NVME
    with pytest.raises(SwapCorruptionError, match="k0"):
        manager.fetch("k0", Tier.HOST)
    assert manager.info("k0").state is EntryState.ON_NVME


def test_optimizer_state_has_its_own_read_ahead_window(tmp_path: Path) -> None:
    """Parameters read ahead up to the whole window (the next forward's, while a step
    streams its state) do not make a sub-group's read-ahead be dropped: optimizer state
    has a window of its own, of the same size, where a state larger than the window still
    goes alone (one sub-group at a time)."""
    window = 16 * KiB
    m = TierManager(_config(tmp_path, prefetch_window_nbytes=window))
    try:
        param = _tensor(0, numel=window // 4)
        m.register("p", param, "param16")
        states = {f"s{i}": _tensor(i + 1, numel=2 * window // 4) for i in range(2)}
        for key, t in states.items():
            m.register(key, t, "optim_state")
        for key in ("p", *states):
            m.evict(key).result(timeout=10)
        # (a read-ahead holds its share of the window until the key is fetched)
        assert m.prefetch(["p"], Tier.HOST) == 1  # the whole window
        assert m.prefetch(["s0"], Tier.HOST) == 1  # its own window: not dropped
        assert m.prefetch(["s1"], Tier.HOST) == 0  # that one is full: one at a time
        assert m.stats().prefetch_dropped == 1
        _wait_for(lambda: all(m.info(k).state is EntryState.RESIDENT for k in ("p", "s0")))
        for key, t in {"p": param, **states}.items():
            assert torch.equal(m.fetch(key, Tier.HOST), t)
            m.release(key, modified=False)
        assert m._ctx.readahead.used_nbytes == m._ctx.state_readahead.used_nbytes == 0
    finally:
        with contextlib.suppress(NotDurableError):
            m.close()
