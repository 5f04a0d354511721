"""Tests of swapper.distributed.partition, .layout and .balance: pure, no process group.

The collectives' layouts are checked here by simulating them in one process (every
rank's segment built from its shards, then all_gather = concatenation, all_reduce = sum):
the multi-process tests (test_dist_collectives.py) then only need to show that the real
collectives behave like the simulation.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from swapper.distributed.balance import balance_report, contiguous_windows, plan_windows
from swapper.distributed.layout import ModuleLayout, module_layout
from swapper.distributed.partition import (
    ALIGN_NUMEL,
    ParamInfo,
    PartitionPlan,
    describe_modules,
    plan_partition,
)
from swapper.distributed.shards import local_sq_sum, shard_of
from swapper.pressure.model import GPT, GPTConfig
from tiers.errors import InvalidArgumentError, SwapConfigError

# -- strategies -------------------------------------------------------------------------


@st.composite
def param_lists(draw: st.DrawFn) -> list[ParamInfo]:
    n = draw(st.integers(0, 12))
    sizes = draw(st.lists(st.integers(0, 3000), min_size=n, max_size=n))
    steps = draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
    itemsize = draw(st.sampled_from([2, 4]))
    out, module = [], 0
    for i, (numel, step) in enumerate(zip(sizes, steps, strict=True)):
        module += step
        out.append(ParamInfo(name=f"p{i}", numel=numel, itemsize=itemsize, module_index=module))
    return out


plans = st.builds(
    lambda params, n, align, threshold: (
        params,
        n,
        align,
        threshold,
        plan_partition(params, n, align_numel=align, whole_below_numel=threshold),
    ),
    param_lists(),
    st.integers(1, 8),
    st.sampled_from([1, 4, 128]),
    st.one_of(st.none(), st.integers(0, 4000)),
)


# -- the plan ---------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(plans)
def test_every_element_owned_once_contiguous_and_padding_bounded(case: tuple) -> None:
    params, n, align, threshold, plan = case
    threshold = align * n if threshold is None else threshold
    assert len(plan.params) == len(params)
    for p, info in zip(plan.params, params, strict=True):
        assert p.info == info
        ranges = [p.real_range(r) for r in range(n)]
        if p.sharded:
            assert info.numel >= threshold
            assert p.shard_numel % align == 0
            # contiguous: rank r's range ends where rank r+1's begins, from 0 to numel
            assert ranges[0][0] == 0 and ranges[-1][1] == info.numel
            for (_, end), (start, _) in itertools.pairwise(ranges):
                assert end == start
            for r, (start, end) in enumerate(ranges):
                assert start == min(r * p.shard_numel, info.numel)
                assert 0 <= end - start <= p.shard_numel == p.local_numel(r)
            # padding: fewer than `align` elements per rank beyond an even split
            assert n * p.shard_numel - info.numel < n * align
        else:
            assert info.numel < threshold
            assert p.owner is not None and 0 <= p.owner < n
            assert [r for r in range(n) if p.local_numel(r)] == ([p.owner] if info.numel else [])
            assert ranges[p.owner] == (0, info.numel)
        covered = sorted(r for r in ranges if r[1] > r[0])
        total = sum(end - start for start, end in covered)
        assert total == info.numel  # no element twice, none missing (ranges are disjoint)
        for (_, e1), (s2, _) in itertools.pairwise(covered):
            assert e1 <= s2
    assert sum(plan.local_numel(r) for r in range(n)) >= sum(p.numel for p in params)


@settings(max_examples=100, deadline=None)
@given(plans)
def test_deterministic(case: tuple) -> None:
    params, n, align, threshold, plan = case
    again = plan_partition(list(params), n, align_numel=align, whole_below_numel=threshold)
    assert again == plan
    assert again.digest() == plan.digest()
    if params and n > 1:
        changed = [*params[:-1], ParamInfo(name="other", numel=1, itemsize=2, module_index=99)]
        assert plan_partition(changed, n).digest() != plan_partition(params, n).digest()


@settings(max_examples=150, deadline=None)
@given(plans)
def test_small_tensors_balance_every_window_within_one_tensor(case: tuple) -> None:
    # greedy to the least-loaded rank of the window keeps max - min <= the largest item
    _, n, _, _, plan = case
    windows: dict[int, list[int]] = {}
    largest: dict[int, int] = {}
    for p in plan.params:
        if p.sharded:
            continue
        m = p.info.module_index
        nbytes = p.numel * p.info.itemsize
        windows.setdefault(m, [0] * n)[p.owner or 0] += nbytes
        largest[m] = max(largest.get(m, 0), nbytes)
    for m, row in windows.items():
        assert max(row) - min(row) <= largest[m], (m, row)


def test_refuses_bad_input() -> None:
    p = ParamInfo(name="w", numel=10, itemsize=2, module_index=0)
    with pytest.raises(SwapConfigError, match="appears twice"):
        plan_partition([p, p], 2)
    with pytest.raises(SwapConfigError, match="world_size"):
        plan_partition([p], 0)
    with pytest.raises(SwapConfigError, match="numel"):
        plan_partition([ParamInfo(name="w", numel=-1, itemsize=2, module_index=0)], 2)
    with pytest.raises(SwapConfigError, match="shape"):
        plan_partition([ParamInfo(name="w", numel=10, itemsize=2, module_index=0, shape=(3, 3))], 2)
    with pytest.raises(SwapConfigError, match="align_numel"):
        plan_partition([p], 2, align_numel=0)
    with pytest.raises(SwapConfigError, match="whole_below_numel"):
        plan_partition([p], 2, whole_below_numel=-1)


# -- a model with uneven sizes: the partitioning acceptance -----------------------------


class Uneven(nn.Module):
    """Tied embeddings, biases, norms, and a parameter with fewer elements than ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 256)
        self.norm = nn.LayerNorm(256)
        self.fc1 = nn.Linear(256, 1000)
        self.fc2 = nn.Linear(1000, 256)
        self.gate = nn.Module()
        self.gate.scale = nn.Parameter(torch.ones(3))  # 3 elements < 4 ranks
        self.norm_f = nn.LayerNorm(256)
        self.head = nn.Linear(256, 1000, bias=False)
        self.head.weight = self.emb.weight  # tied


def _forward_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if list(m.parameters(recurse=False))]


def test_describe_modules_lists_a_tied_parameter_once_at_its_first_use() -> None:
    infos = describe_modules(_forward_modules(Uneven().to(torch.bfloat16)))
    names = [p.name for p in infos]
    assert names.count("emb.weight") == 1 and "head.weight" not in names
    assert infos[0].name == "emb.weight" and infos[0].module_index == 0
    assert infos[0].shape == (1000, 256) and infos[0].itemsize == 2
    assert infos[0].dtype == "torch.bfloat16"
    assert "gate.scale" in names


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_each_rank_holds_total_over_n_within_one_percent_plus_padding(world_size: int) -> None:
    model = Uneven().to(torch.bfloat16)
    infos = describe_modules(_forward_modules(model))
    plan = plan_partition(infos, world_size)
    total = plan.total_nbytes()
    assert total == sum(p.numel() * 2 for p in model.parameters())  # tied counted once
    small = plan.by_name("gate.scale")
    assert not small.sharded  # fewer elements than ranks: owned whole
    for r in range(world_size):
        real = plan.local_nbytes(r) - plan.padding_nbytes(r)
        assert abs(real - total / world_size) <= 0.01 * total / world_size, (r, real)
        assert plan.padding_nbytes(r) <= len(infos) * ALIGN_NUMEL * 2
    assert sum(plan.local_nbytes(r) - plan.padding_nbytes(r) for r in range(world_size)) == total


# -- balance ----------------------------------------------------------------------------


def _gpt_infos() -> list[ParamInfo]:
    cfg = GPTConfig(vocab_size=512, context=128, d_model=128, n_layers=4, n_heads=2)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    return describe_modules(_forward_modules(model))


def test_balanced_backward_offload_on_gpt_at_four_ranks() -> None:
    infos = _gpt_infos()
    balanced = balance_report(plan_windows(plan_partition(infos, 4)))
    contiguous = balance_report(contiguous_windows(infos, 4))
    assert balanced.max_over_mean <= 1.25
    assert contiguous.max_over_mean > 2.0  # one rank at a time: the figure the plan fixes
    assert max(balanced.per_rank_nbytes) / min(balanced.per_rank_nbytes) < 1.01
    # windows are in backward order: the last forward module first
    modules = [m for m, _ in balanced.windows]
    assert modules == sorted(modules, reverse=True)


def test_balance_report_figures_by_hand() -> None:
    # two windows: [4, 0] then [2, 2] → sum max = 6, sum mean = 4
    r = balance_report([(1, [4, 0]), (0, [2, 2]), (5, [0, 0])])
    assert r.max_over_mean == pytest.approx(1.5)
    assert r.worst_window == pytest.approx(2.0)
    assert r.cumulative_worst == pytest.approx(2.0)
    assert r.per_rank_nbytes == (6, 2)
    assert len(r.windows) == 2  # the empty window is left out
    one = [ParamInfo(name="w", numel=1000, itemsize=2, module_index=0)]
    assert contiguous_windows(one, 2, align_numel=1) == [(0, [1000, 1000])]


# -- layouts, checked by simulating the collectives -------------------------------------


def _shards(plan: PartitionPlan, full: list[torch.Tensor], rank: int) -> dict[int, torch.Tensor]:
    out = {}
    for p in plan.params:
        if p.holds(rank):
            shard = torch.zeros(p.local_numel(rank), dtype=full[p.index].dtype)
            start, end = p.real_range(rank)
            shard[: end - start] = full[p.index][start:end]
            out[p.index] = shard
    return out


def _simulate(layout: ModuleLayout, shards: list[dict[int, torch.Tensor]], method: str) -> dict:
    n, seg = layout.plan.world_size, layout.segment_numel
    if method == "all_reduce":
        total = torch.full((layout.buffer_numel,), -0.0)
        for r in range(n):
            mine = torch.full((layout.buffer_numel,), -0.0)
            for piece in layout.rank_pieces(r):
                k = piece.real_numel
                mine[piece.buffer_offset : piece.buffer_offset + k] = shards[r][piece.index][:k]
            total = total + mine
        buffer = total
    else:
        staging = torch.full((n * seg,), float("nan"))
        for r in range(n):
            for piece in layout.rank_pieces(r):
                o = r * seg + piece.segment_offset
                staging[o : o + piece.stored_numel] = shards[r][piece.index]
        buffer = torch.full((layout.buffer_numel,), float("nan"))
        for piece in layout.pieces:
            src = piece.rank * seg + piece.segment_offset
            k = piece.real_numel
            buffer[piece.buffer_offset : piece.buffer_offset + k] = staging[src : src + k]
    return {
        i: buffer[o : o + layout.plan.params[i].numel]
        for i, o in zip(layout.indices, layout.region_offsets, strict=True)
    }


@settings(max_examples=100, deadline=None)
@given(plans, st.data())
def test_layout_gathers_every_parameter_exactly(case: tuple, data: st.DataObject) -> None:
    params, n, _, _, plan = case
    if not params:
        return
    indices = data.draw(st.lists(st.sampled_from(range(len(params))), unique=True, min_size=1))
    sub = [params[i] for i in indices]
    if len({p.itemsize for p in sub}) > 1:
        return
    layout = module_layout(plan, indices)
    align = plan.align_numel
    # regions: aligned, disjoint, in order, inside the buffer
    for i, off in zip(layout.indices, layout.region_offsets, strict=True):
        assert off % align == 0
        assert off + plan.params[i].numel <= layout.buffer_numel
    ends = [
        o + plan.params[i].numel for i, o in zip(layout.indices, layout.region_offsets, strict=True)
    ]
    for end, nxt in zip(ends, layout.region_offsets[1:], strict=False):
        assert end <= nxt
    # segments: each rank's pieces disjoint and inside its segment
    for r in range(n):
        spans = sorted(
            (p.segment_offset, p.segment_offset + p.stored_numel) for p in layout.rank_pieces(r)
        )
        for (_, e), (s, _) in itertools.pairwise(spans):
            assert e <= s
        assert all(e <= layout.segment_numel for _, e in spans)
    # the simulated collectives rebuild every parameter, -0.0 and all
    full = []
    for p in plan.params:
        t = torch.arange(p.numel, dtype=torch.float32) - p.numel / 2
        if p.numel:
            t[0] = -0.0
        full.append(t)
    shards = [_shards(plan, full, r) for r in range(n)]
    for method in ("all_gather", "all_reduce"):
        views = _simulate(layout, shards, method)
        for i in indices:
            got, want = views[i], full[i]
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (method, i)


def test_layout_refuses_mixed_dtypes_and_bad_indices() -> None:
    params = [
        ParamInfo(name="a", numel=10, itemsize=2, module_index=0, dtype="torch.bfloat16"),
        ParamInfo(name="b", numel=10, itemsize=4, module_index=0, dtype="torch.float32"),
    ]
    plan = plan_partition(params, 2)
    with pytest.raises(InvalidArgumentError, match="different dtypes"):
        module_layout(plan, [0, 1])
    with pytest.raises(InvalidArgumentError, match="out of range"):
        module_layout(plan, [2])
    with pytest.raises(InvalidArgumentError, match="repeated"):
        module_layout(plan, [0, 0])


def test_partition_balance_tool_prints_both_figures(capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).resolve().parents[1] / "tools" / "partition_balance.py"
    spec = importlib.util.spec_from_file_location("partition_balance", path)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--world-size", "4", "--params", "2M"]) == 0
    out = capsys.readouterr().out
    balanced = float(out.split("balanced")[1].split("max/mean")[1].split()[0])
    contiguous = float(out.split("contiguous")[1].split("max/mean")[1].split()[0])
    assert balanced <= 1.25 < 2.0 < contiguous


# -- shards -----------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(plans)
def test_shards_rebuild_the_tensor_and_their_squares_sum_to_the_norm(case: tuple) -> None:
    _params, n, _, _, plan = case
    for p in plan.params:
        full = torch.randn(p.numel, dtype=torch.float64).to(torch.bfloat16)
        rebuilt = torch.full((p.numel,), float("nan"), dtype=torch.bfloat16)
        sq = 0.0
        for r in range(n):
            shard = shard_of(p, full, r)
            if shard is None:
                assert not p.holds(r)
                continue
            assert shard.numel() == p.local_numel(r) and shard.dtype == torch.bfloat16
            start, end = p.real_range(r)
            rebuilt[start:end] = shard[: end - start]
            assert bool((shard[end - start :] == 0).all())  # padding is zero
            sq += local_sq_sum([shard])
        assert torch.equal(rebuilt, full)
        assert sq == pytest.approx(float(full.float().pow(2).sum()), rel=1e-5, abs=1e-6)


def test_shard_of_refuses_a_tensor_of_another_size() -> None:
    plan = plan_partition([ParamInfo(name="w", numel=10, itemsize=2, module_index=0)], 2)
    with pytest.raises(InvalidArgumentError, match="'w' has 10 elements"):
        shard_of(plan.params[0], torch.zeros(11), 0)


def test_local_sq_sum_of_a_huge_but_finite_bf16_gradient_is_finite() -> None:
    # 2**70 is a finite bf16; its square (2**140) is past fp32's range but not fp64's: an
    # fp32 sum would report an overflow and skip the step on every rank.
    big = torch.tensor([2.0**70, -(2.0**70), 1.0], dtype=torch.bfloat16)
    assert local_sq_sum([big]) == 2.0**141 + 1.0
    assert local_sq_sum([torch.tensor([float("inf")], dtype=torch.bfloat16)]) == math.inf
    assert math.isnan(local_sq_sum([torch.tensor([float("nan"), 1.0], dtype=torch.float16)]))
    # chunked: more elements than one chunk, exact because every square is 1
    assert local_sq_sum([torch.ones((1 << 22) + 3, dtype=torch.bfloat16)]) == (1 << 22) + 3
    assert local_sq_sum([]) == 0.0 and local_sq_sum([torch.empty(0)]) == 0.0
