"""How evenly do N ranks share the offload traffic of backward? Balanced vs contiguous.

Builds the pressure tool's GPT (:mod:`swapper.pressure.model`, on the meta device: no
memory) in bf16, plans its partition with :func:`swapper.distributed.plan_partition`, and
prints, for the plan's ownership and for the contiguous layout (every parameter end to
end, cut into N equal ranges), the figures of :mod:`swapper.distributed.balance`:

- ``max/mean``: ``sum over module windows of the busiest rank's bytes`` over ``sum of
  the mean``, i.e. how much longer the backward offload takes than perfectly balanced
  when every window waits for its slowest rank (1.00 perfect, N one rank at a time);
- the worst single window, the worst cumulative imbalance, and each rank's total.

    python tools/partition_balance.py --world-size 4 --params 20M
"""

from __future__ import annotations

import argparse

import torch

from swapper.distributed import (
    ALIGN_NUMEL,
    balance_report,
    contiguous_windows,
    describe_modules,
    plan_partition,
    plan_windows,
)
from swapper.distributed.balance import BalanceReport
from swapper.pressure.model import GPT, GPTConfig


def _count(text: str) -> int:
    units = {"k": 10**3, "m": 10**6, "g": 10**9}
    text = text.strip().lower()
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _line(label: str, r: BalanceReport) -> str:
    totals = " ".join(f"{b / 2**20:.2f}" for b in r.per_rank_nbytes)
    return (
        f"{label:<11} max/mean {r.max_over_mean:5.2f}   worst window {r.worst_window:5.2f}   "
        f"worst cumulative {r.cumulative_worst:5.2f}   per rank MiB: {totals}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--world-size", type=int, default=4, help="ranks (default 4)")
    parser.add_argument("--params", default="20M", help="model size, e.g. 20M (default)")
    parser.add_argument("--align", type=int, default=ALIGN_NUMEL, help="shard alignment")
    parser.add_argument(
        "--whole-below", type=int, default=None,
        help="parameters with fewer elements are owned whole (default align * N)",
    )  # fmt: skip
    parser.add_argument("--no-tie", action="store_true", help="untie the lm head")
    args = parser.parse_args(argv)

    cfg = GPTConfig.for_params(_count(args.params), tie_weights=not args.no_tie)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    modules = [(n, m) for n, m in model.named_modules() if list(m.parameters(recurse=False))]
    infos = describe_modules(modules)
    plan = plan_partition(
        infos, args.world_size, align_numel=args.align, whole_below_numel=args.whole_below
    )
    whole = sum(1 for p in plan.params if not p.sharded)
    print(
        f"GPT d_model={cfg.d_model} n_layers={cfg.n_layers} vocab={cfg.vocab_size} "
        f"params={cfg.num_params():,} ({len(infos)} tensors, {whole} owned whole) "
        f"N={args.world_size} align={args.align}"
    )
    print(_line("balanced", balance_report(plan_windows(plan))))
    print(_line("contiguous", balance_report(contiguous_windows(infos, args.world_size))))
    total = plan.total_nbytes()
    worst = max(
        abs(plan.local_nbytes(r) - plan.padding_nbytes(r) - total / args.world_size)
        for r in range(args.world_size)
    )
    pad = max(plan.padding_nbytes(r) for r in range(args.world_size))
    percent = 100 * worst / (total / args.world_size)
    print(
        f"per-rank parameter bytes: worst deviation from total/N {percent:.3f}% "
        f"(+ at most {pad:,} B of padding)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
