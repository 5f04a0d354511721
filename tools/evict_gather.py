"""Durable evictions against the group commit's gather bound, alternating, in one sitting.

Runs ``swapper-bench tiers`` (raw disk and manager alternating within every pass, as the
command always does) once per gather bound per round, each in a fresh process with
:data:`tiers.nvme.committer.GATHER_S` set to the bound, and counts the ``os.fdatasync``
calls of each run (two per group commit, plus a few at store creation and close). Prints
one line per run (evict ratio, fetch ratio, fsyncs, load average) and the median evict
ratio of each bound. The bench's own working files go to a fresh directory under ``--dir``,
removed after each run.

    python tools/evict_gather.py --dir /work/scratch/x --gather 0.02,0.5 --rounds 3

With ``--child`` (internal) it is the run itself: ``--child GATHER BENCH-ARGS...``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def _child(gather: float, bench_args: list[str]) -> int:
    """One bench run with the bound patched in and fdatasync counted (printed last)."""
    import tiers.nvme.committer as committer

    committer.GATHER_S = gather
    calls = [0]
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        calls[0] += 1
        real(fd)

    os.fdatasync = fdatasync
    from swapper.console import bench

    sys.argv = ["swapper-bench", *bench_args]
    try:
        return bench()
    finally:
        print(f"FDATASYNC {calls[0]}", flush=True)


def _run(gather: float, root: Path, size: str, loops: int) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="evict-gather-", dir=root))
    try:
        out = work / "tiers.json"
        (work / "d").mkdir()
        bench = ["tiers", "--dir", str(work / "d"), "--size", size, "--loops", str(loops)]
        proc = subprocess.run(
            [sys.executable, __file__, "--child", str(gather), *bench, "--json", str(out)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"bench failed (gather {gather}):\n{proc.stdout}\n{proc.stderr}")
        ratios = {r["op"]: r["ratio"] for r in json.loads(out.read_text())["results"]}
        syncs = [line for line in proc.stdout.splitlines() if line.startswith("FDATASYNC ")]
        return {
            "evict": ratios["evict"],
            "fetch": ratios["fetch"],
            "fdatasync": float(syncs[-1].split()[1]),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(float(argv[1]), argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="scratch directory (must exist)")
    p.add_argument("--gather", default="0.02,0.5", help="bounds in seconds, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size", default="2GiB")
    p.add_argument("--loops", type=int, default=3)
    args = p.parse_args(argv)
    bounds = [float(g) for g in args.gather.split(",")]
    evict: dict[float, list[float]] = {g: [] for g in bounds}
    for r in range(1, args.rounds + 1):
        for g in bounds:
            load = Path("/proc/loadavg").read_text().split()[0]
            res = _run(g, args.dir, args.size, args.loops)
            evict[g].append(res["evict"])
            print(
                f"round {r} gather {g:g} s: evict ratio {res['evict']:.2f}, fetch ratio "
                f"{res['fetch']:.2f}, fdatasync {res['fdatasync']:.0f}, load {load}",
                flush=True,
            )
    for g in bounds:
        print(f"gather {g:g} s: evict ratio median {statistics.median(evict[g]):.2f} {evict[g]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
