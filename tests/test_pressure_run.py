"""End-to-end memory-pressure runs (``swapper.pressure``): a GPT whose 16-bit parameters are
at least 4x the device budget and whose optimizer state is at least 4x the host budget
trains bit-identically to an unlimited run, within its budgets, and leaves nothing in its
swap directory; and the ``swapper-pressure`` command around it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swapper.pressure.cli import main
from swapper.pressure.model import GPTConfig
from swapper.pressure.runner import PressureResult, PressureSettings, run_pressure

# GPTConfig.for_params(300_000): d_model 64, 5 layers, 291 008 parameters. Its largest
# module needs (64 * 256 + 256) * 2 B + the tied 512 x 64 embedding held through backward
# (65 536 B) = 98 816 B of device memory, under the quarter of its 16-bit parameters.
PARAMS = 300_000
NUM_PARAMS = GPTConfig.for_params(PARAMS).num_params()
DEVICE_NBYTES = 2 * NUM_PARAMS // 4
HOST_NBYTES = 12 * NUM_PARAMS // 4


def _check_result(result: PressureResult, steps: int) -> None:
    device = result.budget_bytes["device"]
    host = result.budget_bytes["host"]
    assert device is not None and host is not None
    # the pressure is real: 16-bit params >= 4x the device budget, optimizer state
    # (12 B/param) >= 4x the host budget
    assert 2 * result.num_params >= 4 * device
    assert 12 * result.num_params >= 4 * host

    assert len(result.losses) == steps
    assert len(result.reference_losses) == steps
    assert result.identical
    assert result.losses == result.reference_losses
    assert result.within_budgets
    assert result.ok
    assert 0 < result.peak_bytes["device"] <= device
    assert 0 < result.peak_bytes["host"] <= host
    assert result.bytes_moved > 0
    assert result.peak_rss_bytes > 0
    assert result.peak_rss_bytes <= result.rss_bound_bytes
    # the bound is the two budgets plus the measured baseline (plus what the runner
    # says the run holds outside the budgets by design)
    assert result.rss_bound_bytes >= host + device + result.baseline_rss_bytes


@pytest.mark.parametrize(("dtype", "steps"), [("bf16", 5), ("fp16", 3)])
def test_pressure_run_is_identical_within_budgets(dtype: str, steps: int, tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    settings = PressureSettings(
        params=PARAMS,
        steps=steps,
        device_nbytes=DEVICE_NBYTES,
        host_nbytes=HOST_NBYTES,
        dirs=(swap,),
        dtype=dtype,
    )
    lines: list[str] = []
    result = run_pressure(settings, say=lines.append)

    assert result.num_params == NUM_PARAMS
    assert result.budget_bytes == {"device": DEVICE_NBYTES, "host": HOST_NBYTES}
    _check_result(result, steps)
    assert lines  # progress was reported
    # the per-process swap subdirectory is gone, and nothing else was left
    assert list(swap.iterdir()) == []


def test_cli_writes_json_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    out = tmp_path / "result.json"
    code = main(["--params", "300k", "--steps", "2", "--dir", str(swap), "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "FAILED" not in captured.err

    data = json.loads(out.read_text(encoding="utf-8"))
    for key in (
        "losses",
        "reference_losses",
        "identical",
        "peak_bytes",
        "budget_bytes",
        "peak_rss_bytes",
        "bytes_moved",
        "stall_fraction",
    ):
        assert key in data, key
    assert data["identical"] is True
    assert len(data["losses"]) == 2
    assert data["losses"] == data["reference_losses"]
    assert set(data["peak_bytes"]) == {"device", "host"}
    assert set(data["budget_bytes"]) == {"device", "host"}
    # defaults: a quarter of the 16-bit params, a quarter of the optimizer state
    assert data["budget_bytes"] == {"device": DEVICE_NBYTES, "host": HOST_NBYTES}
    for tier in ("device", "host"):
        assert 0 < data["peak_bytes"][tier] <= data["budget_bytes"][tier]
    assert data["peak_rss_bytes"] > 0
    assert data["bytes_moved"] > 0
    assert 0.0 <= data["stall_fraction"] <= 1.0
    assert list(swap.iterdir()) == []
    # What the disk pays (issue 29): bytes written per step are the kinds' sum; the
    # optimizer state dominates; per token and per day follow from them.
    by_kind = data["nvme_written_bytes_per_step_by_kind"]
    assert set(by_kind) == {"param16", "grad16", "optim_state", "grad32"} | {
        "journal",
        "manifest",
        "snapshot",
    }
    per_step = data["nvme_written_bytes_per_step"]
    assert per_step == pytest.approx(sum(by_kind.values()))
    assert by_kind["optim_state"] > 0 and by_kind["journal"] > 0 and by_kind["grad32"] == 0
    assert data["nvme_written_bytes_per_token"] == pytest.approx(per_step / (4 * 64))
    assert data["nvme_written_bytes_per_day"] > 0
    assert "NVMe written per step:" in captured.out and "per day" in captured.out


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--dtype", "fp8"], "--dtype"), (["--params", "0"], "--params")],
)
def test_cli_bad_arguments_exit_2_with_one_line(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("swapper-pressure: error:")
    assert named in lines[0]
    assert captured.out == ""


def test_cli_budget_too_small_for_largest_module_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    code = main(
        ["--params", "300k", "--steps", "1", "--device-budget", "10KiB", "--dir", str(swap)]
    )
    captured = capsys.readouterr()
    assert code == 1
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("swapper-pressure: error:")
    # the floor, the largest need of any module (not the first that does not fit, the
    # 512 x 64 embedding's 65 536 B): one run finds it (issue 28 item 4)
    assert "'blocks.0.mlp.fc'" in lines[0] and "floor of 98816 bytes" in lines[0], lines
    assert "at least 98816" in lines[0]
    # the failed run left nothing behind either
    assert list(swap.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--params", "inf"], "must be a whole number"),
        (["--params", "nan"], "must be a whole number"),
        (["--dir", "{missing}"], "no such directory"),
        (["--dir", "{file}"], "not a directory"),
    ],
)
def test_cli_bad_arguments_exit_2_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    argv = [a.format(missing=tmp_path / "nope", file=a_file) for a in argv]
    code = main([*argv, "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]  # nothing made


def test_cli_checkpoint_every_and_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    base = ["--params", "300k", "--steps", "3", "--dir", str(swap), "--checkpoint-every", "2"]
    assert main([*base, "--json", str(first)]) == 0, capsys.readouterr().err
    data = json.loads(first.read_text(encoding="utf-8"))
    assert data["identical"] is True
    assert data["final_digest"].startswith("xxh3-128:")
    assert data["final_digest"] == data["reference_final_digest"]
    assert data["resumed_from_step"] == 0
    [snap] = data["snapshots"]
    assert snap["step"] == 2 and snap["name"] == "step-000000002"
    # right after a step only the 16-bit params can be dirty: <= 2/14 of the state
    assert 0 < snap["written_bytes"] <= snap["state_bytes"] // 5
    # the checkpoint store outlives the run; --resume continues from step 2
    assert (swap / "swapper-pressure-checkpoint").is_dir()
    export = tmp_path / "export"
    argv = [*base, "--resume", "--json", str(second), "--export", str(export)]
    assert main(argv) == 0, capsys.readouterr().err
    again = json.loads(second.read_text(encoding="utf-8"))
    assert again["resumed_from_step"] == 2
    assert len(again["losses"]) == 1 and again["losses"] == data["losses"][2:]
    assert again["final_digest"] == data["final_digest"]
    out = capsys.readouterr().out
    assert "resumed from step 2" in out
    assert "export: safetensors 100%" in out and "export: DCP 100%" in out  # progress
    assert again["export_seconds"] > 0
    assert (export / "model.safetensors.index.json").exists()


def test_cli_resume_needs_a_dir(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--resume"]) == 2
    assert "--dir" in capsys.readouterr().err


def test_cli_resume_passes_over_a_damaged_newest_snapshot(tmp_path: Path) -> None:
    """``--resume`` with the newest snapshot truncated: the one before is used, and the run
    ends with the uninterrupted run's final_digest."""
    swap = tmp_path / "swap"
    swap.mkdir()
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    base = ["--params", "300k", "--steps", "3", "--seq", "16", "--dir", str(swap)]
    base += ["--checkpoint-every", "1"]
    assert main([*base, "--json", str(first)]) == 0
    data = json.loads(first.read_text(encoding="utf-8"))
    [newest] = (swap / "swapper-pressure-checkpoint").glob("*.step-000000003.snap")
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    assert main([*base, "--resume", "--json", str(second)]) == 0
    again = json.loads(second.read_text(encoding="utf-8"))
    assert again["resumed_from_step"] == 2
    assert again["identical"] is True
    assert again["losses"] == data["losses"][2:]
    assert again["final_digest"] == data["final_digest"]


def test_cli_write_budget_warns_once_and_strict_stops_resumably(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--write-budget over a tiny budget: one WriteBudgetWarning, the run goes on. With
    --write-budget-strict: exit 1 at the crossing step naming the budget, and the run
    resumes from its snapshot (--resume) to the end, identical to the unlimited run."""
    from swapper.manager import WriteBudgetWarning

    swap = tmp_path / "swap"
    swap.mkdir()
    base = ["--params", "300k", "--steps", "3", "--dir", str(swap)]
    with pytest.warns(WriteBudgetWarning) as caught:
        assert main([*base, "--write-budget", "1KB/day"]) == 0, capsys.readouterr().err
    assert len([w for w in caught if issubclass(w.category, WriteBudgetWarning)]) == 1
    capsys.readouterr()
    strict = [*base, "--checkpoint-every", "1", "--write-budget", "1KB/day"]
    assert main([*strict, "--write-budget-strict"]) == 1
    err = capsys.readouterr().err
    assert "write budget of 1000 B a day" in err and "durable" in err, err
    out = tmp_path / "resumed.json"
    with pytest.warns(WriteBudgetWarning):  # still over it, without --write-budget-strict
        assert main([*strict, "--resume", "--json", str(out)]) == 0, capsys.readouterr().err
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["resumed_from_step"] >= 1 and data["identical"] is True


@pytest.mark.parametrize("name", ["sgd", "adafactor"])
def test_cli_optimizer_budgeted_equals_unlimited(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--optimizer NAME`` (issue 26): a torch.optim optimizer under OffloadOptimizer in
    both runs; the budgeted run (its state through NVMe) equals the unlimited one."""
    swap = tmp_path / "swap"
    swap.mkdir()
    out = tmp_path / "result.json"
    argv = ["--params", "300k", "--steps", "3", "--dir", str(swap), "--json", str(out)]
    code = main([*argv, "--optimizer", name])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(out.read_text(encoding="utf-8"))
    assert data["identical"] is True and data["losses"] == data["reference_losses"]
    assert data["nvme_written_bytes_per_step_by_kind"]["optim_state"] > 0


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--optimizer", "lbfgs"], "lbfgs"),
        (["--optimizer", "sgd", "--moments", "bf16"], "--moments"),
        (["--optimizer", "adafactor", "--nproc", "2"], "not element-wise"),
    ],
)
def test_cli_optimizer_refusals(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--params", "300k", "--steps", "1", *argv]) == 2
    assert match in capsys.readouterr().err


def test_cli_optimizer_names_are_the_named_optimizers() -> None:
    from swapper.pressure.cli import OPTIMIZER_NAMES, WHOLE_PARAMETER_OPTIMIZERS
    from swapper.step.offload_optimizer import NAMED
    from swapper.step.rules.torch_optim import NOT_ELEMENTWISE

    assert ("adamw", *NAMED) == OPTIMIZER_NAMES
    whole = tuple(n for n, (cls, _) in NAMED.items() if cls.__name__ in NOT_ELEMENTWISE)
    assert whole == WHOLE_PARAMETER_OPTIMIZERS
