"""Launcher of tests/dist_ckpt_train.py's ranks for the kill test, without torch (so that
a run does not pay one more torch import before its ranks start)::

    python tests/dist_ckpt_launch.py SWAP_DIR --world 2 --steps 8 --every 2 [--kill ...]

It makes itself a process group leader (a kill takes this group: the launcher and its
ranks, nothing else), starts ``--world`` rank processes (``dist_ckpt_train.py --rank r``,
rendezvous through a file in a fresh directory beside ``SWAP_DIR``) and waits for them
with a deadline. Exit status 0 when every rank exited 0; else 1, the others killed.
The ranks' output passes through (rank 0 prints ``resumed`` and ``digest``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_RANK = Path(__file__).with_name("dist_ckpt_train.py")
DEADLINE_S = 150.0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("swap", type=Path)
    parser.add_argument("--world", type=int, default=2)
    args, rest = parser.parse_known_args()
    if os.getpgrp() != os.getpid():
        os.setpgid(0, 0)
    rdv = tempfile.mkdtemp(prefix="rdv-", dir=args.swap.parent)
    common = [sys.executable, str(_RANK), str(args.swap), "--world", str(args.world)]
    procs = [
        subprocess.Popen([*common, "--rank", str(r), "--rdv", rdv, *rest])
        for r in range(args.world)
    ]
    deadline = time.monotonic() + DEADLINE_S
    codes: list[int | None] = [None] * len(procs)
    while None in codes and time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            break  # one failed: the others would wait at a collective until its timeout
        time.sleep(0.05)
    for p in procs:  # ours, by handle
        if p.poll() is None:
            p.kill()
        p.wait()
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
