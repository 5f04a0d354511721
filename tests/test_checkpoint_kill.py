"""A run with training snapshots, SIGKILLed at random moments and resumed each time, ends
bit-identical to an uninterrupted run (issue 13, single process).

The child is ``tests/ckpt_train.py`` (a tiny GPT under tight budgets spilling to NVMe, a
snapshot every 2 steps, keep_last=2, data from the global RNG). Kills land in forward,
backward and the optimizer step (a seeded random delay after the phase begins, so the
exact instant varies), and inside a snapshot: after its tensors are durable but before
its file is written (the snapshot never happened: the run resumes from the one before),
and right after its file is written (before retention ran). Every child but the last
must die by SIGKILL; each resume starts at or before the step it was killed at; the last
child's ``final_digest`` must equal the uninterrupted run's.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

_WORKER = Path(__file__).with_name("ckpt_train.py")
STEPS, EVERY = 8, 2


def _run(swap: Path, kill: str | None = None) -> tuple[int, list[str], str]:
    args = [sys.executable, str(_WORKER), str(swap), "--steps", str(STEPS), "--every", str(EVERY)]
    args += ["--host-fraction", "0.1"]
    if kill is not None:
        args += ["--kill", kill]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    return proc.returncode, proc.stdout.splitlines(), proc.stderr


def _value(lines: list[str], word: str) -> str:
    found = [line.split()[1] for line in lines if line.startswith(word + " ")]
    assert found, f"no {word!r} line in {lines}"
    return found[-1]


def test_sigkilled_and_resumed_run_ends_with_the_uninterrupted_digest(tmp_path: Path) -> None:
    rc, lines, err = _run(tmp_path / "reference")
    assert rc == 0, err
    reference = _value(lines, "digest")

    rng = random.Random(13)
    kills = [
        f"forward:1:{rng.uniform(0, 10):.1f}",  # before any snapshot: starts afresh
        f"backward:3:{rng.uniform(0, 10):.1f}",
        "snapshot-file:4:0",  # tensors durable, no file: resumes from step 2
        f"step:5:{rng.uniform(0, 10):.1f}",
        "snapshot-done:6:0",  # file written, retention not run: resumes from step 6
        f"snapshot:8:{rng.uniform(0, 3):.1f}",  # in the last snapshot, or just after
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
