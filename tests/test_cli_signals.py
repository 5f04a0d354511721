"""Both command-line tools, signalled at random moments, exit 128 + signal within 5 s,
print one line and no traceback, and leave none of their files behind.

Each trial starts the console-script entry point in a subprocess (the same function the
installed ``swapper-bench`` / ``swapper-pressure`` scripts call), with its swap directory
and ``TMPDIR`` in fresh temporary directories, sends SIGINT, SIGTERM or SIGHUP at a seeded
random moment from 0.1 s on (during the torch import, the setup, or the run), and checks
the exit code, stderr and both directories.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

_ENTRY = "import sys; from swapper.console import {fn}; sys.argv[0] = {prog!r}; {fn}()"

#: (entry function, program name, arguments long enough that no trial finishes first)
TOOLS = {
    "bench": ("bench", "swapper-bench", ["disk", "--size", "64MiB", "--loops", "100"]),
    "pressure": ("pressure", "swapper-pressure", ["--params", "1M", "--steps", "400"]),
}

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _trials(seed: int, n: int) -> list[tuple[float, signal.Signals]]:
    rng = random.Random(seed)
    # Spread over the import (~0.1–2 s here), the setup and the run.
    return [(round(rng.uniform(0.1, 4.0), 2), SIGNALS[i % len(SIGNALS)]) for i in range(n)]


def _listing(root: Path) -> list[str]:
    """What is under ``root``, but torch's own cache directory (``torchinductor_<user>``,
    made in TMPDIR by torch itself, and kept by torch between runs on purpose)."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if not p.relative_to(root).parts[0].startswith("torchinductor_")
    )


@pytest.mark.parametrize("tool", sorted(TOOLS))
@pytest.mark.parametrize("trial", range(5))
def test_signal_at_a_random_moment(tool: str, trial: int, tmp_path: Path) -> None:
    fn, prog, args = TOOLS[tool]
    delay, sig = _trials(seed=zlib.crc32(tool.encode()), n=5)[trial]
    swap, tmpdir = tmp_path / "swap", tmp_path / "tmp"
    swap.mkdir(mode=0o700)
    tmpdir.mkdir(mode=0o700)
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _ENTRY.format(fn=fn, prog=prog), *args, "--dir", str(swap)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        time.sleep(delay)
        assert proc.poll() is None, f"{prog} ended before the signal at {delay} s"
        proc.send_signal(sig)
        sent = time.monotonic()
        _, stderr = proc.communicate(timeout=5)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, (delay, sig.name, proc.returncode, stderr)
    assert took <= 5
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"{prog}: interrupted"), stderr
    assert _listing(swap) == [], f"{prog} left {_listing(swap)} after {sig.name} at {delay} s"
    assert _listing(tmpdir) == [], f"{prog} left {_listing(tmpdir)} in TMPDIR"


def test_a_second_signal_does_not_cut_the_cleanup(tmp_path: Path) -> None:
    fn, prog, args = TOOLS["pressure"]
    swap, tmpdir = tmp_path / "swap", tmp_path / "tmp"
    swap.mkdir(mode=0o700)
    tmpdir.mkdir(mode=0o700)
    proc = subprocess.Popen(
        [sys.executable, "-c", _ENTRY.format(fn=fn, prog=prog), *args, "--dir", str(swap)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(tmpdir), "PYTHONUNBUFFERED": "1"},
        text=True,
    )
    try:
        # Wait until it trains (its first step line), so that there is a store to remove.
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        for line in proc.stdout:
            if "step" in line or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)  # (signals pending together are handled lowest number first)
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGHUP)
        _, stderr = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr, stderr
    assert _listing(swap) == [] and _listing(tmpdir) == []
