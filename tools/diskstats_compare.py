"""No hidden write amplification (issue 29): the manager's count against the block device.

Trains a small MLP (``--hidden``) offloaded with its optimizer state on NVMe in ``--dir``
for ``--steps`` steps, and compares the bytes the manager says it wrote
(``stats().nvme_written_nbytes``: tensors and the store's metadata) with the sectors the
block device under ``--dir`` received (``/proc/diskstats``, field 10, 512-byte sectors),
over the same window: both read after ``os.sync()`` once the store is set up, and again
after the steps and a ``flush()`` and ``os.sync()``.

    python tools/diskstats_compare.py --dir /tmp/ds --steps 100 --hidden 2048 --json ds.json

The device's count includes everything else that wrote to it meanwhile and the
filesystem's own writes (its journal, inode and extent updates). On a shared disk the
others' writes swamp it (11x on the development VM with five other engineers); give the
swap directory a device of its own, e.g. a loop-mounted ext4 image (root):

    truncate -s 3G /tmp/ds.img && mkfs.ext4 -q -F /tmp/ds.img
    mkdir -p /tmp/ds && mount "$(losetup -f --show /tmp/ds.img)" /tmp/ds && chmod 700 /tmp/ds

(``umount /tmp/ds; losetup -d /dev/loopN`` after). Exit status 1 when the two differ by
more than ``--tolerance`` (default 3 %).

``--pressure "ARGS"`` measures a ``swapper-pressure`` run instead (its own budgets, model
and optimizer; ARGS are extra flags, e.g. ``"--params 2M --write-budget 10TB/day"``): it
runs ``swapper-pressure --dir DIR --json ...`` for ``--steps-lo`` and ``--steps`` steps,
alternating, ``--rounds`` times each, reading the device's sectors around each process
(after ``os.sync()``). The run's JSON gives the manager's bytes per step by kind (checked:
``nvme_written_bytes_per_step`` is their sum); what the setup and the close write (the
model's first placement, the final flush) is the same in both lengths and cancels in the
difference, so the figure compared is (device bytes, long run − short run) against
(counted bytes per step × steps, long − short), medians over the rounds::

    python tools/diskstats_compare.py --dir /tmp/ds --pressure "--params 2M" \
        --steps-lo 4 --steps 16 --rounds 3 --json ds_pressure.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig


def device_of(path: Path) -> str:
    """The ``/proc/diskstats`` name of the block device holding ``path`` (its partition
    when it is on one)."""
    st = os.stat(path)
    link = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    return link.resolve().name


def sectors_written(device: str) -> int:
    """Sectors (512 B) written to ``device`` since boot (``/proc/diskstats`` field 10)."""
    for line in Path("/proc/diskstats").read_text().splitlines():
        fields = line.split()
        if fields[2] == device:
            return int(fields[9])
    raise KeyError(f"no {device!r} in /proc/diskstats")


def pressure_run(args: argparse.Namespace, device: str, steps: int) -> dict[str, Any]:
    """One ``swapper-pressure`` process of ``steps`` steps swapping to ``args.dir``: the
    device's bytes received around it, the manager's count from its JSON.

    Raises:
        RuntimeError: the run failed, or its per-step figure is not the sum of its kinds.
    """
    with tempfile.TemporaryDirectory(prefix="ds-pressure-") as scratch:
        out = Path(scratch, "run.json")
        command = [sys.executable, "-m", "swapper.pressure", "--dir", str(args.dir)]
        command += ["--steps", str(steps), "--json", str(out), *shlex.split(args.pressure)]
        os.sync()
        sectors0 = sectors_written(device)
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
        os.sync()
        sectors1 = sectors_written(device)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed:\n{done.stdout}\n{done.stderr}")
        doc = json.loads(out.read_text())
    by_kind: dict[str, float] = doc["nvme_written_bytes_per_step_by_kind"]
    per_step = float(doc["nvme_written_bytes_per_step"])
    if abs(per_step - sum(by_kind.values())) > 1e-6 * max(1.0, per_step):
        raise RuntimeError(f"per step {per_step} is not the sum of the kinds {by_kind}")
    steps_run = len(doc["losses"])
    return {
        "steps": steps_run,
        "seconds": seconds,
        "device_bytes": (sectors1 - sectors0) * 512,
        "counted_bytes": per_step * steps_run,
        "counted_per_step": per_step,
        "counted_per_step_by_kind": by_kind,
        "identical": doc.get("identical"),
    }


def compare_pressure(args: argparse.Namespace, device: str) -> int:
    """``--pressure``: short and long runs, alternating; the difference compared."""
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        lo = pressure_run(args, device, args.steps_lo)
        hi = pressure_run(args, device, args.steps)
        counted = hi["counted_bytes"] - lo["counted_bytes"]
        received = hi["device_bytes"] - lo["device_bytes"]
        row = {"short": lo, "long": hi, "counted_bytes": counted, "device_bytes": received}
        row["device_over_counted"] = received / counted if counted else float("nan")
        rounds.append(row)
        print(
            f"round {i + 1}: {hi['steps'] - lo['steps']} steps: counted {counted:,.0f} B, "
            f"received {received:,} B, device/counted {row['device_over_counted']:.4f} "
            f"(whole runs: {lo['device_bytes'] / lo['counted_bytes']:.3f}, "
            f"{hi['device_bytes'] / hi['counted_bytes']:.3f})",
            flush=True,
        )
    ratio = statistics.median(r["device_over_counted"] for r in rounds)
    doc = {"device": device, "pressure_args": args.pressure, "rounds": rounds}
    doc |= {"steps_lo": args.steps_lo, "steps": args.steps, "device_over_counted": ratio}
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    ok = abs(ratio - 1) <= args.tolerance
    spread = [r["device_over_counted"] for r in rounds]
    print(
        f"device/counted = {ratio:.4f} (median of {len(rounds)}; "
        f"{min(spread):.4f}-{max(spread):.4f}) ({'within' if ok else 'outside'} "
        f"{args.tolerance:.0%})"
    )
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tolerance", type=float, default=0.03)
    p.add_argument("--json", type=Path)
    p.add_argument("--pressure", metavar="ARGS", help="measure swapper-pressure runs instead")
    p.add_argument("--steps-lo", type=int, default=4, help="--pressure: the short run's steps")
    p.add_argument("--rounds", type=int, default=3, help="--pressure: short/long pairs")
    args = p.parse_args()
    device = device_of(args.dir)
    if args.pressure is not None:
        return compare_pressure(args, device)
    torch.manual_seed(0)
    h = args.hidden
    model = nn.Sequential(nn.Linear(64, h), nn.GELU(), nn.Linear(h, 64)).to(torch.bfloat16)
    numel = sum(q.numel() for q in model.parameters())
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="diskstats-") as root:
        config = OffloadConfig.create(
            device_nbytes=None,
            host_nbytes=max(1 << 20, numel * 4),  # most of the 12 B/param of state on NVMe
            nvme_dirs=[Path(root) / "nvme"],
            device="cpu",
            step=StepConfig(sub_group_numel=max(4096, numel // 16)),
        )
        x = torch.randn(8, 64).to(torch.bfloat16)
        with (
            swapper.OffloadedModel(model, config) as wrapped,
            OffloadAdamW(wrapped.parameters(), lr=1e-3, tiers=wrapped) as opt,
        ):
            wrapped.manager.flush()
            os.sync()
            counted0, sectors0 = wrapped.stats().nvme_written(), sectors_written(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                wrapped(x).float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            wrapped.manager.flush()
            os.sync()
            counted1, sectors1 = wrapped.stats().nvme_written(), sectors_written(device)
            seconds = time.perf_counter() - t0
    by_kind = {k: counted1[k] - counted0.get(k, 0) for k in counted1}
    counted = sum(by_kind.values())
    device_nbytes = (sectors1 - sectors0) * 512
    ratio = device_nbytes / counted if counted else float("nan")
    doc = {
        "device": device,
        "params": numel,
        "steps": args.steps,
        "seconds": seconds,
        "counted_bytes": counted,
        "counted_by_kind": by_kind,
        "device_bytes": device_nbytes,
        "device_over_counted": ratio,
    }
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))
    ok = abs(ratio - 1) <= args.tolerance
    print(f"device/counted = {ratio:.4f} ({'within' if ok else 'outside'} {args.tolerance:.0%})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
