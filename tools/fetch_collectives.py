"""Fetch a model's parameters by all_gather vs all_reduce, N gloo ranks, side by side.

Spawns ``--world-size`` processes (gloo, CPU), partitions the pressure tool's GPT in bf16
with :func:`swapper.distributed.plan_partition`, and times a full forward's worth of
fetches (one :func:`~swapper.distributed.start_fetch` per module, ``--ahead`` in flight,
each waited on in order) with each method, alternating the methods over ``--rounds``
rounds. Prints, per method, the median seconds per full fetch, GB/s of parameters
delivered (GB = 1e9 bytes), and the bytes copied after the collective (0 for all_reduce).
Every round's result is checked bitwise against the unsharded parameters.

    python tools/fetch_collectives.py --world-size 2 --params 20M --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from swapper.distributed import (
    FETCH_METHODS,
    DistGroup,
    PendingFetch,
    describe_modules,
    module_layout,
    plan_partition,
    start_fetch,
)
from swapper.pressure.model import GPT, GPTConfig, init_weights_


def _count(text: str) -> int:
    units = {"k": 10**3, "m": 10**6, "g": 10**9}
    text = text.strip().lower()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _rank(rank: int, world: int, rendezvous: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    dg = DistGroup.of(timeout=120)
    model = GPT(GPTConfig.for_params(_count(args.params)))
    init_weights_(model, seed=0)
    model = model.to(torch.bfloat16)
    modules = [(n, m) for n, m in model.named_modules() if list(m.parameters(recurse=False))]
    infos = describe_modules(modules)
    plan = plan_partition(infos, world)
    full = {}
    seen: set[int] = set()
    for _, m in modules:
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                full[len(full)] = p.detach().reshape(-1)
    shards = {}
    for p in plan.params:
        if p.holds(rank):
            t = torch.zeros(p.local_numel(rank), dtype=torch.bfloat16)
            start, end = p.real_range(rank)
            t[: end - start] = full[p.index][start:end]
            shards[p.index] = t
    by: dict[int, list[int]] = {}
    for p in plan.params:
        by.setdefault(p.info.module_index, []).append(p.index)
    layouts = [module_layout(plan, by[m]) for m in sorted(by)]
    nbytes = sum(lay.real_nbytes for lay in layouts)
    times: dict[str, list[float]] = {m: [] for m in FETCH_METHODS}
    copied: dict[str, int] = {}
    cpu = torch.device("cpu")
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for method in FETCH_METHODS if round_ % 2 == 0 else FETCH_METHODS[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            pending = []
            total_copied = 0
            for k, lay in enumerate(layouts):
                pending.append(
                    start_fetch(lay, shards, dg, dtype=torch.bfloat16, device=cpu, method=method)
                )
                if k >= args.ahead:
                    total_copied += _finish(pending.pop(0), full)
            while pending:
                total_copied += _finish(pending.pop(0), full)
            elapsed = time.perf_counter() - t0
            if round_:
                times[method].append(elapsed)
            copied[method] = total_copied
    if rank == 0:
        print(
            f"N={world} gloo, GPT {sum(p.numel for p in infos):,} params bf16, "
            f"{len(layouts)} modules, {args.ahead} fetches ahead, {args.rounds} rounds"
        )
        base = statistics.median(times["all_gather"])
        for method in FETCH_METHODS:
            med = statistics.median(times[method])
            print(
                f"{method:<10}  {med * 1e3:8.1f} ms per full fetch  {nbytes / med / 1e9:6.2f} GB/s"
                f"  x{med / base:4.2f} of all_gather   bytes copied after: {copied[method]:,}"
            )
    dist.barrier()
    dist.destroy_process_group()


def _finish(pf: PendingFetch, full: dict[int, torch.Tensor]) -> int:
    views = pf.wait()
    for i, v in views.items():
        if not torch.equal(v.view(torch.int16), full[i].view(torch.int16)):
            raise SystemExit(f"fetch by {pf.method} differs from parameter {i}")
    return pf.bytes_copied_after


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="all_gather vs all_reduce fetch, gloo")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--params", default="20M", help="model size, e.g. 20M (default)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ahead", type=int, default=2, help="fetches in flight (default 2)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        spawn(
            _rank, args=(args.world_size, os.path.join(tmp, "rendezvous"), args),
            nprocs=args.world_size,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
