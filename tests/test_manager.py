"""Tests of swapper.manager: placement, fetch/evict/prefetch, faults, threads, reopen, a
stateful property test over random operation sequences."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from swapper.manager import (
    AccessOrder,
    EntryInUseError,
    EntryState,
    IllegalTransitionError,
    KeyExistsError,
    Kind,
    ManagerClosedError,
    ManagerConfig,
    NotDurableError,
    NotInUseError,
    Policy,
    SwapEntry,
    Tier,
    TierManager,
    UnknownKeyError,
)
from swapper.manager.policy import choose_victims
from tiers.budget import BudgetExceededError, BudgetTimeout
from tiers.config import AioConfig
from tiers.errors import SwapConfigError, SwapIOError, SwapNoSpaceError
from tiers.nvme import StoreExistsError

KiB = 1024
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _config(dirs: list[Path] | None, **overrides: Any) -> ManagerConfig:
    settings_: dict[str, Any] = {
        "device_nbytes": 64 * KiB,
        "host_nbytes": 128 * KiB,
        "nvme_dirs": dirs or (),
        "aio": AioConfig(block_size=64 * KiB, close_timeout_s=20),
        "stripe_nbytes": 8 * KiB,
        "host_arena_nbytes": 64 * KiB,
        "timeout_s": 10.0,
        "close_timeout_s": 10.0,
        "device": "cpu",
    }
    settings_.update(overrides)
    return ManagerConfig(**settings_)


@pytest.fixture
def dirs(tmp_path: Path) -> list[Path]:
    return [tmp_path / "nvme0", tmp_path / "nvme1"]


@pytest.fixture
def manager(dirs: list[Path]) -> Iterator[TierManager]:
    m = TierManager(_config(dirs))
    try:
        yield m
    finally:
        with contextlib.suppress(NotDurableError):
            m.close()


def _rand(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs and all), so only a byte-exact copy compares equal."""
    numel = int(torch.Size(shape).numel())
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    dense = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach().cpu())  # any strides, 0-d
    return dense.reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def _until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


def _check(m: TierManager, key: str, expected: torch.Tensor, tier: Tier | None = None) -> None:
    got = m.fetch(key, tier)
    try:
        assert _same(got, expected), key
    finally:
        m.release(key, modified=False)


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"device_nbytes": -1}, "device_nbytes"),
        ({"host_nbytes": "1 GiBs"}, "host_nbytes"),
        ({"nvme_dirs": "/tmp/one"}, "nvme_dirs"),
        ({"placement": {"bogus": ["host"]}}, "placement"),
        ({"placement": {"param16": ["gpu"]}}, "param16"),
        ({"placement": {"param16": []}}, "param16"),
        ({"placement": {"param16": ["host", "host"]}}, "param16"),
        ({"placement": {"param16": "host"}}, "param16"),
        ({"policy": "mru"}, "policy"),
        ({"prefetch_window_nbytes": 1 << 30}, "prefetch_window_nbytes"),
        ({"write_behind_nbytes": 0}, "write_behind_nbytes"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"close_timeout_s": float("nan")}, "close_timeout_s"),
        ({"stats_interval_s": -1}, "stats_interval_s"),
        ({"mover_threads": 0}, "mover_threads"),
        ({"stripe_nbytes": 1000}, "stripe_nbytes"),
        ({"host_arena_nbytes": 0}, "host_arena_nbytes"),
        ({"aio": {"backend": "threads"}}, "aio"),
        ({"checksum": "yes"}, "checksum"),
        ({"host_nbytes": 0, "prefetch_window_nbytes": None}, "host_nbytes=0"),
    ],
)
def test_config_errors_name_the_setting(
    dirs: list[Path], overrides: dict[str, Any], name: str
) -> None:
    with pytest.raises(SwapConfigError, match=name):
        _config(dirs, **overrides)


def test_config_defaults_and_normalisation(dirs: list[Path]) -> None:
    config = _config(dirs, policy="lru", placement={"optim_state": ["nvme"]})
    assert config.policy is Policy.LRU
    assert config.nvme_dirs == tuple(dirs)
    assert config.placement[Kind.PARAM16] == (Tier.DEVICE, Tier.HOST, Tier.NVME)
    assert config.placement[Kind.OPTIM_STATE] == (Tier.NVME,)
    assert config.prefetch_window_nbytes == config.write_behind_nbytes == 64 * KiB
    no_nvme = _config(None)
    assert Tier.NVME not in no_nvme.placement[Kind.OPTIM_STATE]
    with pytest.raises(SwapConfigError, match="nvme_dirs is empty"):
        _config(None, placement={"param16": ["host", "nvme"]})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.host_nbytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        ManagerConfig(1, 2)  # type: ignore[misc]


# -- placement, fetch, release ------------------------------------------------------------


def test_register_takes_the_fastest_tier_with_room(manager: TierManager) -> None:
    tensors = {f"p{i}": _rand(torch.float16, (8 * KiB,), i) for i in range(11)}  # 16 KiB each
    for key, t in tensors.items():
        manager.register(key, t, Kind.PARAM16)
    where = [manager.info(k).tier for k in tensors]
    assert where == [Tier.DEVICE] * 4 + [Tier.HOST] * 7
    manager.register("o", _rand(torch.float32, (4 * KiB,), 9), "optim_state")
    assert manager.info("o").tier is Tier.HOST and manager.info("o").home is Tier.HOST
    # Host is full now (8 x 16 KiB): the next one goes straight to NVMe, evicting nothing.
    manager.register("late", _rand(torch.bfloat16, (8 * KiB,), 10), Kind.GRAD16)
    info = manager.info("late")
    assert info.state is EntryState.ON_NVME and info.tier is None and info.clean
    assert info.home is Tier.DEVICE
    for key, t in tensors.items():
        _check(manager, key, t)


def test_fetch_marks_in_use_and_release_makes_it_evictable(manager: TierManager) -> None:
    t = _rand(torch.bfloat16, (3, 5, 7), 1)
    manager.register("w", t, "param16")
    got = manager.fetch("w")
    assert _same(got, t) and got.device.type == "cpu"
    assert manager.info("w").state is EntryState.IN_USE and manager.info("w").users == 1
    again = manager.fetch("w")  # a second user, same tier
    assert manager.info("w").users == 2 and again.data_ptr() == got.data_ptr()
    with pytest.raises(EntryInUseError, match="'w'"):
        manager.evict("w")
    with pytest.raises(EntryInUseError, match=r"'w'.*in use in device"):
        manager.fetch("w", Tier.HOST, timeout_s=1)
    manager.release("w", modified=False)
    manager.release("w", modified=False)
    assert manager.info("w").state is EntryState.RESIDENT
    with pytest.raises(NotInUseError, match="'w'"):
        manager.release("w")
    # Moving between memory tiers on fetch.
    host = manager.fetch("w", "host")
    assert _same(host, t) and manager.info("w").tier is Tier.HOST
    manager.release("w")
    assert manager.stats().moved(Tier.DEVICE, Tier.HOST).nbytes == t.numel() * 2


def test_unknown_keys_are_named(manager: TierManager) -> None:
    for call in (
        lambda: manager.fetch("nope"),
        lambda: manager.release("nope"),
        lambda: manager.evict("nope"),
        lambda: manager.unregister("nope"),
        lambda: manager.info("nope"),
        lambda: manager.prefetch(["nope"]),
    ):
        with pytest.raises(UnknownKeyError, match="key='nope'"):
            call()


def test_bad_arguments(manager: TierManager) -> None:
    manager.register("x", torch.zeros(4), "param16")
    with pytest.raises(KeyExistsError, match="key='x'"):
        manager.register("x", torch.zeros(4), "grad16")
    with pytest.raises(TypeError, match="key"):
        manager.register("", torch.zeros(4), "param16")
    with pytest.raises(ValueError, match="kind='weights'"):
        manager.register("y", torch.zeros(4), "weights")
    with pytest.raises(ValueError, match="tier must be"):
        manager.fetch("x", Tier.NVME)
    with pytest.raises(ValueError, match="down"):
        manager.evict("x", Tier.DEVICE)
    with pytest.raises(IllegalTransitionError, match="on_nvme -> in_use"):
        entry = SwapEntry("e", Kind.PARAM16, torch.float32, (1,), 4, Tier.HOST)
        entry.transition(EntryState.ON_NVME)
        entry.transition(EntryState.IN_USE)


def test_too_large_for_every_memory_tier_goes_to_nvme(manager: TierManager) -> None:
    big = _rand(torch.float32, (40 * KiB,), 3)  # 160 KiB > host 128 KiB > device 64 KiB
    manager.register("big", big, "param16")
    info = manager.info("big")
    assert info.state is EntryState.ON_NVME and info.home is Tier.NVME
    assert manager.stats().moved(Tier.HOST, Tier.NVME).nbytes == 160 * KiB
    with pytest.raises(BudgetExceededError, match=r"key='big'.*160 KiB.*'device'"):
        manager.fetch("big")
    with pytest.raises(BudgetExceededError, match=r"key='big'.*'host'"):
        manager.fetch("big", "host")
    manager.unregister("big")


def test_too_large_without_nvme_fails_with_the_budget_error() -> None:
    with TierManager(_config(None, timeout_s=0.3)) as m:
        with pytest.raises(BudgetExceededError) as info:
            m.register("huge", torch.zeros(64 * KiB), "param16")  # 256 KiB
        message = str(info.value)
        assert "key='huge'" in message and "256 KiB" in message and "'host'" in message
        assert "huge" not in m
        # Without NVMe, a full device demotes to host, and a full host just waits.
        for i in range(12):
            m.register(f"t{i}", torch.full((4 * KiB,), float(i)), "param16")  # 16 KiB each
        with pytest.raises(BudgetTimeout):
            m.register("no-room", torch.zeros(4 * KiB), "optim_state")
        assert "no-room" not in m


def test_non_contiguous_input_is_copied_once(
    manager: TierManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _rand(torch.float16, (64, 48), 5)
    views = {
        "t": base.t(),
        "s": base[::2, 1::3],
        "big": _rand(torch.float32, (200, 256), 6)[:, ::2],
    }
    expected = {k: v.clone() for k, v in views.items()}

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("clone()/contiguous() would copy the tensor a second time")

    monkeypatch.setattr(torch.Tensor, "clone", forbidden)
    monkeypatch.setattr(torch.Tensor, "contiguous", forbidden)
    manager.register("t", views["t"], "param16")
    manager.register("s", views["s"], "optim_state")
    manager.register("big", views["big"], "param16")  # 100 KiB: host
    manager.register("ssd", _rand(torch.float32, (300, 256), 7)[:, ::2], "param16")  # NVMe
    monkeypatch.undo()
    assert manager.info("ssd").state is EntryState.ON_NVME
    for key, t in expected.items():
        _check(manager, key, t)


# -- evict, prefetch, clean copies ------------------------------------------------------------


def test_evict_is_write_behind_and_frees_memory_only_when_durable(
    manager: TierManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = _rand(torch.float32, (8 * KiB,), 11)  # 32 KiB
    manager.register("o", t, "optim_state")
    store = manager._ctx.store
    gate = threading.Event()
    real_write = store.write

    def slow_write(key: str, tensor: torch.Tensor) -> concurrent.futures.Future[int]:
        inner = real_write(key, tensor)
        outer: concurrent.futures.Future[int] = concurrent.futures.Future()
        inner.add_done_callback(
            lambda f: threading.Thread(
                target=lambda: (gate.wait(), outer.set_result(f.result()))
            ).start()
        )
        return outer

    monkeypatch.setattr(store, "write", slow_write)
    start = time.monotonic()
    future = manager.evict("o")
    assert time.monotonic() - start < 0.5  # returns at once
    _until(lambda: manager.info("o").state is EntryState.WRITING)
    time.sleep(0.05)
    assert not future.done()
    assert manager.stats().tiers[Tier.HOST].used_nbytes == 32 * KiB  # still held
    gate.set()
    assert future.result(timeout=10) is None
    info = manager.info("o")
    assert info.state is EntryState.ON_NVME and info.clean
    assert manager.stats().tiers[Tier.HOST].used_nbytes == 0
    _check(manager, "o", t, Tier.HOST)


def test_clean_copy_is_reused_without_rewriting(manager: TierManager) -> None:
    t = _rand(torch.bfloat16, (16 * KiB,), 12)  # 32 KiB
    manager.register("p", t, "param16")
    manager.evict("p").result(timeout=10)
    written = manager.stats().moved(Tier.HOST, Tier.NVME).nbytes
    assert written == 32 * KiB
    _check(manager, "p", t)  # read back, released with modified=False
    assert manager.info("p").clean
    manager.evict("p").result(timeout=10)
    assert manager.stats().moved(Tier.HOST, Tier.NVME).nbytes == written  # nothing rewritten
    got = manager.fetch("p")
    got.add_(1)
    manager.release("p")  # modified: the NVMe copy is stale now
    assert not manager.info("p").clean
    manager.evict("p").result(timeout=10)
    assert manager.stats().moved(Tier.HOST, Tier.NVME).nbytes == 2 * written
    _check(manager, "p", t + 1)


def test_evict_to_host_and_from_device_to_nvme(manager: TierManager) -> None:
    t = _rand(torch.float16, (4 * KiB,), 13)
    manager.register("d", t, "grad16")
    assert manager.info("d").tier is Tier.DEVICE
    manager.evict("d", "host").result(timeout=10)
    assert manager.info("d").tier is Tier.HOST
    manager.evict("d", "host").result(timeout=10)  # already there: nothing to do
    _check(manager, "d", t, Tier.DEVICE)
    manager.evict("d").result(timeout=10)  # device -> NVMe, staged through host
    stats = manager.stats()
    assert manager.info("d").state is EntryState.ON_NVME
    assert stats.moved(Tier.DEVICE, Tier.HOST).count == 2
    assert stats.tiers[Tier.HOST].used_nbytes == 0 and stats.tiers[Tier.DEVICE].used_nbytes == 0
    _check(manager, "d", t)


def test_prefetch_reads_ahead_and_fetch_counts_a_hit(manager: TierManager) -> None:
    t = _rand(torch.float32, (4 * KiB,), 14)
    manager.register("a", t, "param16")
    manager.evict("a").result(timeout=10)
    assert manager.prefetch(["a"]) == 1
    assert manager.prefetch(["a"]) == 0  # already requested
    _until(
        lambda: (
            manager.info("a").tier is Tier.DEVICE
            and manager._ctx.entries["a"].prefetch.value == "none"
        )
    )
    _check(manager, "a", t)
    stats = manager.stats()
    assert stats.prefetch_hits == 1 and stats.prefetch_misses == 0 and stats.fetches == 1
    assert stats.stall_s == 0.0
    assert stats.moved(Tier.NVME, Tier.HOST).nbytes == 16 * KiB
    assert stats.moved(Tier.HOST, Tier.DEVICE).nbytes == 16 * KiB
    assert manager._ctx.readahead.used_nbytes == 0  # the window is given back on fetch


def test_prefetch_never_blocks_and_takes_no_room_from_tensors_in_use(manager: TierManager) -> None:
    held = {f"h{i}": _rand(torch.float32, (4 * KiB,), i) for i in range(4)}  # fill the device
    for key, t in held.items():
        manager.register(key, t, "param16")
        manager.fetch(key)
    manager.register("x", _rand(torch.float32, (4 * KiB,), 99), "optim_state")
    start = time.monotonic()
    manager.prefetch(["x"], Tier.DEVICE)
    assert time.monotonic() - start < 0.5
    _until(lambda: manager._ctx.entries["x"].prefetch.value == "none")
    assert manager.info("x").tier is Tier.HOST  # no room: dropped, nothing evicted
    assert manager.stats().prefetch_dropped == 1
    for key in held:
        assert manager.info(key).state is EntryState.IN_USE
        manager.release(key)


def test_in_use_entries_are_never_victims(manager: TierManager) -> None:
    for i in range(4):
        manager.register(f"h{i}", torch.full((4 * KiB,), float(i)), "param16")
        manager.fetch(f"h{i}")
    manager.register("x", torch.ones(4 * KiB), "optim_state")
    with pytest.raises(BudgetTimeout, match="'h0', 'h1', 'h2', 'h3'"):
        manager.fetch("x", Tier.DEVICE, timeout_s=0.2)
    manager.release("h2")
    got = manager.fetch("x", Tier.DEVICE)  # h2 is the only possible victim
    assert bool((got == 1).all()) and manager.info("h2").tier is Tier.HOST
    manager.release("x")
    for i in (0, 1, 3):
        manager.release(f"h{i}")


def test_belady_evicts_the_furthest_next_use(dirs: list[Path]) -> None:
    with TierManager(_config(dirs, device_nbytes=48 * KiB)) as m:
        for key in "abc":
            m.register(key, torch.zeros(4 * KiB), "param16")  # 16 KiB each: device full
        m.record_access_order(["d", "a", "b", "c"])
        m.register("d", torch.ones(4 * KiB), "param16")  # no room: host
        m.fetch("d")  # cursor after d: next a, b, c: c is furthest
        m.release("d")
        assert m.info("c").tier is Tier.HOST and m.info("a").tier is Tier.DEVICE
    with TierManager(_config([d / "lru" for d in dirs], device_nbytes=48 * KiB, policy="lru")) as m:
        for key in "abc":
            m.register(key, torch.zeros(4 * KiB), "param16")
        m.record_access_order(["d", "a", "b", "c"])
        m.register("d", torch.ones(4 * KiB), "param16")
        m.fetch("d")
        m.release("d")
        assert m.info("a").tier is Tier.HOST  # least recently used, needed next


@settings(max_examples=15, deadline=None)
@given(order=st.permutations(list("abc")), cold=st.sets(st.sampled_from("abc")))
def test_a_cold_release_makes_the_first_victim(order: list[str], cold: set[str]) -> None:
    """A scan's reads released cold are evicted before anything else, in the order they
    were released; the others least recently used first (a scan of more than the tier
    holds, released warm, evicted the tensor it needed next at every miss)."""
    with TierManager(_config(None, device_nbytes=48 * KiB, policy="lru")) as m:
        for key in "abc":
            m.register(key, torch.zeros(4 * KiB), "param16")  # 16 KiB each: device full
        for key in order:
            m.fetch(key)
            m.release(key, modified=False, cold=key in cold)
        expected = [k for k in order if k in cold] + [k for k in order if k not in cold]
        evicted: list[str] = []
        for i in range(3):
            m.register(f"new{i}", torch.ones(4 * KiB), "param16")  # room made on the device
            m.fetch(f"new{i}", Tier.DEVICE)
            m.release(f"new{i}")
            evicted += [k for k in "abc" if m.info(k).tier is not Tier.DEVICE and k not in evicted]
        assert evicted == expected


def test_recording_sets_the_order(manager: TierManager) -> None:
    for key in "xyz":
        manager.register(key, torch.zeros(4), "param16")
    with manager.recording():
        for key in "zxy":
            manager.fetch(key)
            manager.release(key)
    assert manager._ctx.order is not None and manager._ctx.order.keys == ("z", "x", "y")


def test_access_order_distances() -> None:
    order = AccessOrder.of(["a", "b", "a", "c"])
    assert [order.distance(k) for k in "abc"] == [0, 1, 3]
    order.advance("a")
    assert [order.distance(k) for k in "abc"] == [1, 0, 2]
    order.advance("c")  # jumps: cursor wraps to the start
    assert order.cursor == 0 and order.distance("zzz") == float("inf")
    entries = [SwapEntry(k, Kind.PARAM16, torch.uint8, (8,), 8, Tier.HOST) for k in "abc"]
    for i, e in enumerate(entries):
        e.last_use = 10 - i
    pick = choose_victims(entries, 8, lambda e: 8, order=order)
    assert [e.key for e in pick] == ["c"]
    assert [e.key for e in choose_victims(entries, 16, lambda e: 8, order=None)] == ["c", "b"]
    spec = choose_victims(entries, 8, lambda e: 8, order=order, speculative=True, not_before=3)
    assert spec == []  # c is used at distance 3: not later than the read-ahead


def test_unregister_deletes_the_nvme_copy(manager: TierManager) -> None:
    manager.register("u", torch.ones(1000), "optim_state")
    manager.evict("u").result(timeout=10)
    assert "optim_state/u" in manager._ctx.store
    manager.unregister("u")
    assert "u" not in manager and "optim_state/u" not in manager._ctx.store
    manager.register("u", torch.zeros(10), "grad16")  # the key is free again
    assert manager.info("u").kind is Kind.GRAD16


def test_stats_and_periodic_log(dirs: list[Path], caplog: pytest.LogCaptureFixture) -> None:
    with TierManager(_config(dirs, stats_interval_s=1e-6)) as m:
        t = _rand(torch.float32, (16 * KiB,), 1)  # 64 KiB
        m.register("s", t, "optim_state")
        m.evict("s").result(timeout=10)
        with caplog.at_level(logging.INFO, logger="swapper.manager"):
            _check(m, "s", t)
        stats = m.stats()
        write = stats.moved(Tier.HOST, Tier.NVME)
        read = stats.moved(Tier.NVME, Tier.HOST)
        assert write.nbytes == read.nbytes == 64 * KiB and write.count == read.count == 1
        assert write.gbps > 0 and read.gbps > 0 and write.busy_s > 0
        assert stats.prefetch_misses == 1 and stats.stall_s > 0
        assert stats.tiers[Tier.HOST].peak_nbytes == 64 * KiB
        assert stats.tiers[Tier.HOST].limit_nbytes == 128 * KiB
        assert stats.tiers[Tier.NVME].used_nbytes >= 64 * KiB
        assert any("fetches 1," in r.getMessage() for r in caplog.records)
        assert "host->nvme 64 KiB at " in stats.summary()
        # one unit family on the line: binary sizes, binary rates
        summary = stats.summary()
        assert f" at {write.gib_per_s:.2f} GiB/s" in summary and "GB/s" not in summary
        assert write.gib_per_s == pytest.approx(write.gbps * 1e9 / 2**30)


# -- close and reopen -----------------------------------------------------------------------


def test_close_leaves_everything_durable_and_open_brings_it_back(dirs: list[Path]) -> None:
    config = _config(dirs)
    tensors = {
        "p": (_rand(torch.bfloat16, (5, 300), 1), Kind.PARAM16),
        "g": (_rand(torch.float16, (7, 9, 11), 2), Kind.GRAD16),
        "o": (_rand(torch.float32, (20 * KiB,), 3), Kind.OPTIM_STATE),
        "scalar": (_rand(torch.float32, (), 4), Kind.OPTIM_STATE),
        "empty": (torch.empty(0, 3, dtype=torch.float16), Kind.PARAM16),
    }
    with TierManager(config) as m:
        for key, (t, kind) in tensors.items():
            m.register(key, t, kind)
        held = m.fetch("g")  # still in use at close: written anyway
        held.zero_()
    tensors["g"] = (torch.zeros(7, 9, 11, dtype=torch.float16), Kind.GRAD16)
    with pytest.raises(StoreExistsError, match=r"TierManager\.open\(config\) reopens it"):
        TierManager(config)
    with TierManager.open(config) as m:
        assert sorted(m.keys()) == sorted(tensors)
        for key, (t, kind) in tensors.items():
            info = m.info(key)
            assert info.state is EntryState.ON_NVME and info.kind is kind and info.clean
            assert info.dtype == t.dtype and info.shape == tuple(t.shape)
            _check(m, key, t)
        m.fetch("o").add_(1)
        m.release("o")
    with TierManager.open(config) as m:
        _check(m, "o", tensors["o"][0] + 1)
    with pytest.raises(SwapConfigError, match="nvme_dirs"):
        TierManager.open(_config(None))


def test_close_remove_writes_nothing_and_deletes_the_store(dirs: list[Path]) -> None:
    m = TierManager(_config(dirs))
    m.register("o", _rand(torch.float32, (20 * KiB,), 3), Kind.OPTIM_STATE)
    m.evict("o").result()
    m.register("p", _rand(torch.bfloat16, (300,), 1), Kind.PARAM16)  # in memory, not written
    written = m.stats().moved(Tier.HOST, Tier.NVME).nbytes
    m.close(remove=True)
    assert m.stats().moved(Tier.HOST, Tier.NVME).nbytes == written
    assert not any(d.exists() for d in dirs)  # the directories it made are gone too
    m.close(remove=True)  # idempotent


def test_fetch_cancels_a_read_ahead_that_has_not_started(manager: TierManager) -> None:
    """A read-ahead queued behind busy movers must not read the tensor again after a
    fetch has moved it, been used, and written it out."""
    manager.register("o", _rand(torch.float32, (1000,), 3), Kind.OPTIM_STATE)
    manager.evict("o").result()
    held: list[Callable[[], None]] = []
    submit = manager._ctx.pool.submit
    manager._ctx.pool.submit = lambda fn, *a: held.append(lambda: fn(*a))  # type: ignore[method-assign]
    try:
        assert manager.prefetch(["o"], Tier.HOST) == 1
    finally:
        manager._ctx.pool.submit = submit  # type: ignore[method-assign]
    manager.fetch("o", Tier.HOST).add_(1)
    manager.release("o")
    manager.evict("o").result()
    read = manager.stats().moved(Tier.NVME, Tier.HOST).nbytes
    for job in held:
        job()  # the late read-ahead
    assert manager.stats().moved(Tier.NVME, Tier.HOST).nbytes == read
    assert manager.info("o").state is EntryState.ON_NVME


def test_stats_count_bytes_by_kind(manager: TierManager) -> None:
    manager.register("o", _rand(torch.float32, (1000,), 3), Kind.OPTIM_STATE)
    manager.register("g", _rand(torch.float32, (500,), 4), Kind.GRAD32)
    for key in ("o", "g"):
        manager.evict(key).result()
        manager.fetch(key, Tier.HOST)
        manager.release(key, modified=False)
    stats = manager.stats()
    for kind, nbytes in ((Kind.OPTIM_STATE, 4000), (Kind.GRAD32, 2000)):
        assert stats.moved_nbytes(kind, Tier.HOST, Tier.NVME) == nbytes
        assert stats.moved_nbytes(kind, Tier.NVME, Tier.HOST) == nbytes
    assert stats.moved_nbytes(Kind.PARAM16, Tier.HOST, Tier.NVME) == 0


def test_closed_manager_refuses_work(manager: TierManager) -> None:
    manager.register("a", torch.ones(3), "param16")
    manager.close()
    manager.close()  # idempotent
    for call in (
        lambda: manager.fetch("a"),
        lambda: manager.register("b", torch.ones(3), "param16"),
        lambda: manager.evict("a"),
        lambda: manager.prefetch(["a"]),
        lambda: manager.flush(),
        lambda: manager.release("a"),
    ):
        with pytest.raises(ManagerClosedError):
            call()


def test_no_descriptor_leaks(dirs: list[Path]) -> None:
    before = _fd_count()
    for reopen in (False, True):
        m = TierManager.open(_config(dirs)) if reopen else TierManager(_config(dirs))
        for i in range(6):
            key = f"k{i}"
            if not reopen:
                m.register(key, torch.full((8 * KiB,), float(i)), "optim_state")
            m.evict(key).result(timeout=10)
            _check(m, key, torch.full((8 * KiB,), float(i)))
        m.close()
    assert _fd_count() == before


# -- faults -------------------------------------------------------------------------------


def _failing_write(
    path: str, code: int = errno.EIO
) -> Callable[..., concurrent.futures.Future[int]]:
    def write(key: str, tensor: torch.Tensor) -> concurrent.futures.Future[int]:
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        future.set_exception(SwapIOError(code, f"write of key={key!r} failed: injected", path))
        return future

    return write


def test_failed_write_keeps_the_data_and_names_key_and_path(
    manager: TierManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = _rand(torch.float32, (4 * KiB,), 21)
    manager.register("w", t, "optim_state")
    path = str(manager._ctx.store.dirs[0] / "swapper-store.bin")
    monkeypatch.setattr(manager._ctx.store, "write", _failing_write(path))
    with pytest.raises(SwapIOError) as info:
        manager.evict("w").result(timeout=10)
    assert "key='w'" in str(info.value) and info.value.filename == path
    assert info.value.errno == errno.EIO
    entry = manager.info("w")
    assert entry.state is EntryState.RESIDENT and entry.tier is Tier.HOST and not entry.on_nvme
    assert manager.stats().write_errors == 1
    _check(manager, "w", t)
    monkeypatch.undo()
    manager.evict("w").result(timeout=10)  # later operations work
    assert manager.info("w").state is EntryState.ON_NVME
    _check(manager, "w", t)


def test_failed_victim_write_fails_the_fetch_that_needed_room(
    manager: TierManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensors = {f"o{i}": _rand(torch.float32, (8 * KiB,), i) for i in range(4)}  # 4 x 32 KiB
    for key, t in tensors.items():
        manager.register(key, t, "optim_state")
    manager.register("new", _rand(torch.float32, (8 * KiB,), 9), "optim_state")  # to NVMe
    path = str(manager._ctx.store.dirs[1] / "swapper-store.bin")
    monkeypatch.setattr(manager._ctx.store, "write", _failing_write(path))
    with pytest.raises(SwapIOError, match="key='o0'") as info:
        manager.fetch("new")
    assert info.value.filename == path
    monkeypatch.undo()
    for key, t in tensors.items():
        _check(manager, key, t)
    _check(manager, "new", _rand(torch.float32, (8 * KiB,), 9))


def test_enospc_on_a_full_filesystem(
    tmp_path: Path, mount_tmpfs: Callable[..., Path | None]
) -> None:
    mount = mount_tmpfs("small", size="160k")
    if mount is None:
        pytest.skip("cannot mount a tmpfs here (not root?)")
    config = _config([mount / "a", mount / "b"], host_nbytes=512 * KiB, device_nbytes=0)
    m = TierManager(config)
    try:
        tensors = {f"o{i}": _rand(torch.float32, (8 * KiB,), i) for i in range(8)}  # 32 KiB
        for key, t in tensors.items():
            m.register(key, t, "optim_state")
        failed = []
        for key in tensors:
            try:
                m.evict(key).result(timeout=10)
            except SwapIOError as exc:
                assert isinstance(exc, SwapNoSpaceError) and exc.errno == errno.ENOSPC
                assert f"key={key!r}" in str(exc) and str(mount) in exc.filename
                failed.append(key)
        assert failed, "the tmpfs never filled up"
        for key in failed:
            info = m.info(key)
            assert info.state is EntryState.RESIDENT and info.tier is Tier.HOST
        for key, t in tensors.items():
            _check(m, key, t)
        # Make room on disk: later writes succeed.
        for key in [k for k in tensors if k not in failed][:3]:
            m.unregister(key)
        # A deleted key's extents are reused only once the delete is durable (else a
        # crash could find the old key's record naming bytes of a new one): wait for it.
        m._ctx.nvme().sync()
        m.evict(failed[0]).result(timeout=10)
        assert m.info(failed[0]).state is EntryState.ON_NVME
        _check(m, failed[0], tensors[failed[0]])
    finally:
        # The manifest may not fit on the full tmpfs either: close still frees everything.
        with contextlib.suppress(NotDurableError, SwapIOError):
            m.close()


def test_short_read_raises_and_leaves_the_entry_on_nvme(manager: TierManager) -> None:
    t = _rand(torch.float16, (20 * KiB,), 31)  # 40 KiB: striped over both files
    manager.register("r", t, "optim_state")
    manager.evict("r").result(timeout=10)
    for d in manager._ctx.store.dirs:
        os.truncate(d / "swapper-store.bin", 4096)
    with pytest.raises(SwapIOError, match="key='r'") as info:
        manager.fetch("r")
    assert "swapper-store.bin" in info.value.filename
    assert manager.info("r").state is EntryState.ON_NVME
    stats = manager.stats()
    assert stats.tiers[Tier.HOST].used_nbytes == stats.tiers[Tier.DEVICE].used_nbytes == 0
    manager.register("ok", torch.ones(100), "param16")  # later operations work
    _check(manager, "ok", torch.ones(100))


def test_close_waits_for_writes_in_flight(
    dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(dirs)
    m = TierManager(config)
    tensors = {f"o{i}": _rand(torch.float32, (4 * KiB,), i) for i in range(4)}
    for key, t in tensors.items():
        m.register(key, t, "optim_state")
    real_write = m._ctx.store.write

    def slow_write(key: str, tensor: torch.Tensor) -> concurrent.futures.Future[int]:
        inner = real_write(key, tensor)
        outer: concurrent.futures.Future[int] = concurrent.futures.Future()
        threading.Timer(0.3, lambda: outer.set_result(inner.result())).start()
        return outer

    monkeypatch.setattr(m._ctx.store, "write", slow_write)
    futures = [m.evict(key) for key in tensors]
    start = time.monotonic()
    m.close()
    assert time.monotonic() - start >= 0.25
    assert all(f.done() and f.exception() is None for f in futures)
    with TierManager.open(config) as again:
        for key, t in tensors.items():
            _check(again, key, t)


def test_close_names_the_keys_that_are_not_durable(
    dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(dirs)
    m = TierManager(config)
    m.register("good", torch.full((1000,), 2.0), "optim_state")
    m.register("bad", torch.full((1000,), 3.0), "optim_state")
    real_write = m._ctx.store.write
    path = str(dirs[0] / "swapper-store.bin")

    def write(key: str, tensor: torch.Tensor) -> concurrent.futures.Future[int]:
        if key.endswith("/bad"):
            return _failing_write(path)(key, tensor)
        return real_write(key, tensor)

    monkeypatch.setattr(m._ctx.store, "write", write)
    before = _fd_count()
    with pytest.raises(NotDurableError, match="'bad'") as info:
        m.close()
    assert info.value.keys == ["bad"] and isinstance(info.value.errors["bad"], SwapIOError)
    assert _fd_count() < before  # closed anyway
    m.close()  # and closed for good
    with TierManager.open(config) as again:
        assert again.keys() == ["good"]
        _check(again, "good", torch.full((1000,), 2.0))


def test_close_times_out_naming_writes_in_flight_then_finishes(
    dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    m = TierManager(_config(dirs, close_timeout_s=0.2))
    m.register("slow", torch.full((1000,), 5.0), "optim_state")
    real_write = m._ctx.store.write
    gate = threading.Event()

    def write(key: str, tensor: torch.Tensor) -> concurrent.futures.Future[int]:
        inner = real_write(key, tensor)
        outer: concurrent.futures.Future[int] = concurrent.futures.Future()
        threading.Thread(target=lambda: (gate.wait(), outer.set_result(inner.result()))).start()
        return outer

    monkeypatch.setattr(m._ctx.store, "write", write)
    with pytest.raises(NotDurableError, match="'slow' \\(still in flight\\)") as info:
        m.close()
    assert info.value.keys == ["slow"] and not info.value.errors
    gate.set()
    m.close()  # waits again, and this time finishes
    with TierManager.open(_config(dirs)) as again:
        _check(again, "slow", torch.full((1000,), 5.0))


# -- threads ------------------------------------------------------------------------------


def test_threads_fetch_release_and_evict_overlapping_keys(dirs: list[Path]) -> None:
    config = _config(dirs, device_nbytes=48 * KiB, host_nbytes=96 * KiB, timeout_s=30)
    n_threads, iterations = 4, 150
    shared = {f"s{i}": _rand(DTYPES[i % 3], (4 * KiB,), i) for i in range(6)}  # read only
    owned = {
        f"t{t}.{i}": _rand(torch.float32, (2 * KiB,), 100 + 10 * t + i)
        for t in range(n_threads)
        for i in range(2)
    }
    expected = {**shared, **{k: v.clone() for k, v in owned.items()}}
    errors: list[BaseException] = []
    with TierManager(config) as m:
        for key, t in shared.items():
            m.register(key, t, "param16")
        for key, t in owned.items():
            m.register(key, t, "optim_state")

        def work(me: int) -> None:
            rng = random.Random(me)
            mine = [k for k in owned if k.startswith(f"t{me}.")]
            try:
                for _ in range(iterations):
                    op = rng.random()
                    key = rng.choice(list(shared))
                    if op < 0.45:
                        got = m.fetch(key)
                        ok = _same(got, shared[key])
                        m.release(key, modified=False)
                        assert ok, key
                    elif op < 0.65:
                        mk = rng.choice(mine)
                        got = m.fetch(mk, Tier.HOST)
                        got.add_(1.0)
                        expected[mk] = expected[mk] + 1.0
                        m.release(mk)
                    elif op < 0.85:
                        target = rng.choice([Tier.HOST, Tier.NVME])
                        victim = rng.choice(list(expected))
                        # Another thread may hold it: in use is never a victim.
                        with contextlib.suppress(EntryInUseError):
                            m.evict(victim, target).result(timeout=30)
                    else:
                        m.prefetch(rng.sample(list(shared), 2))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=90)
        assert not any(t.is_alive() for t in threads), "deadlock: a thread is stuck"
        assert not errors, errors
        for key, t in expected.items():
            _check(m, key, t)
        stats = m.stats()
        for tier in (Tier.DEVICE, Tier.HOST):
            assert stats.tiers[tier].peak_nbytes <= stats.tiers[tier].limit_nbytes
    with TierManager.open(config) as m:
        for key, t in expected.items():
            _check(m, key, t)


# -- stateful property test ---------------------------------------------------------------

_KEYS = [f"k{i}" for i in range(8)]
_DEVICE_NBYTES = 24 * KiB
_HOST_NBYTES = 64 * KiB
_shapes = st.one_of(
    st.just(()),
    st.lists(st.integers(0, 12), min_size=1, max_size=3).map(tuple),
    st.lists(st.integers(1, 64), min_size=1, max_size=2).map(tuple),
    st.tuples(st.integers(2000, 8000)),
)


class ManagerMachine(RuleBasedStateMachine):
    """Random register / fetch / assign / prefetch / evict / release / unregister / close-and-reopen
    over two swap directories: every tensor stays bit-exact, no tier exceeds its budget."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="swapper-machine-"))
        self.config = _config(
            [self.root / "nvme0", self.root / "nvme1"],
            device_nbytes=_DEVICE_NBYTES,
            host_nbytes=_HOST_NBYTES,
            host_arena_nbytes=32 * KiB,
            stripe_nbytes=4 * KiB,
            timeout_s=20.0,
        )
        self.m = TierManager(self.config)
        self.model: dict[str, torch.Tensor] = {}
        self.held: dict[str, torch.Tensor] = {}
        self.seed = 0
        self.reopens = 0

    def _fresh(self, dtype: torch.dtype, shape: tuple[int, ...], strided: bool) -> torch.Tensor:
        self.seed += 1
        if not strided:
            return _rand(dtype, shape, self.seed)
        return _rand(dtype, (*shape, 2), self.seed)[..., 1]  # every other element

    @rule(
        key=st.sampled_from(_KEYS),
        dtype=st.sampled_from(DTYPES),
        shape=_shapes,
        strided=st.booleans(),
        kind=st.sampled_from(list(Kind)),
    )
    def register(
        self, key: str, dtype: torch.dtype, shape: tuple[int, ...], strided: bool, kind: Kind
    ) -> None:
        tensor = self._fresh(dtype, shape, strided)
        if key in self.model:
            with pytest.raises(KeyExistsError):
                self.m.register(key, tensor, kind)
            return
        self.m.register(key, tensor, kind)
        self.model[key] = tensor.clone()

    @precondition(lambda self: set(self.model) - set(self.held))
    @rule(
        data=st.data(), tier=st.sampled_from([None, Tier.DEVICE, Tier.HOST]), modify=st.booleans()
    )
    def fetch(self, data: st.DataObject, tier: Tier | None, modify: bool) -> None:
        key = data.draw(st.sampled_from(sorted(set(self.model) - set(self.held))))
        try:
            got = self.m.fetch(key, tier)
        except BudgetExceededError:
            nbytes = self.model[key].numel() * self.model[key].element_size()
            assert nbytes > (_DEVICE_NBYTES if tier is not Tier.HOST else _HOST_NBYTES) - 4096
            return
        assert _same(got, self.model[key]), key
        if modify and got.numel():
            flat = got.reshape(-1).view(torch.uint8)
            flat[:: max(1, flat.numel() // 7)] ^= 0x5A
            self.model[key] = got.clone()
        self.m.release(key, modified=modify)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=st.sampled_from([None, Tier.DEVICE, Tier.HOST]))
    def assign(self, data: st.DataObject, tier: Tier | None) -> None:
        # Held keys too: copied into where they are (the holder sees the new value).
        key = data.draw(st.sampled_from(sorted(self.model)))
        old = self.model[key]
        new = self._fresh(old.dtype, tuple(old.shape), strided=False)
        try:
            self.m.assign(key, new, tier)
        except BudgetExceededError:
            nbytes = old.numel() * old.element_size()
            assert nbytes > (_DEVICE_NBYTES if tier is not Tier.HOST else _HOST_NBYTES) - 4096
            return
        self.model[key] = new.clone()
        info = self.m.info(key)
        assert info.tier is not None and not info.clean, (key, info)
        assert info.users == (1 if key in self.held else 0), (key, info)

    @precondition(lambda self: set(self.model) - set(self.held))
    @rule(data=st.data())
    def hold(self, data: st.DataObject) -> None:
        # Held tensors stay in host memory, a third of it at most, so room can be made.
        key = data.draw(st.sampled_from(sorted(set(self.model) - set(self.held))))
        nbytes = self.model[key].numel() * self.model[key].element_size()
        in_hand = sum(t.numel() * t.element_size() + 4096 for t in self.held.values())
        if in_hand + nbytes + 4096 > _HOST_NBYTES // 3:
            return
        got = self.m.fetch(key, Tier.HOST)
        assert _same(got, self.model[key]), key
        self.held[key] = got

    @precondition(lambda self: self.held)
    @rule(data=st.data(), modify=st.booleans())
    def release_held(self, data: st.DataObject, modify: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.held)))
        got = self.held.pop(key)
        if modify and got.numel():
            got.reshape(-1).view(torch.uint8)[0] ^= 0xFF
            self.model[key] = got.clone()
        self.m.release(key, modified=modify)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), tier=st.sampled_from([None, Tier.DEVICE, Tier.HOST]))
    def prefetch(self, data: st.DataObject, tier: Tier | None) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.model)), max_size=3, unique=True))
        self.m.prefetch(keys, tier)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), to=st.sampled_from([Tier.HOST, Tier.NVME]))
    def evict(self, data: st.DataObject, to: Tier) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        if key in self.held:
            with pytest.raises(EntryInUseError):
                self.m.evict(key, to)
            return
        try:
            self.m.evict(key, to).result(timeout=30)
        except BudgetExceededError:
            assert to is Tier.HOST  # larger than the host budget
        info = self.m.info(key)
        assert info.state is not EntryState.IN_USE

    @precondition(lambda self: set(self.model) - set(self.held))
    @rule(data=st.data())
    def unregister(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(set(self.model) - set(self.held))))
        self.m.unregister(key)
        del self.model[key]

    @precondition(lambda self: self.reopens < 2)  # each one costs ~60 ms of AIO setup
    @rule()
    def close_and_reopen(self) -> None:
        self.reopens += 1
        for key in list(self.held):
            self.m.release(key, modified=False)
        self.held.clear()
        self.m.close()
        self.m = TierManager.open(self.config)
        assert sorted(self.m.keys()) == sorted(self.model)
        for key, t in self.model.items():
            info = self.m.info(key)
            assert info.state is EntryState.ON_NVME and info.dtype == t.dtype
            assert info.shape == tuple(t.shape)

    @invariant()
    def within_budgets(self) -> None:
        stats = self.m.stats()
        for tier in (Tier.DEVICE, Tier.HOST):
            assert stats.tiers[tier].peak_nbytes <= stats.tiers[tier].limit_nbytes
            assert stats.tiers[tier].used_nbytes <= stats.tiers[tier].limit_nbytes

    def teardown(self) -> None:
        try:
            for key in list(self.held):
                self.m.release(key, modified=False)
            for key, t in self.model.items():
                try:
                    _check(self.m, key, t)
                except BudgetExceededError:
                    _check(self.m, key, t, Tier.HOST)
            self.m.close()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(
    # ~10 s here; SWAPPER_MACHINE_EXAMPLES=500 for a longer hunt.
    max_examples=int(os.environ.get("SWAPPER_MACHINE_EXAMPLES", "50")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- CUDA ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_device_tier_round_trip(dirs: list[Path]) -> None:
    config = _config(dirs, device="cuda", device_nbytes=64 * KiB)
    tensors = {f"c{i}": _rand(torch.bfloat16, (8 * KiB,), i) for i in range(8)}  # 16 KiB
    with TierManager(config) as m:
        for key, t in tensors.items():
            m.register(key, t.cuda(), "param16")
        for _ in range(2):
            for i, (key, t) in enumerate(tensors.items()):
                m.prefetch([f"c{(i + 1) % 8}"])
                got = m.fetch(key)
                assert got.is_cuda and _same(got.cpu(), t)
                m.release(key, modified=False)
        assert m.stats().moved(Tier.HOST, Tier.DEVICE).nbytes > 0
    with TierManager.open(config) as m:
        for key, t in tensors.items():
            got = m.fetch(key)
            assert _same(got.cpu(), t)
            m.release(key, modified=False)


# -- review findings (regressions) ---------------------------------------------------


def _small_manager(tmp_path: Path, **overrides: Any) -> TierManager:
    settings: dict[str, Any] = {
        "device_nbytes": 64 * KiB,
        "host_nbytes": 128 * KiB,
        "nvme_dirs": [tmp_path / "swap"],
        "aio": AioConfig(block_size=64 * KiB),
        "stripe_nbytes": 8 * KiB,
        "timeout_s": 10,
    }
    settings.update(overrides)
    return TierManager(ManagerConfig(**settings))


def test_evict_callback_may_call_the_manager(tmp_path: Path) -> None:
    """A done-callback on an evict future may fetch from NVMe (it once deadlocked: the
    future was resolved on the AIO worker the fetch's read needed)."""
    with _small_manager(tmp_path) as m:
        m.register("a", torch.ones(2048), Kind.OPTIM_STATE)
        m.evict("a").result()
        m.register("b", torch.ones(2048), Kind.OPTIM_STATE)
        got = threading.Event()
        seen: list[float] = []

        def callback(_future: Any) -> None:
            seen.append(float(m.fetch("a").sum()))
            m.release("a")
            got.set()

        m.evict("b").add_done_callback(callback)
        assert got.wait(20), "the callback's fetch never finished"
        assert seen == [2048.0]


def test_fetch_of_a_read_ahead_tensor_returns_its_window(tmp_path: Path) -> None:
    """Read ahead into host, then fetched into the device (its home): the read-ahead
    window share must come back, or later prefetches are dropped for good."""
    with _small_manager(tmp_path, prefetch_window_nbytes=16 * KiB) as m:
        for i in range(4):
            m.register(f"k{i}", torch.full((2048,), float(i)), Kind.PARAM16)  # 8 KiB each
            m.evict(f"k{i}").result()
        assert m.prefetch(["k0", "k1"], tier="host") == 2
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            m.info(k).tier is not Tier.HOST for k in ("k0", "k1")
        ):
            time.sleep(0.01)
        for k in ("k0", "k1"):
            m.fetch(k)  # home is the device: moved host -> device
            m.release(k, modified=False)
        assert m.prefetch(["k2", "k3"], tier="host") == 2
        assert m.stats().prefetch_dropped == 0


def test_a_corrupted_chunk_is_refused_and_the_entry_stays(tmp_path: Path) -> None:
    """A byte flipped in the data file: fetch raises SwapCorruptionError (with
    ``verify=False`` the bad bytes come back, which is what the switch is for)."""
    from tiers.errors import SwapCorruptionError

    t = torch.arange(4096, dtype=torch.float32)
    for verify in (True, False):
        swap = tmp_path / f"swap-{verify}"
        config = ManagerConfig(device_nbytes=0, host_nbytes=None, nvme_dirs=[swap], verify=verify)
        with TierManager(config) as manager:
            manager.register("w", t, "optim_state")
            manager.evict("w").result()
            data = next(swap.glob("*.bin"))
            with open(data, "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 0x01]))
            if verify:
                with pytest.raises(SwapCorruptionError, match="w"):
                    manager.fetch("w")
                assert manager.info("w").state.value == "on_nvme"  # still registered
            else:
                got = manager.fetch("w")
                assert not torch.equal(got, t)
                manager.release("w", modified=False)
            manager.close(remove=True)


def test_reserve_room_evicts_counts_in_the_peak_and_waits_bounded() -> None:
    with TierManager(_config(None, timeout_s=0.3)) as m:
        for i in range(4):  # 16 KiB each: the 64 KiB device is full
            m.register(f"t{i}", torch.full((4 * KiB,), float(i)), "param16")
        assert m.stats().tiers[Tier.DEVICE].used_nbytes == 64 * KiB
        block = m.reserve_room("device", 40 * KiB, what="a gathered buffer")
        device = m.stats().tiers[Tier.DEVICE]
        assert device.used_nbytes <= 64 * KiB and device.peak_nbytes == 64 * KiB
        assert sum(m.info(f"t{i}").tier is Tier.DEVICE for i in range(4)) <= 1  # evicted
        for i in range(4):  # the evicted data is intact
            assert torch.equal(m.fetch(f"t{i}", "host"), torch.full((4 * KiB,), float(i)))
            m.release(f"t{i}", modified=False)
        with pytest.raises(BudgetTimeout, match="another buffer"):  # bounded, typed
            m.reserve_room("device", 40 * KiB, what="another buffer")
        with pytest.raises(BudgetExceededError):
            m.reserve_room("device", 65 * KiB, what="too big")
        block.release()
        assert m.stats().tiers[Tier.DEVICE].used_nbytes <= 24 * KiB
        m.reserve_room("device", 40 * KiB, what="again").release()
