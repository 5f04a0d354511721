"""``swapper-pressure --nproc`` ranks die with their parent, even one killed by SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")

# The parent starts a child that asks to die with it, prints the child's pid, then sleeps.
_PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())])
print(child.pid, flush=True)
time.sleep(120)
"""
_CHILD = """
import sys, time
from swapper.pressure.ranks import die_with_parent
die_with_parent(int(sys.argv[1]))
open(READY, "w").close()
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (dead, not yet reaped by init) counts as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_a_rank_dies_when_its_parent_is_sigkilled(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    child_code = _CHILD.replace("READY", repr(str(ready)))
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, child_code], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child_pid = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while not ready.exists():  # the child has made its request
            assert time.monotonic() < deadline, "the child never got going"
            time.sleep(0.05)
        assert _alive(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 5
        while _alive(child_pid):
            assert time.monotonic() < deadline, "the rank outlived its SIGKILLed parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


def test_a_rank_whose_parent_is_already_gone_exits_at_once() -> None:
    code = "from swapper.pressure.ranks import die_with_parent; die_with_parent(1); print('ran on')"
    # pid 1 is never our parent here (the test runner is): as if the parent had died before
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "ran on" not in done.stdout
