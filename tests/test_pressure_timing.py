"""The pressure runner's timing figures (``swapper.pressure.timing``): seconds per step of
the budgeted, unlimited and plain PyTorch runs, the I/O floor from the disk's measured
rates, and the forward/backward/step stall split; and the one summary line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from swapper.pressure.cli import main
from swapper.pressure.model import GPTConfig, batches
from swapper.pressure.runner import PressureSettings, run_pressure
from swapper.pressure.timing import (
    DiskRates,
    Phases,
    PlainRun,
    Timing,
    measure_disk,
    median_after_first,
    plain_run,
)
from tiers.config import AioConfig
from tiers.errors import SwapConfigError

PARAMS = 300_000
NUM_PARAMS = GPTConfig.for_params(PARAMS).num_params()
# The plain run is the reference's math by another code path (norm summed and update
# applied in another order): losses agree to this relative tolerance over a few steps
# (measured: equal at 300K params, 3 steps; a plain run with lr 10 % off is 5.5e-4 away
# by step 3, so the check can fail).
LOSS_RTOL = 1e-4
KEYS = (
    "seconds_per_step",
    "reference_seconds_per_step",
    "plain_seconds_per_step",
    "io_floor_seconds",
)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_pressure_json_has_positive_consistent_timing(dtype: str, tmp_path: Path) -> None:
    settings = PressureSettings(
        params=PARAMS,
        steps=3,
        dtype=dtype,
        device_nbytes=2 * NUM_PARAMS // 4,
        host_nbytes=12 * NUM_PARAMS // 4,
        dirs=(tmp_path,),
    )
    result = run_pressure(settings)
    assert result.ok
    out = result.to_json()
    for key in KEYS:
        assert math.isfinite(out[key]) and out[key] > 0, key
    assert set(out["stall_seconds"]) == {"forward", "backward", "step"}
    assert all(v >= 0 for v in out["stall_seconds"].values())
    # the budgeted run moves optimizer state through NVMe every step: the floor is real
    assert all(n > 0 for n in result.phases.nvme_nbytes[1:])
    # the stall split adds up to what the runner already tracked per phase
    p = result.phases
    for f, m in zip(p.forward_stall_s, p.model_stall_s, strict=True):
        assert 0 <= f <= m + 1e-9
    assert out["disk"]["write_bytes_per_second"] > 0 and out["disk"]["read_bytes_per_second"] > 0
    # same model, seed and batches: plain PyTorch trains to the same losses
    assert out["plain_losses"] == pytest.approx(out["reference_losses"], rel=LOSS_RTOL)
    assert out["plain_losses"][0] == out["reference_losses"][0]  # before any update
    assert json.loads(json.dumps(out)) == out
    assert list(tmp_path.iterdir()) == []  # the disk probe left nothing


def test_cli_prints_the_timing_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    code = main(["--params", "300K", "--steps", "2", "--dir", str(tmp_path), "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    line = next(x for x in text.splitlines() if x.startswith("per step (median after the first)"))
    for label in ("s budgeted", "s unlimited", "s plain PyTorch", "I/O floor", "/s write"):
        assert label in line
    assert "s forward" in line and "s backward" in line and "s step" in line
    data = json.loads(out.read_text())
    assert all(key in data for key in (*KEYS, "stall_seconds"))


def test_plain_run_matches_the_pressure_models_losses_bf16() -> None:
    config = GPTConfig.for_params(200_000)
    data = batches(config, batch=2, seq=16, steps=3, seed=1)
    a = plain_run(config, data, dtype=torch.bfloat16, seed=1, lr=1e-3)
    b = plain_run(config, data, dtype=torch.bfloat16, seed=1, lr=1e-3)
    assert a.losses == b.losses  # deterministic
    assert len(a.step_s) == 3 and all(s > 0 for s in a.step_s)
    assert a.losses[-1] < a.losses[0]  # it trains
    with pytest.raises(SwapConfigError, match="dtype"):
        plain_run(config, data, dtype=torch.float32, seed=1, lr=1e-3)


def test_measure_disk_rates_and_bad_input(tmp_path: Path) -> None:
    rates = measure_disk([tmp_path, tmp_path], AioConfig(), nbytes=1 << 20)
    assert rates.nbytes == 2 << 20
    assert rates.write_bytes_per_s > 0 and rates.read_bytes_per_s > 0
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(SwapConfigError, match="at least one"):
        measure_disk([], AioConfig())
    with pytest.raises(SwapConfigError, match="4096"):
        measure_disk([tmp_path], AioConfig(), nbytes=100)


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=20))
def test_median_after_first_ignores_the_first_step(values: list[float]) -> None:
    got = median_after_first(values)
    rest = values[1:] or values
    assert min(rest) <= got <= max(rest)
    assert median_after_first([1e9, *values]) == median_after_first([0.0, *values])


def test_timing_io_floor_from_bytes_and_rates() -> None:
    phases = Phases(
        model_s=[1.0, 1.0, 1.0],
        model_stall_s=[0.5, 0.3, 0.3],
        forward_stall_s=[0.2, 0.1, 0.1],
        optimizer_s=[2.0, 2.0, 2.0],
        optimizer_stall_s=[0.4, 0.2, 0.2],
        nvme_read_nbytes=[0, 100, 100],
        nvme_written_nbytes=[0, 50, 50],
    )
    disk = DiskRates(write_bytes_per_s=50.0, read_bytes_per_s=100.0, nbytes=1, direct=True)
    timing = Timing.of(phases, phases, PlainRun([1.0] * 3, [0.5] * 3), disk)
    assert timing.io_floor_seconds == pytest.approx(2.0)  # 100 / 100 + 50 / 50
    assert timing.seconds_per_step == pytest.approx(3.0)
    assert timing.plain_seconds_per_step == pytest.approx(0.5)
    assert timing.stall_seconds == pytest.approx({"forward": 0.1, "backward": 0.2, "step": 0.2})
