"""``swapper-pressure --nproc N`` (:mod:`swapper.pressure.ranks`): N gloo ranks started by
the command itself, under per-rank budgets, beside N unlimited ranks and one process.

Small on purpose (a tiny GPT, 2 steps, 2 ranks): the parity of multi-rank training is
tested in ``tests/test_dist_train.py``; this tests the command around it: its JSON, its
exit codes, and that a failed rank ends the run with that rank's error, never a hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swapper.pressure.cli import main
from swapper.pressure.model import GPTConfig
from swapper.pressure.ranks import RankFailedError, _gather_floor, _Plan, _spawn
from swapper.pressure.runner import PressureSettings

pytestmark = pytest.mark.dist

PARAMS = 200_000  # at 100K the default per-rank device budget is below the tied embedding
NUM_PARAMS = GPTConfig.for_params(PARAMS).num_params()


def test_nproc_2_trains_identically_within_budgets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    swap = tmp_path / "swap"
    swap.mkdir()
    argv = ["--nproc", "2", "--params", str(PARAMS), "--steps", "2", "--seq", "16"]
    argv += ["--json", str(out)]
    assert main([*argv, "--dir", str(swap)]) == 0
    res = json.loads(out.read_text())
    assert res["world_size"] == 2
    assert res["fetch_collective"] == "all_gather"
    assert res["reduce_dtype"] == "bf16"  # the default: the gradients' own dtype
    assert res["identical"] is True and res["within_budgets"] is True
    assert res["within_tolerance"] is True
    assert 0 <= res["max_abs_diff_vs_single"] <= res["tolerance"]["abs"] + 0.01
    assert res["tolerance"]["abs"] == pytest.approx(2 * 1e-3 * 2)  # 2 * lr * steps
    assert 0.5 < res["equal_fraction_vs_single"] <= 1
    assert len(res["losses"]) == len(res["single_losses"]) == 2
    assert res["losses"][0] == pytest.approx(res["single_losses"][0], abs=0.01)
    budgets = res["budget_bytes"]
    # per rank by default: a quarter of the rank's half of the 16-bit params / state, the
    # device budget raised to the floor of the gathered buffers (the wrap refuses less)
    floor = _gather_floor(GPTConfig.for_params(PARAMS), 2, 30.0)
    assert floor > 2 * -(-NUM_PARAMS // 2) // 4  # at this size the floor decides
    assert budgets["device"] == floor
    assert len(res["per_rank"]) == 2
    for r, rank in enumerate(res["per_rank"]):
        assert rank["rank"] == r
        assert rank["budget_bytes"] == budgets
        for tier in ("device", "host"):
            assert 0 < rank["peak_bytes"][tier] <= budgets[tier]
        assert rank["bytes_moved"] > 0
        assert rank["offload_nbytes"] > 0  # gradients and evictions went down in backward
        assert 0 <= rank["stall_fraction"] < 1
        assert rank["losses"] == rank["reference_losses"]
        assert rank["final_digest"] == rank["reference_final_digest"]
        state = rank["state_nbytes"]
        # each rank stores about half of the 2 B/param (padding and whole small tensors
        # aside) and the optimizer's 12 B per element it owns
        assert state["param16"] == state["grad16"]
        assert abs(state["param16"] - NUM_PARAMS) <= 0.1 * NUM_PARAMS
        assert 6 * state["param16"] <= state["optim_state"] <= 6 * state["param16"] + 12 * 4096
        # the budgeted rank's memory: measured, bounded by its own budgets (the
        # reference-less run's figures are checked in test_pressure_budgeted.py)
        assert rank["peak_rss_bytes"] > 0 and rank["final_phase_peak_rss_bytes"] > 0
        bound = budgets["device"] + budgets["host"] + 2 * rank["activation_bytes"] + (3 << 29)
        assert rank["activation_bytes"] > 0 and rank["rss_bound_bytes"] == bound
        assert rank["rss_within_bound"] is True and rank["freed_memory_returned"] is True
    assert res["rss_within_bound"] is True
    shown = capsys.readouterr().out
    assert "within budgets, RSS within bound, within tolerance" in shown
    assert shown.count("after it; bound ") == 2  # each rank's line
    # the last backward's gradient offload, measured per module window: spread evenly
    windows = [dict(map(tuple, r["offload_windows"])) for r in res["per_rank"]]
    assert windows[0].keys() == windows[1].keys() and len(windows[0]) > 10
    assert sum(sum(w.values()) for w in windows) > 0
    assert 1.0 <= res["offload_balance"]["max_over_mean"] <= 1.25
    # the ranks trained different halves of the batch
    assert res["per_rank"][0]["losses"] != res["per_rank"][1]["losses"]
    assert list(swap.iterdir()) == []  # the swap directories went with the run


def test_nproc_2_trains_an_elementwise_torch_optimizer(tmp_path: Path) -> None:
    """--optimizer sgd over 2 ranks (it was refused: the ranks' runner built OffloadAdamW):
    bit-identical to the unlimited ranks, within tolerance of one process, and each rank
    stores SGD's 8 B per element it owns, not AdamW's 12."""
    out = tmp_path / "r.json"
    swap = tmp_path / "swap"
    swap.mkdir()
    argv = ["--nproc", "2", "--params", str(PARAMS), "--steps", "2", "--seq", "16"]
    assert main([*argv, "--optimizer", "sgd", "--json", str(out), "--dir", str(swap)]) == 0
    res = json.loads(out.read_text())
    assert res["identical"] is True and res["within_budgets"] is True
    assert res["within_tolerance"] is True
    for rank in res["per_rank"]:
        assert rank["final_digest"] == rank["reference_final_digest"]
        state = rank["state_nbytes"]
        assert 4 * state["param16"] <= state["optim_state"] <= 4 * state["param16"] + 8 * 4096


def test_fetch_collective_and_reduce_dtype_are_chosen_and_reported(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["--nproc", "2", "--params", str(PARAMS), "--steps", "1", "--seq", "16"]
    argv += ["--fetch-collective", "all_reduce", "--reduce-dtype", "float32"]
    assert main([*argv, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["fetch_collective"] == "all_reduce" and res["reduce_dtype"] == "float32"
    assert res["identical"] is True and res["within_budgets"] is True
    assert res["within_tolerance"] is True
    floor = _gather_floor(GPTConfig.for_params(PARAMS), 2, 30.0, fetch_collective="all_reduce")
    # the default device budget is raised to the floor of the all_reduce buffers (no
    # rank-major staging: a lower floor than all_gather's)
    assert res["budget_bytes"]["device"] == max(2 * -(-NUM_PARAMS // 2) // 4, floor)
    assert floor < _gather_floor(GPTConfig.for_params(PARAMS), 2, 30.0)


def test_nproc_2_checkpoints_and_resumes_to_the_same_digest(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    base = ["--nproc", "2", "--params", str(PARAMS), "--steps", "3", "--seq", "16"]
    base += ["--dir", str(swap), "--checkpoint-every", "2"]
    assert main([*base, "--json", str(first)]) == 0
    data = json.loads(first.read_text())
    assert data["identical"] is True and data["resumed_from_step"] == 0
    assert data["final_digest"].startswith("xxh3-128:")
    assert data["final_digest"] == data["reference_final_digest"]
    assert [s["name"] for s in data["snapshots"]] == ["step-000000002"]
    assert len(data["steps_detail"]["forward_backward_seconds"]) == 3
    # the parts and rank 0's commit record outlive the run, where a rerun finds them
    kept = swap / "swapper-pressure-checkpoint"
    assert (kept / "swapper-offload.step-000000002.commit").is_file()
    assert sorted(p.name for p in kept.glob("rank*")) == ["rank0of2", "rank1of2"]
    assert main([*base, "--resume", "--json", str(second)]) == 0
    again = json.loads(second.read_text())
    assert again["resumed_from_step"] == 2
    assert again["identical"] is True  # step 3 as the unlimited ranks trained it
    assert len(again["losses"]) == 1 and again["losses"] == data["losses"][2:]
    assert again["single_losses"] == data["single_losses"][2:]
    for r, rank in enumerate(again["per_rank"]):
        assert rank["losses"] == data["per_rank"][r]["losses"][2:]
    # the uninterrupted run's final state, parameters and optimizer state alike
    assert again["final_digest"] == data["final_digest"]
    assert "pressure: resumed from step 2" in capfd.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--nproc", "0"],
        ["--nproc", "65"],
        ["--nproc", "x"],
        ["--nproc", "3", "--batch", "4"],  # a batch of 4 does not split over 3 ranks
        ["--fetch-collective", "all_reduce"],  # one process: no collectives
        ["--reduce-dtype", "float32"],
        ["--nproc", "2", "--reduce-dtype", "float64"],
        ["--nproc", "2", "--fetch-collective", "broadcast"],
    ],
)
def test_bad_nproc_exits_2_before_any_work(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    start = time.monotonic()
    assert main([*argv, "--json", str(out)]) == 2
    assert time.monotonic() - start < 2  # no rank started, no model built
    assert not out.exists()
    assert "--" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["raise", "exit"])
def test_a_failed_rank_fails_the_run_without_a_hang(how: str, tmp_path: Path) -> None:
    settings = PressureSettings(params=PARAMS, steps=2)
    plan = _Plan(settings, 2, 240_000, 300_000, 1024, timeout_s=180.0, fault=(1, how))
    swap = tmp_path / "swap"
    swap.mkdir()
    lines: list[str] = []
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        _spawn(plan, [str(swap)], lines.append, grace_s=1.0)
    # rank 0 waits in a collective that rank 1 never joins: killed after the grace, long
    # before the group's 180 s timeout (the run itself takes ~25 s on a quiet 2-core VM,
    # 31-41 s under load: the bound leaves room for that, not for the timeout)
    assert time.monotonic() - start < 90
    message = str(info.value)
    assert message.startswith("rank 1 of 2 failed")
    if how == "raise":
        assert "injected fault on rank 1" in message
        assert any("injected fault" in line for line in lines)  # its traceback was said
    else:
        assert "exited with code 3" in message


def test_compare_judges_bound_ulp_and_equal_fraction() -> None:
    import torch

    from swapper.pressure.ranks_report import compare_params as _compare

    bf16 = torch.bfloat16
    a = {"w": torch.zeros(10, dtype=bf16), "n": torch.ones(2, dtype=bf16)}
    assert _compare(a, a, 0.01, bf16) == (0.0, 1.0, True)
    near = {"w": a["w"].clone(), "n": torch.tensor([1.0, 1.0078125], dtype=bf16)}
    near["w"][0] = 0.01  # at the bound; and one ulp at 1.0 on top of a 0.0 bound
    assert _compare(near, a, 0.01, bf16)[2]
    assert _compare(near, a, 0.0, bf16)[2] is False  # 0.01 on an element near zero
    far = {"w": a["w"].clone(), "n": a["n"].clone()}
    far["w"][3] = 0.05
    worst, _, ok = _compare(far, a, 0.01, bf16)
    assert not ok and worst == pytest.approx(0.05, rel=0.01)
    moved = {"w": torch.full((10,), 0.005, dtype=bf16), "n": a["n"].clone()}
    assert _compare(moved, a, 0.01, bf16)[1:] == (2 / 12, False)  # most elements differ
    assert _compare({"x": a["w"]}, a, 1.0, bf16)[2] is False


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie left for a parent to reap does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_sigterm_stops_the_ranks_and_removes_the_files(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    argv = ["--nproc", "2", "--params", str(PARAMS), "--steps", "10000", "--seq", "16"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "swapper.pressure", *argv, "--dir", str(swap)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the ranks are started once this is said
            if "started 2 ranks" in line:
                break
        time.sleep(3)  # the ranks import torch, wrap and train
        children = [
            int(c)
            for task in Path(f"/proc/{proc.pid}/task").iterdir()
            for c in (task / "children").read_text().split()
        ]
        ranks = [c for c in children if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(ranks) == 2, children
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not [r for r in ranks if _alive(r)]  # killed by the parent, not left training
    assert list(swap.iterdir()) == []
    assert os.path.isdir(swap)


def test_nproc_2_resume_passes_over_bad_snapshots_to_the_last_good_one(tmp_path: Path) -> None:
    """``--resume`` over a newest snapshot with a truncated rank part, and a commit record
    without its parts newer still: both passed over, the run continues from the last
    good snapshot and ends with the uninterrupted run's final_digest."""
    from swapper.zero.checkpoint.commit import commit_path, encode_commit, read_commits

    swap = tmp_path / "swap"
    swap.mkdir()
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    base = ["--nproc", "2", "--params", str(PARAMS), "--steps", "3", "--seq", "16"]
    base += ["--dir", str(swap), "--checkpoint-every", "1"]
    assert main([*base, "--json", str(first)]) == 0
    data = json.loads(first.read_text())
    kept = swap / "swapper-pressure-checkpoint"
    store = "swapper-offload"
    part = kept / "rank1of2" / f"{store}.step-000000003.snap"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])  # truncated
    newest = read_commits(kept, store)[0][0]
    assert newest.name == "step-000000003"
    fake = encode_commit(
        store=store, name="step-000000009", seq=newest.seq + 1, step=9, world_size=2,
        created=newest.created, parts=list(newest.parts),
    )  # fmt: skip
    commit_path(kept, store, "step-000000009").write_bytes(fake)  # its parts: nowhere
    assert main([*base, "--resume", "--json", str(second)]) == 0
    again = json.loads(second.read_text())
    assert again["resumed_from_step"] == 2
    assert again["identical"] is True
    assert again["losses"] == data["losses"][2:]
    assert again["final_digest"] == data["final_digest"]
