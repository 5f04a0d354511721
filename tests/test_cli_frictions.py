"""The command-line tools as a newcomer meets them (issue 28): each test runs a console
script in a subprocess, as a user would, with this tree first on PYTHONPATH."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def console(prog: str, *argv: str, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    """Run console script ``prog`` (the venv's, else ``python -m``) with ``argv``."""
    script = Path(sys.executable).parent / prog
    module = {"swapper-bench": "swapper.bench", "swapper-pressure": "swapper.pressure"}[prog]
    command = [str(script)] if script.exists() else [sys.executable, "-m", module]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [*command, *argv], capture_output=True, text=True, env=env, timeout=timeout_s
    )


def _one_error_line(res: subprocess.CompletedProcess[str], prog: str) -> str:
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), res.stderr
    return lines[0]


# -- item 2: rerunning a checkpointing command --------------------------------------------


def test_pressure_rerun_over_snapshots_says_resume_or_another_dir(tmp_path: Path) -> None:
    checkpoint = tmp_path / "swapper-pressure-checkpoint"
    checkpoint.mkdir(mode=0o700)
    (checkpoint / "swapper-offload.json").write_text("{}")
    (checkpoint / "swapper-offload.lock").write_text("1\n")  # a run that ended: not held
    res = console("swapper-pressure", "--dir", str(tmp_path), "--checkpoint-every", "1")
    assert res.returncode == 2, res
    line = _one_error_line(res, "swapper-pressure")
    assert "--resume" in line and "another --dir" in line, line
    assert f"rm -r {checkpoint}" in line and "NvmeStore" not in line, line
    assert (checkpoint / "swapper-offload.json").exists()  # nothing touched


def test_pressure_over_a_checkpoint_in_use_names_the_process(tmp_path: Path) -> None:
    checkpoint = tmp_path / "swapper-pressure-checkpoint" / "rank0of2"
    checkpoint.mkdir(mode=0o700, parents=True)
    lock = checkpoint / "swapper-offload.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(lock)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "READY"
        for flags in (["--checkpoint-every", "1"], ["--resume"]):
            res = console("swapper-pressure", "--dir", str(tmp_path), *flags)
            assert res.returncode == 2, res
            line = _one_error_line(res, "swapper-pressure")
            assert f"in use by process {holder.pid}" in line, line
            assert "another --dir" in line, line
    finally:
        holder.kill()
        holder.wait(timeout=30)


_HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
print("READY", flush=True)
time.sleep(120)
"""
