"""tools/snapshot_bench.py and tools/kill_bench.py (issue 13's benchmarks), at sizes that
run in seconds: the snapshot bench's figures and resume check; the kill bench's aim, its
reading of the store's newest snapshot, and its refusal of several ranks where
swapper-pressure refuses snapshots with --nproc > 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

_TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, _TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def test_snapshot_bench_writes_a_small_share_and_resumes_bit_exactly(tmp_path: Path) -> None:
    bench = _tool("snapshot_bench")
    out = tmp_path / "snap.json"
    args = ["--params", "200k", "--dir", str(tmp_path), "--steps", "2", "--host-budget", "1MiB"]
    args += ["--device-budget", "256KiB", "--sub-group", "64k", "--check-resume"]
    args += ["--json", str(out)]
    assert bench.main(args) == 0
    result = json.loads(out.read_text())
    assert result["resumed_digest_equal"] is True
    for snap in result["snapshots"]:
        assert snap["rebuilt_bytes"] > 0
        assert snap["written_bytes"] <= 0.05 * snap["state_bytes"]
    assert result["store_bytes"] > result["snapshots"][-1]["state_bytes"] // 2
    assert list(tmp_path.glob("snapshot-bench-*")) == []  # its directory is removed


def _args(**kw: object) -> argparse.Namespace:
    base = {"steps": 10, "every": 2, "params": "1M", "nproc": 1}
    base.update(kw)
    return argparse.Namespace(**base)


_REF = {
    "steps_detail": {"forward_backward_seconds": [1.0] * 10, "optimizer_seconds": [0.5] * 10},
    "snapshots": [{"seconds": 0.2}],
}


@pytest.mark.parametrize("resumed", [0, 2, 4, 8])
@pytest.mark.parametrize("phase", ["forward", "backward", "step", "snapshot"])
def test_kill_bench_aims_after_the_resume_and_within_the_phase(resumed: int, phase: str) -> None:
    bench = _tool("kill_bench")
    for seed in range(20):
        aim = bench._aim(random.Random(seed), phase, resumed, _args(), _REF)
        assert aim is not None
        step, delay, anchor = aim
        assert max(resumed + 1, 2) <= step <= min(10, resumed + 4)
        if phase == "snapshot":
            assert step % 2 == 0 and 0 <= delay <= 0.2
            assert anchor == f"  pressure step {step}:"
            continue
        low, high = {"forward": (0.05, 0.3), "backward": (0.45, 0.95), "step": (1.025, 1.475)}[
            phase
        ]
        assert low <= delay <= high
        if step - 1 == resumed:
            assert anchor == f"  pressure: resumed from step {resumed}"
        elif (step - 1) % 2 == 0:
            assert anchor == f"  pressure snapshot step-{step - 1:09d}"
        else:
            assert anchor == f"  pressure step {step - 1}:"


def test_kill_bench_has_nothing_to_aim_at_past_the_end() -> None:
    bench = _tool("kill_bench")
    assert bench._aim(random.Random(0), "forward", 10, _args(), _REF) is None


def test_kill_bench_reads_the_newest_snapshot_of_the_store(tmp_path: Path) -> None:
    bench = _tool("kill_bench")
    store = tmp_path / "swap" / "swapper-pressure-checkpoint"
    store.mkdir(parents=True)
    assert bench._newest_snapshot(tmp_path / "swap") == 0
    for step in (4, 12, 8):
        (store / f"swapper-offload.step-{step:09d}.snap").write_bytes(b"x")
    (store / "swapper-offload.step-000000099.snap.tmp").write_bytes(b"x")  # not whole
    assert bench._newest_snapshot(tmp_path / "swap") == 12


def test_kill_bench_reads_the_newest_commit_record_with_several_ranks(tmp_path: Path) -> None:
    """With several ranks a snapshot counts once rank 0's commit record is there: parts
    alone (a kill between the parts and the record) are not a snapshot to resume from."""
    bench = _tool("kill_bench")
    store = tmp_path / "swap" / "swapper-pressure-checkpoint"
    (store / "rank0of2").mkdir(parents=True)
    assert bench._newest_snapshot(tmp_path / "swap", nproc=2) == 0
    for step in (4, 12, 8):
        (store / f"swapper-offload.step-{step:09d}.commit").write_bytes(b"x")
    (store / "swapper-offload.step-000000099.commit.tmp").write_bytes(b"x")  # not whole
    (store / "rank0of2" / "swapper-offload.step-000000016.snap").write_bytes(b"x")  # no record
    assert bench._newest_snapshot(tmp_path / "swap", nproc=2) == 12
