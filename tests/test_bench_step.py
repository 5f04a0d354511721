"""Tests of ``swapper-bench step``: the four passes, their traffic, the JSON record."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from swapper.bench import main
from swapper.bench.step_command import SAMPLE_ABOVE_NBYTES, StepPlan, build_plan
from swapper.cli_args import count_arg as _count


def test_step_json_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "step.json"
    argv = ["step", "--dir", str(work), "--params", "300K", "--sub-group", "50K"]
    argv += ["--steps", "2", "--warmup", "1", "--legacy-grad-swap", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for name in ("io-only", "compute-only", "step", "legacy", "legacy / step"):
        assert name in printed
    doc = json.loads(out.read_text())
    for key in ("step_seconds", "io_only_seconds", "compute_only_seconds"):
        assert doc[key] > 0
    assert doc["overlap_ratio"] == pytest.approx(
        doc["step_seconds"] / max(doc["io_only_seconds"], doc["compute_only_seconds"])
    )
    # 12 B of state each way per parameter, plus the sub-groups' padding (< 1 % here)
    # 50K rounds up to 51200 elements: 5 full sub-groups and one of 44000 (padded 44032)
    padded = 12 * (5 * 51200 + 44032) / 300_000
    assert doc["read_bytes_per_param"] == pytest.approx(padded)
    assert doc["write_bytes_per_param"] == pytest.approx(padded)
    assert set(doc["read_bytes_by_kind"]) == {"optim_state"}
    # the legacy pass also moves 4 B of fp32 gradient per parameter each way
    assert doc["legacy_read_bytes_per_param"] == pytest.approx(padded * 16 / 12)
    assert doc["legacy_write_bytes_per_param"] == pytest.approx(padded * 16 / 12)
    assert doc["passes"]["legacy"]["read_nbytes"]["grad32"] > 0
    assert doc["passes"]["compute-only"]["read_nbytes"] == {}
    assert all(len(p["seconds"]) == 2 for p in doc["passes"].values())
    rounds = doc["passes"]
    assert doc["overlap_ratio_per_round"] == pytest.approx(
        [
            s / max(i, c)
            for s, i, c in zip(
                rounds["step"]["seconds"],
                rounds["io-only"]["seconds"],
                rounds["compute-only"]["seconds"],
                strict=True,
            )
        ]
    )
    assert len(doc["legacy_speedup_per_round"]) == 2
    # the step judged against the disk measured in the same run
    disk = doc["disk"]
    assert len(disk["rounds"]) == 2
    assert all(r["read_bps"] > 0 and r["mixed_bps"] > 0 for r in disk["rounds"])
    read, written = (padded * 300_000 for _ in range(2))
    floor = doc["floor"]
    assert floor["separate_seconds"] == pytest.approx(
        read / disk["read_bytes_per_second"] + written / disk["write_bytes_per_second"]
    )
    assert floor["seconds"] == pytest.approx(
        max(floor["disk_seconds"], doc["compute_only_seconds"])
    )
    assert doc["step_over_floor"] == pytest.approx(doc["step_seconds"] / floor["seconds"])
    assert len(doc["step_over_floor_per_round"]) == 2
    assert "step / floor" in printed
    assert list(work.iterdir()) == []  # everything it made is gone


def test_step_without_legacy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "step.json"
    argv = ["step", "--dir", str(tmp_path), "--params", "100K", "--sub-group", "30K"]
    argv += ["--steps", "1", "--warmup", "0", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert "legacy_step_seconds" not in doc
    assert set(doc["passes"]) == {"io-only", "compute-only", "step"}


def test_step_readahead_passes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--readahead 1,auto``: a pass each beside "step", the same traffic, their ratio."""
    out = tmp_path / "step.json"
    argv = ["step", "--dir", str(tmp_path), "--params", "100K", "--sub-group", "20K"]
    argv += ["--steps", "2", "--warmup", "0", "--readahead", "1,auto,1", "--json", str(out)]
    assert main(argv) == 0
    assert "step-raauto / step" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert set(doc["passes"]) == {"io-only", "compute-only", "step", "step-ra1", "step-raauto"}
    assert set(doc["readahead"]) == {"1", "auto"}
    for name in ("step-ra1", "step-raauto"):
        assert doc["passes"][name]["read_nbytes"] == doc["passes"]["step"]["read_nbytes"]
    entry = doc["readahead"]["auto"]
    assert len(entry["time_ratio_per_round"]) == 2 and entry["step_seconds"] > 0


@pytest.mark.parametrize(
    ("name", "state_bytes"), [("sgd", 8), ("adagrad", 8), ("adam", 12), ("adafactor", None)]
)
def test_step_optimizer(tmp_path: Path, name: str, state_bytes: int | None) -> None:
    """``--optimizer NAME``: the step of a torch.optim optimizer under OffloadOptimizer;
    per parameter, 4 B of master weights and its state's bytes each way (issue 26)."""
    out = tmp_path / "step.json"
    argv = ["step", "--dir", str(tmp_path), "--params", "300K", "--sub-group", "50K"]
    argv += ["--steps", "1", "--warmup", "1", "--optimizer", name, "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["optimizer"] == name
    read, written = doc["read_bytes_per_param"], doc["write_bytes_per_param"]
    assert read == written
    if state_bytes is not None:  # 5 sub-groups of 51200 and one of 44000 (padded 44032)
        assert read == pytest.approx(state_bytes * (5 * 51200 + 44032) / 300_000)
    else:  # Adafactor on the bench's 2-D tensors: 4 B of master and its factored rows
        # (48 + 1024 fp32 per 48 x 1024 tensor), not a full 4 B "variance"
        assert 4 < read < 4.5
    assert doc["step_over_floor"] > 0


@pytest.mark.parametrize(("name", "update_threads"), [("sgd", 1), ("adafactor", 2)])
def test_compute_pass_runs_on_the_steps_update_threads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, update_threads: int
) -> None:
    """The compute floor is the step's own update alone: on 2 intra-op threads the
    streamed step of an element-wise optimizer leaves one to the I/O, so the compute-only
    pass runs on 1 (and on 2 as a diagnostic, outside the floor); Adafactor's update keeps
    both, and so does its compute-only pass."""
    out = tmp_path / "step.json"
    argv = ["step", "--dir", str(tmp_path), "--params", "300K", "--sub-group", "50K"]
    argv += ["--steps", "2", "--warmup", "0", "--optimizer", name, "--json", str(out)]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(before)
    assert torch.get_num_threads() == before
    doc = json.loads(out.read_text())
    assert doc["compute_threads"] == update_threads
    assert f"compute-only ran on {update_threads} intra-op thread(s)" in capsys.readouterr().out
    assert set(doc["passes"]) == {"io-only", "compute-only", "step"}
    every = doc.get("compute_all_threads")
    if update_threads == 2:
        assert every is None
    else:
        assert every["threads"] == 2 and len(every["seconds"]) == 2
        assert every["median_seconds"] == pytest.approx(statistics.median(every["seconds"]))
    assert doc["floor"]["compute_seconds"] == pytest.approx(doc["compute_only_seconds"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--optimizer", "lbfgs"],
        ["--optimizer", "sgd", "--moments", "bf16"],
        ["--readahead", "-1"],
        ["--readahead", "two"],
        ["--params", "0"],
        ["--params", "12x"],
        ["--sub-group", "1.5"],
        ["--steps", "0"],
        ["--size", "1GiB"],
        ["--params", "100K", "--sub-group", "50K", "--host-budget", "4KiB"],
    ],
)
def test_step_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert main(["step", "--dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("swapper-bench: error:") and len(err.splitlines()) == 1


def test_count_suffixes() -> None:
    assert _count("200M") == 200_000_000
    assert _count("1.5G") == 1_500_000_000
    assert _count("4096") == 4096
    assert _count("25k") == 25_000
    assert _count("2.2B") == _count("2.2G") == 2_200_000_000
    assert _count("2.17B") == 2_170_000_000
    assert _count("1T") == 10**12


@pytest.mark.parametrize(
    "text", ["0", "-5", "inf", "-inf", "nan", "1e400", "2.5", "abc", "M", "B", "1.0000000001K"]
)
def test_count_refuses_what_is_not_a_positive_whole_number(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        _count(text)


def _small_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[str, dict[str, Any]]:
    """One timed round, no warm-up, of 200K parameters in 4 sub-groups: (printed, JSON)."""
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "step.json"
    argv = ["step", "--dir", str(work), "--params", "200K", "--sub-group", "50K"]
    argv += ["--steps", "1", "--warmup", "0", *flags, "--json", str(out)]
    assert main(argv) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_sampled_compute_pass_times_one_sub_group_scaled(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 24: at 1B the compute-only pass cannot hold all the state in memory; the floor's
    # compute is then one in-memory sub-group's update times the sub-groups.
    printed, doc = _small_run(tmp_path, capsys, "--compute-pass", "sampled")
    # 4 sub-groups; the first one's elements rounded up for alignment: a little under 4
    assert doc["compute_pass"] == "sampled" and 3.9 < doc["compute_scale"] <= 4.0
    assert f"one sub-group's update in memory, x {doc['compute_scale']:.2f}" in printed
    seconds = doc["passes"]["compute-only"]["seconds"]
    assert doc["compute_only_seconds"] == pytest.approx(statistics.median(seconds))
    assert doc["compute_only_seconds"] > 0


def test_compute_pass_auto_samples_only_above_the_threshold(tmp_path: Path) -> None:
    def plan_for(params: str, mode: str = "auto") -> StepPlan:
        args = argparse.Namespace(
            dirs=[tmp_path], size=None, params=_count(params), sub_group=_count("50K"),
            json=None, steps=1, warmup=0, host_budget=None, legacy_grad_swap=False, seed=0,
            compute_pass=mode,
        )  # fmt: skip
        return build_plan(args)

    small = plan_for("200K")
    assert small.compute_pass == "full" and small.compute_scale == 1.0
    assert small.compute_shapes() == small.shapes()
    sampled = plan_for("200K", "sampled")
    assert sampled.compute_pass == "sampled"
    assert sum(s[0] for s in sampled.compute_shapes()) == sampled.sub_groups()[0].numel
    assert SAMPLE_ABOVE_NBYTES < 12 * 1_000_000_000  # 1B parameters' state is sampled


def test_no_io_only_leaves_out_the_pass_and_its_store(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 24: at 1B a second store of state (the io-only pass's) would not fit the disk
    # allowed; the floor does not need it.
    printed, doc = _small_run(tmp_path, capsys, "--no-io-only")
    assert "setting up the state (step)" in printed and "io-only" not in printed
    assert set(doc["passes"]) == {"compute-only", "step"}
    assert doc["io_only_seconds"] is None and doc["overlap_ratio"] is None
    assert doc["step_over_floor"] > 0
