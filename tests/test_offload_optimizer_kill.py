"""Snapshots of ``OffloadOptimizer`` state resume after SIGKILL bit-identically (issue 26):
SGD (momentum), Adagrad and Adafactor (per-parameter state) under an offloaded tiny GPT
with tight budgets, killed in the step, in backward and inside a snapshot, each time
resumed; the last run's ``final_digest`` equals the uninterrupted run's.

The worker is ``tests/ckpt_train.py --optimizer NAME`` (the AdamW kill test's worker)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_checkpoint_kill import _value

_WORKER = Path(__file__).with_name("ckpt_train.py")
STEPS, EVERY = 6, 2


def _run(swap: Path, name: str, kill: str | None = None) -> tuple[int, list[str], str]:
    args = [sys.executable, str(_WORKER), str(swap), "--steps", str(STEPS), "--every", str(EVERY)]
    args += ["--optimizer", name]
    if kill is not None:
        args += ["--kill", kill]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    return proc.returncode, proc.stdout.splitlines(), proc.stderr


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adafactor"])
def test_sigkilled_and_resumed_run_ends_with_the_uninterrupted_digest(
    tmp_path: Path, name: str
) -> None:
    rc, lines, err = _run(tmp_path / "reference", name)
    assert rc == 0, err
    reference = _value(lines, "digest")
    swap = tmp_path / "swap"
    resumed_at: list[int] = []
    for kill in ("step:3:2", "snapshot-file:4:0", "backward:5:1"):
        rc, lines, err = _run(swap, name, kill)
        assert rc == -signal.SIGKILL, f"kill {kill}: exit {rc}\n{err}"
        resumed_at.append(int(_value(lines, "resumed")))
    rc, lines, err = _run(swap, name)
    assert rc == 0, err
    # step 3 killed: from the snapshot of step 2; snapshot 4 never written: from 2 again;
    # killed in step 5's backward: from 2 (4's file was never written), and so on
    assert resumed_at[0] == 0 and resumed_at[1] == 2 and resumed_at[2] in (2, 4)
    assert _value(lines, "digest") == reference
