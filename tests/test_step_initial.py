"""The optimizer's initial state written with several writes in flight (swapper.step.initial)
and the manager's ``register_behind`` under it."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swapper.manager import EntryState, ManagerConfig, Tier, TierManager
from swapper.step import OffloadAdamW, StepConfig
from swapper.step.initial import InitialWriter, writes_in_flight
from tiers.errors import SwapIOError

KiB = 1024
SG = 4096  # elements per sub-group (ALIGN_NUMEL x 4)


def _config(root: Path, host_nbytes: int = 4 * KiB) -> ManagerConfig:
    """No device tier; a host tier of ``host_nbytes`` (what is larger goes to NVMe), all
    of it the write-behind window (the default half would let one sub-group's write
    through at a time: the window bounds the bytes in flight)."""
    return ManagerConfig(
        device_nbytes=0,
        host_nbytes=host_nbytes,
        write_behind_nbytes=host_nbytes,
        nvme_dirs=[root],
        timeout_s=20.0,
        close_timeout_s=20.0,
    )


def _params(numels: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(torch.bfloat16) for n in numels]


def _failing_write(
    real: object, fail_at: int, calls: list[str]
) -> object:  # the store's write, failing its ``fail_at``-th call with EIO
    def write(key: str, tensor: torch.Tensor) -> concurrent.futures.Future[int]:
        calls.append(key)
        if len(calls) == fail_at:
            future: concurrent.futures.Future[int] = concurrent.futures.Future()
            future.set_exception(SwapIOError(errno.EIO, f"write of {key!r}: injected", "x.bin"))
            return future
        return real(key, tensor)  # type: ignore[operator]

    return write


def _slow_flushes(monkeypatch: pytest.MonkeyPatch, delay_s: float = 0.3) -> None:
    """Every ``fdatasync`` (the store's group commits) takes ``delay_s`` longer."""
    real = os.fdatasync

    def slow(fd: int) -> None:
        time.sleep(delay_s)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow)


# -- the manager's register_behind ----------------------------------------------------------


def test_register_behind_releases_the_tensor_before_the_flush(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``released`` comes when the write's pieces end, before its flush: the tensor may be
    reused then, and what is stored is what it held when the write was issued."""
    with TierManager(_config(tmp_path / "s", host_nbytes=64 * KiB)) as manager:
        manager.register("filler", torch.zeros(12 * KiB), "optim_state")  # 48 of 64 KiB
        _slow_flushes(monkeypatch)
        t = torch.arange(8 * KiB, dtype=torch.float32)
        future = manager.register_behind("a", t, "optim_state")  # no room: to NVMe
        future.released.result(timeout=20)
        assert not future.done()  # its flush (0.3 s) is still to come
        t.zero_()  # reused while the key settles
        future.result(timeout=20)
        assert manager.info("a").state is EntryState.ON_NVME
        assert torch.equal(manager.fetch("a"), torch.arange(8 * KiB, dtype=torch.float32))
        manager.release("a", modified=False)


def test_register_behind_returns_before_the_write_and_reads_back(tmp_path: Path) -> None:
    with TierManager(_config(tmp_path / "s", host_nbytes=64 * KiB)) as manager:
        manager.register("filler", torch.zeros(12 * KiB), "optim_state")  # 48 of 64 KiB
        t = torch.arange(8 * KiB, dtype=torch.float32)
        future = manager.register_behind("a", t, "optim_state")  # no room: to NVMe
        future.result(timeout=20)
        assert manager.info("a").state is EntryState.ON_NVME
        assert torch.equal(manager.fetch("a"), t)  # read back against its checksums
        manager.release("a", modified=False)


def test_register_behind_into_memory_is_done_at_once(tmp_path: Path) -> None:
    with TierManager(_config(tmp_path / "s", host_nbytes=1 << 20)) as manager:
        t = torch.ones(KiB)
        future = manager.register_behind("m", t, "optim_state")
        assert future.done() and future.exception() is None
        t.zero_()  # the copy was taken: changing the caller's tensor changes nothing
        assert torch.equal(manager.fetch("m"), torch.ones(KiB))
        manager.release("m", modified=False)


def test_register_behind_failed_write_forgets_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with TierManager(_config(tmp_path / "s")) as manager:
        store = manager._ctx.store
        assert store is not None
        calls: list[str] = []
        monkeypatch.setattr(store, "write", _failing_write(store.write, 1, calls))
        future = manager.register_behind("bad", torch.ones(4 * KiB), "optim_state")  # 16 KiB
        with pytest.raises(SwapIOError, match="key='bad'"):
            future.result(timeout=20)
        assert "bad" not in manager
        monkeypatch.undo()
        manager.register("bad", torch.ones(4 * KiB), "optim_state")  # the key is free again
        assert manager.info("bad").state is EntryState.ON_NVME


# -- the optimizer's creation ---------------------------------------------------------------


def test_writes_in_flight_bounds() -> None:
    assert writes_in_flight(1) == 4
    assert writes_in_flight(1 << 40) == 2
    assert writes_in_flight(100 << 20, host_nbytes=1 << 30) == 2  # a quarter: 256 MiB
    assert writes_in_flight(10 << 20, host_nbytes=1 << 30) == 4


def _chain(source: concurrent.futures.Future[int], proxy: concurrent.futures.Future[int]) -> None:
    def copy(done: concurrent.futures.Future[int]) -> None:
        if proxy.done():
            return
        error = done.exception()
        if error is None:
            proxy.set_result(done.result())
        else:
            proxy.set_exception(error)

    source.add_done_callback(copy)


def test_creation_keeps_several_writes_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each sub-group is made and registered while the previous one's write is still in
    flight. The store's writes are made to complete only once the next write is issued
    (or 0.5 s later): the old path, which waited for each write before making the next
    sub-group, never had one in flight at a registration."""
    params = _params([7 * SG, 5 * SG])
    in_flight_at_put: list[int] = []
    # the host tier holds 4 sub-groups (and so the write-behind window up to 4 writes)
    with TierManager(_config(tmp_path / "s", host_nbytes=4 * 12 * SG)) as manager:
        store = manager._ctx.store
        assert store is not None
        real_write = store.write
        held: list[tuple[concurrent.futures.Future[int], concurrent.futures.Future[int]]] = []
        timers: list[threading.Timer] = []

        def late_write(key: str, tensor: torch.Tensor) -> concurrent.futures.Future[int]:
            in_flight_at_put.append(sum(not proxy.done() for _, proxy in held))
            for source, proxy in held:  # a later write issued: the earlier ones may end
                _chain(source, proxy)
            future = real_write(key, tensor)
            proxy: concurrent.futures.Future[int] = concurrent.futures.Future()
            held.append((future, proxy))
            timer = threading.Timer(0.5, _chain, (future, proxy))
            timers.append(timer)
            timer.start()
            return proxy

        monkeypatch.setattr(store, "write", late_write)
        try:
            opt = OffloadAdamW(params, tiers=manager, config=StepConfig(sub_group_numel=SG))
        finally:
            for timer in timers:
                timer.join()
        try:
            # the first sub-groups fit the host tier beside the slots (no write); the rest
            # are written, each registered while the one before is in flight
            on_nvme = [
                i
                for i in range(len(opt.sub_groups))
                if manager.info(opt._pipeline.key(i)).state is EntryState.ON_NVME
            ]
            assert len(in_flight_at_put) == len(on_nvme) >= 8
            assert in_flight_at_put[0] == 0 and min(in_flight_at_put[1:]) >= 1
        finally:
            opt.close()


def test_a_failed_write_during_creation_leaves_nothing_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = _params([6 * SG, 2 * SG + 100])
    with TierManager(_config(tmp_path / "s", host_nbytes=12 * SG)) as manager:
        store = manager._ctx.store
        assert store is not None
        calls: list[str] = []
        monkeypatch.setattr(store, "write", _failing_write(store.write, 4, calls))
        # (sub-group 0 stays in memory: the 4th write is sub-group 4's)
        with pytest.raises(SwapIOError, match="state/4"):
            OffloadAdamW(params, tiers=manager, config=StepConfig(sub_group_numel=SG))
        assert manager.keys() == []
        monkeypatch.undo()
        with OffloadAdamW(params, tiers=manager, config=StepConfig(sub_group_numel=SG)) as opt:
            assert len(manager.keys()) == len(opt.sub_groups)


def test_a_slot_is_not_reused_while_its_write_runs(tmp_path: Path) -> None:
    """The writer waits for a slot's previous write before making a sub-group in it: with
    two slots, the third put finds the first write done."""
    params = _params([3 * SG])
    with TierManager(_config(tmp_path / "s", host_nbytes=12 * SG)) as manager:
        opt = OffloadAdamW(params, tiers=manager, config=StepConfig(sub_group_numel=SG))
        pipeline = opt._pipeline
        writer = InitialWriter(
            manager, pipeline.codec, pipeline.sub_groups, pipeline._fp32_shape, timeout_s=20.0
        )
        try:
            assert writer.depth >= 2
            seen: list[int] = []

            def fill(sg: object, buffer: torch.Tensor) -> None:
                seen.append(buffer.data_ptr())
                for slot in writer._slots:  # the slot being filled has no write in flight
                    if slot.memory.data_ptr() == buffer.data_ptr():
                        assert slot.busy is None
                buffer.fill_(1.0)

            for sg in pipeline.sub_groups:
                writer.put(f"extra/{sg.index}", sg, fill)
            writer.finish()
            assert len(set(seen)) == min(writer.depth, len(pipeline.sub_groups))
            for sg in pipeline.sub_groups:
                got = manager.fetch(f"extra/{sg.index}")
                assert torch.equal(got, torch.ones_like(got))
                manager.release(f"extra/{sg.index}", modified=False)
        finally:
            writer.close()
            opt.close()


def test_a_slot_is_made_again_before_its_last_write_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot is refilled once its write's pieces have ended, while that key still waits
    for its flush (slowed here to 0.3 s): the disk is not left idle for each flush. Every
    key is durable and reads back (verified) after ``finish``."""
    params = _params([SG])
    # the window (all the host tier) never holds a write back here
    with TierManager(_config(tmp_path / "s", host_nbytes=16 * 12 * SG)) as manager:
        opt = OffloadAdamW(params, tiers=manager, config=StepConfig(sub_group_numel=SG))
        # the host tier (768 KiB, 48 of them the optimizer's) filled but for the writer's
        # 4 slots (192 KiB) and less than a sub-group: the sub-groups below go to NVMe
        manager.register("filler", torch.zeros(125 * KiB), "optim_state")  # 500 KiB
        pipeline = opt._pipeline
        sub_groups = pipeline.sub_groups * 12
        writer = InitialWriter(
            manager, pipeline.codec, sub_groups, pipeline._fp32_shape, timeout_s=20.0
        )
        _slow_flushes(monkeypatch)
        settling_at_refill: list[bool] = []
        try:

            def fill(sg: object, buffer: torch.Tensor) -> None:
                for slot in writer._slots:
                    if slot.memory.data_ptr() == buffer.data_ptr() and slot.key:
                        state = manager.info(slot.key).state
                        settling_at_refill.append(state is EntryState.NEW)
                buffer.fill_(float(len(settling_at_refill)))

            for i, sg in enumerate(sub_groups):
                writer.put(f"extra/{i}", sg, fill)
            writer.finish()
            assert any(settling_at_refill)  # before: every refill found its key durable
            for i in range(len(sub_groups)):
                assert manager.info(f"extra/{i}").state in (EntryState.ON_NVME, EntryState.RESIDENT)
                got = manager.fetch(f"extra/{i}")
                assert got.unique().numel() == 1  # one fill's value, whole
                manager.release(f"extra/{i}", modified=False)
        finally:
            writer.close()
            opt.close()


@settings(max_examples=8, deadline=None)
@given(
    numels=st.lists(st.integers(1, 3 * SG), min_size=1, max_size=4),
    moments=st.sampled_from(["fp32", "bf16", "int8"]),
    host_sub_groups=st.integers(0, 2),
)
def test_initial_state_round_trip(
    tmp_path_factory: pytest.TempPathFactory, numels: list[int], moments: str, host_sub_groups: int
) -> None:
    """Whatever the sizes, moments and how many sub-groups fit in memory: every sub-group
    reads back (verified) as the fp32 copy of its parameters with zero moments."""
    params = _params(numels, seed=sum(numels))
    flat = torch.cat([p.float() for p in params])
    root = tmp_path_factory.mktemp("init")
    with TierManager(_config(root / "s", host_nbytes=(1 + host_sub_groups) * 12 * SG)) as manager:
        config = StepConfig(sub_group_numel=SG, moments=moments)
        with OffloadAdamW(params, tiers=manager, config=config) as opt:
            start = 0
            for sg in opt.sub_groups:
                state = opt._pipeline.read(sg.index)
                n = sg.numel
                assert torch.equal(state[0, :n], flat[start : start + n])
                assert not state[1:].any() and not state[0, n:].any()
                start += n
            assert start == flat.numel()


def test_a_slot_with_its_write_in_flight_is_given_back_only_when_it_ends(tmp_path: Path) -> None:
    params = _params([2 * SG])
    with TierManager(_config(tmp_path / "s", host_nbytes=16 * 12 * SG)) as manager:
        opt = OffloadAdamW(params, tiers=manager, config=StepConfig(sub_group_numel=SG))
        pipeline = opt._pipeline
        host = manager.stats().tiers
        writer = InitialWriter(
            manager, pipeline.codec, pipeline.sub_groups, pipeline._fp32_shape, timeout_s=20.0
        )
        try:
            in_host = manager.stats().tiers
            # the slots are host-tier blocks: charged to its budget while held
            assert in_host[Tier.HOST].used_nbytes >= host[Tier.HOST].used_nbytes + 2 * 12 * SG
            released: list[int] = []
            running: concurrent.futures.Future[None] = concurrent.futures.Future()
            first = writer._slots[0]
            real = first.release
            first.release = lambda: (released.append(1), real())[0]  # type: ignore[func-returns-value]
            first.busy = running  # a write still in flight
            writer.close()
            assert released == []  # not while its write runs
            running.set_result(None)
            assert released == [1]
            assert manager.stats().tiers[Tier.HOST].used_nbytes == host[Tier.HOST].used_nbytes
        finally:
            writer.close()
            opt.close()
