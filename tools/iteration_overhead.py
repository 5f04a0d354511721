"""CPU time of one full training iteration (forward, backward, clipping, optimizer step,
``zero_grad``) through ``swapper.offload`` with unlimited budgets, against the same model
in plain PyTorch (fp32 master copies, ``torch.optim.AdamW(fused=True)``, clipping,
everything in memory): the figure issue 14's "swapper <= 1.05x plain" is about.

The model is the pressure runner's GPT (``--params``, default 2M: 1.9 M parameters,
4 layers, d 192), bf16, batch ``--batch`` x ``--seq``; swapper's optimizer is
``OffloadAdamW(max_grad_norm=1.0)`` with the runner's sub-group size for its default host
budget (``--sub-group`` to change it). Plain and swapper alternate in one process,
``--iters`` times after ``--warmup`` untimed iterations each; the figures are medians of
``time.process_time`` (CPU time: another process on shared cores does not count; one
intra-op thread by default, so that CPU time is the work done). ``--rounds`` repeats the
whole comparison (fresh models) and prints each round's ratio.

    python tools/iteration_overhead.py                      # 1.9M GPT, 15 iterations
    python tools/iteration_overhead.py --iters 30 --rounds 3
    python tools/iteration_overhead.py --profile 40          # then cProfile of swapper's

Swapper's forward + backward and step + ``zero_grad`` are printed apart (plain's too), so
that a gap can be placed. ``--profile N`` runs ``--iters`` more swapper iterations under
``cProfile`` (CPU clock) and prints the top N by own time.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import torch

from swapper.pressure.model import GPT, GPTConfig, init_weights_
from swapper.step import OffloadAdamW, StepConfig
from swapper.zero import OffloadConfig
from swapper.zero.local.offload import OffloadedModel

Phases = Callable[[], tuple[float, float]]


def _plain(model: GPT, tokens: torch.Tensor) -> Phases:
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_(True) for p in params]
    optimizer = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.01, fused=True)

    def iteration() -> tuple[float, float]:
        start = time.process_time()
        model.loss(tokens).backward()
        middle = time.process_time()
        for p, m in zip(params, masters, strict=True):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, masters, strict=True):
                p.copy_(m)
        model.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)
        return middle - start, time.process_time() - middle

    return iteration


def _swapper(model: GPT, tokens: torch.Tensor, sub_group: int) -> tuple[Phases, OffloadedModel]:
    config = OffloadConfig.create(
        device_nbytes=None,
        host_nbytes=None,
        step=StepConfig(sub_group_numel=sub_group),
        device="cpu",
    )
    wrapped = OffloadedModel(model, config)
    optimizer = OffloadAdamW(
        wrapped.parameters(),
        lr=1e-3,
        weight_decay=0.01,
        tiers=wrapped,
        config=StepConfig(max_grad_norm=1.0),
    )

    def iteration() -> tuple[float, float]:
        start = time.process_time()
        model.loss(tokens).backward()
        middle = time.process_time()
        optimizer.step()
        optimizer.zero_grad()
        return middle - start, time.process_time() - middle

    return iteration, wrapped


def _round(args: argparse.Namespace) -> dict[str, float]:
    config = GPTConfig.for_params(args.params)
    plain = GPT(config).to(torch.bfloat16)
    init_weights_(plain, 0)
    offloaded = copy.deepcopy(plain)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1))
    sub_group = args.sub_group or max(1024, 12 * args.params // 4 // 4 // 12)
    plain_it = _plain(plain, tokens)
    swapper_it, wrapped = _swapper(offloaded, tokens, sub_group)
    try:
        for _ in range(args.warmup):
            plain_it()
            swapper_it()
        p: list[tuple[float, float]] = []
        s: list[tuple[float, float]] = []
        for _ in range(args.iters):
            p.append(plain_it())
            s.append(swapper_it())
        if args.profile:
            profile = cProfile.Profile(time.process_time)
            profile.enable()
            for _ in range(args.iters):
                swapper_it()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    finally:
        wrapped.close()

    def med(rows: list[tuple[float, float]], part: int | None) -> float:
        return statistics.median(sum(r) if part is None else r[part] for r in rows) * 1e3

    return {
        "plain": med(p, None),
        "swapper": med(s, None),
        "plain_fb": med(p, 0),
        "plain_step": med(p, 1),
        "swapper_fb": med(s, 0),
        "swapper_step": med(s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--params", type=int, default=2_000_000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--sub-group", type=int, default=None, help="optimizer sub-group numel")
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print top N")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"load {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}", flush=True)
    print(
        f"{'round':>5} {'plain ms':>9} {'swapper ms':>10} {'ratio':>6}  "
        "plain fwd+bwd / step  swapper fwd+bwd / step (ms)"
    )
    ratios = []
    for index in range(args.rounds):
        torch.manual_seed(index)
        r = _round(args)
        ratios.append(r["swapper"] / r["plain"])
        print(
            f"{index:>5} {r['plain']:>9.2f} {r['swapper']:>10.2f} {ratios[-1]:>6.3f}  "
            f"{r['plain_fb']:>8.2f} / {r['plain_step']:<6.2f}      "
            f"{r['swapper_fb']:>8.2f} / {r['swapper_step']:.2f}",
            flush=True,
        )
    if args.rounds > 1:
        print(f"median ratio {statistics.median(ratios):.3f}")
    print(f"load {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
