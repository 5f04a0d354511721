"""Export throughput against the disk: ``swapper-bench disk``'s write figure and the
Distributed Checkpoint export's bytes per second, measured in one run on one directory.

Each round runs ``swapper-bench disk --op write`` (its default AIO settings, O_DIRECT,
no baselines) on ``--dir``, then :func:`swapper.zero.checkpoint.dcp_export.export_dcp` of a GPT
of about ``--params`` parameters and its :class:`~swapper.OffloadAdamW` (14 bytes per
parameter: bf16 weights and three fp32 state rows) into a fresh directory under
``--dir``, timed up to ``save`` returning (files fsync'd, metadata written). The
export's figure is the checkpoint's bytes on disk over that time; the ratio is export /
disk of the same round, and the median over rounds is printed (goal: >= 0.8). Each
round also writes ``--disk-size`` bytes into a new file with the same engine settings
(:func:`new_file_write_gbps`): what any export, which creates its files, can reach.

``--state host`` keeps the training state in host memory (the export only writes);
``--state nvme`` puts it on NVMe in the same directory under budgets too small to hold
it (the export then reads every byte it writes from the same disk). A progress line
(bytes, percent, MB/s, on stderr) is printed during each export, about once a second.

    python tools/export_bench.py --dir /mnt/nvme --params 100M --rounds 3 --state host

Round 1 also pays what a process pays once (importing torch.distributed.checkpoint,
the archive templates): the median over rounds is the steady figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig
from swapper.bench import main as bench_main
from swapper.cli_args import size_arg
from swapper.pressure.model import GPT, GPTConfig, init_weights_
from swapper.zero.checkpoint.dcp_export import export_dcp
from tiers.aio import AioEngine
from tiers.buffers import allocate
from tiers.config import AioConfig


def disk_write_gbps(directory: Path, size: int, work: Path) -> float:
    """``swapper-bench disk --op write`` on ``directory``: its write figure (GB/s)."""
    out = work / "disk.json"
    argv = ["disk", "--dir", str(directory), "--size", str(size), "--op", "write"]
    argv += ["--no-baselines", "--json", str(out)]
    code = bench_main(argv)
    if code != 0:
        raise SystemExit(f"swapper-bench disk exited {code}")
    records = json.loads(out.read_text())["results"]
    writes = [r for r in records if r["op"] == "write"]
    return float(writes[0]["gbps"])


def new_file_write_gbps(directory: Path, size: int) -> float:
    """The same engine settings as ``swapper-bench disk`` (8 MiB requests, 32 in flight,
    O_DIRECT, timed to ``fsync``) writing ``size`` bytes into a *new* file, as an export
    must: ``swapper-bench``'s timed passes overwrite a file its warm-up wrote, which
    ext4 takes faster than new blocks (no allocation, no unwritten-extent conversion)."""
    path = directory / "new-file-write.bin"
    buffer = allocate(size)
    engine = AioEngine(AioConfig(block_size=8 << 20, queue_depth=32))
    try:
        buffer.tensor.fill_(0x5A)  # (faulted in before the clock starts)
        path.unlink(missing_ok=True)
        start = time.perf_counter()
        file = engine.open(path, create=True)
        try:
            step = 16 << 20
            futures = [engine.pwrite(buffer.tensor[i : i + step], file, i)
                       for i in range(0, size, step)]  # fmt: skip
            for future in futures:
                future.result()
            os.fsync(file.fd)
        finally:
            file.close()
        return size / (time.perf_counter() - start) / 1e9
    finally:
        engine.close()
        buffer.close()
        path.unlink(missing_ok=True)


class Progress:
    """``progress(done, total)`` for the export: one line on stderr, about once a second."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now - self.last < 1.0 and done < total:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9) / 1e6
        tty = sys.stderr.isatty()  # one line rewritten on a terminal, else a line each
        print(
            f"{chr(13) if tty else ''}export: {done / 1e6:,.0f} / {total / 1e6:,.0f} MB "
            f"({100 * done / total:.0f}%) {rate:,.0f} MB/s",
            end="\n" if done >= total or not tty else "",
            file=sys.stderr,
            flush=True,
        )


def _config(work: Path, state: str, n_params: int) -> OffloadConfig:
    if state == "host":
        return OffloadConfig.create(device="cpu", nvme_dirs=[work / "swap"],
                                    step=StepConfig(sub_group_numel=8 << 20))  # fmt: skip
    # a quarter of the 16-bit weights on the device, an eighth of the state on the host:
    # the rest lives on NVMe, and the export reads it back from there
    return OffloadConfig.create(
        device="cpu",
        nvme_dirs=[work / "swap"],
        device_nbytes=max(2 * n_params // 4, 64 << 20),
        host_nbytes=max(12 * n_params // 8, 256 << 20),
        step=StepConfig(sub_group_numel=8 << 20),
    )


def loadavg() -> float:
    """The 1-minute load average (other processes competing for the CPUs and the disk)."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def export_once(work: Path, model: Any, optimizer: OffloadAdamW, round_: int) -> tuple[int, float]:
    """(bytes on disk, seconds) of one export into a fresh directory (removed after)."""
    target = work / f"export{round_}"
    progress = Progress()
    start = time.perf_counter()
    export_dcp(model, target, optimizer, progress=progress)
    seconds = time.perf_counter() - start
    nbytes = sum(f.stat().st_size for f in target.iterdir())
    shutil.rmtree(target)
    return nbytes, seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, required=True, help="the disk's directory")
    p.add_argument("--params", type=size_arg, default=100_000_000, help="model size (elements)")
    p.add_argument("--disk-size", type=size_arg, default=1 << 30, help="swapper-bench --size")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--state", choices=("host", "nvme"), default="host")
    p.add_argument("--json", type=Path, help="write the figures as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = Path(tempfile.mkdtemp(prefix="swapper-export-bench-", dir=args.dir))
    rows: list[dict[str, float]] = []
    try:
        config = GPTConfig.for_params(args.params, vocab_size=32_000, context=512)
        gpt = GPT(config).to(torch.bfloat16)
        init_weights_(gpt, seed=0)
        n = sum(q.numel() for q in gpt.parameters())
        print(f"model: {n / 1e6:.1f} M parameters ({config}); state: {args.state}", flush=True)
        with (
            swapper.offload(gpt, _config(work, args.state, n)) as model,
            OffloadAdamW(model.parameters(), lr=1e-4, tiers=model) as optimizer,
        ):
            for r in range(args.rounds):
                disk = disk_write_gbps(args.dir, args.disk_size, work)
                fresh = new_file_write_gbps(work, args.disk_size)
                nbytes, seconds = export_once(work, model, optimizer, r)
                gbps = nbytes / seconds / 1e9
                load = loadavg()
                rows.append({"disk_write_gbps": disk, "new_file_write_gbps": fresh,
                             "ratio_to_new_file": gbps / fresh, "export_gbps": gbps,
                             "export_nbytes": nbytes, "export_seconds": seconds,
                             "ratio": gbps / disk, "loadavg_1min": load})  # fmt: skip
                print(
                    f"round {r + 1}: disk write {disk:.2f} GB/s (new file {fresh:.2f}), export "
                    f"{nbytes / 1e9:.2f} GB in {seconds:.2f} s = {gbps:.2f} GB/s, ratio "
                    f"{gbps / disk:.2f} (to a new file's {gbps / fresh:.2f}) (load {load:.1f})",
                    flush=True,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = statistics.median(r["ratio"] for r in rows)
    fresh_ratio = statistics.median(r["ratio_to_new_file"] for r in rows)
    print(f"median ratio export / disk write: {ratio:.2f} (goal >= 0.8); "
          f"export / new-file write: {fresh_ratio:.2f}")  # fmt: skip
    if args.json is not None:
        summary = {"rounds": rows, "median_ratio": ratio, "median_ratio_to_new_file": fresh_ratio}
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
