"""A 2-rank run with snapshots, SIGKILLed at random moments and resumed each time, ends
bit-identical to an uninterrupted run (issue 13, several ranks).

The child is ``tests/dist_ckpt_launch.py``: its own process group, 2 gloo ranks
(``tests/dist_ckpt_train.py``: a tiny GPT whose optimizer state spills to NVMe, a
snapshot every 2 steps, keep_last=2, a 20 s timeout on every collective). A kill takes
the whole job (launcher and both ranks, one ``killpg``) at a seeded random delay after
a phase begins on rank 0 (forward, backward, optimizer step, snapshot), or inside a
snapshot: every part durable but no commit record yet (the snapshot never happened: the
run resumes from the one before), and right after the record is written (before
retention ran). Every child but
the last must die by SIGKILL; each resume starts at or before the step it was killed at;
the last child's ``final_digest`` (the same on both ranks) must equal the uninterrupted
run's.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

_LAUNCHER = Path(__file__).with_name("dist_ckpt_launch.py")
STEPS, EVERY = 8, 2


def _run(swap: Path, kill: str | None = None) -> tuple[int, list[str], str]:
    args = [sys.executable, str(_LAUNCHER), str(swap), "--world", "2"]
    args += ["--steps", str(STEPS), "--every", str(EVERY)]
    if kill is not None:
        args += ["--kill", kill]
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=180, check=False, start_new_session=True
    )
    return proc.returncode, proc.stdout.splitlines(), proc.stderr


def _value(lines: list[str], word: str) -> str:
    found = [line.split()[1] for line in lines if line.startswith(word + " ")]
    assert found, f"no {word!r} line in {lines}"
    return found[-1]


def test_two_ranks_sigkilled_and_resumed_end_with_the_uninterrupted_digest(
    tmp_path: Path,
) -> None:
    rc, lines, err = _run(tmp_path / "reference")
    assert rc == 0, err
    reference = _value(lines, "digest")

    rng = random.Random(13)
    kills = [
        f"forward:1:{rng.uniform(0, 20):.1f}",  # before any snapshot: starts afresh
        f"backward:3:{rng.uniform(0, 20):.1f}",
        "snapshot-commit:4:0",  # parts durable, no record: resumes from step 2
        f"step:5:{rng.uniform(0, 20):.1f}",
        "snapshot-done:6:0",  # record written, retention not run: resumes from step 6
        f"snapshot:8:{rng.uniform(0, 5):.1f}",  # in the last snapshot, or just after
    ]
    swap = tmp_path / "swap"
    resumed_at: list[int] = []
    for kill in kills:
        rc, lines, err = _run(swap, kill)
        assert rc == -signal.SIGKILL, f"kill {kill}: exit {rc}\n{err}"
        resumed_at.append(int(_value(lines, "resumed")))
        assert resumed_at[-1] <= int(kill.split(":")[1]), (kill, resumed_at)
    rc, lines, err = _run(swap)
    assert rc == 0, err
    resumed_at.append(int(_value(lines, "resumed")))
    # 0, 0 (no snapshot yet), 2, 2, 4, 6, then 6 or 8
    assert resumed_at[:6] == [0, 0, 2, 2, 4, 6] and resumed_at[6] in (6, 8), resumed_at
    assert _value(lines, "digest") == reference
