"""The cost of ``reduce_dtype="float32"`` against the 16-bit gradient reduction, in training.

Spawns ``--world-size`` gloo ranks (CPU). Each rank first probes which collectives the
backend runs for bf16, fp16 and fp32 (reduce_scatter, all_reduce, all_gather; a small
tensor each). Then it wraps two copies of the pressure tool's GPT (bf16, same weights,
unlimited budgets: only the collectives differ), one per ``DistributedConfig.
reduce_dtype`` (``None``: the gradients' bf16; ``"float32"``), and trains them side by
side on the same batches, alternating which goes first each step. Per step and model it
measures the whole step (forward, backward, optimizer) and, from
:class:`swapper.zero.sharded.grads.ReduceRecord`, the gradient collectives: their seconds
(copy into the rank-major buffer, sum, average, copy out) and the bytes each rank put in
(a ring reduce-scatter sends ``(N - 1) / N`` of them). Rank 0 prints the medians over the
steps after the first, and how far apart the two models' parameters end.

    python tools/reduce_dtype_cost.py --world-size 2 --params 10M --steps 6
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
import torch.nn.functional as F
from torch.multiprocessing.spawn import spawn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig
from swapper.distributed.groups import all_gather_single, reduce_scatter_single
from swapper.pressure.model import GPT, GPTConfig, batches, init_weights_
from swapper.zero.config.distributed import DistributedConfig
from swapper.zero.sharded.grads import ReduceRecord

TIMEOUT_S = 120.0
VARIANTS: tuple[str | None, ...] = (None, "float32")


def _count(text: str) -> int:
    units = {"k": 10**3, "m": 10**6, "g": 10**9}
    text = text.strip().lower()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _probe(world: int) -> dict[str, dict[str, str]]:
    """Which collectives run on this backend, per dtype ("ok", or the error's first line)."""
    out: dict[str, dict[str, str]] = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        row: dict[str, str] = {}
        calls = {
            "reduce_scatter": lambda d=dtype: reduce_scatter_single(
                torch.empty(4, dtype=d), torch.ones(4 * world, dtype=d)
            ),
            "all_reduce": lambda d=dtype: dist.all_reduce(torch.ones(4, dtype=d)),
            "all_gather": lambda d=dtype: all_gather_single(
                torch.empty(4 * world, dtype=d), torch.ones(4, dtype=d)
            ),
        }
        for name, call in calls.items():
            try:
                call()
                row[name] = "ok"
            except Exception as exc:  # reported, not raised: what the backend lacks
                row[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
            dist.barrier()
        out[str(dtype).removeprefix("torch.")] = row
    return out


def _rank(rank: int, world: int, tmp: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
    )  # fmt: skip
    probe = _probe(world)
    cfg = GPTConfig.for_params(_count(args.params))
    wrapped, optimizers, reducers = [], [], []
    for variant in VARIANTS:
        model = GPT(cfg)
        init_weights_(model, seed=0)
        config = OffloadConfig.create(
            device="cpu",
            step=StepConfig(sub_group_numel=1 << 18),
            distributed=DistributedConfig(timeout_s=TIMEOUT_S, reduce_dtype=variant),
        )
        w = swapper.offload(model.to(torch.bfloat16), config, dist.group.WORLD)
        wrapped.append(w)
        optimizers.append(OffloadAdamW(w.parameters(), lr=1e-3, tiers=w))
        reducers.append(w._grads)  # type: ignore[union-attr]  # (a measuring tool)
    data = batches(cfg, batch=args.batch, seq=args.seq, steps=args.steps, seed=0)
    per = args.batch // world
    step_s: list[list[float]] = [[] for _ in VARIANTS]
    reduce_s: list[list[float]] = [[] for _ in VARIANTS]
    wire: list[int] = [0 for _ in VARIANTS]
    collectives: list[set[str]] = [set() for _ in VARIANTS]
    for step, tokens in enumerate(data):
        mine = tokens[rank * per : (rank + 1) * per]
        order = range(len(VARIANTS)) if step % 2 == 0 else reversed(range(len(VARIANTS)))
        for v in order:
            trace: list[ReduceRecord] = []
            dist.barrier()
            t0 = time.perf_counter()
            logits = wrapped[v](mine[:, :-1]).float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mine[:, 1:].reshape(-1))
            reducers[v].trace = trace
            loss.backward()
            reducers[v].trace = None
            optimizers[v].step()
            optimizers[v].zero_grad()
            elapsed = time.perf_counter() - t0
            if step:  # the first step records the gather order and warms up
                step_s[v].append(elapsed)
                reduce_s[v].append(sum(r.reduce_s for r in trace))
            wire[v] = sum(r.wire_nbytes for r in trace)
            collectives[v] |= {f"{r.collective} in {r.reduce_dtype}" for r in trace}
    params = [dict(w.state_dict()) for w in wrapped]  # consolidated on rank 0
    if rank == 0:
        print(
            f"N={world} gloo, GPT {cfg.num_params():,} params bf16 (d_model {cfg.d_model}, "
            f"{cfg.n_layers} layers), batch {args.batch} x {args.seq}, {args.steps} steps "
            "(medians over all but the first)"
        )
        for dtype, row in probe.items():
            print(f"  gloo {dtype:<9} " + "  ".join(f"{k}: {v}" for k, v in row.items()))
        base = statistics.median(step_s[0])
        base_reduce = statistics.median(reduce_s[0])
        for v, variant in enumerate(VARIANTS):
            med, red = statistics.median(step_s[v]), statistics.median(reduce_s[v])
            print(
                f"reduce_dtype={variant!s:<8} step {med * 1e3:8.1f} ms (x{med / base:4.2f})  "
                f"gradient collectives {red * 1e3:7.1f} ms (x{red / base_reduce:4.2f})  "
                f"bytes put in per rank and step {wire[v]:,} (sent by a ring: "
                f"{wire[v] * (world - 1) // world:,})  [{', '.join(sorted(collectives[v]))}]"
            )
        diff = max(
            float((params[0][k].float() - params[1][k].float()).abs().max()) for k in params[0]
        )
        equal = sum(int(torch.equal(params[0][k], params[1][k])) for k in params[0])
        print(
            f"after {args.steps} steps: max |param(bf16 sum) - param(fp32 sum)| = {diff:.3g}; "
            f"{equal} of {len(params[0])} tensors bitwise equal"
        )
    for o, w in zip(optimizers, wrapped, strict=True):
        o.close()
        w.close()
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="reduce_dtype float32 vs 16-bit, gloo")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--params", default="10M", help="model size, e.g. 10M (default)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4, help="global batch (default 4)")
    parser.add_argument("--seq", type=int, default=64)
    args = parser.parse_args(argv)
    if args.batch % args.world_size or args.steps < 2:
        parser.error("--batch must be a multiple of --world-size, --steps at least 2")
    with tempfile.TemporaryDirectory() as tmp:
        spawn(_rank, args=(args.world_size, tmp, args), nprocs=args.world_size)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
