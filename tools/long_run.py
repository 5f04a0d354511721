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

With ``--nproc N`` (N > 1) the same loop runs on N ranks (gloo, spawned here, every
collective under a 120 s timeout): the model is a :class:`~swapper.zero.ShardedModel`, each
rank samples its own process and its store's directory (``<nvme>/rank{r}ofN``), rank 0 also
the shared directory (the snapshots' commit records), and the JSON holds every rank's rows
(the plot a line per rank)::

    python tools/long_run.py --nproc 2 --steps 500 --snapshot-every 50 --dir /tmp/lr2 \
        --json long500x2.json --plot long500x2.png

The short form is ``tests/test_leaks.py`` (200 steps). Exit status 1 when something grew.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.spawn import spawn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig
from swapper.pressure.growth import growth, sample
from swapper.zero import save_snapshot
from swapper.zero.config.distributed import DistributedConfig

MiB = 1 << 20
#: The longest any collective (and the process group's rendezvous) is waited on, seconds.
TIMEOUT_S = 120.0


def _shared_sample(shared: Path) -> dict[str, int]:
    """Files directly in the swap root beside the ranks' stores (commit records): count, bytes."""
    files = [e for e in os.scandir(shared) if e.is_file(follow_symlinks=False)]
    return {
        "shared_files": len(files),
        "shared_file_bytes": sum(e.stat(follow_symlinks=False).st_size for e in files),
    }


def run(
    args: argparse.Namespace, swap_root: Path, rank: int = 0, world: int = 1
) -> list[dict[str, float]]:
    """Train ``args.steps`` steps on this rank (``world`` > 1: sharded over the group made
    by the caller); the sampled rows."""
    torch.manual_seed(0)
    h = args.hidden
    model = nn.Sequential(nn.Linear(64, h), nn.GELU(), nn.Linear(h, 64)).to(torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters()) // world
    config = OffloadConfig.create(
        # about the largest layer's parameters (several ranks: its gathered buffer, the
        # all_gather staging and this rank's shards of it, the floor ShardedModel checks)
        device_nbytes=(64 * h + h) * 2 * (3 if world > 1 else 1) + 4096,
        host_nbytes=max(64 * 1024, numel * 8),  # < 2+2+12 B/param: the rest on NVMe
        nvme_dirs=[swap_root / "nvme"],
        device="cpu",
        step=StepConfig(sub_group_numel=max(1024, numel // 8)),
        distributed=DistributedConfig(timeout_s=TIMEOUT_S),
    )
    store_dir = swap_root / "nvme" / (f"rank{rank}of{world}" if world > 1 else "")
    torch.manual_seed(1 + rank)  # each rank its own batch
    x = torch.randn(8, 64).to(torch.bfloat16)
    rows: list[dict[str, float]] = []
    start = time.perf_counter()
    group = dist.group.WORLD if world > 1 else None
    with (
        swapper.offload(model, config, group) as wrapped,
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
                row.update(sample(store_dir, host))
                if world > 1:
                    row.update(_shared_sample(swap_root / "nvme"))
                rows.append(row)
                if step % (args.every * 20) == 0:
                    print(f"rank {rank} step {step}: {json.dumps(row)}", flush=True)
    return rows


def _rank(rank: int, world: int, root: str, args: argparse.Namespace) -> None:
    """One spawned rank: train, then rank 0 writes every rank's rows to ``root/rows.json``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    try:
        rows = run(args, Path(root, "swap"), rank, world)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, rows)
        if rank == 0:
            Path(root, "rows.json").write_text(json.dumps(everyone))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(args: argparse.Namespace, root: Path) -> list[list[dict[str, float]]]:
    """Every rank's rows from ``args.nproc`` spawned ranks."""
    spawn(_rank, args=(args.nproc, str(root), args), nprocs=args.nproc)
    return json.loads(Path(root, "rows.json").read_text())


def plot(ranks: list[list[dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        for i, rows in enumerate(ranks):
            label = f"rank {i}" if len(ranks) > 1 else None
            ax.plot([r["step"] for r in rows], [r[name] / scale for r in rows], label=label)
        if len(ranks) > 1:
            ax.legend()
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
    p.add_argument("--nproc", type=int, default=1, help="ranks (gloo, spawned here)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="long-run-") as root:
        os.chmod(root, 0o700)
        ranks = [run(args, Path(root))] if args.nproc == 1 else run_ranks(args, Path(root))
    warmup = max(1, len(ranks[0]) // 5)
    shared = ("shared_files", "shared_file_bytes")
    grew_by_rank = []
    for rows in ranks:
        grew = growth(rows, warmup, rss_slack_nbytes=8 * MiB, file_slack_nbytes=256 << 10)  # type: ignore[arg-type]
        # Commit records: kept as configured (their JSON grows a byte as the step gains a digit)
        for name, slack in zip(shared, (0, 64), strict=True) if args.nproc > 1 else ():
            more = max(r[name] for r in rows[warmup:]) - max(r[name] for r in rows[:warmup])
            if more > slack:
                grew[name] = int(more)
        grew_by_rank.append(grew)
    doc: dict[str, Any] = {"steps": args.steps, "every": args.every, "hidden": args.hidden}
    doc |= {"snapshot_every": args.snapshot_every, "keep_last": args.keep_last}
    if args.nproc == 1:
        doc |= {"rows": ranks[0], "grew": grew_by_rank[0]}
    else:
        doc |= {"nproc": args.nproc, "ranks": ranks, "grew": grew_by_rank}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    if args.plot:
        plot(ranks, args.plot)
    names = ["fds", "os_threads", "locked_bytes", "rss_bytes", "swap_files", "swap_disk_bytes"]
    for i, (rows, grew) in enumerate(zip(ranks, grew_by_rank, strict=True)):
        first, last = rows[warmup], rows[-1]
        head = f"rank {i} " if args.nproc > 1 else ""
        for name in names + (list(shared) if args.nproc > 1 else []):
            at = f"at step {first['step']:.0f}"
            print(f"{head}{name}: {first[name]:.0f} {at} -> {last[name]:.0f}")
        print(f"{head}journal_bytes at the end: {last['journal_bytes']:.0f}")
        print(f"{head}grew after warm-up: " + (json.dumps(grew) if grew else "nothing"))
    return 1 if any(grew_by_rank) else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
