"""Tests of swapper.step.compress (compressed Adam moments, ``StepConfig.moments``): the
encodings' error bounds (hypothesis round trips), determinism, the stored layout and the
bytes a step moves, the optimizer against fp32 moments, state dicts, snapshots and DCP
exports of compressed state, and bad settings refused by name.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import swapper
from swapper import Kind, ManagerConfig, OffloadAdamW, StepConfig, SwapConfigError
from swapper.step.compress import (
    MomentCodec,
    decode_bf16,
    decode_int8,
    dynamic_map,
    encode_bf16,
    encode_int8,
)
from swapper.step.layout import (
    ALIGN_NUMEL,
    INT8_BLOCK_NUMEL,
    STORED_ALIGN_NBYTES,
    plan_sub_groups,
    scales_numel,
    stored_layout,
)
from swapper.step.state import MomentsMismatchError, StateDictError

ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


def _half_gap(signed: bool) -> float:
    """Half the largest distance between two neighbouring levels of the dynamic map (or
    the distance from an end of the range to the level nearest it), plus the 2^-9 of
    the rounding to bfloat16 the encoder looks levels up by: the worst rounding error,
    as a fraction of the block's scale."""
    levels = dynamic_map(signed).double()
    ends = [float(levels[0]) - (-1.0 if signed else 0.0), 1.0 - float(levels[-1])]
    return max(float((levels[1:] - levels[:-1]).max()) / 2, *ends) + 2.0**-9


# -- the encodings --------------------------------------------------------------------------

finite32 = st.floats(
    min_value=-(2.0**100), max_value=2.0**100, allow_nan=False, allow_infinity=False, width=32
)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite32, min_size=1, max_size=300))
def test_bf16_round_trip_is_within_2_pow_minus_8_relative(values: list[float]) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    codes = torch.empty(x.numel(), dtype=torch.bfloat16)
    out = torch.empty_like(x)
    encode_bf16(x, codes)
    decode_bf16(codes, out)
    normal = x.abs() >= torch.finfo(torch.bfloat16).tiny  # (subnormals: absolute error)
    err = (out - x).abs()
    assert torch.all(err[normal] <= x.abs()[normal] * 2.0**-8)
    assert torch.all(err[~normal] <= torch.finfo(torch.bfloat16).tiny)
    assert torch.equal(out[x == 0], x[x == 0])


@st.composite
def blocks(draw: st.DrawFn, signed: bool) -> torch.Tensor:
    """1 to 3 blocks of values spanning many decades (as Adam's moments do), some zero."""
    n = draw(st.integers(1, 3)) * INT8_BLOCK_NUMEL
    seed = draw(st.integers(0, 2**31 - 1))
    decades = draw(st.floats(0.0, 12.0))
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (-decades * torch.rand(n, generator=g, dtype=torch.float64))
    scale = 10.0 ** draw(st.floats(-12.0, 3.0))
    x = (magnitude * scale).float()
    if signed:
        x = torch.where(torch.rand(n, generator=g) < 0.5, -x, x)
    zero_block = draw(st.booleans())
    if zero_block:
        x[:INT8_BLOCK_NUMEL] = 0.0
    x[torch.rand(n, generator=g) < 0.05] = 0.0
    return x


@pytest.mark.parametrize("signed", [True, False])
def test_int8_block_error_is_within_half_a_level_of_the_scale(signed: bool) -> None:
    @settings(max_examples=40, deadline=None)
    @given(blocks(signed))
    def check(x: torch.Tensor) -> None:
        n = x.numel()
        codes = torch.empty(n, dtype=torch.uint8)
        scales = torch.empty(n // INT8_BLOCK_NUMEL, dtype=torch.float32)
        encode_int8(x, codes, scales, signed=signed)
        out = torch.empty_like(x)
        decode_int8(codes, scales, out, signed=signed)
        per_block = x.view(-1, INT8_BLOCK_NUMEL)
        assert torch.equal(scales, per_block.abs().amax(dim=1))
        bound = scales[:, None].double() * (_half_gap(signed) * (1 + 1e-6)) + 1e-45
        err = (out.double() - x.double()).view(-1, INT8_BLOCK_NUMEL).abs()
        assert torch.all(err <= bound)
        assert torch.equal(out[x == 0], x[x == 0].abs())  # zero stays zero
        # each block's largest element is kept exactly (level ±1.0 times the scale)
        top = per_block.abs().argmax(dim=1)
        rows = torch.arange(per_block.shape[0])
        assert torch.equal(out.view(-1, INT8_BLOCK_NUMEL)[rows, top], per_block[rows, top])
        # decoded values encode to themselves again (a step re-encodes every block)
        codes2 = torch.empty_like(codes)
        scales2 = torch.empty_like(scales)
        encode_int8(out, codes2, scales2, signed=signed)
        assert torch.equal(codes2, codes) and torch.equal(scales2, scales)

    check()


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.floats(-1.0, 1.0, width=32), min_size=1, max_size=200),
    st.booleans(),
)
def test_table_lookup_finds_the_nearest_level_of_the_bf16_value(
    values: list[float], signed: bool
) -> None:
    from swapper.step.compress import _midpoints_cpu, _nearest_codes

    x = torch.tensor(values, dtype=torch.float32)
    if not signed:
        x = x.abs()
    # also every midpoint and its neighbours (the ties and the edges of the buckets)
    mids = _midpoints_cpu(signed)
    x = torch.cat([x, mids, mids.nextafter(torch.tensor(2.0)), mids.nextafter(torch.tensor(-2.0))])
    x = x.clamp(-1.0 if signed else 0.0, 1.0)
    expected = torch.bucketize(x.to(torch.bfloat16).float(), mids).to(torch.uint8)
    got = torch.empty(x.numel(), dtype=torch.uint8)
    _nearest_codes(x, signed, got)
    assert torch.equal(got, expected)
    # every level maps to itself
    levels = dynamic_map(signed)
    own = torch.empty(256, dtype=torch.uint8)
    _nearest_codes(levels, signed, own)
    assert torch.equal(own.long(), torch.arange(256))


def test_the_error_bound_is_about_scale_over_127() -> None:
    # bitsandbytes' dynamic map: the coarsest steps are in the top decade
    assert 1 / 160 < _half_gap(True) - 2.0**-9 < 1 / 127
    assert 1 / 320 < _half_gap(False) - 2.0**-9 < 1 / 254
    assert _half_gap(True) < 1 / 100 and _half_gap(False) < 1 / 165
    for signed in (True, False):
        levels = dynamic_map(signed)
        assert levels.numel() == 256 and torch.all(levels[1:] > levels[:-1])
        assert 0.0 in levels.tolist() and levels.max() == 1.0
        assert levels.min() == (-1.0 if signed else 0.0)


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_codec_round_trip_keeps_master_exact_and_is_deterministic(moments: str) -> None:
    (sg,) = plan_sub_groups([[5000]], 8192, moments)
    g = torch.Generator().manual_seed(3)
    state = torch.zeros(3, sg.padded_numel)
    state[0, :5000] = torch.randn(5000, generator=g)
    state[1, :5000] = torch.randn(5000, generator=g) * 1e-3
    state[2, :5000] = torch.rand(5000, generator=g) ** 4 * 1e-6
    codec = MomentCodec(moments)
    scales = torch.zeros(sg.scales_numel)  # int8: kept apart from the stored tensor
    codec.bind_scales(scales)
    stored = torch.zeros(sg.state_shape, dtype=sg.state_dtype)
    codec.encode(sg, state, stored)
    kept_scales = scales.clone()
    again = torch.zeros_like(stored)
    codec.encode(sg, state.clone(), again)
    assert torch.equal(stored, again)  # run to run: the same bytes
    assert torch.equal(scales, kept_scales)
    out = codec.decode(sg, stored)
    assert torch.equal(out[0], state[0])  # master weights are never compressed
    assert torch.equal(out[:, 5000:], torch.zeros(3, sg.padded_numel - 5000))
    assert torch.equal(codec.master(sg, stored), state[0])
    if moments == "bf16":
        assert torch.equal(out[1:], state[1:].to(torch.bfloat16).float())
    else:
        rel_m = (out[1] - state[1]).abs().max() / state[1].abs().max()
        assert rel_m <= _half_gap(True) * 1.001
        # exp_avg_sq is stored as its square root: the bound holds there
        root = (out[2].sqrt() - state[2].sqrt()).abs().view(-1, INT8_BLOCK_NUMEL)
        scale = state[2].sqrt().view(-1, INT8_BLOCK_NUMEL).amax(dim=1, keepdim=True)
        assert torch.all(root <= scale * _half_gap(False) * 1.001 + 1e-30)
    # rows(): decoded views; the block's end encodes them back
    with codec.rows(sg, stored) as (master, m, v):
        assert master.numel() == m.numel() == v.numel() == 5000
        assert torch.equal(m, out[1, :5000]) and torch.equal(v, out[2, :5000])
        master.add_(1.0)
    assert torch.equal(codec.master(sg, stored)[:5000], state[0, :5000] + 1.0)
    # an exception inside leaves the stored moments (and their scales) as they were
    before, scales_before = stored.clone(), scales.clone()
    with pytest.raises(RuntimeError), codec.rows(sg, stored) as (_, m, _v):
        m.fill_(7.0)
        raise RuntimeError("kernel failed")
    assert torch.equal(stored, before) and torch.equal(scales, scales_before)
    if moments == "int8":  # the scales are what decoding reads: unbound, it refuses
        assert scales.numel() == 2 * sg.padded_numel // INT8_BLOCK_NUMEL
        codec.bind_scales(None)
        with pytest.raises(SwapConfigError, match=r"block scales bound"):
            codec.decode(sg, stored)


# -- layout and bytes -------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40_000), st.sampled_from(["bf16", "int8"]))
def test_stored_layout_sections_fit_and_align(padded_blocks: int, moments: str) -> None:
    padded = padded_blocks * ALIGN_NUMEL  # up to 41M elements
    layout = stored_layout(moments, padded)
    assert layout.nbytes % STORED_ALIGN_NBYTES == 0
    assert layout.exp_avg_offset == 4 * padded  # fp32 master first
    per = 2 if moments == "bf16" else 1
    assert layout.exp_avg_sq_offset == layout.exp_avg_offset + per * padded
    assert layout.end == layout.exp_avg_sq_offset + per * padded  # no scales in-band
    # one 4 KiB round-up per sub-group, at most half of it (1024-element multiples)
    assert layout.nbytes - layout.end <= STORED_ALIGN_NBYTES // 2
    assert layout.scales_numel == (2 * padded // INT8_BLOCK_NUMEL if moments == "int8" else 0)
    for offset in (layout.exp_avg_offset, layout.exp_avg_sq_offset, layout.end):
        assert offset % 4 == 0
    if padded >= 1 << 20:  # a sub-group of a realistic size: 6 (8) B + alignment
        limit = 8.0 if moments == "bf16" else 6.0
        assert layout.nbytes / padded <= limit + 0.002


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9000), max_size=4), min_size=1, max_size=3))
def test_int8_scales_of_the_sub_groups_lie_end_to_end(numels: list[list[int]]) -> None:
    plan = plan_sub_groups(numels, 2048, "int8")
    cursor = 0
    for sg in plan:
        assert sg.scales_offset == cursor
        assert sg.scales_numel == sg.stored.scales_numel == 2 * sg.padded_numel // 1024
        cursor += sg.scales_numel
    assert scales_numel(plan) == cursor
    assert all(sg.scales_offset == 0 for sg in plan_sub_groups(numels, 2048, "bf16"))


def test_bad_settings_are_refused_naming_them() -> None:
    with pytest.raises(SwapConfigError, match=r"moments='fp16' must be one of 'fp32', 'bf16'"):
        StepConfig(moments="fp16")
    with pytest.raises(SwapConfigError, match=r"moments=8"):
        StepConfig(moments=8)  # type: ignore[arg-type]
    with pytest.raises(SwapConfigError, match=r"moments='int4'"):
        swapper.OffloadConfig.from_dict({"step": {"moments": "int4"}})
    with pytest.raises(SwapConfigError, match=r"moments='x'"):
        plan_sub_groups([[10]], 1024, "x")
    with pytest.raises(SwapConfigError, match=r"moments='fp32' has no compressed layout"):
        stored_layout("fp32", 1024)
    from swapper.pressure.runner import PressureSettings

    with pytest.raises(SwapConfigError, match=r"moments='bf8'"):
        PressureSettings(moments="bf8")
    # the model's config gives it to the optimizer (one config tree)
    config = swapper.OffloadConfig.from_dict({"step": {"moments": "bf16"}})
    assert config.step.moments == "bf16"
    assert swapper.OffloadConfig.create().step.moments == "fp32"
    assert swapper.OffloadConfig.create().as_dict()["step"]["moments"] == "fp32"


# -- the optimizer ----------------------------------------------------------------------------


def _model(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(64, 160), nn.GELU(), nn.Linear(160, 70)).to(torch.bfloat16)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    return model(x).float().square().mean()


def _manager(tmp_path: Path, name: str, host_nbytes: int = 4 * 12 * 4096) -> ManagerConfig:
    return ManagerConfig(
        device_nbytes=0,
        host_nbytes=host_nbytes,
        nvme_dirs=[tmp_path / name],
        timeout_s=20.0,
        close_timeout_s=20.0,
    )


def _train(
    tmp_path: Path, name: str, moments: str | None, steps: int = 4
) -> tuple[list[float], list[dict[str, torch.Tensor]], list[torch.Tensor], list[tuple[int, int]]]:
    model = _model()
    with OffloadAdamW(
        model.parameters(),
        **ADAM,
        tiers=_manager(tmp_path, name),
        config=StepConfig(sub_group_numel=4096, moments=moments),
    ) as opt:
        losses, traffic = [], []
        for step in range(1, steps + 1):
            loss = _loss(model, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            assert opt.last_step is not None
            t = opt.last_step.traffic
            traffic.append(
                (t.read_nbytes.get(Kind.OPTIM_STATE, 0), t.written_nbytes.get(Kind.OPTIM_STATE, 0))
            )
        state = [dict(v) for v in opt.state_dict()["state"].values()]
        params = [p.detach().clone() for p in model.parameters()]
    return losses, state, params, traffic


def test_fp32_given_explicitly_is_the_default_bitwise(tmp_path: Path) -> None:
    default = _train(tmp_path, "a", None, steps=2)
    explicit = _train(tmp_path, "b", "fp32", steps=2)
    assert default[0] == explicit[0]
    for x, y in zip(default[1], explicit[1], strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)
    assert all(torch.equal(a, b) for a, b in zip(default[2], explicit[2], strict=True))


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_compressed_moments_step_close_to_fp32_deterministically_with_fewer_bytes(
    tmp_path: Path, moments: str
) -> None:
    losses32, state32, _, traffic32 = _train(tmp_path, "fp32", "fp32")
    losses, state, params, traffic = _train(tmp_path, "c1", moments)
    again = _train(tmp_path, "c2", moments)
    # deterministic run to run: the same losses, parameters and state, to the bit
    assert losses == again[0]
    assert all(torch.equal(a, b) for a, b in zip(params, again[2], strict=True))
    for x, y in zip(state, again[1], strict=True):
        assert all(torch.equal(x[k], y[k]) for k in x)
    # close to fp32 moments (a few steps: rounding has not compounded)
    for a, b in zip(losses, losses32, strict=True):
        assert math.isclose(a, b, rel_tol=1e-2)
    for x, y in zip(state, state32, strict=True):
        assert torch.allclose(x["master"], y["master"], rtol=0, atol=5e-3)
        scale = y["exp_avg"].abs().max()
        assert (x["exp_avg"] - y["exp_avg"]).abs().max() <= 0.05 * scale
    # bytes: every sub-group read and written once per step (after the first), as stored
    numel = sum(p.numel() for p in params)
    sub_groups = plan_sub_groups([[p.numel() for p in params]], 4096, moments)
    stored = sum(sg.state_nbytes for sg in sub_groups)
    assert traffic[-1] == (stored, stored)
    assert traffic32[-1][0] == sum(sg.state_nbytes for sg in plan_sub_groups([[numel]], 4096))
    # (sub-groups this small pay their padding to 1024 elements and, int8, the 4 KiB
    # alignment of the stored tensor; at real sizes it is 8.00 and 6.01 B: see
    # test_stored_layout_sections_fit_and_align)
    assert traffic[-1][0] < traffic32[-1][0] * (0.67 if moments == "bf16" else 0.6)


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_state_dict_is_decoded_fp32_and_loads_into_any_moments(
    tmp_path: Path, moments: str
) -> None:
    model = _model()
    with OffloadAdamW(
        model.parameters(),
        **ADAM,
        tiers=_manager(tmp_path, "src"),
        config=StepConfig(sub_group_numel=4096, moments=moments),
    ) as opt:
        for step in range(1, 3):
            _loss(model, step).backward()
            opt.step()
            opt.zero_grad()
        saved = opt.state_dict()
        assert saved["swapper"]["moments"] == moments
        rows = {i: {k: t.clone() for k, t in v.items()} for i, v in saved["state"].items()}
        assert all(t.dtype == torch.float32 for v in rows.values() for t in v.values())
        # into fp32 moments: exactly what was decoded
        with OffloadAdamW(
            model.parameters(),
            **ADAM,
            tiers=_manager(tmp_path, "fp32"),
            config=StepConfig(sub_group_numel=4096),
        ) as other:
            other.load_state_dict(saved)
            loaded = other.state_dict()["state"]
            for i, v in rows.items():
                assert all(torch.equal(loaded[i][k], t) for k, t in v.items())
        # back into the same compressed moments: decoded values re-encode to themselves
        opt.load_state_dict(saved)
        for i, v in opt.state_dict()["state"].items():
            assert all(torch.equal(t, rows[i][k]) for k, t in v.items())


# -- snapshots and DCP --------------------------------------------------------------------------


def _ckpt_config(swap: Path, moments: str) -> swapper.OffloadConfig:
    from ckpt_train import DEVICE_NBYTES, HOST_NBYTES

    return swapper.OffloadConfig.create(
        device_nbytes=DEVICE_NBYTES,
        host_nbytes=HOST_NBYTES,
        nvme_dirs=[swap],
        device="cpu",
        step=StepConfig(sub_group_numel=4096, moments=moments),
    )


def test_snapshot_keeps_the_compressed_form_and_refuses_other_moments(tmp_path: Path) -> None:
    from ckpt_train import model

    from swapper.zero.checkpoint.snapshot import final_digest, save_snapshot

    swap = tmp_path / "swap"
    gpt = model()
    with (
        swapper.offload(gpt, _ckpt_config(swap, "int8")) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as opt,
    ):
        for _ in range(2):
            gpt.loss(torch.randint(0, 64, (2, 9))).backward()
            opt.step()
            opt.zero_grad()
        report = save_snapshot(wrapped, opt)
        # compressed on disk too: ~6 B per element of state instead of 12
        assert report.nbytes < 10 * 28_032
        digest = final_digest(wrapped, opt)
    for other in ("fp32", "bf16"):
        gpt = model()
        with (
            swapper.offload(gpt, _ckpt_config(swap, other), resume=True) as wrapped,
            pytest.raises(MomentsMismatchError, match=r"moments='int8'.*moments='" + other),
        ):
            OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
    assert issubclass(MomentsMismatchError, SwapConfigError)
    assert issubclass(MomentsMismatchError, StateDictError)
    gpt = model()
    with (
        swapper.offload(gpt, _ckpt_config(swap, "int8"), resume=True) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as opt,
    ):
        assert opt.step_count == 2
        assert final_digest(wrapped, opt) == digest


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_export_of_compressed_moments_is_decoded_fp32(tmp_path: Path) -> None:
    from ckpt_train import model

    from swapper.zero.checkpoint.dcp_export import export_dcp
    from swapper.zero.checkpoint.dcp_import import import_dcp

    gpt = model()
    with (
        swapper.offload(gpt, _ckpt_config(tmp_path / "swap", "bf16")) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as opt,
    ):
        for _ in range(2):
            gpt.loss(torch.randint(0, 64, (2, 9))).backward()
            opt.step()
            opt.zero_grad()
        export_dcp(wrapped, tmp_path / "dcp", opt)
        expected = {i: dict(v) for i, v in opt.state_dict()["state"].items()}
    # into fp32 moments and another sub-group size: the decoded values, exactly
    other = model()
    with (
        swapper.offload(other, _ckpt_config(tmp_path / "swap2", "fp32")) as wrapped2,
        OffloadAdamW(wrapped2.parameters(), lr=1e-2, tiers=wrapped2) as opt2,
    ):
        import_dcp(wrapped2, tmp_path / "dcp", opt2)
        got = opt2.state_dict()["state"]
        for row in ("master", "exp_avg", "exp_avg_sq"):
            a = torch.cat([expected[i][row] for i in sorted(expected)])
            b = torch.cat([got[i][row] for i in range(len(got))])
            assert torch.equal(a, b), row


# -- the tools: bytes per parameter printed -------------------------------------------------------


def test_bench_step_times_compressed_moments_beside_fp32(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from swapper.bench import main

    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "step.json"
    argv = ["step", "--dir", str(work), "--params", "300K", "--sub-group", "100K"]
    argv += ["--steps", "1", "--warmup", "1", "--moments", "bf16,int8", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "step-bf16 / step" in printed and "step-int8 / step" in printed
    doc = json.loads(out.read_text())
    assert set(doc["passes"]) == {"io-only", "compute-only", "step", "step-bf16", "step-int8"}
    plan = plan_sub_groups([[300_000]], 100_000)
    fp32 = sum(sg.state_nbytes for sg in plan) / 300_000
    assert doc["read_bytes_per_param"] == pytest.approx(fp32)
    for moments, limit in (("bf16", 8.0), ("int8", 6.03)):
        entry = doc["moments"][moments]
        stored = sum(sg.state_nbytes for sg in plan_sub_groups([[300_000]], 100_000, moments))
        assert entry["read_bytes_per_param"] == pytest.approx(stored / 300_000)
        assert entry["write_bytes_per_param"] == pytest.approx(stored / 300_000)
        assert entry["read_bytes_per_param"] <= limit * 1.01  # (padding at 100K elements)
        assert entry["step_seconds"] > 0 and len(entry["time_ratio_per_round"]) == 1
    assert list(work.iterdir()) == []
    assert main(["step", "--dir", str(work), "--moments", "fp16"]) == 2
    assert "unknown moments 'fp16'" in capsys.readouterr().err


def test_pressure_json_has_bytes_per_parameter_and_stays_identical(tmp_path: Path) -> None:
    from swapper.pressure.runner import PressureSettings, run_pressure

    result = run_pressure(
        PressureSettings(params=300_000, steps=3, moments="int8", dirs=(tmp_path,))
    )
    doc = result.to_json()
    assert doc["moments"] == "int8"
    # budgeted and unlimited runs store the moments alike: still bit-identical
    assert result.identical and doc["identical"]
    assert 6.0 <= doc["optimizer_read_bytes_per_param_per_step"] <= 7.0
    assert 6.0 <= doc["optimizer_written_bytes_per_param_per_step"] <= 7.0


def test_pressure_command_line_refuses_what_it_cannot_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from swapper.pressure.cli import MOMENTS as CLI_MOMENTS
    from swapper.pressure.cli import main
    from swapper.step.config import MOMENTS

    assert CLI_MOMENTS == MOMENTS  # (the command line keeps its own copy: no torch there)
    assert main(["--moments", "int4"]) == 2
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    assert main(["--moments", "int8", "--nproc", "2"]) == 2
    assert "--moments other than fp32 is single-process" in capsys.readouterr().err


# -- several ranks ------------------------------------------------------------------------------


def _ranks_train(rank: int, world: int, tmp: str, moments: str, tight: bool) -> dict:
    """One rank of tests/test_dist_train.py's tiny model, with ``moments``."""
    import os

    import test_dist_train as d
    import torch.distributed as dist
    import torch.nn.functional as F

    from swapper.zero.config.distributed import DistributedConfig

    settings = {**d.TIGHT, "nvme_dirs": [os.path.join(tmp, f"{moments}-tight")]} if tight else {}
    config = swapper.OffloadConfig(
        manager=swapper.OffloadConfig.create(device="cpu", **settings).manager,
        step=StepConfig(sub_group_numel=d.SUB_GROUP_NUMEL, max_grad_norm=d.CLIP, moments=moments),
        distributed=DistributedConfig(timeout_s=d.PG_TIMEOUT_S),
    )
    wrapped = swapper.offload(d._model(), config, dist.group.WORLD)
    optimizer = OffloadAdamW(wrapped.parameters(), lr=d.LR, tiers=wrapped)
    losses = []
    try:
        for tokens in d._batches():
            share = tokens[rank * d.BATCH // world : (rank + 1) * d.BATCH // world]
            logits = wrapped(share[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, d.VOCAB), share[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        return {
            "losses": losses,
            "params": {k: v.clone() for k, v in wrapped.state_dict().items()},
            "stored": sum(sg.state_nbytes for sg in optimizer.sub_groups),
            "nvme_read": wrapped.stats().moved("nvme", "host").nbytes,
        }
    finally:
        optimizer.close()
        wrapped.close()


def _ranks_variants(rank: int, world: int, tmp: str) -> list[dict]:
    return [
        _ranks_train(rank, world, tmp, moments, tight)
        for moments, tight in (("int8", True), ("int8", False), ("fp32", False))
    ]


@pytest.mark.dist
def test_two_ranks_store_their_shards_moments_compressed(tmp_path: Path) -> None:
    import test_dist_train as d

    results = d._spawn(_ranks_variants, 2, tmp_path / "ranks")
    d._same(results[0][0]["params"], results[0][1]["params"])  # tight == unlimited
    for tight, free, fp32 in results:
        assert tight["nvme_read"] > 0
        assert tight["losses"] == free["losses"]
        assert tight["stored"] < fp32["stored"] * 0.75  # (tiny shards: padding and alignment)
        for a, b in zip(free["losses"], fp32["losses"], strict=True):
            assert math.isclose(a, b, rel_tol=2e-2)
