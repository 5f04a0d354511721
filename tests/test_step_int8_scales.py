"""Tests of the int8 moments' block scales kept apart from the state tensors (issue 14:
6 B per parameter per step each way): one held entry ``<name>/scales`` per optimizer,
charged to the host budget, round-tripped bitwise through state dicts (hypothesis) and
snapshots, verified at resume (a corrupted record is named), and int8 snapshots of the
layout before (scales at the end of each state tensor) converted as they are adopted.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_train import DEVICE_NBYTES, HOST_NBYTES, model
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import swapper
from swapper import Kind, ManagerConfig, OffloadAdamW, StepConfig, SwapConfigError
from swapper.step.compress import MomentCodec
from swapper.step.layout import INT8_BLOCK_NUMEL, STORED_ALIGN_NBYTES, round_up
from swapper.step.state import StateDictError
from swapper.zero.checkpoint.snapshot import final_digest, save_snapshot
from tiers.aio import AioEngine
from tiers.config import AioConfig
from tiers.errors import SwapCorruptionError
from tiers.nvme import NvmeStore

STORE = "swapper-offload"
ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


def _config(swap: Path, host_fraction: float = 0.0) -> swapper.OffloadConfig:
    return swapper.OffloadConfig.create(
        device_nbytes=DEVICE_NBYTES,
        host_nbytes=HOST_NBYTES,
        nvme_dirs=[swap],
        device="cpu",
        step=StepConfig(sub_group_numel=4096, host_fraction=host_fraction, moments="int8"),
    )


def _steps(gpt: Any, opt: OffloadAdamW, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        gpt.loss(torch.randint(0, 64, (2, 9), generator=g)).backward()
        opt.step()
        opt.zero_grad()


def _scales(opt: OffloadAdamW) -> torch.Tensor:
    scales = opt._pipeline.codec.scales
    assert scales is not None
    return scales


# -- where they live, what they cost ------------------------------------------------------------


def test_a_step_moves_master_and_codes_only_and_the_scales_stay_held(tmp_path: Path) -> None:
    gpt = model()
    with (
        swapper.offload(gpt, _config(tmp_path / "swap")) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as opt,
    ):
        _steps(gpt, opt, 2, seed=1)
        pipeline = opt._pipeline
        assert opt.last_step is not None
        traffic = opt.last_step.traffic
        stored = sum(sg.state_nbytes for sg in opt.sub_groups)
        assert traffic.read_nbytes[Kind.OPTIM_STATE] == stored
        assert traffic.written_nbytes[Kind.OPTIM_STATE] == stored
        for sg in opt.sub_groups:  # 6 B per element, one round-up to 4 KiB, no scales
            assert sg.state_nbytes == round_up(6 * sg.padded_numel, STORED_ALIGN_NBYTES)
        info = wrapped.manager.info(pipeline.scales.key)
        blocks = sum(sg.padded_numel for sg in opt.sub_groups) // INT8_BLOCK_NUMEL
        assert info.kind is Kind.OPTIM_STATE and list(info.shape) == [2 * blocks]
        assert pipeline.scales.nbytes == 8 * blocks
        assert pipeline.kept_nbytes == 4096  # (no kept sub-groups; one 4 KiB host block)
        # the scales are the blocks' absolute maxima of the decoded moments
        for sg in opt.sub_groups:
            state = pipeline.read(sg.index)
            own = _scales(opt)[sg.scales_offset : sg.scales_offset + sg.scales_numel]
            m = state[1].view(-1, INT8_BLOCK_NUMEL).abs().amax(dim=1)
            v = state[2].sqrt().view(-1, INT8_BLOCK_NUMEL).amax(dim=1)
            assert torch.equal(own, torch.cat([m, v]))
            assert bool(own.gt(0).all())  # (after two steps every block has moments)


def _net() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 160), nn.GELU(), nn.Linear(160, 70)).to(torch.bfloat16)


def _manager(root: Path, host_nbytes: int | None) -> ManagerConfig:
    return ManagerConfig(
        device_nbytes=0,
        host_nbytes=host_nbytes,
        nvme_dirs=[root],
        timeout_s=20.0,
        close_timeout_s=20.0,
    )


def test_a_host_budget_without_room_for_the_scales_is_refused(tmp_path: Path) -> None:
    net = _net()
    config = StepConfig(sub_group_numel=4096, moments="int8")
    with OffloadAdamW(
        net.parameters(), **ADAM, tiers=_manager(tmp_path / "probe", None), config=config
    ) as probe:
        largest = max(sg.state_nbytes for sg in probe.sub_groups)
        nbytes = probe._pipeline.scales.nbytes
        scales = probe._pipeline.scales.charge
    assert nbytes == 8 * sum(sg.padded_numel for sg in probe.sub_groups) // INT8_BLOCK_NUMEL
    assert scales == round_up(nbytes, 4096)  # what a host block of them costs
    need = largest + scales
    with pytest.raises(
        SwapConfigError, match=rf"int8 block scales \({scales} bytes.*at least {need}"
    ):
        OffloadAdamW(
            net.parameters(), **ADAM, tiers=_manager(tmp_path / "a", need - 1), config=config
        )
    with OffloadAdamW(
        net.parameters(), **ADAM, tiers=_manager(tmp_path / "b", need), config=config
    ) as opt:
        net[0].weight.grad = torch.ones_like(net[0].weight)
        opt.step()  # the scales and one streamed sub-group: exactly the budget
        peak = opt.manager.stats().tiers[swapper.Tier.HOST].peak_nbytes
        assert peak is not None and peak <= need


# -- state dicts (hypothesis) -------------------------------------------------------------------


@settings(max_examples=12, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(0, 12))
def test_state_dict_round_trip_keeps_scales_and_codes_bitwise(seed: int, decades: int) -> None:
    net = _net()
    config = StepConfig(sub_group_numel=4096, moments="int8")
    with (
        tempfile.TemporaryDirectory() as root,
        OffloadAdamW(
            net.parameters(), **ADAM, tiers=_manager(Path(root), 4 * 6 * 4096), config=config
        ) as opt,
    ):
        g = torch.Generator().manual_seed(seed)
        saved = opt.state_dict()
        rows: dict[int, dict[str, torch.Tensor]] = {}
        for sg in opt.sub_groups:
            n = sg.numel
            # moments spanning many decades, as Adam's do (some blocks all zero)
            size = 10.0 ** -torch.randint(0, decades + 1, (n,), generator=g).float()
            m = torch.randn(n, generator=g) * size
            v = torch.rand(n, generator=g) * size * size
            if seed % 3 == 0:
                m[: min(n, INT8_BLOCK_NUMEL)] = 0.0
            rows[sg.index] = {"master": torch.randn(n, generator=g), "exp_avg": m, "exp_avg_sq": v}
        saved["state"] = rows
        opt.load_state_dict(saved)
        # what the codec alone makes of the same values (scales bound to a local tensor)
        codec = MomentCodec("int8")
        expected_scales = torch.zeros_like(_scales(opt))
        codec.bind_scales(expected_scales)
        once: dict[int, dict[str, torch.Tensor]] = {}
        for sg in opt.sub_groups:
            state = torch.zeros(3, sg.padded_numel)
            for i, row in enumerate(("master", "exp_avg", "exp_avg_sq")):
                state[i, : sg.numel] = rows[sg.index][row]
            stored = torch.zeros(sg.state_shape, dtype=sg.state_dtype)
            codec.encode(sg, state, stored)
            decoded = codec.decode(sg, stored)
            once[sg.index] = {
                r: decoded[i, : sg.numel].clone()
                for i, r in enumerate(("master", "exp_avg", "exp_avg_sq"))
            }
        assert torch.equal(_scales(opt), expected_scales)
        for sg in opt.sub_groups:  # each block's absolute maximum, of the values given
            blocks = sg.padded_numel // INT8_BLOCK_NUMEL
            m = torch.zeros(sg.padded_numel)
            m[: sg.numel] = rows[sg.index]["exp_avg"]
            root = torch.zeros(sg.padded_numel)
            root[: sg.numel] = rows[sg.index]["exp_avg_sq"].sqrt()
            own = _scales(opt)[sg.scales_offset : sg.scales_offset + 2 * blocks]
            assert torch.equal(own[:blocks], m.abs().view(blocks, -1).amax(dim=1))
            assert torch.equal(own[blocks:], root.view(blocks, -1).amax(dim=1))
            # and the decoded moments are within the 8-bit form's bound of them
            decoded = once[sg.index]["exp_avg"]
            scale = own[:blocks].repeat_interleave(INT8_BLOCK_NUMEL)[: sg.numel]
            assert torch.all((decoded - rows[sg.index]["exp_avg"]).abs() <= scale * 0.02)
        got = {i: dict(v) for i, v in opt.state_dict()["state"].items()}
        for i, v in once.items():
            assert all(torch.equal(got[i][k], t) for k, t in v.items()), i
        # decoded values load to the same codes and the same scales again
        saved["state"] = got
        opt.load_state_dict(saved)
        assert torch.equal(_scales(opt), expected_scales)
        again = opt.state_dict()["state"]
        for i, v in once.items():
            assert all(torch.equal(again[i][k], t) for k, t in v.items()), i


# -- snapshots ----------------------------------------------------------------------------------


@pytest.mark.parametrize("host_fraction", [0.0, 0.25])
def test_scales_round_trip_through_a_snapshot_bitwise(tmp_path: Path, host_fraction: float) -> None:
    swap = tmp_path / "swap"
    gpt = model()
    with (
        swapper.offload(gpt, _config(swap, host_fraction)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as opt,
    ):
        _steps(gpt, opt, 2, seed=1)
        save_snapshot(wrapped, opt)
        scales = _scales(opt).clone()
        digest = final_digest(wrapped, opt)
        assert _scales(opt).data_ptr() != 0  # held again after the snapshot
        _steps(gpt, opt, 2, seed=2)
        whole = final_digest(wrapped, opt)
        key = opt._pipeline.scales.key
    gpt = model()
    with (
        swapper.offload(gpt, _config(swap, host_fraction), resume=True) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as opt,
    ):
        assert torch.equal(_scales(opt), scales)
        assert final_digest(wrapped, opt) == digest
        _steps(gpt, opt, 2, seed=2)
        assert final_digest(wrapped, opt) == whole
    engine = AioEngine(AioConfig())
    try:
        with NvmeStore.open([swap], engine, name=STORE) as store:
            assert f"optim_state/{key}" in store.snapshots()[-1].keys
    finally:
        engine.close()


def test_a_corrupted_scales_record_is_named_at_resume(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    gpt = model()
    with (
        swapper.offload(gpt, _config(swap)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as opt,
    ):
        _steps(gpt, opt, 2, seed=1)
        report = save_snapshot(wrapped, opt)
        key = f"optim_state/{opt._pipeline.scales.key}"
    engine = AioEngine(AioConfig())
    try:
        with NvmeStore.open([swap], engine, name=STORE) as store:
            extent = store.snapshot_tensor(report.name, key).extents[0]
    finally:
        engine.close()
    with open(swap / f"{STORE}.bin", "r+b") as f:  # one bit of one scale flipped
        f.seek(extent.offset + 6)
        byte = f.read(1)
        f.seek(extent.offset + 6)
        f.write(bytes([byte[0] ^ 0x04]))
    with pytest.raises(SwapCorruptionError, match=rf"{key}.*{STORE}") as caught:
        swapper.offload(model(), _config(swap), resume=report.name)
    assert str(swap) in str(caught.value)


# -- int8 snapshots of the layout before: scales at the end of each state tensor ----------------


def _inband(opt: OffloadAdamW) -> None:
    """Rewrite ``opt``'s state in the manager as the layout before kept it (each int8
    state tensor: master, codes, then its scales, padded to 4 KiB; no scales entry), as
    the code of that time wrote it (``stored_layout``: scales at ``6 * padded_numel``,
    exp_avg's blocks then exp_avg_sq's)."""
    pipeline = opt._pipeline
    manager = pipeline.manager
    scales = _scales(opt).clone()
    pipeline.scales.release(modified=True)
    for sg in opt.sub_groups:
        key = pipeline.key(sg.index)
        new = manager.fetch(key).clone()
        manager.release(key, modified=False)
        end = 6 * sg.padded_numel
        legacy = torch.zeros(round_up(end + 4 * sg.scales_numel, 4096), dtype=torch.uint8)
        legacy[:end] = new[:end]
        own = scales[sg.scales_offset : sg.scales_offset + sg.scales_numel]
        legacy[end : end + 4 * sg.scales_numel] = own.view(torch.uint8)
        manager.unregister(key)
        manager.register(key, legacy, Kind.OPTIM_STATE)
    manager.unregister(pipeline.scales.key)
    pipeline.scales.registered = False


def _old_snapshot(swap: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str, str]:
    """An int8 snapshot of the layout before at step 2: its name, the digest then, and
    the digest two more steps on."""
    import swapper.zero.checkpoint.snapshot as checkpoint

    real_meta = checkpoint.optimizer_meta

    def old_meta(optimizer: OffloadAdamW) -> dict[str, Any]:
        meta = real_meta(optimizer)
        del meta["scales"]  # (records of that time had no such field)
        return meta

    gpt = model()
    with (
        swapper.offload(gpt, _config(swap)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as opt,
    ):
        _steps(gpt, opt, 2, seed=1)
        digest = final_digest(wrapped, opt)
        # the same run, on: what the resumed one must reach
        other = model()
        with (
            swapper.offload(other, _config(swap.parent / "whole")) as wrapped2,
            OffloadAdamW(wrapped2.parameters(), lr=1e-2, tiers=wrapped2) as opt2,
        ):
            _steps(other, opt2, 2, seed=1)
            _steps(other, opt2, 2, seed=2)
            whole = final_digest(wrapped2, opt2)
        _inband(opt)
        with monkeypatch.context() as patch:
            patch.setattr(checkpoint, "optimizer_meta", old_meta)
            report = save_snapshot(wrapped, opt)
    return report.name, digest, whole


def test_an_int8_snapshot_of_the_layout_before_is_converted_on_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    swap = tmp_path / "swap"
    name, digest, whole = _old_snapshot(swap, monkeypatch)
    engine = AioEngine(AioConfig())
    try:
        with NvmeStore.open([swap], engine, name=STORE) as store:
            keys = store.snapshots()[-1].keys
            assert not any(k.endswith("/scales") for k in keys)  # scales in-band only
    finally:
        engine.close()
    for _ in range(2):  # a second resume: the snapshot was left as it was
        gpt = model()
        with (
            swapper.offload(gpt, _config(swap), resume=name) as wrapped,
            OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as opt,
        ):
            assert opt.step_count == 2
            assert final_digest(wrapped, opt) == digest
            _steps(gpt, opt, 2, seed=2)
            assert final_digest(wrapped, opt) == whole
            assert opt.last_step is not None  # converted: 6 B per element, no scales
            stored = sum(sg.state_nbytes for sg in opt.sub_groups)
            assert opt.last_step.traffic.read_nbytes[Kind.OPTIM_STATE] == stored


def test_an_unknown_or_mismatched_scales_layout_is_refused_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    swap = tmp_path / "swap"
    name, _, _ = _old_snapshot(swap, monkeypatch)
    gpt = model()
    with swapper.offload(gpt, _config(swap), resume=name) as wrapped:
        resumed = wrapped.resumed
        assert resumed is not None and resumed.optimizer is not None
        resumed.optimizer["scales"] = "inline-v9"
        with pytest.raises(StateDictError, match=rf"{resumed.path}.*scales.*'inline-v9'"):
            OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
        # recorded apart, but the state tensors are of the layout before
        resumed.optimizer["scales"] = "apart"
        with pytest.raises(
            StateDictError, match=rf"{resumed.path}: .*/state/0.*expected.*moments int8\)"
        ):
            OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
        del resumed.optimizer["scales"]  # as recorded: converted, then usable
        with OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as opt:
            assert opt.step_count == 2


def test_a_conversion_failing_part_way_leaves_the_snapshot_to_resume_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    swap = tmp_path / "swap"
    name, digest, _ = _old_snapshot(swap, monkeypatch)
    from swapper.manager import TierManager
    from tiers.errors import SwapIOError

    real_register = TierManager.register
    calls = {"n": 0}

    def failing_register(self: TierManager, key: str, tensor: torch.Tensor, kind: Any) -> None:
        if "/state/" in key:
            calls["n"] += 1
            if calls["n"] == 3:  # the third sub-group converted: two are already
                raise SwapIOError(f"injected: writing {key} failed")
        real_register(self, key, tensor, kind)

    gpt = model()
    with swapper.offload(gpt, _config(swap), resume=name) as wrapped:
        with monkeypatch.context() as patch:
            patch.setattr(TierManager, "register", failing_register)
            with pytest.raises(SwapIOError, match="injected"):
                OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
        assert any("resume from it again" in r.getMessage() for r in caplog.records)
    gpt = model()
    with (
        swapper.offload(gpt, _config(swap), resume=name) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as opt,
    ):
        assert final_digest(wrapped, opt) == digest


def test_scales_not_fetched_back_after_a_snapshot_are_fetched_at_the_next_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from swapper.step.scales import HeldScales
    from tiers.errors import SwapIOError

    gpt = model()
    with (
        swapper.offload(gpt, _config(tmp_path / "swap")) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as opt,
    ):
        _steps(gpt, opt, 1, seed=1)
        real_hold = HeldScales.hold

        def failing_hold(self: HeldScales) -> None:
            raise SwapIOError("injected: reading the scales failed")

        with monkeypatch.context() as patch:
            patch.setattr(HeldScales, "hold", failing_hold)
            with pytest.raises(SwapIOError, match="injected"):
                save_snapshot(wrapped, opt)  # (written; the re-fetch at its end fails)
        assert not opt._pipeline.scales.held
        assert HeldScales.hold is real_hold
        _steps(gpt, opt, 1, seed=2)  # held again first: the step reads and writes them
        assert opt._pipeline.scales.held and opt.step_count == 2
