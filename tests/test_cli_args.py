"""What both command-line tools share (swapper/cli_args.py): ``SWAPPER_AIO_*`` honoured
wherever they build I/O settings, the same exit code for the same mistake in both, and
every argument error found before any work (torch loaded, a file made, a run started).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

import swapper.cli_args as cli_args
from swapper.bench import main as bench_main
from swapper.bench.cli import build_parser as bench_parser
from swapper.bench.step_command import build_plan as step_plan
from swapper.bench.tiers_command import build_plan as tiers_plan
from swapper.pressure import runner as pressure_runner
from swapper.pressure.cli import main as pressure_main
from tiers.config import AioConfig, Backend
from tiers.errors import SwapError

KiB = 1024
FAST = ["--loops", "1", "--warmup", "0"]


@pytest.fixture(autouse=True)
def _no_aio_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from an environment without SWAPPER_AIO_* (a developer's shell
    may set them)."""
    for name in list(os.environ):
        if name.startswith("SWAPPER_AIO_"):
            monkeypatch.delenv(name)


@pytest.fixture
def no_pressure_run(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """run_pressure replaced: records the settings it got and fails the run (exit 1)."""
    seen: list[Any] = []

    def fake(settings: Any, **kwargs: Any) -> Any:
        seen.append(settings)
        raise SwapError("stopped by the test")

    monkeypatch.setattr(pressure_runner, "run_pressure", fake)
    return seen


# ----------------------------------------------------------------------------------------
# SWAPPER_AIO_*


def test_env_sets_the_bench_disk_default_and_a_flag_wins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("SWAPPER_AIO_BLOCK_SIZE", "64KiB")
    monkeypatch.setenv("SWAPPER_AIO_QUEUE_DEPTH", "4")
    out = tmp_path / "r.json"
    argv = ["disk", "--dir", str(work), "--size", "1MiB", "--no-baselines", *FAST]
    assert bench_main([*argv, "--json", str(out)]) == 0, capsys.readouterr().err
    records = json.loads(out.read_text())["results"]
    assert {(r["block_size"], r["queue_depth"]) for r in records} == {(64 * KiB, 4)}

    assert bench_main([*argv, "--block-size", "128KiB", "--json", str(out)]) == 0
    records = json.loads(out.read_text())["results"]
    assert {(r["block_size"], r["queue_depth"]) for r in records} == {(128 * KiB, 4)}
    assert list(work.iterdir()) == []


def test_emitted_config_says_the_single_submit_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWAPPER_AIO_SINGLE_SUBMIT", "off")
    out = tmp_path / "aio.json"
    argv = ["disk", "--dir", str(tmp_path), "--size", "1MiB", "--no-baselines", *FAST]
    assert bench_main([*argv, "--emit-config", str(out)]) == 0, capsys.readouterr().err
    emitted = json.loads(out.read_text())
    assert emitted["deepspeed"]["aio"]["single_submit"] is False
    assert AioConfig.from_json(out).single_submit is False


def test_env_reaches_bench_tiers_and_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SWAPPER_AIO_BLOCK_SIZE", "256KiB")
    monkeypatch.setenv("SWAPPER_AIO_THREADS", "3")
    monkeypatch.setenv("SWAPPER_AIO_BACKEND", "threads")
    monkeypatch.setenv("SWAPPER_AIO_SINGLE_SUBMIT", "false")
    tiers_args = bench_parser().parse_args(["tiers", "--dir", str(tmp_path), "--size", "8MiB"])
    aio = tiers_plan(tiers_args).setting.aio_config()
    assert (aio.block_size, aio.num_threads, aio.backend) == (256 * KiB, 3, Backend.THREADS)
    assert aio.single_submit is False
    tiers_args = bench_parser().parse_args(
        ["tiers", "--dir", str(tmp_path), "--size", "8MiB", "--threads", "2"]
    )
    assert tiers_plan(tiers_args).setting.aio_config().num_threads == 2  # the flag wins

    step_args = bench_parser().parse_args(
        ["step", "--dir", str(tmp_path), "--params", "10K", "--sub-group", "2K"]
    )
    assert step_plan(step_args).aio == AioConfig(
        block_size=256 * KiB, num_threads=3, backend=Backend.THREADS, single_submit=False
    )
    assert list(tmp_path.iterdir()) == []


def test_env_reaches_pressure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_pressure_run: list[Any]
) -> None:
    monkeypatch.setenv("SWAPPER_AIO_BLOCK_SIZE", "64KiB")
    monkeypatch.setenv("SWAPPER_AIO_DIRECT", "0")
    assert pressure_main(["--params", "300k", "--steps", "1", "--dir", str(tmp_path)]) == 1
    (settings,) = no_pressure_run
    assert settings.aio == AioConfig(block_size=64 * KiB, direct=False)


TOOLS = {
    "bench disk": lambda tmp: bench_main(["disk", "--dir", str(tmp), "--size", "1MiB", *FAST]),
    "bench tiers": lambda tmp: bench_main(["tiers", "--dir", str(tmp), "--size", "8MiB"]),
    "bench step": lambda tmp: bench_main(["step", "--dir", str(tmp), "--params", "10K"]),
    "pressure": lambda tmp: pressure_main(["--params", "300k", "--dir", str(tmp)]),
}


@pytest.mark.parametrize("tool", list(TOOLS))
@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("SWAPPER_AIO_QUEUE_DEPTH", "0"),
        ("SWAPPER_AIO_BLOCK_SIZE", "1000"),
        ("SWAPPER_AIO_BACKEND", "warp"),
        ("SWAPPER_AIO_DIRECT", "maybe"),
    ],
)
def test_a_bad_variable_is_a_usage_error_naming_it(
    tool: str,
    variable: str,
    value: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_pressure_run: list[Any],
) -> None:
    monkeypatch.setenv(variable, value)
    assert TOOLS[tool](tmp_path) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ": error: environment: " in err, err
    assert variable in err
    assert list(tmp_path.iterdir()) == [] and no_pressure_run == []


def test_env_values_reads_only_what_is_set() -> None:
    assert AioConfig.env_values({}) == {}
    env = {"SWAPPER_AIO_BLOCK_SIZE": "2MiB", "SWAPPER_AIO_DIRECT": "off", "OTHER": "x"}
    assert AioConfig.env_values(env) == {"block_size": 2 << 20, "direct": False}
    assert AioConfig.from_env(env) == AioConfig(block_size=2 << 20, direct=False)


# ----------------------------------------------------------------------------------------
# Exit codes: the same mistake, the same code, before any work

#: (bench argv, pressure argv, fragment of the message) for each mistake.
MISTAKES = [
    (["step", "--params", "0"], ["--params", "0"], "--params"),
    (["step", "--params", "inf"], ["--params", "inf"], "--params"),
    (["step", "--params", "-5"], ["--params", "-5"], "--params"),
    (["step", "--steps", "0"], ["--steps", "0"], "--steps"),
    (["step", "--steps", "two"], ["--steps", "two"], "--steps"),
    (["step", "--sub-group", "0"], ["--sub-group", "0"], "--sub-group"),
    (["step", "--host-budget", "-1MiB"], ["--host-budget", "-1MiB"], "--host-budget"),
    (["disk", "--size=-4MiB"], ["--device-budget=-4MiB"], "not a size"),
    (["step", "--host-budget", "-1"], ["--host-budget", "-1"], "--host-budget"),
    (["step", "--seed", "x"], ["--seed", "x"], "--seed"),
    (
        ["disk", "--json", "{tmp}/missing/out.json"],
        ["--json", "{tmp}/missing/out.json"],
        "does not exist",
    ),
    (["disk", "--json", "{tmp}"], ["--json", "{tmp}"], "is a directory"),
    (["disk", "--dir", "{tmp}/missing"], ["--dir", "{tmp}/missing"], "no such directory"),
    (["disk", "--bogus"], ["--bogus"], "unrecognized arguments"),
]


@pytest.mark.parametrize(("bench_argv", "pressure_argv", "fragment"), MISTAKES)
def test_the_same_mistake_exits_2_in_both_tools_before_any_work(
    bench_argv: list[str],
    pressure_argv: list[str],
    fragment: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_pressure_run: list[Any],
) -> None:
    work = tmp_path / "work"
    work.mkdir()

    def fill(argv: list[str]) -> list[str]:
        argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
        return argv if "--dir" in argv else [*argv, "--dir", str(work)]

    for prog, run, argv in (
        ("swapper-bench", bench_main, fill(bench_argv)),
        ("swapper-pressure", pressure_main, fill(pressure_argv)),
    ):
        code = run(argv)
        err = capsys.readouterr().err
        assert code == 2, (prog, argv, err)
        assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1, err
        assert fragment in err, err
        assert "usage:" not in err
    assert no_pressure_run == []  # refused before the run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
    assert list(work.iterdir()) == []


@pytest.mark.parametrize(
    "argv",
    [["--batch", "0"], ["--seq", "-1"], ["--lr", "nan"], ["--lr", "inf"], ["--lr", "-1"]],
)
def test_pressure_value_checks_exit_2_before_the_run(
    argv: list[str], capsys: pytest.CaptureFixture[str], no_pressure_run: list[Any]
) -> None:
    assert pressure_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("swapper-pressure: error: ") and argv[0] in err
    assert no_pressure_run == []


def test_json_into_an_unwritable_directory_is_refused_first(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    no_pressure_run: list[Any],
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access

    # root may write anywhere: the check asks os.access, which the test answers for root
    def access(path: Any, mode: int, **kwargs: Any) -> bool:
        if Path(path) == locked and mode & os.W_OK:
            return False
        return real_access(path, mode, **kwargs)

    monkeypatch.setattr(cli_args.os, "access", access)
    target = str(locked / "out.json")
    assert pressure_main(["--json", target]) == 2
    assert "not writable" in capsys.readouterr().err
    assert bench_main(["disk", "--dir", str(tmp_path), "--json", target]) == 2
    assert "not writable" in capsys.readouterr().err
    assert no_pressure_run == []
    assert list(locked.iterdir()) == []


def test_a_failed_run_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_pressure_run: list[Any]
) -> None:
    assert pressure_main(["--params", "300k", "--dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == "swapper-pressure: error: stopped by the test\n"


# ----------------------------------------------------------------------------------------
# Units: binary prefixes, labelled, in both tools' human output; --json keys unchanged


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (100 << 20, "100 MiB"),
        (3 << 30, "3 GiB"),
    ],
)
def test_format_size_as_the_tools_print_it(nbytes: int, text: str) -> None:
    assert cli_args.format_size(nbytes) == text


def _pressure_result() -> Any:
    from swapper.pressure.model import GPTConfig
    from swapper.pressure.runner import PressureResult, PressureSettings
    from swapper.pressure.timing import Phases

    return PressureResult(
        settings=PressureSettings(steps=1),
        model=GPTConfig.for_params(300_000),
        num_params=291_008,
        losses=[1.5],
        reference_losses=[1.5],
        identical=True,
        peak_bytes={"device": 140_000, "host": 800_000},
        budget_bytes={"device": 145_504, "host": None},
        peak_rss_bytes=300 << 20,
        baseline_rss_bytes=250 << 20,
        sub_group_numel=1 << 16,
        activation_bytes=3 << 20,
        bytes_moved=5 << 30,
        phases=Phases(),
        reference_phases=Phases(),
        stall_fraction=0.25,
        seconds=2.0,
        reference_seconds=1.0,
    )


def test_pressure_summary_units() -> None:
    from swapper.pressure.cli import _summary

    text = _summary(_pressure_result())
    assert "device peak 137 KiB of budget 142 KiB" in text
    assert "host peak 781 KiB of budget unlimited" in text
    assert "peak RSS 300 MiB, bound 257 MiB (budgets + baseline 250 MiB" in text
    assert "moved 5 GiB between tiers" in text
    assert "stalled 0.50 s waiting for bytes (25.0% of the budgeted run)" in text
    assert " GB" not in text and "MB" not in text  # no decimal prefixes
    data = _pressure_result().to_json()  # --json: integers in bytes, the same keys
    assert data["bytes_moved"] == 5 << 30 and data["stall_fraction"] == 0.25


def test_bench_tables_are_in_gib_per_second() -> None:
    from swapper.bench.disk import Measurement, Setting
    from swapper.bench.report import format_table

    setting = Setting(
        engine="swapper",
        backend=Backend.THREADS,
        block_size=1 << 20,
        queue_depth=8,
        threads=1,
        direct=True,
    )
    m = Measurement(
        op="read",
        setting=setting,
        backend="threads",
        direct=True,
        nbytes=2 << 30,
        seconds=[1.0],
        cpu_seconds=0.5,
        cache="O_DIRECT",
        dirs=["/x"],
    )
    header, row, note = format_table([m]).splitlines()
    assert "GiB/s" in header and "CPU s/GiB" in header and "GB/s" not in header
    assert "2.00" in row  # 2 GiB in 1 s
    assert "GiB = 2^30 bytes" in note
    assert m.to_record()["gbps"] == pytest.approx(2 * 2**30 / 1e9)  # --json: GB/s as before
