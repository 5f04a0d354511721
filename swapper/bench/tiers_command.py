"""``swapper-bench tiers``: evict and fetch tensors through the tier manager, next to raw disk.

One run measures, in the same directories and with the same I/O settings:

1. the raw disk (``disk``'s O_DIRECT pass: one request per file, one file per directory), and
2. the :class:`~swapper.manager.TierManager`: a set of bf16 tensors (sizes drawn between
   ``--tensor-min`` and ``--tensor-max``, ``--size`` in all) registered in the host tier,
   then, per pass, all evicted to NVMe at once (write-behind; timed until every future
   is done, i.e. every byte durable) and all fetched back (read-ahead of every key, then
   ``fetch`` in order; timed until the last is in host memory).

alternating within every pass (raw write, evict, raw read, fetch) so that the shared
disk's changes of speed hit both alike, and prints the manager's GB/s beside the raw
figure (evict against write, fetch against read) with their ratio. The first manager
pass also checks every tensor's bytes (a content hash) after the fetch; timed passes do
not.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import swapper
from swapper.bench.args import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LOOPS,
    DEFAULT_QUEUE_DEPTH,
    DEFAULT_TENSOR_MAX_NBYTES,
    DEFAULT_TENSOR_MIN_NBYTES,
    DEFAULT_THREADS,
    DEFAULT_TIERS_SIZE_NBYTES,
    DEFAULT_TIERS_WARMUP,
    PROG,
)
from swapper.bench.checks import (
    check_backends,
    check_dirs,
    check_free_space,
    check_memory,
)
from swapper.bench.disk import (
    ENGINE_SWAPPER,
    BenchError,
    Measurement,
    Setting,
    Workspace,
    _engine_pass,
    cpu_seconds,
    fill_random,
    split_nbytes,
)
from swapper.cli_args import (
    GB,
    GIB,
    UsageError,
    aio_environment,
    check_output_path,
    gib_per_s,
    table,
    write_json,
)
from swapper.manager import Kind, ManagerConfig, Tier, TierManager
from tiers.aio import AioEngine
from tiers.buffers import allocate
from tiers.config import DIRECT_ALIGNMENT, AioConfig, Backend
from tiers.nvme import content_hash
from tiers.units import format_size

COMMAND = "tiers"
_ELEMENT_NBYTES = 2  # bf16


@dataclasses.dataclass(frozen=True, kw_only=True)
class TiersPlan:
    """Everything one ``tiers`` run will do, checked before any file is made."""

    dirs: list[Path]
    total_nbytes: int
    tensor_nbytes: list[int]
    setting: Setting
    loops: int
    warmup: int
    checksum: bool
    verify: bool = True


@dataclasses.dataclass(kw_only=True)
class TiersMeasurement:
    """One manager operation's timed passes, with the raw disk's taken alongside."""

    manager: Measurement  #: op "evict" or "fetch", engine "manager"
    disk: Measurement  #: op "write" or "read", the raw O_DIRECT passes

    @property
    def ratio(self) -> float:
        return self.manager.gbps / self.disk.gbps

    def to_record(self, plan: TiersPlan) -> dict[str, Any]:
        """``disk``'s record schema for the manager side, plus the raw figure beside it."""
        return {
            **self.manager.to_record(),
            "disk_gbps": self.disk.gbps,
            "disk_op": self.disk.op,
            "disk_cpu_seconds_per_gb": self.disk.cpu_seconds_per_gb,
            "ratio": self.ratio,
            "tensors": len(plan.tensor_nbytes),
            "checksum": plan.checksum,
            "verify": plan.verify and plan.checksum,
        }


def build_plan(args: argparse.Namespace) -> TiersPlan:
    """Check the arguments and draw the tensor sizes.

    Raises:
        UsageError: an argument cannot work here; the message names it.
    """
    dirs = check_dirs(args.dirs)
    total = DEFAULT_TIERS_SIZE_NBYTES if args.size is None else args.size
    low = DEFAULT_TENSOR_MIN_NBYTES if args.tensor_min is None else args.tensor_min
    high = DEFAULT_TENSOR_MAX_NBYTES if args.tensor_max is None else args.tensor_max
    if not 0 < low <= high:
        raise UsageError(f"--tensor-min {low} and --tensor-max {high}: need 0 < min <= max")
    if total < low:
        raise UsageError(f"--size {format_size(total)} is smaller than --tensor-min")
    # flags over SWAPPER_AIO_* over the defaults; the manager always uses O_DIRECT here
    env = aio_environment()
    backend = check_backends([args.backend or env.get("backend", Backend.AUTO)])[0]
    setting = Setting(
        engine=ENGINE_SWAPPER,
        backend=backend,
        block_size=args.block_size or env.get("block_size", DEFAULT_BLOCK_SIZE),
        queue_depth=args.queue_depth or env.get("queue_depth", DEFAULT_QUEUE_DEPTH),
        threads=args.threads or env.get("num_threads", DEFAULT_THREADS),
        direct=True,
        single_submit=env.get("single_submit", AioConfig.single_submit),
        close_timeout_s=env.get("close_timeout_s", AioConfig.close_timeout_s),
    )
    if setting.block_size % DIRECT_ALIGNMENT:
        raise UsageError(f"--block-size must be a multiple of {DIRECT_ALIGNMENT}")
    check_output_path("--json", args.json)
    sizes = _draw_sizes(total, low, high, random.Random(args.seed))
    # The raw disk run and the manager each hold the whole size in host memory.
    check_memory(2 * total)
    check_free_space(dirs, 2 * split_nbytes(total, len(dirs)) + high)
    return TiersPlan(
        dirs=dirs,
        total_nbytes=sum(sizes),
        tensor_nbytes=sizes,
        setting=setting,
        loops=args.loops or DEFAULT_LOOPS,
        warmup=DEFAULT_TIERS_WARMUP if args.warmup is None else args.warmup,
        checksum=args.checksum,
        verify=args.verify,
    )


def _draw_sizes(total: int, low: int, high: int, rng: random.Random) -> list[int]:
    """Tensor sizes in [low, high] (whole bf16 elements) adding up to about ``total``."""
    sizes: list[int] = []
    left = total
    while left >= low:
        n = min(left, rng.randint(low, high))
        n -= n % _ELEMENT_NBYTES
        sizes.append(n)
        left -= n
    return sizes


@dataclasses.dataclass
class _Passes:
    """Seconds and CPU seconds of the timed passes of one operation."""

    seconds: list[float] = dataclasses.field(default_factory=list)
    cpu_seconds: float = 0.0


def _timed(run: Callable[[], float]) -> tuple[float, float]:
    """(seconds the pass reports, CPU seconds of the process meanwhile)."""
    cpu_start = cpu_seconds()
    elapsed = run()
    return elapsed, cpu_seconds() - cpu_start


def _evict_all(manager: TierManager, keys: list[str]) -> float:
    """Evict every key to NVMe at once; seconds until all are durable."""
    start = time.perf_counter()
    for future in [manager.evict(k, Tier.NVME) for k in keys]:
        future.result()
    return time.perf_counter() - start


def _fetch_all(manager: TierManager, keys: list[str], hashes: dict[str, int] | None) -> float:
    """Read every key ahead, then fetch in order; seconds until the last is in host memory.

    With ``hashes``, every tensor's bytes are checked (after the clock stops). All keys
    are released as modified, so the next eviction writes them again.
    """
    start = time.perf_counter()
    manager.prefetch(keys, Tier.HOST)
    fetched = [manager.fetch(k, Tier.HOST) for k in keys]
    seconds = time.perf_counter() - start
    if hashes is not None:
        for key, tensor in zip(keys, fetched, strict=True):
            if content_hash(tensor) != hashes[key]:
                raise BenchError(f"key={key!r} came back from NVMe with other bytes")
    del fetched
    for k in keys:
        manager.release(k, modified=True)
    return seconds


def _timed_passes(
    plan: TiersPlan, workspace: Workspace, say: Callable[[str], None]
) -> tuple[dict[str, _Passes], str, bool]:
    """Warm-up and timed passes, raw disk and manager alternating in every pass.

    Per pass: raw write, manager evict, raw read, manager fetch, so that a change in the
    shared disk's speed during the run hits both sides alike. Returns the passes per
    operation (write, evict, read, fetch), the raw passes' backend and whether they
    really used O_DIRECT.
    """
    config = ManagerConfig(
        device_nbytes=0,
        host_nbytes=None,
        nvme_dirs=list(workspace.tmpdirs),
        aio=plan.setting.aio_config(),
        placement={Kind.OPTIM_STATE: (Tier.HOST, Tier.NVME)},
        checksum=plan.checksum,
        verify=plan.verify,
    )
    gen = torch.Generator().manual_seed(len(plan.tensor_nbytes))
    keys = [f"t{i:04d}" for i in range(len(plan.tensor_nbytes))]
    hashes: dict[str, int] = {}
    passes = {op: _Passes() for op in ("write", "evict", "read", "fetch")}
    file_nbytes = split_nbytes(plan.total_nbytes, len(plan.dirs))
    with contextlib.ExitStack() as stack:
        raw = stack.enter_context(allocate(file_nbytes * len(plan.dirs)))
        engine = stack.enter_context(AioEngine(plan.setting.aio_config()))
        files = [
            stack.enter_context(engine.open(d / "raw.bin", create=True)) for d in workspace.tmpdirs
        ]
        views = [raw.tensor[i * file_nbytes : (i + 1) * file_nbytes] for i in range(len(files))]
        fill_random(raw.tensor)
        _engine_pass(engine, "write", files, views)  # allocate the raw files (untimed)
        manager = stack.enter_context(TierManager(config))
        for key, nbytes in zip(keys, plan.tensor_nbytes, strict=True):
            t = torch.randint(-(2**15), 2**15, (nbytes // 2,), dtype=torch.int16, generator=gen)
            hashes[key] = content_hash(t)
            manager.register(key, t.view(torch.bfloat16), Kind.OPTIM_STATE)
            del t
        for i in range(plan.warmup + plan.loops):
            runs = {
                "write": lambda: _engine_pass(engine, "write", files, views),
                "evict": lambda: _evict_all(manager, keys),
                "read": lambda: _engine_pass(engine, "read", files, views),
                # The first pass, timed or not, proves the bytes come back intact.
                "fetch": lambda i=i: _fetch_all(manager, keys, hashes if i == 0 else None),
            }
            cells = []
            for op, run in runs.items():
                elapsed, cpu = _timed(run)
                moved = file_nbytes * len(files) if op in ("write", "read") else plan.total_nbytes
                cells.append(f"{op} {moved / elapsed / GIB:.2f}")
                if i >= plan.warmup:
                    passes[op].seconds.append(elapsed)
                    passes[op].cpu_seconds += cpu
            label = f"round {i + 1 - plan.warmup}" if i >= plan.warmup else "warm-up"
            say(f"  {label}: " + ", ".join(cells) + " GiB/s")  # (progress: as each ends)
        backend = engine.backend.value
        direct = all(f.direct_fd is not None for f in files)
    return passes, backend, direct


def run_tiers(
    plan: TiersPlan, say: Callable[[str], None] = lambda line: None
) -> list[TiersMeasurement]:
    """Measure the manager and the raw disk, alternating, in the same directories;
    ``say`` gets a line per round as it ends (its four passes' GiB/s)."""
    with Workspace(plan.dirs) as workspace:
        passes, backend, direct = _timed_passes(plan, workspace, say)
    raw_nbytes = split_nbytes(plan.total_nbytes, len(plan.dirs)) * len(plan.dirs)

    def measurement(op: str, nbytes: int, engine: str) -> Measurement:
        return Measurement(
            op=op,
            setting=dataclasses.replace(plan.setting, engine=engine),
            backend=backend,
            direct=direct,
            nbytes=nbytes,
            seconds=passes[op].seconds,
            cpu_seconds=passes[op].cpu_seconds,
            cache="O_DIRECT",
            dirs=[str(d) for d in plan.dirs],
        )

    return [
        TiersMeasurement(
            manager=measurement(op, plan.total_nbytes, "manager"),
            disk=measurement(raw_op, raw_nbytes, ENGINE_SWAPPER),
        )
        for op, raw_op in (("evict", "write"), ("fetch", "read"))
    ]


def format_table(results: list[TiersMeasurement]) -> str:
    rows = [("op", "GiB/s", "min-max", "CPU s/GiB", "disk op", "disk GiB/s", "ratio")]
    for r in results:
        m = r.manager
        rows.append(
            (
                m.op,
                f"{gib_per_s(m.gbps):.2f}",
                f"{gib_per_s(m.gbps_min):.2f}-{gib_per_s(m.gbps_max):.2f}",
                f"{m.cpu_seconds_per_gb * GIB / GB:.3f}",
                r.disk.op,
                f"{gib_per_s(r.disk.gbps):.2f}",
                f"{r.ratio:.2f}",
            )
        )
    lines = table(rows)
    lines.append(
        "GiB/s: median of the timed passes, GiB = 2^30 bytes; ratio = manager / raw disk "
        "(--json: gbps in GB/s, GB = 10^9 bytes)"
    )
    return "\n".join(lines)


def run_tiers_command(args: argparse.Namespace) -> int:
    """``swapper-bench tiers``: returns the exit code."""
    plan = build_plan(args)
    s = plan.setting
    where = ", ".join(str(d) for d in plan.dirs)
    print(
        f"{PROG} {COMMAND}: {len(plan.tensor_nbytes)} bf16 tensors "
        f"({format_size(min(plan.tensor_nbytes))}-{format_size(max(plan.tensor_nbytes))}), "
        f"{format_size(plan.total_nbytes)} in all, in {where}; backend {s.backend.value}, "
        f"O_DIRECT, bs {format_size(s.block_size)} qd {s.queue_depth} threads {s.threads}, "
        f"checksum {'on' if plan.checksum else 'off'}, "
        f"verify {'on' if plan.verify and plan.checksum else 'off'}",
        flush=True,
    )
    print(
        f"  raw disk and manager alternating: {plan.loops} timed passes after "
        f"{plan.warmup} warm-up",
        file=sys.stdout,
        flush=True,
    )
    results = run_tiers(plan, say=lambda line: print(line, flush=True))
    print(format_table(results))
    if args.json is not None:
        meta = {"command": COMMAND, "version": swapper.__version__, "gb": "10^9 bytes"}
        records = [r.to_record(plan) for r in results]
        write_json(args.json, {"results": records, "meta": meta})
        print(f"results written to {args.json}")
    return 0
