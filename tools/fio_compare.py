#!/usr/bin/env python3
"""Run fio and ``swapper-bench disk`` alternately in one directory and print the ratios.

For each (block size, queue depth) the script runs, ``--pairs`` times and in ABBA order so
that drift in a noisy shared disk cancels out:

* fio, libaio, O_DIRECT, with each buffer memory type in ``--fio-mem`` (default
  ``shmhuge``, its fastest here, and ``malloc``, its default);
* ``swapper-bench disk`` in the same directory with the same size, block size, queue
  depth, one thread, O_DIRECT (it writes and removes its own file there; fio's file is
  rewritten by fio's write job just the same).

It prints the median GB/s (GB = 10^9 bytes) of each, swapper's ratio to fio's best memory
type, and CPU seconds per GB moved for both. ``shmhuge`` needs reserved huge pages: the
script raises ``/proc/sys/vm/nr_hugepages`` as far as needed (root only) and restores it
on exit, Ctrl-C included.

Example (the command behind docs/benchmarks.md)::

    python tools/fio_compare.py --dir /tmp --size 2GiB --pairs 3 --json fio_compare.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tiers.units import format_size, parse_size

HUGEPAGE_NBYTES = 2 << 20
NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")


@dataclass
class Sample:
    tool: str  # "fio-shmhuge", "fio-malloc", "swapper"
    op: str
    block_size: int
    queue_depth: int
    gbps: float
    cpu_seconds_per_gb: float


@dataclass
class Row:
    op: str
    block_size: int
    queue_depth: int
    gbps: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)

    def add(self, sample: Sample) -> None:
        self.gbps.setdefault(sample.tool, []).append(sample.gbps)
        self.cpu.setdefault(sample.tool, []).append(sample.cpu_seconds_per_gb)

    def median(self, tool: str) -> float:
        return statistics.median(self.gbps[tool])

    def best_fio(self) -> tuple[str, float]:
        fio = {t: self.median(t) for t in self.gbps if t.startswith("fio-")}
        tool = max(fio, key=fio.__getitem__)
        return tool, fio[tool]


def run_fio(
    path: Path, op: str, nbytes: int, block_size: int, queue_depth: int, mem: str
) -> Sample:
    """One fio job; returns its throughput and CPU seconds per GB."""
    cmd = [
        "fio", "--name=cmp", f"--filename={path}", f"--size={nbytes}", f"--bs={block_size}",
        f"--iodepth={queue_depth}", "--ioengine=libaio", "--direct=1", f"--rw={op}",
        f"--mem={mem}", "--numjobs=1", "--output-format=json",
    ]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    stats = job[op]
    seconds = stats["runtime"] / 1000.0
    moved_gb = stats["io_bytes"] / 1e9
    cpu_seconds = (job["usr_cpu"] + job["sys_cpu"]) / 100.0 * seconds
    return Sample(
        f"fio-{mem}", op, block_size, queue_depth, stats["bw_bytes"] / 1e9, cpu_seconds / moved_gb
    )


def run_swapper(
    workdir: Path, ops: list[str], nbytes: int, block_size: int, queue_depth: int
) -> list[Sample]:
    """One ``swapper-bench disk`` run in the same directory with the same settings.

    swapper-bench makes (and removes) its own file beside fio's: same filesystem, same
    size, written fresh each run just as fio's file is rewritten by its write job.
    """
    op = ops[0] if len(ops) == 1 else "both"
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [
            sys.executable, "-m", "swapper.bench", "disk", "--dir", str(workdir),
            "--size", str(nbytes), "--op", op, "--block-size", str(block_size),
            "--queue-depth", str(queue_depth), "--threads", "1", "--backend", "libaio",
            "--direct", "--loops", "1", "--warmup", "1", "--no-baselines", "--json", out.name,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        records = json.loads(Path(out.name).read_text())["results"]
    return [
        Sample("swapper", r["op"], block_size, queue_depth, r["gbps"], r["cpu_seconds_per_gb"])
        for r in records
    ]


@contextlib.contextmanager
def hugepages(nbytes: int) -> Iterator[bool]:
    """Reserve enough 2 MiB huge pages for fio's shmhuge buffer; restore the count after."""
    try:
        before = int(NR_HUGEPAGES.read_text())
    except OSError:
        yield False
        return
    wanted = -(-nbytes // HUGEPAGE_NBYTES) + 8
    try:
        if before < wanted:
            NR_HUGEPAGES.write_text(str(wanted))
        ok = int(NR_HUGEPAGES.read_text()) >= wanted
    except OSError:
        ok = False
    try:
        yield ok
    finally:
        with contextlib.suppress(OSError):
            NR_HUGEPAGES.write_text(str(before))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dir", default=".", help="directory for the test file (default: .)")
    parser.add_argument("--size", default="2GiB", help="file size (default 2GiB)")
    parser.add_argument("--settings", default="1MiB:32,8MiB:32", help="bs:qd list")
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs (default 3)")
    parser.add_argument("--op", choices=["read", "write", "both"], default="both")
    parser.add_argument("--fio-mem", default="shmhuge,malloc", help="fio --mem types")
    parser.add_argument("--json", help="write all samples and the summary here")
    args = parser.parse_args(argv)
    if shutil.which("fio") is None:
        parser.error("fio is not installed (Debian: apt-get install fio)")
    nbytes = parse_size(args.size)
    settings = []
    for item in args.settings.split(","):
        bs, qd = item.split(":")
        settings.append((parse_size(bs), int(qd)))
    ops = ["write", "read"] if args.op == "both" else [args.op]
    mems = args.fio_mem.split(",")
    max_buffer = max(bs * qd for bs, qd in settings)

    workdir = Path(tempfile.mkdtemp(prefix="swapper-fio-", dir=args.dir))
    path = workdir / "cmp.bin"
    rows: dict[tuple[str, int, int], Row] = {}
    samples: list[Sample] = []
    try:
        with hugepages(max_buffer) as have_hugepages:
            if "shmhuge" in mems and not have_hugepages:
                print(
                    "no huge pages could be reserved: dropping fio --mem=shmhuge", file=sys.stderr
                )
                mems = [m for m in mems if m != "shmhuge"]
            for bs, qd in settings:
                for pair in range(args.pairs):
                    # ABBA: swapper first on odd pairs so drift does not favour one side.
                    runners = [
                        functools.partial(run_fio, path, op, nbytes, bs, qd, m)
                        for m in mems
                        for op in ops
                    ]
                    runners.append(functools.partial(run_swapper, workdir, ops, nbytes, bs, qd))
                    if pair % 2:
                        runners.reverse()
                    for runner in runners:
                        got = runner()
                        for sample in got if isinstance(got, list) else [got]:
                            samples.append(sample)
                            key = (sample.op, bs, qd)
                            rows.setdefault(key, Row(sample.op, bs, qd)).add(sample)
                            print(
                                f"  pair {pair + 1} {sample.op:5} bs {format_size(bs):>5} "
                                f"qd {qd:>3} {sample.tool:12} {sample.gbps:6.2f} GB/s",
                                file=sys.stderr,
                            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"\nfio vs swapper-bench, {format_size(nbytes)} file, O_DIRECT, libaio, 1 thread, "
        f"median of {args.pairs} alternating pairs (GB = 1e9 B)"
    )
    tools = [*[f"fio-{m}" for m in mems], "swapper"]
    header = f"{'op':5} {'bs':>5} {'qd':>3} " + " ".join(f"{t:>12}" for t in tools)
    print(header + f" {'ratio':>6} {'CPU s/GB fio':>12} {'swapper':>8}")
    summary = []
    for (op, bs, qd), row in rows.items():
        best_tool, best = row.best_fio()
        ratio = row.median("swapper") / best
        cells = " ".join(f"{row.median(t):12.2f}" for t in tools)
        cpu_fio = statistics.median(row.cpu[best_tool])
        cpu_sw = statistics.median(row.cpu["swapper"])
        print(
            f"{op:5} {format_size(bs):>5} {qd:>3} {cells} {ratio:6.2f} "
            f"{cpu_fio:12.3f} {cpu_sw:8.3f}"
        )
        summary.append(
            {
                "op": op,
                "block_size": bs,
                "queue_depth": qd,
                "fio_best": best_tool,
                "fio_gbps": best,
                "swapper_gbps": row.median("swapper"),
                "ratio": ratio,
                "fio_cpu_seconds_per_gb": cpu_fio,
                "swapper_cpu_seconds_per_gb": cpu_sw,
            }
        )
    print("ratio = swapper median / best fio median")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": [asdict(s) for s in samples], "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
