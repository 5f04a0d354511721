"""Long runs do not grow (issue 29): thousands of offloaded steps, sampled for leaks.

Trains a small MLP (``--hidden``, bf16) offloaded under tight budgets (a device budget of
about its largest layer, a host budget below its parameters, gradients and 12 B/param of
optimizer state, the rest on NVMe), ``--steps`` steps, taking a snapshot every
``--snapshot-every`` steps (``--keep-last`` kept), and every ``--every`` steps records
:func:`swapper.pressure.growth.sample`: open descriptors, threads, locked bytes, RSS, the
host tier's bytes, and the swap directory's files and bytes. Writes the rows as JSON and
a plot of descriptors, threads, RSS and swap-directory bytes against steps, and says
what grew after the warm-up (the first fifth of the samples).

    python tools/long_run.py --steps 2000 --dir /tmp/longrun --json long.json --plot long.png

The short form is ``tests/test_leaks.py`` (200 steps). Exit status 1 when something grew.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig
from swapper.pressure.growth import growth, sample
from swapper.zero import save_snapshot

MiB = 1 << 20


def run(args: argparse.Namespace, swap_root: Path) -> list[dict[str, float]]:
    torch.manual_seed(0)
    h = args.hidden
    model = nn.Sequential(nn.Linear(64, h), nn.GELU(), nn.Linear(h, 64)).to(torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    config = OffloadConfig.create(
        device_nbytes=(64 * h + h) * 2 + 4096,  # about the largest layer's parameters
        host_nbytes=max(64 * 1024, numel * 8),  # < 2+2+12 B/param: the rest on NVMe
        nvme_dirs=[swap_root / "nvme"],
        device="cpu",
        step=StepConfig(sub_group_numel=max(1024, numel // 8)),
    )
    x = torch.randn(8, 64).to(torch.bfloat16)
    rows: list[dict[str, float]] = []
    start = time.perf_counter()
    with (
        swapper.OffloadedModel(model, config) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-3, tiers=wrapped) as opt,
    ):
        for step in range(1, args.steps + 1):
            wrapped(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if args.snapshot_every and step % args.snapshot_every == 0:
                save_snapshot(wrapped, opt, keep_last=args.keep_last)
            if step % args.every == 0:
                gc.collect()
                host = wrapped.stats().tiers[swapper.Tier.HOST].used_nbytes
                row: dict[str, float] = {"step": step, "seconds": time.perf_counter() - start}
                row.update(sample(swap_root / "nvme", host))
                rows.append(row)
                if step % (args.every * 20) == 0:
                    print(f"step {step}: {json.dumps(row)}", flush=True)
    return rows


def plot(rows: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, (name, scale, unit) in zip(
        axes.flat,
        [
            ("fds", 1, "open descriptors"),
            ("os_threads", 1, "threads (OS)"),
            ("rss_bytes", MiB, "RSS (MiB)"),
            ("swap_disk_bytes", MiB, "swap dir on disk (MiB, journal apart)"),
        ],
        strict=True,
    ):
        ax.plot(steps, [r[name] / scale for r in rows])
        ax.set_title(unit)
        ax.set_xlabel("step")
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=10, help="steps between samples")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--snapshot-every", type=int, default=100, help="0: no snapshots")
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--dir", type=Path, help="where the swap directory is made (removed after)")
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="long-run-") as root:
        rows = run(args, Path(root))
    warmup = max(1, len(rows) // 5)
    grew = growth(rows, warmup, rss_slack_nbytes=8 * MiB, file_slack_nbytes=256 << 10)  # type: ignore[arg-type]
    doc = {"steps": args.steps, "every": args.every, "hidden": args.hidden, "rows": rows}
    doc |= {"snapshot_every": args.snapshot_every, "keep_last": args.keep_last, "grew": grew}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    if args.plot:
        plot(rows, args.plot)
    first, last = rows[warmup], rows[-1]
    for name in ("fds", "os_threads", "locked_bytes", "rss_bytes", "swap_files", "swap_disk_bytes"):
        print(f"{name}: {first[name]:.0f} at step {first['step']:.0f} -> {last[name]:.0f}")
    print(f"journal_bytes at the end: {last['journal_bytes']:.0f}")
    print("grew after warm-up: " + (json.dumps(grew) if grew else "nothing"))
    return 1 if grew else 0


if __name__ == "__main__":
    sys.exit(main())
