"""The floor of the gathered buffers (swapper.zero.sharded.gather_budget), without ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from swapper.zero.config.distributed import DistributedConfig
from swapper.zero.config.offload import OffloadConfig
from swapper.zero.sharded.gather_budget import GatherNeed, check_device_floor, device_floor
from swapper.zero.sharded.setup import gather_floor
from tiers.errors import SwapConfigError

needs = st.lists(
    st.tuples(
        st.text("abc", min_size=1, max_size=3),
        st.builds(GatherNeed, *(st.integers(0, 10_000) for _ in range(3))),
        st.booleans(),
    ),
    min_size=1,
    max_size=8,
)


@given(needs)
def test_floor_is_the_worst_module_with_every_other_tied_buffer(
    modules: list[tuple[str, GatherNeed, bool]],
) -> None:
    floor, name, tied = device_floor(modules)
    assert 0 <= tied <= sum(n.buffer for _, n, t in modules if t)
    worst = 0
    for i, (_, need, _) in enumerate(modules):
        held = sum(n.buffer for j, (_, n, t) in enumerate(modules) if t and j != i)
        worst = max(worst, need.total + held)
    assert floor == worst
    if worst:
        assert any(n == name for n, _, _ in modules)
    check_device_floor(modules, floor, "all_gather")  # at the floor: accepted
    check_device_floor(modules, None, "all_gather")
    if floor:
        with pytest.raises(SwapConfigError, match=f"at least {floor}"):
            check_device_floor(modules, floor - 1, "all_gather")


def test_floor_of_a_model_counts_staging_shards_and_tied_buffers() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 100), nn.Linear(8, 10, bias=False))
    model[2].weight = model[0].weight  # tied: both modules hold it through the backward
    model = model.to(torch.bfloat16)

    def floor(method: str, device_nbytes: int | None) -> int:
        config = OffloadConfig.create(
            device="cpu",
            device_nbytes=device_nbytes,
            distributed=DistributedConfig(fetch_collective=method),
        )
        return gather_floor(model, config, 2)

    fc = (8 * 100 + 100) * 2  # the Linear's buffer, the largest
    tied = 10 * 8 * 2
    gather, reduce = floor("all_gather", 1 << 20), floor("all_reduce", 1 << 20)
    # the Linear's buffer, both tied modules' buffers, its shards (the parameters' first
    # tier is the device: about half of it); alignment pads every region
    assert fc + 2 * tied + fc // 2 <= reduce <= 2 * (fc + 2 * tied) + fc
    assert gather - reduce >= fc  # the staging buffer: N segments of the largest share
