"""Tests of tiers.host: blocks carved from arenas under a byte budget."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tiers.budget import BudgetExceededError, BudgetTimeout
from tiers.config import DIRECT_ALIGNMENT
from tiers.errors import SwapConfigError
from tiers.extents import pad as padded_nbytes
from tiers.host import HostBlock, HostTier

KiB = 1024


def test_block_is_aligned_exact_and_charged_padded() -> None:
    with HostTier(64 * KiB, arena_nbytes=64 * KiB) as tier:
        block = tier.try_alloc(5000, what="key='a'")
        assert block is not None
        assert block.nbytes == 5000 and block.tensor.numel() == 5000
        assert block.tensor.dtype == torch.uint8 and block.tensor.is_contiguous()
        assert block.tensor.data_ptr() % DIRECT_ALIGNMENT == 0
        assert block.charged_nbytes == padded_nbytes(5000) == 8192
        assert tier.budget.used_nbytes == 8192
        block.tensor.fill_(7)
        assert int(block.tensor.sum()) == 7 * 5000
        block.release()
        block.release()  # idempotent
        assert block.released and tier.budget.used_nbytes == 0
        with pytest.raises(RuntimeError, match="released"):
            _ = block.tensor


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(torch.bfloat16, (3, 5)), (torch.float16, (7,)), (torch.float32, ()), (torch.int8, (0, 4))],
)
def test_typed_view_shares_memory(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    with HostTier(None) as tier:
        block = tier.try_alloc(nbytes, what="v")
        view = block.view(dtype, shape)
        assert view.dtype == dtype and tuple(view.shape) == shape
        view.zero_()
        assert int(block.tensor.sum()) == 0
        block.release()


def test_zero_bytes() -> None:
    with HostTier(0) as tier:
        block = tier.try_alloc(0, what="empty")
        assert block is not None and block.nbytes == 0 and block.charged_nbytes == 0
        assert tier.mapped_nbytes == 0
        block.release()


def test_try_alloc_returns_none_when_full_and_room_is_reused() -> None:
    with HostTier(16 * KiB, arena_nbytes=16 * KiB) as tier:
        a = tier.try_alloc(8 * KiB, what="a")
        b = tier.try_alloc(8 * KiB, what="b")
        assert a is not None and b is not None
        assert tier.try_alloc(1, what="c") is None
        a.release()
        c = tier.try_alloc(8 * KiB, what="c")
        assert c is not None
        assert c.tensor.data_ptr() == a._offset + tier._arenas[0].buffer.address  # reused
        assert tier.dedicated_allocations == 0
        b.release()
        c.release()


def test_too_large_names_what_size_and_budget() -> None:
    with HostTier(8 * KiB, name="host") as tier:
        with pytest.raises(BudgetExceededError) as info:
            tier.try_alloc(10_000, what="key='big'")
        message = str(info.value)
        assert "key='big'" in message and "12 KiB" in message and "'host'" in message
        assert info.value.limit_nbytes == 8 * KiB


def test_alloc_waits_for_a_release_and_times_out() -> None:
    with HostTier(8 * KiB) as tier:
        held = tier.alloc(8 * KiB, what="held")
        with pytest.raises(BudgetTimeout):
            tier.alloc(4 * KiB, what="late", timeout_s=0.05)
        threading.Timer(0.05, held.release).start()
        start = time.monotonic()
        block = tier.alloc(4 * KiB, what="waits", timeout_s=5)
        assert time.monotonic() - start >= 0.04
        block.release()


def test_blocks_larger_than_an_arena_get_their_own_buffer() -> None:
    with HostTier(1 << 20, arena_nbytes=64 * KiB) as tier:
        small = tier.try_alloc(4 * KiB, what="small")
        big = tier.try_alloc(200 * KiB, what="big")
        assert tier.dedicated_allocations == 1 and tier.arena_count == 1
        big.tensor.fill_(3)
        big.release()
        assert tier.budget.used_nbytes == 4 * KiB
        small.release()


def test_arenas_never_map_more_than_the_limit_and_fragmentation_falls_back() -> None:
    with HostTier(40 * KiB, arena_nbytes=16 * KiB) as tier:
        blocks = [tier.try_alloc(8 * KiB, what=f"b{i}") for i in range(5)]
        assert all(b is not None for b in blocks)
        # 16 + 16 + 8 KiB: the last arena is cut to the limit.
        assert tier.mapped_nbytes == 40 * KiB and tier.arena_count == 3
        # Free one block in each of the two full arenas: 16 KiB free, but no 16 KiB hole.
        blocks[0].release()
        blocks[2].release()
        c = tier.try_alloc(16 * KiB, what="c")
        assert c is not None and tier.dedicated_allocations == 1
        assert tier.mapped_nbytes == 40 * KiB
        assert tier.budget.peak_nbytes <= 40 * KiB
        for block in (blocks[1], blocks[3], blocks[4], c):
            block.release()
        assert tier.budget.used_nbytes == 0


def test_a_block_larger_than_an_arena_maps_once_over_many_fetches() -> None:
    # Issue 24: a sub-group's state larger than an arena was mapped, prefaulted and unmapped
    # at every fetch; its released buffer now serves the next block of its size.
    with HostTier(1 << 20, arena_nbytes=64 * KiB) as tier:
        small = tier.try_alloc(4 * KiB, what="small")
        addresses = set()
        for i in range(10):
            big = tier.try_alloc(300 * KiB - 2 * KiB * i, what=f"big{i}")  # (within 1/8)
            assert big is not None
            big.tensor.fill_(i)
            addresses.add(big.tensor.data_ptr())
            big.release()
            assert tier.dedicated_nbytes == 0 and tier.spare_nbytes == 300 * KiB
        assert tier.dedicated_allocations == 1 and tier.dedicated_reuses == 9
        assert len(addresses) == 1
        small.release()
    assert tier.spare_nbytes == 0


def test_spares_serve_only_blocks_of_about_their_size() -> None:
    with HostTier(None, arena_nbytes=64 * KiB) as tier:
        tier.try_alloc(1 << 20, what="big").release()
        # much smaller than the spare (still larger than an arena): a buffer of its own
        medium = tier.try_alloc(128 * KiB, what="medium")
        assert tier.dedicated_allocations == 2 and tier.dedicated_reuses == 0
        # Unlimited: spares stay within the most dedicated bytes ever held at once (1 MiB).
        assert tier.spare_nbytes == 0
        medium.release()
        assert tier.spare_nbytes == 128 * KiB


def test_spares_never_map_past_the_limit_and_are_dropped_before_new_mappings() -> None:
    limit = 512 * KiB
    with HostTier(limit, arena_nbytes=64 * KiB) as tier:
        a = tier.try_alloc(200 * KiB, what="a")
        b = tier.try_alloc(200 * KiB, what="b")
        assert a is not None and b is not None
        a.release()
        b.release()
        assert tier.spare_nbytes == 400 * KiB
        # A block of another size: the spares that would pass the limit go first.
        c = tier.try_alloc(300 * KiB, what="c")
        assert c is not None and tier.dedicated_allocations == 3
        assert tier.mapped_nbytes + tier.dedicated_nbytes + tier.spare_nbytes <= limit
        assert tier.spare_nbytes == 200 * KiB
        c.release()
        # Kept only within the limit: 200 + 300 KiB of spares fit 512 KiB.
        assert tier.spare_nbytes == 500 * KiB
        # A first arena (64 KiB): the oldest spare goes before it is mapped.
        small = tier.try_alloc(4 * KiB, what="small")
        assert small is not None and tier.mapped_nbytes == 64 * KiB
        assert tier.spare_nbytes == 300 * KiB
        small.release()
    assert tier.spare_nbytes == 0 and tier.mapped_nbytes == 0


def test_nothing_stays_mapped_after_close() -> None:
    tier = HostTier(1 << 20, arena_nbytes=64 * KiB)
    small = tier.try_alloc(4 * KiB, what="small")
    big = tier.try_alloc(300 * KiB, what="big")
    held = tier.try_alloc(300 * KiB, what="held")
    assert small is not None and big is not None and held is not None
    buffers = [tier._arenas[0].buffer, big._dedicated, held._dedicated]
    big.release()
    small.release()
    tier.close()
    assert all(buffer is not None for buffer in buffers)
    assert [buffer.closed for buffer in buffers if buffer is not None] == [True, True, False]
    held.release()  # a block released after close unmaps its buffer: no spare is kept
    assert buffers[2] is not None and buffers[2].closed and tier.spare_nbytes == 0


def test_holes_coalesce() -> None:
    with HostTier(None, arena_nbytes=32 * KiB) as tier:
        blocks = [tier.try_alloc(8 * KiB, what=str(i)) for i in range(4)]
        blocks[1].release()
        blocks[2].release()
        merged = tier.try_alloc(16 * KiB, what="merged")
        assert merged.tensor.data_ptr() == blocks[0].tensor.data_ptr() + 8 * KiB
        assert tier.dedicated_allocations == 0
        for block in (blocks[0], blocks[3], merged):
            block.release()


def test_close_then_release_and_alloc() -> None:
    tier = HostTier(64 * KiB, arena_nbytes=64 * KiB)
    block = tier.try_alloc(4 * KiB, what="x")
    block.tensor.fill_(1)
    tier.close()
    tier.close()
    assert int(block.tensor.sum()) == 4 * KiB  # the view keeps the mapping alive
    block.release()
    with pytest.raises(RuntimeError, match="closed"):
        tier.try_alloc(4 * KiB, what="y")


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"limit_nbytes": -1}, "limit_nbytes"),
        ({"limit_nbytes": 1.5}, "limit_nbytes"),
        ({"limit_nbytes": 10, "arena_nbytes": 1000}, "arena_nbytes"),
        ({"limit_nbytes": 10, "arena_nbytes": 0}, "arena_nbytes"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(SwapConfigError, match=name):
        HostTier(**kwargs)  # type: ignore[arg-type]


def test_threads_allocate_fill_and_release_without_overlap() -> None:
    with HostTier(256 * KiB, arena_nbytes=64 * KiB) as tier:
        errors: list[BaseException] = []

        def work(seed: int) -> None:
            g = torch.Generator().manual_seed(seed)
            try:
                for i in range(150):
                    nbytes = int(torch.randint(1, 20 * KiB, (1,), generator=g))
                    block = tier.alloc(nbytes, what=f"{seed}.{i}", timeout_s=10)
                    block.tensor.fill_(seed)
                    time.sleep(0)
                    if not bool((block.tensor == seed).all()):
                        raise AssertionError(f"block {seed}.{i} was overwritten")
                    block.release()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(s,)) for s in range(1, 5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        assert tier.budget.used_nbytes == 0 and tier.budget.peak_nbytes <= 256 * KiB


class HostTierMachine(RuleBasedStateMachine):
    """Random allocations and releases: live blocks never overlap, keep their bytes, and the
    budget counts exactly their padded sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.tier = HostTier(96 * KiB, arena_nbytes=32 * KiB)
        self.live: list[tuple[HostBlock, int]] = []
        self.fill = 0

    @rule(nbytes=st.integers(0, 40 * KiB))
    def alloc(self, nbytes: int) -> None:
        try:
            block = self.tier.try_alloc(nbytes, what="b")
        except BudgetExceededError:
            assert padded_nbytes(nbytes) > 96 * KiB
            return
        if block is None:
            assert self.tier.budget.used_nbytes + padded_nbytes(nbytes) > 96 * KiB
            return
        self.fill = self.fill % 250 + 1
        block.tensor.fill_(self.fill)
        self.live.append((block, self.fill))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if self.live:
            i = data.draw(st.integers(0, len(self.live) - 1))
            block, fill = self.live.pop(i)
            assert bool((block.tensor == fill).all())
            block.release()

    @invariant()
    def accounting(self) -> None:
        assert self.tier.budget.used_nbytes == sum(b.charged_nbytes for b, _ in self.live)
        assert self.tier.mapped_nbytes <= 96 * KiB
        # spares are kept only within the limit (arenas' holes may pass it, spares never)
        mapped = self.tier.mapped_nbytes + self.tier.dedicated_nbytes
        assert self.tier.spare_nbytes == 0 or mapped + self.tier.spare_nbytes <= 96 * KiB
        spans = sorted(
            (b.tensor.data_ptr(), b.tensor.data_ptr() + b.nbytes) for b, _ in self.live if b.nbytes
        )
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start
        for block, fill in self.live:
            assert block.tensor.data_ptr() % DIRECT_ALIGNMENT == 0 or block.nbytes == 0
            assert bool((block.tensor == fill).all())

    def teardown(self) -> None:
        for block, _ in self.live:
            block.release()
        self.tier.close()


TestHostTierMachine = HostTierMachine.TestCase
TestHostTierMachine.settings = settings(
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.gpu
def test_arenas_are_pinned_with_cuda() -> None:
    with HostTier(1 << 20, arena_nbytes=1 << 20) as tier:
        block = tier.try_alloc(4 * KiB, what="p")
        assert tier._arenas[0].buffer.pinned
        block.release()
