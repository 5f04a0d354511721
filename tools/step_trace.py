"""Trace where an optimizer step's time goes against the disk: what the step's I/O does
and what it waits on (issue 24, "make the step's I/O reach the floor").

One process builds ``--params`` bf16 parameters with gradients, an ``OffloadAdamW`` whose
state lives on NVMe in ``--dir`` (or, ``--io-only``, the bare pipeline with nothing
computed), runs ``--warmup`` + ``--steps`` steps and, for each timed step, prints:

- wall seconds, bytes read and written, and the disk-rate floor of those bytes at the
  rates a :class:`~swapper.bench.step_floor.DiskProbe` measured just before (same engine
  settings);
- the requests the store hands the engine (one per extent run, before the engine's own
  ``block_size`` split): count and sizes by op, and how many did not start on a 1 MiB
  boundary;
- ``fdatasync`` calls and their seconds (the store's group commits: data files + journal);
- XXH3 hashing seconds (every chunk written is hashed, every chunk read verified);
- the step's stall (fetch waits, the manager's counter) and the wait for its writes.

    python tools/step_trace.py --dir /tmp/x --params 256M --sub-group 32M
    SWAPPER_AIO_BLOCK_SIZE=8MiB python tools/step_trace.py --dir /tmp/x --io-only

The counting wraps ``os.fdatasync``, the store's ``digest`` and ``AioEngine._submit`` in
this process only (a developer's tool: the library is not changed). Everything it makes
is under a private temporary directory in ``--dir``, removed at exit.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import swapper
import tiers.nvme.committer as nvme_committer
import tiers.nvme.futures as nvme_futures
import tiers.nvme.store as nvme_store
from swapper.bench.step_floor import DiskProbe, step_floor
from swapper.cli_args import aio_environment, count_arg
from swapper.manager import ManagerConfig
from swapper.step import OffloadAdamW, StepConfig, StepPipeline, StreamedOptimizer
from swapper.step.layout import plan_sub_groups
from swapper.step.offload_optimizer import make_optimizer, plan_named
from tiers.aio.engine import AioEngine
from tiers.config import AioConfig

MIB = 1 << 20


class Counters:
    """What the wrapped calls saw; thread-safe (the committer, verifier and engine threads
    all report)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.fdatasync_n = 0
        self.fdatasync_s = 0.0
        self.hash_s = 0.0
        self.hash_nbytes = 0
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.unaligned = 0
        self.t0 = time.perf_counter()
        #: (op, issued, done) of every engine request, seconds since :meth:`reset`
        self.intervals: list[tuple[str, float, float]] = []
        #: (start, end) of every fdatasync, seconds since :meth:`reset`
        self.syncs: list[tuple[float, float]] = []

    def busy(self, end: float) -> tuple[float, float, float, list[tuple[float, float]]]:
        """Seconds in [0, end] with a read in flight, with a write in flight, with either,
        and the gaps of more than 10 ms with none."""
        with self.lock:
            spans = list(self.intervals)

        def union(items: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
            total, gaps, reach = 0.0, [], 0.0
            for lo, hi in sorted(items):
                lo, hi = max(lo, 0.0), min(hi, end)
                if hi <= reach:
                    continue
                if lo > reach + 0.01:
                    gaps.append((reach, lo))
                total += hi - max(lo, reach)
                reach = hi
            if end > reach + 0.01:
                gaps.append((reach, end))
            return total, gaps

        reads = union([(lo, hi) for op, lo, hi in spans if op == "read"])[0]
        writes = union([(lo, hi) for op, lo, hi in spans if op == "write"])[0]
        either, gaps = union([(lo, hi) for _, lo, hi in spans])
        return reads, writes, either, gaps

    def add(self, **kwargs: Any) -> None:
        with self.lock:
            for name, value in kwargs.items():
                setattr(self, name, getattr(self, name) + value)


@contextlib.contextmanager
def wrapped(counters: Counters) -> Iterator[None]:
    """Count fdatasync, hashing and engine requests while the block runs."""
    real_sync = os.fdatasync
    real_digest = nvme_futures.digest
    real_submit = AioEngine._submit  # pyright: ignore[reportPrivateUsage]

    def fdatasync(fd: int) -> None:
        start = time.perf_counter()
        try:
            real_sync(fd)
        finally:
            end = time.perf_counter()
            counters.add(fdatasync_n=1, fdatasync_s=end - start)
            with counters.lock:
                counters.syncs.append((start - counters.t0, end - counters.t0))

    def digest(data: torch.Tensor) -> int:
        start = time.perf_counter()
        try:
            return real_digest(data)
        finally:
            counters.add(hash_s=time.perf_counter() - start, hash_nbytes=data.numel())

    def submit(self: AioEngine, op: Any, buffer: Any, file: Any, offset: Any, nbytes: Any) -> Any:
        # nbytes None: the whole buffer (a tensor, memoryview or host block: .nbytes)
        size = int(nbytes) if nbytes is not None else int(getattr(buffer, "nbytes", -1))
        with counters.lock:
            counters.requests[(str(getattr(op, "value", op)), size)] += 1
            if int(offset) % MIB:
                counters.unaligned += 1
        issued = time.perf_counter() - counters.t0
        future = real_submit(self, op, buffer, file, offset, nbytes)
        name = str(getattr(op, "value", op))

        def done(_: Any) -> None:
            with counters.lock:
                counters.intervals.append((name, issued, time.perf_counter() - counters.t0))

        future.add_done_callback(done)
        return future

    os.fdatasync = fdatasync
    nvme_futures.digest = digest
    nvme_store.digest = digest  # the store imported the name
    AioEngine._submit = submit  # pyright: ignore[reportPrivateUsage]
    try:
        yield
    finally:
        os.fdatasync = real_sync
        nvme_futures.digest = real_digest
        nvme_store.digest = real_digest
        AioEngine._submit = real_submit  # pyright: ignore[reportPrivateUsage]


class Timeline:
    """Per key: when its fetch was asked and returned, when its evict was asked, when the
    engine finished its write (``written``) and when the evict's future resolved
    (``durable``), in seconds since :meth:`start`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.events: list[tuple[float, str, str]] = []

    def start(self) -> None:
        with self.lock:
            self.t0 = time.perf_counter()
            self.events = []

    def mark(self, what: str, key: str) -> None:
        with self.lock:
            self.events.append((time.perf_counter() - self.t0, what, key))

    def print(self) -> None:
        with self.lock:
            for t, what, key in sorted(self.events):
                print(f"    {t:7.3f}  {what:<14} {key}")


@contextlib.contextmanager
def timed_manager(manager: swapper.TierManager, timeline: Timeline) -> Iterator[None]:
    """Record the step's fetches and evictions on ``timeline`` (patches this instance)."""
    real_fetch, real_evict = manager.fetch, manager.evict
    real_write = manager._ctx.nvme().write  # pyright: ignore[reportPrivateUsage]

    def fetch(key: str, *a: Any, **k: Any) -> Any:
        timeline.mark("fetch asked", key)
        try:
            return real_fetch(key, *a, **k)
        finally:
            timeline.mark("fetch got", key)

    def evict(key: str, *a: Any, **k: Any) -> Any:
        timeline.mark("evict asked", key)
        future = real_evict(key, *a, **k)
        future.add_done_callback(lambda f: timeline.mark("durable", key))
        return future

    real_prefetch = manager.prefetch

    def prefetch(keys: Any, *a: Any, **k: Any) -> Any:
        keys = list(keys)
        for key in keys:
            timeline.mark("prefetch asked", key)
        return real_prefetch(keys, *a, **k)

    def write(key: str, tensor: torch.Tensor) -> Any:
        future = real_write(key, tensor)
        timeline.mark("write issued", key)
        return future

    manager.fetch, manager.evict = fetch, evict  # type: ignore[method-assign]
    manager.prefetch = prefetch  # type: ignore[method-assign]
    store = manager._ctx.nvme()  # pyright: ignore[reportPrivateUsage]
    store.write = write  # type: ignore[method-assign]
    try:
        yield
    finally:
        manager.fetch, manager.evict = real_fetch, real_evict  # type: ignore[method-assign]
        manager.prefetch = real_prefetch  # type: ignore[method-assign]
        store.write = real_write  # type: ignore[method-assign]


def _sizes(requests: collections.Counter[tuple[str, int]], op: str) -> str:
    mine = {size: n for (o, size), n in requests.items() if o == op}
    if not mine:
        return "none"
    total = sum(mine.values())
    top = sorted(mine.items(), key=lambda kv: -kv[1])[:3]
    return f"{total} requests (" + ", ".join(f"{n}x {s / MIB:.2f}MiB" for s, n in top) + ")"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--params", type=count_arg, default=64_000_000)
    parser.add_argument("--sub-group", type=count_arg, default=8_000_000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--io-only", action="store_true", help="the bare pipeline, no compute")
    parser.add_argument(
        "--optimizer",
        default="adamw",
        help="adamw (OffloadAdamW) or a name of swapper.step.offload_optimizer.NAMED",
    )
    parser.add_argument("--timeline", action="store_true", help="print each step's events")
    parser.add_argument("--mover-threads", type=int, default=None, help="ManagerConfig's")
    parser.add_argument(
        "--gather-s",
        type=float,
        default=None,
        help="the group commit's gather bound (tiers.nvme.committer.GATHER_S) for this run",
    )
    args = parser.parse_args(argv)
    aio = AioConfig(**aio_environment())
    if args.gather_s is not None:
        nvme_committer.GATHER_S = args.gather_s  # read when each store is made
    numels = [10_000_000] * (args.params // 10_000_000)
    if args.params % 10_000_000:
        numels.append(args.params % 10_000_000)
    gen = torch.Generator().manual_seed(0)
    params = []
    for numel in numels:
        p = torch.nn.Parameter(torch.randn(numel, generator=gen).to(torch.bfloat16))
        p.grad = (torch.randn(numel, generator=gen) * 1e-3).to(torch.bfloat16)
        params.append(p)
    if args.optimizer == "adamw":
        sub_groups = plan_sub_groups([numels], args.sub_group)
    else:  # (its layout: the io-only pass moves the same bytes as its step)
        sub_groups = plan_named(args.optimizer, list(numels), args.sub_group)
    largest = max(sg.state_nbytes for sg in sub_groups)
    counters = Counters()
    timeline = Timeline()
    print(f"{aio.describe()}; {len(sub_groups)} sub-groups; host budget 4 sub-groups", flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        (work / "probe").mkdir()
        probe = stack.enter_context(
            DiskProbe([work / "probe"], aio, min(1 << 30, sum(s.state_nbytes for s in sub_groups)))
        )
        config = ManagerConfig(device_nbytes=0, host_nbytes=4 * largest, nvme_dirs=[work], aio=aio)
        if args.mover_threads is not None:
            config = dataclasses.replace(config, mover_threads=args.mover_threads)
        run: Callable[[], tuple[int, int, float]]
        if args.io_only:
            manager = stack.enter_context(swapper.TierManager(config))
            pipeline = StepPipeline(manager, sub_groups, name="trace")
            stack.callback(pipeline.close)
            pipeline.initialize(lambda sg, buffer: None)
            stack.enter_context(timed_manager(manager, timeline))
            print(f"read-ahead {pipeline.readahead} sub-group(s)", flush=True)
            n = 0

            def run() -> tuple[int, int, float]:
                nonlocal n
                n += 1
                before, stall = pipeline.counters(), manager.stats().stall_s
                pipeline.run(n, lambda sg, s, e: None, lambda sg, s: None)
                t = pipeline.traffic_since(before)
                stall = manager.stats().stall_s - stall
                return t.total_read_nbytes, t.total_written_nbytes, stall

        else:
            step_config = StepConfig(sub_group_numel=args.sub_group)
            opt: StreamedOptimizer = stack.enter_context(
                OffloadAdamW(params, lr=1e-4, tiers=config, config=step_config)
                if args.optimizer == "adamw"
                else make_optimizer(
                    args.optimizer, params, lr=1e-4, tiers=config, config=step_config
                )
            )

            stack.enter_context(timed_manager(opt.manager, timeline))

            def run() -> tuple[int, int, float]:
                opt.step()
                r = opt.last_step
                if r is None:
                    raise RuntimeError(f"{type(opt).__name__}.step() left no report")
                return r.traffic.total_read_nbytes, r.traffic.total_written_nbytes, r.stall_seconds

        with wrapped(counters):
            for i in range(args.warmup + args.steps):
                rates = probe.round()
                counters.reset()
                timeline.start()
                start = time.perf_counter()
                read, written, stall = run()
                wall = time.perf_counter() - start
                floor = step_floor(
                    read_nbytes=read, written_nbytes=written, rates=rates, compute_seconds=0
                )
                label = "warm-up" if i < args.warmup else f"step {i + 1 - args.warmup}"
                print(
                    f"{label}: {wall:.2f} s, read {read / 1e9:.2f} GB + written "
                    f"{written / 1e9:.2f} GB; disk floor {floor.disk_seconds:.2f} s "
                    f"(r {rates.read_bps / 1e9:.2f} w {rates.write_bps / 1e9:.2f} "
                    f"r+w {rates.mixed_bps / 1e9:.2f} GB/s) -> {wall / floor.disk_seconds:.2f}x\n"
                    f"  reads: {_sizes(counters.requests, 'read')}; writes: "
                    f"{_sizes(counters.requests, 'write')}; not 1 MiB-aligned: "
                    f"{counters.unaligned}\n"
                    f"  fdatasync {counters.fdatasync_n}x {counters.fdatasync_s:.2f} s; hashing "
                    f"{counters.hash_nbytes / 1e9:.2f} GB in {counters.hash_s:.2f} s (all "
                    f"threads); stall {stall:.2f} s",
                    flush=True,
                )
                reads_s, writes_s, busy_s, gaps = counters.busy(wall)
                print(
                    f"  disk busy {busy_s:.2f} s of {wall:.2f} (a read in flight {reads_s:.2f} s, "
                    f"a write {writes_s:.2f} s); idle gaps over 10 ms: "
                    + (", ".join(f"{lo:.3f}-{hi:.3f}" for lo, hi in gaps) or "none"),
                    flush=True,
                )
                if args.timeline:
                    with counters.lock:
                        for lo, hi in counters.syncs:
                            timeline.events.append((lo, "fdatasync", f"until {hi:.3f}"))
                    timeline.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
