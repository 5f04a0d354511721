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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

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


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--tolerance", type=float, default=0.03)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    device = device_of(args.dir)
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
