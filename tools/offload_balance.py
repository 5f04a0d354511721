"""Backward offload per rank, measured in training: balanced vs contiguous ownership.

Spawns ``--world-size`` gloo ranks (CPU). For each ownership
(``DistributedConfig.ownership``: ``balanced``, the default plan, and ``contiguous``,
whole parameters in N contiguous runs), every rank wraps the pressure tool's GPT in bf16
with ``swapper.offload(model, config, group)`` (gradients on host then NVMe, as by
default; ``--host-budget`` makes them spill to NVMe) and trains ``--steps`` steps; during
the last step's backward each rank records, per module window (one gradient group's
reduce-scatter), the bytes of gradient shards it actually handed to its tiers, the bytes
its manager wrote down a tier (evictions) and the seconds the offload took
(:class:`swapper.zero.sharded.grads.ReduceRecord`). Rank 0 prints, per ownership:

- measured ``max/mean`` over the windows (``sum_w max_r / sum_w mean_r``, 1.00 perfect,
  N one rank at a time; :func:`swapper.distributed.balance_report`), of the retained
  gradient bytes and of retained + evicted bytes, beside the figure planned from the
  partition (:func:`swapper.distributed.plan_windows`), and for contiguous the flat cut
  of :func:`swapper.distributed.contiguous_windows` too;
- the same figure of the measured offload seconds, and their sum over the windows of
  the slowest rank's (what a backward whose windows wait for each other would take;
  noisy on a shared machine, and where the ranks share cores and one disk, spreading
  the bytes does not add bandwidth).

    python tools/offload_balance.py --world-size 4 --params 2M
"""

from __future__ import annotations

import argparse
import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.multiprocessing.spawn import spawn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig
from swapper.distributed import (
    balance_report,
    contiguous_windows,
    describe_modules,
    plan_windows,
)
from swapper.distributed.balance import BalanceReport
from swapper.pressure.model import GPT, GPTConfig, batches, init_weights_
from swapper.zero.config.distributed import OWNERSHIPS, DistributedConfig
from swapper.zero.sharded.grads import ReduceRecord

TIMEOUT_S = 120.0


def _count(text: str) -> int:
    units = {"k": 10**3, "m": 10**6, "g": 10**9}
    text = text.strip().lower()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _train(rank: int, world: int, tmp: str, args: argparse.Namespace, ownership: str) -> Any:
    """Train on this rank's share; the trace of the last backward and the plan's windows."""
    cfg = GPTConfig.for_params(_count(args.params))
    model = GPT(cfg)
    init_weights_(model, seed=0)
    model = model.to(torch.bfloat16)
    config = OffloadConfig.create(
        device="cpu",
        host_nbytes=args.host_budget,
        nvme_dirs=[Path(tmp, ownership)],
        step=StepConfig(sub_group_numel=args.sub_group),
        distributed=DistributedConfig(timeout_s=TIMEOUT_S, ownership=ownership),
    )
    wrapped = swapper.offload(model, config, dist.group.WORLD)
    optimizer = OffloadAdamW(wrapped.parameters(), lr=1e-3, tiers=wrapped)
    reducer = wrapped._grads  # type: ignore[union-attr]  # (a measuring tool)
    data = batches(cfg, batch=args.batch, seq=args.seq, steps=args.steps, seed=0)
    per = args.batch // world
    trace: list[ReduceRecord] = []
    try:
        for step, tokens in enumerate(data):
            mine = tokens[rank * per : (rank + 1) * per]
            logits = wrapped(mine[:, :-1]).float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mine[:, 1:].reshape(-1))
            reducer.trace = trace if step == len(data) - 1 else None
            loss.backward()
            reducer.trace = None
            optimizer.step()
            optimizer.zero_grad()
        planned = plan_windows(wrapped.plan)  # type: ignore[union-attr]
    finally:
        optimizer.close()
        wrapped.close()
    return trace, planned


def _rank(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    results = {o: _train(rank, world, tmp, args, o) for o in OWNERSHIPS}
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, results)
    if rank == 0:
        _report(everyone, world, args)
    dist.barrier()
    dist.destroy_process_group()


def _windows(traces: list[list[ReduceRecord]], value: Any) -> list[tuple[int, list[float]]]:
    """Per module window (backward order), per rank ``value(record)``."""
    rows: dict[int, list[float]] = {}
    order: list[int] = []
    for rank, trace in enumerate(traces):
        for rec in trace:
            if rec.module_index not in rows:
                rows[rec.module_index] = [0.0] * len(traces)
                order.append(rec.module_index)
            rows[rec.module_index][rank] += value(rec)
    return [(m, rows[m]) for m in order]


def _line(label: str, r: BalanceReport, unit: float = 2**20, name: str = "MiB") -> str:
    totals = " ".join(f"{b / unit:.3f}" for b in r.per_rank_nbytes)
    return (
        f"  {label:<34} max/mean {r.max_over_mean:5.2f}   worst window {r.worst_window:5.2f}"
        f"   per rank {name}: {totals}"
    )


def _report(everyone: list[Any], world: int, args: argparse.Namespace) -> None:
    cfg = GPTConfig.for_params(_count(args.params))
    print(
        f"GPT {cfg.num_params():,} params (d_model {cfg.d_model}, {cfg.n_layers} layers), "
        f"bf16, N={world} gloo, batch {args.batch} x {args.seq}, last of {args.steps} steps' "
        f"backward measured; host budget {args.host_budget or 'unlimited'}"
    )
    for ownership in OWNERSHIPS:
        traces = [r[ownership][0] for r in everyone]
        planned = everyone[0][ownership][1]
        windows = len(traces[0])
        print(f"{ownership} ownership ({windows} module windows):")
        retained = _windows(traces, lambda rec: rec.retained_nbytes)
        print(_line("measured: gradient shards offloaded", balance_report(retained)))
        total = _windows(traces, lambda rec: rec.retained_nbytes + rec.down_nbytes)
        print(_line("measured: + evictions in the window", balance_report(total)))
        nvme = sum(rec.nvme_nbytes for t in traces for rec in t)
        print(f"  (of which straight to NVMe: {nvme / 2**20:.3f} MiB over all ranks)")
        print(_line("planned (the partition plan)", balance_report(planned)))
        if ownership == "contiguous":
            with torch.device("meta"):
                model = GPT(cfg).to(torch.bfloat16)
            named = [(n, m) for n, m in model.named_modules() if list(m.parameters(recurse=False))]
            flat = contiguous_windows(describe_modules(named), world)
            print(_line("planned, flat cut (ZeRO-1/2 style)", balance_report(flat)))
        seconds = _windows(traces, lambda rec: rec.offload_s)
        print(_line("measured: offload seconds", balance_report(seconds), 1e-3, "ms"))
        slowest = sum(max(row) for _, row in seconds)
        print(
            f"  backward offload if each window waits for its slowest rank: {slowest * 1e3:.1f} ms"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="backward offload per rank, measured")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--params", default="2M", help="model size, e.g. 2M (default)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="global batch (default 4)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--host-budget", type=int, default=None, help="bytes per rank")
    parser.add_argument("--sub-group", type=int, default=1 << 14, help="optimizer elements")
    args = parser.parse_args(argv)
    if args.batch % args.world_size:
        parser.error("--batch must be a multiple of --world-size")
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_rank, args=(args.world_size, tmp, args), nprocs=args.world_size)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
