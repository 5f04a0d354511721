"""Budgeted runs with no in-memory reference (``swapper.pressure.budgeted``): the small
form of ``swapper-pressure --reference none`` and of ``--compare-budgets`` (issue 23).

A 300K-parameter GPT under budgets a quarter of its 16-bit parameters and of its
optimizer state: it trains with finite losses within its budgets, its JSON says per step
where the seconds and bytes went, and two budget splits (other budgets, half the
sub-group, overlap flipped) give bit-identical losses and final digests.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from swapper.pressure.budgeted import (
    BudgetComparison,
    MaterialiseFigures,
    compare_budgets,
    compute_floor,
    other_split,
    run_budgeted,
)
from swapper.pressure.cli import main
from swapper.pressure.model import GPTConfig
from swapper.pressure.ranks_report import RankReport
from swapper.pressure.runner import Materialised, PressureSettings
from swapper.pressure.timing import DiskRates
from tiers.errors import SwapConfigError

PARAMS = 300_000
NUM_PARAMS = GPTConfig.for_params(PARAMS).num_params()
DEVICE_NBYTES = 2 * NUM_PARAMS // 4
HOST_NBYTES = 12 * NUM_PARAMS // 4


def _settings(swap: Path, **changes: object) -> PressureSettings:
    swap.mkdir(exist_ok=True)
    base = PressureSettings(
        params=PARAMS,
        steps=2,
        device_nbytes=DEVICE_NBYTES,
        host_nbytes=HOST_NBYTES,
        dirs=(swap,),
        batch=2,
        seq=16,
    )
    return dataclasses.replace(base, **changes)


def test_no_reference_run_reports_each_step(tmp_path: Path) -> None:
    result = run_budgeted(_settings(tmp_path / "swap"))
    assert result.ok, result.summary()
    assert len(result.steps) == 2 and result.losses_finite
    assert result.within_budgets
    assert 0 < result.peak_rss_bytes <= result.rss_bound_bytes
    # the final phase (hashes, digest) is measured apart, and counts for ok
    assert 0 < result.final_peak_rss_bytes <= result.rss_bound_bytes
    over = dataclasses.replace(result, final_peak_rss_bytes=result.rss_bound_bytes + 1)
    assert not over.ok and "PEAK RSS OVER BOUND" in over.summary()
    assert result.state_nbytes == 16 * result.num_params
    assert result.compute_floor_sub_group_s > 0
    assert result.disk.read_bytes_per_s > 0 and result.disk.write_bytes_per_s > 0
    m = result.materialised
    assert m.modules > 0 and m.model_s > 0 and m.optimizer_s > 0
    # the 16-bit parameters and the optimizer state went to NVMe as they were built
    assert m.written_nbytes > 0
    for step in result.steps:
        model, optim = step.nvme_nbytes["model"], step.nvme_nbytes["optimizer"]
        # under these budgets the forward reads parameters back, backward writes
        # gradients, and the step streams the optimizer state both ways
        assert model["read"].get("param16", 0) > 0
        assert optim["read"].get("optim_state", 0) > 0
        assert optim["written"].get("optim_state", 0) > 0
        assert step.io_floor_s >= step.optimizer_io_floor_s > 0
        assert step.compute_floor_s == pytest.approx(
            result.compute_floor_sub_group_s * result.sub_groups
        )
        ratio, busy = step.optimizer_over_floor, step.optimizer_disk_busy
        assert ratio is not None and ratio > 0
        assert busy is not None and busy > 0
        assert 0 <= step.forward_backward_stall_fraction < 1
        assert step.peak_rss_nbytes > 0
        assert set(step.prefetch) == {"hits", "misses", "dropped", "wasted"}
    assert result.steps[-1].peak_rss_nbytes <= result.peak_rss_bytes
    # nothing left in the swap directory: the private one inside it is gone
    assert list((tmp_path / "swap").iterdir()) == []


def test_two_budget_splits_give_bit_identical_results(tmp_path: Path) -> None:
    settings = _settings(tmp_path / "swap")
    second = other_split(settings, NUM_PARAMS)
    assert second.overlap is not settings.overlap
    assert second.device_nbytes == 2 * DEVICE_NBYTES
    assert second.host_nbytes is not None and second.host_nbytes < HOST_NBYTES
    comparison = compare_budgets(settings)
    assert comparison.identical, comparison.summary()
    assert comparison.ok
    assert comparison.first.losses == comparison.second.losses
    assert comparison.first.final_digest == comparison.second.final_digest
    assert comparison.first.sub_group_numel == 2 * comparison.second.sub_group_numel
    # a different digest is caught (the comparison is not vacuous)
    changed = dataclasses.replace(comparison.second, final_digest="xxh3-128:0")
    assert not BudgetComparison(comparison.first, changed).identical


def test_cli_no_reference_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    out = tmp_path / "r.json"
    args = ["--reference", "none", "--params", "300K", "--steps", "2", "--batch", "2"]
    args += ["--seq", "16", "--device-budget", str(DEVICE_NBYTES)]
    args += ["--host-budget", str(HOST_NBYTES), "--dir", str(swap), "--json", str(out)]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert data["reference"] == "none" and data["ok"]
    assert len(data["per_step"]) == 2
    step = data["per_step"][0]
    for key in (
        "forward_backward_seconds",
        "optimizer_seconds",
        "forward_stall_seconds",
        "backward_stall_seconds",
        "io_floor_seconds",
        "compute_floor_seconds",
        "optimizer_over_floor",
        "optimizer_disk_busy_fraction",
        "peak_rss_bytes",
    ):
        assert step[key] is not None and step[key] >= 0, key
    assert step["nvme_bytes"]["optimizer"]["written"]["optim_state"] > 0
    assert data["state_bytes"] > 0 and data["memory_total_bytes"] > 0
    assert 0 < data["final_phase_peak_rss_bytes"] <= data["rss_bound_bytes"]
    assert data["materialise"]["nvme_written_bytes"] > 0
    assert "result (no reference): losses finite" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra",
    [["--compare-budgets", "--resume", "--dir", "."], ["--compare-budgets", "--nproc", "2"]],
)
def test_cli_refuses_what_no_reference_cannot_do(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(extra) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_compute_floor_refuses_bad_sizes() -> None:
    with pytest.raises(SwapConfigError, match="sub_group_numel"):
        compute_floor(0)
    assert compute_floor(4096, repeats=1) > 0


def test_materialise_bound_is_write_time_plus_init() -> None:
    built = Materialised(modules=3, model_s=5.0, place_s=4.0, optimizer_s=2.0)
    built.model_written_nbytes, built.optimizer_written_nbytes = 1 << 30, 3 << 30
    disk = DiskRates(write_bytes_per_s=float(1 << 30), read_bytes_per_s=1.0, nbytes=1, direct=True)
    figures = MaterialiseFigures.of(built, disk)
    assert figures.seconds == 7.0
    assert figures.bound_s == pytest.approx(1.3 * 4 + 1.0)
    assert figures.to_json()["within_bound"] is False


def test_cli_no_reference_two_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    out = tmp_path / "r.json"
    per_rank_device = 256 << 10  # above the gathers' floor (224 KiB), below the params
    args = ["--reference", "none", "--nproc", "2", "--params", "300K", "--steps", "2"]
    args += ["--batch", "2", "--seq", "16", "--device-budget", str(per_rank_device)]
    args += ["--host-budget", str(HOST_NBYTES // 2), "--dir", str(swap), "--json", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["reference"] == "none" and data["ok"] and data["world_size"] == 2
    assert [len(r["losses"]) for r in data["per_rank"]] == [2, 2]
    assert data["rss_within_bound"] is True
    for rank in data["per_rank"]:
        assert rank["peak_bytes"]["host"] <= HOST_NBYTES // 2
        assert rank["peak_bytes"]["device"] <= per_rank_device
        _check_rank_rss(rank, data["budget_bytes"])
    shown = capsys.readouterr().out
    assert "result (2 ranks, no reference): losses finite, within budgets" in shown
    assert ", RSS within bound" in shown
    assert shown.count("after it; bound ") == 2  # each rank's line
    assert list(swap.iterdir()) == []


def _check_rank_rss(rank: dict[str, Any], budgets: dict[str, int]) -> None:
    """One rank's memory figures in ``--nproc`` JSON: measured, and the bound its own."""
    assert rank["peak_rss_bytes"] > 0 and rank["final_phase_peak_rss_bytes"] > 0
    assert rank["activation_bytes"] > 0  # its forward saved tensors for backward
    bound = budgets["device"] + budgets["host"] + 2 * rank["activation_bytes"] + (3 << 29)
    assert rank["rss_bound_bytes"] == bound
    peak = max(rank["peak_rss_bytes"], rank["final_phase_peak_rss_bytes"])
    assert rank["rss_within_bound"] is (peak <= bound)
    # each rank's process made glibc return freed tensors (ff358fc): else its peak RSS
    # measures the allocator's cache of the tensors freed each step, not what it holds
    assert rank["freed_memory_returned"] is True


def test_rank_report_judges_its_rss_against_its_own_budgets() -> None:
    budgets = {"device": 1 << 30, "host": 2 << 30}
    report = RankReport(
        rank=1,
        losses=[1.0],
        peak_bytes={"device": 0, "host": 0},
        bytes_moved=0,
        state_nbytes={},
        offload_nbytes=0,
        stall_s=0.0,
        seconds=1.0,
        peak_rss_bytes=4 << 30,
        digest="d",
        param_hashes={},
        final_phase_peak_rss_bytes=5 << 30,
        activation_bytes=1 << 28,
    )
    bound = (3 << 30) + (1 << 29) + (3 << 29)
    assert report.rss_bound_bytes(budgets) == bound == 5 << 30
    assert report.rss_within_bound(budgets)  # the final phase's peak is the bound exactly
    over = dataclasses.replace(report, final_phase_peak_rss_bytes=(5 << 30) + 1)
    assert not over.rss_within_bound(budgets)
    assert over.rss_json(budgets)["rss_within_bound"] is False
    assert "EXCEEDED" in over.rss_line(budgets) and "EXCEEDED" not in report.rss_line(budgets)


def test_resume_continues_bit_exactly_and_says_it_opened(tmp_path: Path) -> None:
    whole = run_budgeted(_settings(tmp_path / "a", steps=3))
    kept = tmp_path / "b"
    first = run_budgeted(_settings(kept, steps=2, checkpoint_every=1))
    assert first.snapshots and first.resumed_from_step == 0
    resumed = run_budgeted(_settings(kept, steps=3, resume=True))
    assert resumed.resumed_from_step == 2
    assert resumed.losses == whole.losses[2:]
    assert resumed.final_digest == whole.final_digest
    data = resumed.to_json()
    # nothing was materialised: the wrap opened the snapshot
    assert data["materialise"] is None and data["open_seconds"] > 0
    assert "resumed from step 2" in resumed.summary()
    assert whole.to_json()["materialise"]["within_bound"] in (True, False)
