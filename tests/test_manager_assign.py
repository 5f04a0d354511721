"""``TierManager.assign`` (issue 24/23): a whole new value placed for a key without
reading the old one from NVMe. No read is issued, the value reads back bit-exact after
eviction, budgets hold, a transfer of the key in flight is waited for, a wrong dtype or
size is refused naming the key, and a cut at any wait leaves the old value readable."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from swapper.manager import (
    EntryState,
    Kind,
    ManagerConfig,
    NotDurableError,
    Tier,
    TierManager,
    UnknownKeyError,
)
from swapper.zero.local.params import copy_in
from tiers import signals
from tiers.nvme import NvmeStore

KiB = 1024
NBYTES = 16 * KiB  # one tensor: the device tier holds one, the host tier two
NUMEL = NBYTES // 4


def _config(tmp_path: Path, **overrides: Any) -> ManagerConfig:
    settings: dict[str, Any] = {
        "device_nbytes": NBYTES,
        "host_nbytes": 2 * NBYTES,
        "nvme_dirs": [tmp_path / "swap"],
        "host_arena_nbytes": 64 * KiB,
        "timeout_s": 10.0,
        "close_timeout_s": 10.0,
        "device": "cpu",
    }
    settings.update(overrides)
    return ManagerConfig(**settings)


@contextlib.contextmanager
def _manager(tmp_path: Path, **overrides: Any) -> Iterator[TierManager]:
    m = TierManager(_config(tmp_path, **overrides))
    try:
        yield m
    finally:
        with contextlib.suppress(NotDurableError):
            m.close()


def _rand(seed: int, numel: int = NUMEL) -> torch.Tensor:
    """Random bit patterns (NaNs and all): only a byte-exact copy compares equal."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (numel * 4,), dtype=torch.uint8, generator=g).view(torch.float32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.detach().contiguous().view(torch.uint8), b.detach().contiguous().view(torch.uint8)
    )


def _read(m: TierManager, key: str, tier: Tier | None = None) -> torch.Tensor:
    got = m.fetch(key, tier)
    try:
        return got.clone()
    finally:
        m.release(key, modified=False)


def _until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every store key read from NVMe from now on, in order (a counting fake around the
    real read)."""
    real = NvmeStore.read
    keys: list[str] = []

    def counting(store: NvmeStore, key: str, out: torch.Tensor) -> Any:
        keys.append(key)
        return real(store, key, out)

    monkeypatch.setattr(NvmeStore, "read", counting)
    return keys


def _budgets_exact(m: TierManager) -> None:
    """Once idle, every byte a budget counts belongs to an entry, and none is over."""
    entries = list(m._ctx.entries.values())
    for tier, memory in ((Tier.HOST, m._ctx.host), (Tier.DEVICE, m._ctx.device)):
        held = sum(e.block.charged_nbytes for e in entries if e.tier is tier and e.block)
        budget = memory.budget
        assert budget.used_nbytes == held, (tier, budget)
        assert budget.limit_nbytes is None or budget.peak_nbytes <= budget.limit_nbytes
    assert m._ctx.writebehind.used_nbytes == 0


def test_assign_on_nvme_reads_nothing_and_reads_back_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old, new = _rand(1), _rand(2)
    with _manager(tmp_path) as m:
        m.register("a", old, Kind.OPTIM_STATE)
        m.evict("a").result()
        assert m.info("a").tier is None
        reads = _reads(monkeypatch)
        before = m.stats()
        source = new.clone()
        m.assign("a", source, Tier.HOST)
        source.fill_(0)  # the caller's tensor is not kept
        after = m.stats()
        assert reads == []
        assert after.moved(Tier.NVME, Tier.HOST).count == before.moved(Tier.NVME, Tier.HOST).count
        assert (after.fetches, after.prefetch_misses) == (before.fetches + 1, 1)
        info = m.info("a")
        assert (info.state, info.tier, info.users) == (EntryState.RESIDENT, Tier.HOST, 0)
        assert info.on_nvme and not info.clean  # the old copy is stale now
        m.evict("a").result()  # written (dirty), then read back from NVMe
        assert m.info("a").clean
        assert _same(_read(m, "a"), new)
        assert len(reads) == 1
        _budgets_exact(m)


def test_assign_in_memory_is_a_copy_where_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resident on the device, assigned with the host asked for: copied into the device
    block, nothing moved; a holder sees the new value in its tensor."""
    old, new = _rand(3), _rand(4)
    with _manager(tmp_path) as m:
        m.register("d", old, Kind.PARAM16)
        assert m.info("d").tier is Tier.DEVICE
        held = m.fetch("d")
        before = m.stats()
        m.assign("d", new, Tier.HOST)
        assert m.stats().transfers == before.transfers  # nothing moved
        assert _same(held, new)
        info = m.info("d")
        assert (info.state, info.tier, info.users) == (EntryState.IN_USE, Tier.DEVICE, 1)
        m.release("d", modified=False)
        assert m.stats().prefetch_hits == before.prefetch_hits + 1
        m.flush()
        assert m.info("d").clean  # written by the flush: it was marked modified


def test_assign_makes_room_within_the_budgets(tmp_path: Path) -> None:
    """Host full of tensors never written: the assign evicts one (written, not lost) and
    places the new value in its room; no budget is ever over."""
    ts = {k: _rand(10 + i) for i, k in enumerate("abc")}
    new = _rand(19)
    with _manager(tmp_path) as m:
        for k, t in ts.items():
            m.register(k, t, Kind.OPTIM_STATE)
        assert [m.info(k).tier for k in ts] == [Tier.HOST, Tier.HOST, None]
        m.assign("c", new)
        assert m.info("c").tier is Tier.HOST
        assert sum(m.info(k).tier is Tier.HOST for k in ts) == 2
        _budgets_exact(m)
        ts["c"] = new
        for k, t in ts.items():
            assert _same(_read(m, k), t), k
        _budgets_exact(m)


def test_wrong_source_is_refused_naming_the_key(tmp_path: Path) -> None:
    old = _rand(5)
    with _manager(tmp_path) as m:
        m.register("layer.w", old, Kind.OPTIM_STATE)
        m.evict("layer.w").result()
        with pytest.raises(TypeError, match=r"key='layer\.w'.*torch\.float16"):
            m.assign("layer.w", old.to(torch.float16))
        with pytest.raises(ValueError, match=r"key='layer\.w'.*4095 elements"):
            m.assign("layer.w", old[:-1])
        with pytest.raises(TypeError, match=r"key='layer\.w'"):
            m.assign("layer.w", old.tolist())  # type: ignore[arg-type]
        with pytest.raises(UnknownKeyError, match="nope"):
            m.assign("nope", old)
        info = m.info("layer.w")
        assert info.tier is None and info.clean and m.stats().fetches == 0
        assert _same(_read(m, "layer.w"), old)


def test_convert_rounds_a_floating_source_as_copy_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The optimizer's case: fp32 master weights published into a bf16 parameter on NVMe,
    bit-identical to ``Tensor.copy_``'s rounding; integers are never converted."""
    master = torch.randn(NUMEL, generator=torch.Generator().manual_seed(11))
    with _manager(tmp_path) as m:
        m.register("p", master.to(torch.bfloat16).neg(), Kind.PARAM16)
        m.evict("p").result()
        reads = _reads(monkeypatch)
        with pytest.raises(TypeError, match=r"key='p'.*torch\.float32"):
            m.assign("p", master)
        m.assign("p", master, convert=True)
        assert reads == []
        want = torch.empty(NUMEL, dtype=torch.bfloat16).copy_(master)
        assert _same(_read(m, "p"), want)
        m.register("i", torch.zeros(NUMEL, dtype=torch.int32), Kind.PARAM16)
        with pytest.raises(TypeError, match=r"key='i'"):
            m.assign("i", master, convert=True)


class _Gate:
    """``NvmeStore.read`` / ``write`` held back until opened: a transfer of the key stays
    in flight while the test calls ``assign``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.go = threading.Event()
        self.issued = threading.Event()
        real = getattr(NvmeStore, name)

        def gated(store: NvmeStore, key: str, tensor: torch.Tensor) -> Any:
            self.issued.set()
            self.go.wait(20)
            return real(store, key, tensor)

        monkeypatch.setattr(NvmeStore, name, gated)


def test_assign_waits_for_a_read_ahead_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read-ahead's read lands only after assign was called: assign must wait for
    it (never copy into a block the kernel still reads into) and its value win."""
    old, new = _rand(6), _rand(7)
    with _manager(tmp_path, prefetch_window_nbytes=NBYTES) as m:
        m.register("p", old, Kind.OPTIM_STATE)
        m.evict("p").result()
        gate = _Gate(monkeypatch, "read")
        assert m.prefetch(["p"]) == 1
        assert gate.issued.wait(10)
        assert m.info("p").state is EntryState.READING
        threading.Timer(0.2, gate.go.set).start()
        m.assign("p", new)
        assert gate.go.is_set()  # it waited for the read
        info = m.info("p")
        assert info.tier is Tier.HOST and not info.clean
        assert _same(_read(m, "p"), new)
        m.evict("p").result()
        assert _same(_read(m, "p"), new)
        _budgets_exact(m)


def test_assign_waits_for_an_eviction_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eviction's write of the key is still in flight: assign waits for it (the write
    reads the old block until it ends) and then places the new value."""
    old, new = _rand(8), _rand(9)
    with _manager(tmp_path) as m:
        m.register("e", old, Kind.OPTIM_STATE)
        assert m.info("e").tier is Tier.HOST
        gate = _Gate(monkeypatch, "write")
        evicting = m.evict("e")
        assert gate.issued.wait(10)
        assert m.info("e").state is EntryState.WRITING
        threading.Timer(0.2, gate.go.set).start()
        m.assign("e", new)
        assert gate.go.is_set()
        evicting.result()
        assert not m.info("e").clean  # the write was of the old value
        assert _same(_read(m, "e"), new)
        m.evict("e").result()
        assert _same(_read(m, "e"), new)
        _budgets_exact(m)


def _cut_setup(m: TierManager) -> dict[str, torch.Tensor]:
    """Device and host full of tensors never written; "n" on NVMe only: an assign of "n"
    into the device demotes the device tensor (evicting a host one) before it can copy."""
    ts = {k: _rand(20 + i) for i, k in enumerate(("d", "h0", "h1", "n"))}
    for k, t in ts.items():
        m.register(k, t, Kind.PARAM16)
    assert [m.info(k).tier for k in ts] == [Tier.DEVICE, Tier.HOST, Tier.HOST, None]
    return ts


def _settled(m: TierManager) -> bool:
    engine = m._ctx.engine
    if (engine is not None and engine.pending()) or m._ctx.jobs:
        return False
    keys = m.keys()
    return not any(m.info(k).state.transient for k in keys)


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_cut_at_each_wait_leaves_the_old_value(tmp_path: Path, sigint_raises: None) -> None:
    """KeyboardInterrupt at the n-th wait point of the caller's thread, for every n the
    uncut assign passes: the entry is as before (on NVMe, clean, old bytes), nothing is
    wedged or leaked, and the assign retried places the new value."""
    new = _rand(29)
    names: list[str] = []
    main = threading.main_thread()

    def count(name: str) -> None:
        if threading.current_thread() is main:
            names.append(name)

    with _manager(tmp_path / "count") as m:
        _cut_setup(m)
        previous = signals.set_wait_hook(count)
        try:
            m.assign("n", new, Tier.DEVICE)
        finally:
            signals.set_wait_hook(previous)
    assert "device.copy" in names and "manager.room" in names, names

    # The k-th wait of each name (how often a thread waits on the condition depends on
    # timing: a point a run does not reach is tried once more; every name must be cut).
    points = [(name, names[: i + 1].count(name)) for i, name in enumerate(names)]
    cut_names: set[str] = set()
    for run, (at, k) in enumerate(points):
        for attempt in range(2):
            seen: list[str] = []

            def cut(name: str, at: str = at, k: int = k, seen: list[str] = seen) -> None:
                if threading.current_thread() is main:
                    seen.append(name)
                    if name == at and seen.count(name) == k:
                        raise KeyboardInterrupt

            with _manager(tmp_path / f"cut{run}-{attempt}") as m:
                ts = _cut_setup(m)
                previous = signals.set_wait_hook(cut)
                raised = False
                try:
                    m.assign("n", new, Tier.DEVICE)
                except KeyboardInterrupt:
                    raised = True
                finally:
                    signals.set_wait_hook(previous)
                assert _until(lambda m=m: _settled(m))
                _budgets_exact(m)
                info = m.info("n")
                if raised:
                    cut_names.add(at)
                    assert (info.state, info.tier, info.clean) == (
                        EntryState.ON_NVME,
                        None,
                        True,
                    ), (at, k, info)
                    for key, t in ts.items():
                        assert _same(_read(m, key), t), (at, k, key)
                    m.assign("n", new, Tier.DEVICE)  # retried
                assert _same(_read(m, "n", Tier.DEVICE), new), (at, k)
                _budgets_exact(m)
            if raised:
                break
    assert cut_names == set(names), (names, cut_names)


def test_copy_in_assigns_a_whole_tensor_and_fetches_a_piece(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The optimizer's publish path: a whole parameter reads nothing back; a piece still
    reads the rest of the tensor first."""
    old, new = _rand(40), _rand(41)
    with _manager(tmp_path) as m:
        m.register("w", old, Kind.PARAM16)
        m.evict("w").result()
        reads = _reads(monkeypatch)
        copy_in(m, "w", Tier.HOST, 0, new)
        assert reads == []
        assert _same(_read(m, "w", Tier.HOST), new)
        m.evict("w").result()
        piece = _rand(42, NUMEL // 4)
        copy_in(m, "w", Tier.HOST, NUMEL // 2, piece)
        assert len(reads) == 1  # the rest of the tensor had to be read
        want = new.clone()
        want[NUMEL // 2 : NUMEL // 2 + piece.numel()] = piece
        assert _same(_read(m, "w"), want)
