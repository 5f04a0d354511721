"""Plot where each second of a no-reference pressure run went (issue 23).

Usage::

    python tools/plot_scale.py RUN.json OUT.png

``RUN.json``: ``swapper-pressure --reference none --json`` (or ``--compare-budgets``,
whose first run is drawn). Left: per step, forward, backward and optimizer seconds, each
split into the training thread's stall and the rest (compute and unhidden work), with
the optimizer's I/O floor and compute floor marked. Right: per step, the optimizer's NVMe
read and write throughput (its bytes over its seconds) beside the rates the run measured
at start with the AIO engine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _run(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    return data["runs"][0] if "runs" in data else data


def plot(run: dict[str, Any], out: Path) -> None:
    """Draw ``run`` (a no-reference result's JSON) into ``out`` (PNG)."""
    steps = run["per_step"]
    x = [s["step"] for s in steps]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    bottom = [0.0] * len(steps)
    parts = [
        ("forward", "forward_seconds", "forward_stall_seconds", "tab:blue"),
        ("backward", "backward_seconds", "backward_stall_seconds", "tab:green"),
        ("optimizer", "optimizer_seconds", "optimizer_stall_seconds", "tab:orange"),
    ]
    for name, total_key, stall_key, colour in parts:
        work = [s[total_key] - s[stall_key] for s in steps]
        stall = [s[stall_key] for s in steps]
        left.bar(x, work, bottom=bottom, color=colour, label=f"{name}: compute + other")
        bottom = [b + w for b, w in zip(bottom, work, strict=True)]
        left.bar(x, stall, bottom=bottom, color=colour, alpha=0.4, hatch="//",
                 label=f"{name}: stall")  # fmt: skip
        bottom = [b + s for b, s in zip(bottom, stall, strict=True)]
    fb = [s["forward_backward_seconds"] for s in steps]
    for i, s in enumerate(steps):
        left.hlines(fb[i] + s["optimizer_io_floor_seconds"], x[i] - 0.4, x[i] + 0.4,
                    colors="black", linestyles="--")  # fmt: skip
        left.hlines(fb[i] + s["compute_floor_seconds"], x[i] - 0.4, x[i] + 0.4,
                    colors="red", linestyles=":")  # fmt: skip
    left.set_xlabel("step")
    left.set_ylabel("seconds")
    left.set_title(
        f"{run['params'] / 1e9:.2f} B params: step time (dashed: optimizer I/O floor, "
        "dotted: compute floor)",
        fontsize=9,
    )
    left.legend(fontsize=7)

    disk = run["disk"]
    reads = [
        sum(s["nvme_bytes"]["optimizer"]["read"].values()) / s["optimizer_seconds"] / 2**30
        for s in steps
    ]
    writes = [
        sum(s["nvme_bytes"]["optimizer"]["written"].values()) / s["optimizer_seconds"] / 2**30
        for s in steps
    ]
    right.plot(x, reads, "o-", label="read in step")
    right.plot(x, writes, "s-", label="write in step")
    right.axhline(disk["read_bytes_per_second"] / 2**30, color="tab:blue", ls="--",
                  label="bench read")  # fmt: skip
    right.axhline(disk["write_bytes_per_second"] / 2**30, color="tab:orange", ls="--",
                  label="bench write (to fsync)")  # fmt: skip
    right.set_xlabel("step")
    right.set_ylabel("GiB/s")
    right.set_title("optimizer step: NVMe throughput vs the bench, same run", fontsize=9)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    plot(_run(Path(argv[0])), Path(argv[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
