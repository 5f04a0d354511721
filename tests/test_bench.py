"""Tests of ``swapper-bench`` (swapper/bench): small sizes, one loop, real files.

Most runs call :func:`swapper.bench.main` in-process; a few start ``python -m
swapper.bench`` to check the module entry point and signal handling.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from swapper.bench import disk as bench_disk
from swapper.bench import main
from tiers.config import AioConfig
from tiers.errors import BackendUnavailableError, SwapConfigError, SwapIOError

RECORD_KEYS = {
    "op",
    "backend",
    "direct",
    "block_size",
    "queue_depth",
    "threads",
    "nbytes",
    "seconds",
    "gbps",
}
FAST = ["--loops", "1", "--warmup", "0"]
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    d = tmp_path / "work"
    d.mkdir()
    return d


def run_ok(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str
) -> tuple[dict[str, Any], str]:
    """Run main() with --json; check exit 0; return the JSON and stdout."""
    out = tmp_path / "results.json"
    rc = main([*argv, "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(out.read_text()), captured.out


def assert_empty(*dirs: Path) -> None:
    for d in dirs:
        assert list(d.iterdir()) == [], f"left behind in {d}: {list(d.iterdir())}"


def check_record(record: dict[str, Any], loops: int, nbytes: int) -> None:
    assert record.keys() >= RECORD_KEYS
    assert record["op"] in ("read", "write")
    assert record["backend"] in ("libaio", "kernel", "threads", "aiofiles")
    assert isinstance(record["direct"], bool)
    assert record["nbytes"] == nbytes
    assert len(record["seconds"]) == loops
    assert all(s > 0 for s in record["seconds"])
    assert record["gbps"] > 0
    assert record["gbps_min"] <= record["gbps"] <= record["gbps_max"]
    assert record["cpu_seconds_per_gb"] >= 0
    assert record["cache"]


# ----------------------------------------------------------------------------------------
# Runs


def test_default_disk_run_schema_and_cleanup(
    tmp_path: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, out = run_ok(
        tmp_path, capsys, "--dir", str(workdir), "--size", "8MiB", "--loops", "2", "--warmup", "0"
    )
    results = data["results"]
    for r in results:
        check_record(r, loops=2, nbytes=8 << 20)
    main_rows = [r for r in results if r["role"] == "main"]
    assert {r["op"] for r in main_rows} == {"read", "write"}
    assert all(r["direct"] for r in main_rows if r["backend"] != "threads")
    # baselines are on by default in a plain run
    assert {"aiofiles"} <= {r["backend"] for r in results}
    assert any(not r["direct"] and r["engine"] == "swapper" for r in results)
    assert str(workdir) in out.splitlines()[0]
    assert "10^9" in out
    assert "best both" in out
    assert_empty(workdir)


def test_disk_subcommand_named_explicitly(
    tmp_path: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _ = run_ok(
        tmp_path, capsys, "disk", "--dir", str(workdir), "--size", "4MiB", "--no-baselines", *FAST
    )
    assert len(data["results"]) == 2
    assert_empty(workdir)


def test_op_read_gives_only_reads(
    tmp_path: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, _ = run_ok(
        tmp_path, capsys, "--dir", str(workdir), "--size", "4MiB", "--op", "read", *FAST
    )
    assert data["results"]
    assert {r["op"] for r in data["results"]} == {"read"}
    for r in data["results"]:
        check_record(r, loops=1, nbytes=4 << 20)
    assert_empty(workdir)


def test_several_dirs_split_the_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    argv = ["--size", "8MiB", "--block-size", "1MiB", "--no-baselines", *FAST]
    data, out = run_ok(tmp_path, capsys, "--dir", str(dirs[0]), "--dir", str(dirs[1]), *argv)
    assert len(data["results"]) == 2
    for r in data["results"]:
        check_record(r, loops=1, nbytes=8 << 20)
        assert r["dirs"] == [str(d) for d in dirs]
    assert "4 MiB each" in out
    assert data["meta"]["file_nbytes"] == 4 << 20
    assert_empty(*dirs)


def test_buffered_rows_say_how_the_cache_was_kept_out(
    tmp_path: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, out = run_ok(
        tmp_path, capsys, "--dir", str(workdir), "--size", "4MiB", "--no-direct",
        "--no-baselines", *FAST,
    )  # fmt: skip
    by_op = {r["op"]: r for r in data["results"]}
    assert by_op["read"]["direct"] is False
    assert by_op["read"]["cache"] in ("fadvise", "fadvise+drop_caches")
    assert by_op["write"]["cache"] == "fsync"
    assert by_op["read"]["cache"] in out
    assert "fsync" in out
    assert_empty(workdir)


def test_baselines_add_aiofiles_threads_and_buffered(
    tmp_path: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, out = run_ok(
        tmp_path, capsys, "--dir", str(workdir), "--size", "4MiB", "--backend", "auto",
        "--baselines", *FAST,
    )  # fmt: skip
    baselines = [r for r in data["results"] if r["role"] == "baseline"]
    # where auto already resolves to threads, the thread backend is the main row instead
    assert {r["backend"] for r in data["results"]} >= {"aiofiles", "threads"}
    assert any(r["engine"] == "swapper" and not r["direct"] for r in baselines)
    aiofiles_rows = [r for r in baselines if r["engine"] == "aiofiles"]
    assert {r["op"] for r in aiofiles_rows} == {"read", "write"}
    assert "aiofiles" in out
    assert_empty(workdir)


def test_sweep_names_best_and_emits_a_loadable_config(
    tmp_path: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "aio.json"
    data, out = run_ok(
        tmp_path, capsys, "--dir", str(workdir), "--size", "4MiB", "--sweep",
        "--block-size", "1MiB,2MiB", "--queue-depth", "4", "--threads", "1",
        "--backend", "auto,threads", "--emit-config", str(config),
    )  # fmt: skip
    settings = {(r["backend"], r["block_size"]) for r in data["results"]}
    assert len(settings) >= 2  # 2 block sizes (x 2 backends where auto is native)
    assert all(r["role"] == "sweep" for r in data["results"])
    assert {"read", "write", "both"} <= data["best"].keys()
    assert "best read" in out and "best write" in out
    emitted = json.loads(config.read_text())
    ds = emitted["deepspeed"]["aio"]
    assert {"block_size", "queue_depth", "intra_op_parallelism"} <= ds.keys()
    assert "thread_count" not in ds
    assert ds["single_submit"] is AioConfig().single_submit and ds["overlap_events"] is True
    assert ds["use_gds"] is False
    loaded = AioConfig.from_json(config)
    best = data["best"]["both"]
    assert loaded.block_size == best["block_size"] == ds["block_size"]
    assert loaded.queue_depth == 4
    assert loaded.num_threads == ds["intra_op_parallelism"] == 1
    assert loaded.backend.value == best["backend"]
    assert AioConfig.from_dict(emitted["swapper"]["aio"]) == loaded
    assert_empty(workdir)


def test_emit_config_without_sweep(
    tmp_path: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "aio.json"
    run_ok(
        tmp_path, capsys, "--dir", str(workdir), "--size", "4MiB", "--block-size", "1MiB",
        "--queue-depth", "8", "--no-baselines", "--emit-config", str(config), *FAST,
    )  # fmt: skip
    loaded = AioConfig.from_json(config)
    assert (loaded.block_size, loaded.queue_depth, loaded.num_threads) == (1 << 20, 8, 1)


def test_plot_writes_a_png(
    tmp_path: Path, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "plot.png"
    run_ok(
        tmp_path, capsys, "--dir", str(workdir), "--size", "4MiB", "--sweep",
        "--block-size", "1MiB,2MiB", "--queue-depth", "4", "--threads", "1",
        "--backend", "threads", "--plot", str(png),
    )  # fmt: skip
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert_empty(workdir)


def test_plot_without_matplotlib_is_a_usage_error(
    tmp_path: Path,
    workdir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    rc = main(["--dir", str(workdir), "--size", "4MiB", "--plot", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "pip install 'swapper[plot]'" in err
    assert_empty(workdir)


# ----------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--bogus"], "unrecognized arguments"),
        (["--size", "12XB"], "unknown size unit"),
        (["--size", "lots"], "not a size"),
        (["--size", "1MiB", "--block-size", "4MiB"], "smaller than --block-size"),
        (["--size", "1KiB"], "too small"),
        (["--loops", "0"], "at least 1"),
        (["--queue-depth", "0"], "--queue-depth"),
        (["--threads", "1000"], "--threads"),
        (["--block-size", "1000"], "--block-size"),
        (["--backend", "warp"], "unknown backend"),
        (["--op", "delete"], "invalid choice"),
        (["--dir", "{tmp}/missing"], "no such directory"),
        (["--dir", "{tmp}/a-file"], "not a directory"),
        (["--json", "{tmp}/missing/out.json"], "does not exist"),
        (["nonsense"], "invalid choice"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(
    tmp_path: Path,
    workdir: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    fragment: str,
) -> None:
    (tmp_path / "a-file").write_text("x")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "--dir" not in argv and argv[0].startswith("-"):
        argv = ["--dir", str(workdir), *argv]
    rc = main(argv)
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.err.startswith("swapper-bench: error: ")
    assert captured.err.count("\n") == 1, captured.err
    assert fragment in captured.err
    assert "usage:" not in captured.err
    assert_empty(workdir)


def test_unavailable_backend_is_a_usage_error(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiers.aio.backend as backend_module

    def refuse(backend: Any) -> Any:
        raise BackendUnavailableError(f"backend {backend.value!r} unavailable: test")

    monkeypatch.setattr(backend_module, "probe_backend", refuse)
    rc = main(["--dir", str(workdir), "--size", "4MiB", "--backend", "libaio"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and "libaio" in err
    assert_empty(workdir)


def test_io_failure_exits_1_with_one_line_and_cleans_up(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_pass(*args: Any, **kwargs: Any) -> float:
        raise SwapIOError(errno.EIO, "write failed: Input/output error", str(workdir / "x"))

    monkeypatch.setattr(bench_disk, "_engine_pass", failing_pass)
    rc = main(["--dir", str(workdir), "--size", "4MiB", *FAST])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("swapper-bench: error: ") and err.count("\n") == 1
    assert "Input/output error" in err
    assert_empty(workdir)


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    assert "disk" in capsys.readouterr().out
    assert main(["disk", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--dir" in out and "--sweep" in out and "--emit-config" in out


def test_sentinels_catch_a_read_that_delivered_nothing(tmp_path: Path) -> None:
    tensor = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8)
    sentinels = bench_disk.Sentinels(tensor, file_nbytes=1 << 15, nfiles=2)
    sentinels.poison()
    with pytest.raises(bench_disk.BenchError, match="wrong data"):
        sentinels.check([tmp_path / "a", tmp_path / "b"])


# ----------------------------------------------------------------------------------------
# AioConfig.from_json / from_dict


def test_from_dict_accepts_the_section_and_refuses_unknown_keys() -> None:
    section = {"backend": "threads", "block_size": "2MiB", "queue_depth": 16}
    config = AioConfig.from_dict(section)
    assert (config.block_size, config.queue_depth) == (2 << 20, 16)
    assert AioConfig.from_dict({"swapper": {"aio": section}, "deepspeed": {}}) == config
    with pytest.raises(SwapConfigError, match="thread_count, zap"):
        AioConfig.from_dict({**section, "zap": 1, "thread_count": 2})
    with pytest.raises(SwapConfigError, match="queue_depth"):
        AioConfig.from_dict({"queue_depth": True})


def test_from_json_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"swapper": {"aio": {"depth": 3}}}')
    with pytest.raises(SwapConfigError, match=r"bad\.json.*depth"):
        AioConfig.from_json(bad)
    bad.write_text("{not json")
    with pytest.raises(SwapConfigError, match="not valid JSON"):
        AioConfig.from_json(bad)


# ----------------------------------------------------------------------------------------
# As a process


def _bench_process(*argv: str) -> subprocess.Popen[str]:
    # the tree first, then whatever the caller put on the path (where its packages may be)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "swapper.bench", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_module_entry_point(tmp_path: Path, workdir: Path) -> None:
    out = tmp_path / "r.json"
    proc = _bench_process(
        "--dir", str(workdir), "--size", "4MiB", "--no-baselines", "--json", str(out), *FAST
    )
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "GB/s" in stdout
    assert {r["op"] for r in json.loads(out.read_text())["results"]} == {"read", "write"}
    assert_empty(workdir)


def test_module_bad_argument_exit_2(workdir: Path) -> None:
    proc = _bench_process("--dir", str(workdir), "--loops", "0")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert stderr.count("\n") == 1 and stderr.startswith("swapper-bench: error:")


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_mid_run_exits_and_removes_everything(workdir: Path, signum: int, code: int) -> None:
    # Long enough to be mid-run when the signal comes (it is cut short by it).
    proc = _bench_process(
        "--dir", str(workdir), "--size", "32MiB", "--block-size", "1MiB", "--loops", "10000",
        "--no-baselines",
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not list(workdir.glob("swapper-bench-*/data.bin")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the temp dir never appeared"
            time.sleep(0.05)
        time.sleep(0.5)  # into the timed passes
        proc.send_signal(signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == code, stderr
    assert "interrupted" in stderr
    assert_empty(workdir)
