"""Tests of the optimizer step's read-ahead window (``StepConfig.readahead``, including
``"auto"``: :mod:`swapper.step.window`): the numbers are bit-identical whatever the
window, ``"auto"`` never takes the host budget past its limit (the manager's peak), sizes
itself from what other keys hold in host memory at each step, and with room for one
sub-group only streams them one at a time and finishes."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from swapper import Kind, ManagerConfig, OffloadAdamW, StepConfig, Tier, TierManager
from swapper.step.window import IO_WINDOW, auto_readahead

ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


def _model(seed: int = 0) -> nn.Module:
    """5 130 + 2 570 parameters: sub-groups of 1024..4096 cut it in 2 to 8."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, 80), nn.GELU(), nn.Linear(80, 32)).to(torch.bfloat16)


def _grads(model: nn.Module, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype)


def _manager(root: Path, host_nbytes: int | None) -> ManagerConfig:
    return ManagerConfig(
        device_nbytes=0,
        host_nbytes=host_nbytes,
        nvme_dirs=[root],
        timeout_s=20.0,
        close_timeout_s=20.0,
    )


def _train(
    root: Path, readahead: int | str, numel: int, host_sub_groups: float, steps: int = 3
) -> tuple[list[torch.Tensor], dict[int, dict[str, torch.Tensor]], int, int]:
    """Params and state after ``steps`` steps; the host tier's peak and its limit."""
    model = _model()
    sg_nbytes = 12 * numel  # numel: a multiple of 1024 (the plan's alignment)
    host = int(host_sub_groups * sg_nbytes)
    with OffloadAdamW(
        model.parameters(),
        **ADAM,
        tiers=_manager(root, host),
        config=StepConfig(sub_group_numel=numel, readahead=readahead),
    ) as opt:
        for step in range(1, steps + 1):
            _grads(model, step)
            opt.step()
            opt.zero_grad()
        state = {  # read now: the state dict's values are read lazily, while open
            index: {
                row: value.clone() if isinstance(value, torch.Tensor) else value
                for row, value in rows.items()
            }
            for index, rows in opt.state_dict()["state"].items()
        }
        peak = opt.manager.stats().tiers[Tier.HOST].peak_nbytes
    params = [p.detach().clone() for p in model.parameters()]
    return params, state, peak or 0, host


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    readahead=st.sampled_from([0, 2, 3, "auto"]),
    numel=st.sampled_from([1024, 2048, 4096]),
    host_sub_groups=st.sampled_from([1, 2, 3.5, 6]),
)
def test_bit_identical_whatever_the_window(
    readahead: int | str, numel: int, host_sub_groups: float
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        one = _train(Path(tmp) / "one", 1, numel, host_sub_groups)
        other = _train(Path(tmp) / "other", readahead, numel, host_sub_groups)
    for i, (a, b) in enumerate(zip(one[0], other[0], strict=True)):
        assert torch.equal(a, b), f"param {i} differs (readahead={readahead!r} vs 1)"
    assert one[1].keys() == other[1].keys()
    for index, rows in one[1].items():
        for row, value in rows.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other[1][index][row]), f"sub-group {index} {row}"
    for _, _, peak, host in (one, other):
        assert peak <= host, f"host peak {peak} over the budget {host}"


def test_auto_counts_what_others_hold_in_host_and_is_resized_every_step(tmp_path: Path) -> None:
    """Another key in host memory (a parameter the next forward fetches) takes room from
    the read-ahead; freeing it gives the room back at the next step. The host peak stays
    within the budget throughout."""
    numel = 1024
    sg_nbytes = 12 * numel
    host = 6 * sg_nbytes
    model = _model()
    with TierManager(_manager(tmp_path, host)) as manager:
        # 3 sub-groups' worth, in host (device budget 0, placement param16: host first)
        manager.register(
            "param/big", torch.zeros(3 * sg_nbytes // 2, dtype=torch.bfloat16), Kind.PARAM16
        )
        assert manager.info("param/big").tier is Tier.HOST
        with OffloadAdamW(
            model.parameters(),
            **ADAM,
            tiers=manager,
            config=StepConfig(sub_group_numel=numel, readahead="auto"),
        ) as opt:
            pipeline = opt._pipeline
            assert len(opt.sub_groups) == 8
            _grads(model, 1)
            opt.step()
            room = pipeline.room
            assert room is not None and room.others_nbytes >= 3 * sg_nbytes
            # 6 slots - 3 held by the parameter = 3: one computing, one written, one ahead
            assert room.slots == 3 and pipeline.readahead == 1
            manager.unregister("param/big")
            _grads(model, 2)
            opt.step()
            room = pipeline.room
            assert room is not None and room.slots == 6
            assert pipeline.readahead == IO_WINDOW  # bounded by the disk, not the budget
        peak = manager.stats().tiers[Tier.HOST].peak_nbytes
        assert peak is not None and peak <= host


def test_auto_with_room_for_one_sub_group_streams_one_at_a_time(tmp_path: Path) -> None:
    """Room for one sub-group beside the others' bytes: nothing read ahead, nothing read
    twice, and the steps finish (no wait for room that never comes). The step's own
    fetch still needs room and may evict the parameter (the manager's LRU): the next
    step sizes its window from where the parameter is then."""
    numel = 1024
    sg_nbytes = 12 * numel
    model = _model()
    with TierManager(_manager(tmp_path, 3 * sg_nbytes)) as manager:
        big = torch.zeros(sg_nbytes, dtype=torch.bfloat16)  # 2 of the 3 slots
        manager.register("param/big", big, Kind.PARAM16)
        with OffloadAdamW(
            model.parameters(),
            **ADAM,
            tiers=manager,
            config=StepConfig(sub_group_numel=numel, readahead="auto"),
        ) as opt:
            pipeline = opt._pipeline
            for step in (1, 2, 3):
                in_host = manager.info("param/big").tier is Tier.HOST
                _grads(model, step)
                opt.step()
                room = pipeline.room
                assert room is not None
                assert room.others_nbytes == (2 * sg_nbytes if in_host else 0)
                assert pipeline.readahead == (0 if in_host else 1)
            assert manager.stats().prefetch_wasted == 0
        peak = manager.stats().tiers[Tier.HOST].peak_nbytes
        assert peak is not None and peak <= 3 * sg_nbytes


@pytest.mark.parametrize(
    ("window", "host", "expected"),
    [
        (None, None, IO_WINDOW),  # no budget: the disk's bound
        (None, 10, IO_WINDOW),  # the manager's default window: half the budget
        (12 * 1024, 10, 1),  # a window of one sub-group: one at a time
        (None, 3, 1),  # 3 slots: one computing, one written, one ahead
        (None, 1, 0),
    ],
)
def test_auto_bounds(tmp_path: Path, window: int | None, host: int | None, expected: int) -> None:
    sg_nbytes = 12 * 1024
    config = ManagerConfig(
        device_nbytes=0,
        host_nbytes=None if host is None else host * sg_nbytes,
        nvme_dirs=[tmp_path],
        prefetch_window_nbytes=window,
    )
    with TierManager(config) as manager:
        room = auto_readahead(manager, set(), kept_nbytes=0, largest_nbytes=sg_nbytes, streamed=8)
        assert room.readahead == expected
        # nothing to read ahead when one sub-group streams
        assert (
            auto_readahead(manager, set(), kept_nbytes=0, largest_nbytes=1, streamed=1).readahead
            == 0
        )


def _offloaded_run(
    root: Path, readahead: int | str, overlap: bool
) -> tuple[list[float], dict[str, torch.Tensor], list[int], int, int]:
    """Three steps over an offloaded MLP whose parameters and gradients share the host
    budget with the streamed state; losses, parameters, each step's others' host bytes,
    the host tier's peak and its limit."""
    import swapper
    from swapper import OffloadConfig

    host = 200_000  # < params + grads + 12 B/param of state: everything spills to NVMe
    config = OffloadConfig.create(
        nvme_dirs=[root],
        device="cpu",
        device_nbytes=40_000,
        host_nbytes=host,
        step=StepConfig(sub_group_numel=4096, readahead=readahead, overlap=overlap),
    )
    g = torch.Generator().manual_seed(1)
    losses: list[float] = []
    others: list[int] = []
    with (
        swapper.offload(_model(), config) as wrapped,
        OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as opt,
    ):
        for _ in range(3):
            x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
            loss = wrapped(x).float().pow(2).mean()
            loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.wait_pending()
            room = opt._pipeline.room
            others.append(-1 if room is None else room.others_nbytes)
            opt.zero_grad()
        params = {k: v.clone() for k, v in wrapped.state_dict().items()}
        peak = wrapped.stats().tiers[Tier.HOST].peak_nbytes or 0
    return losses, params, others, peak, host


@pytest.mark.parametrize("overlap", [False, True], ids=["step", "overlapped"])
def test_auto_over_an_offloaded_model_matches_window_one(tmp_path: Path, overlap: bool) -> None:
    """Under a model's budgets the parameters and gradients count as others' bytes; the
    run is bit-identical to one sub-group at a time and stays within the host budget."""
    one = _offloaded_run(tmp_path / "one", 1, overlap)
    auto = _offloaded_run(tmp_path / "auto", "auto", overlap)
    assert one[0] == auto[0]  # losses, exactly
    for name, value in one[1].items():
        assert torch.equal(value, auto[1][name]), name
    assert all(n > 0 for n in auto[2]), auto[2]  # the model's bytes were seen
    for _, _, _, peak, host in (one, auto):
        assert 0 < peak <= host


def test_far_read_ahead_is_asked_after_the_eviction_before_it(tmp_path: Path) -> None:
    # The manager runs read-aheads and evictions on the same mover threads in the order
    # asked; a read-ahead waiting for room there must not stand before the eviction that
    # frees it (swapper/step/pipeline.py, _read_ahead).
    from swapper.step import StepPipeline
    from swapper.step.layout import plan_sub_groups

    sub_groups = plan_sub_groups([[4096] * 6], 4096)
    config = ManagerConfig(
        device_nbytes=0, host_nbytes=4 * sub_groups[0].state_nbytes, nvme_dirs=[tmp_path]
    )
    asked: list[tuple[str, str]] = []
    with TierManager(config) as manager:
        pipeline = StepPipeline(manager, sub_groups, name="o", readahead=2)
        pipeline.initialize(lambda sg, buffer: None)
        real_prefetch, real_evict = manager.prefetch, manager.evict

        def prefetch(keys: list[str], *a: object, **k: object) -> int:
            asked.extend(("prefetch", key) for key in keys)
            return real_prefetch(keys)

        def evict(key: str, *a: object, **k: object) -> object:
            asked.append(("evict", key))
            return real_evict(key, Tier.NVME)

        manager.prefetch, manager.evict = prefetch, evict  # type: ignore[method-assign,assignment]
        pipeline.run(1, lambda sg, state, extra: None, lambda sg, state: None)
        pipeline.close()
    for k in range(len(sub_groups) - 2):
        far = asked.index(("prefetch", pipeline.key(k + 2)))
        assert asked.index(("evict", pipeline.key(k))) < far, asked
