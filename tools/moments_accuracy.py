"""The accuracy cost of compressed moments (``StepConfig.moments``) on the pressure GPT.

Trains ``swapper-pressure``'s default model and data (2M parameters, batch 4 x 64
tokens, bf16, lr 1e-3, weight decay 0.01, clipping at 1.0, seed 0) three times in one
process, a step of each in turn: Adam moments stored fp32, bf16 and int8. The optimizer
state stays in memory here (the stored form, and so every number, is the same as when it
streams from NVMe: ``swapper-pressure --moments`` shows the budgeted run bit-identical to
the unlimited one). Prints the loss at the last step, the mean over the last 20 steps,
and the per-step loss difference against fp32 moments (max, mean, at the last step);
``--json FILE`` keeps every loss.

    PYTHONPATH=. python tools/moments_accuracy.py [--steps 200] [--json losses.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from swapper import ManagerConfig, OffloadAdamW, StepConfig
from swapper.pressure.model import GPT, GPTConfig, batches, init_weights_

MOMENTS = ("fp32", "bf16", "int8")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--params", type=int, default=2_000_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    config = GPTConfig.for_params(args.params)
    data = batches(config, batch=4, seq=64, steps=args.steps, seed=0)
    models, optimizers = {}, {}
    for moments in MOMENTS:
        gpt = GPT(config).to(torch.bfloat16)
        init_weights_(gpt, seed=0)
        models[moments] = gpt
        optimizers[moments] = OffloadAdamW(
            gpt.parameters(),
            lr=1e-3,
            weight_decay=0.01,
            tiers=ManagerConfig(device_nbytes=0, host_nbytes=None),
            config=StepConfig(max_grad_norm=1.0, moments=moments, name=f"adamw-{moments}"),
        )
    losses: dict[str, list[float]] = {m: [] for m in MOMENTS}
    seconds: dict[str, float] = dict.fromkeys(MOMENTS, 0.0)
    print(f"pressure GPT {config.num_params():,} params, {args.steps} steps")
    for step, tokens in enumerate(data, 1):
        for moments in MOMENTS:
            start = time.perf_counter()
            loss = models[moments].loss(tokens)
            loss.backward()
            optimizers[moments].step()
            optimizers[moments].zero_grad()
            seconds[moments] += time.perf_counter() - start
            losses[moments].append(float(loss))
        if step % 20 == 0 or step == 1:
            print(f"  step {step}: " + ", ".join(f"{m} {losses[m][-1]:.5f}" for m in MOMENTS))
    base = losses["fp32"]
    print(
        f"{'moments':<8} {'loss@last':>10} {'mean last 20':>13} {'max |d|':>9} {'mean |d|':>9} "
        f"{'d@last':>9} {'rel d@last':>10} {'s/step':>7}"
    )
    for moments in MOMENTS:
        got = losses[moments]
        diff = [abs(a - b) for a, b in zip(got, base, strict=True)]
        print(
            f"{moments:<8} {got[-1]:>10.5f} {statistics.mean(got[-20:]):>13.5f} "
            f"{max(diff):>9.5f} {statistics.mean(diff):>9.5f} {got[-1] - base[-1]:>+9.5f} "
            f"{(got[-1] - base[-1]) / base[-1]:>+10.4%} {seconds[moments] / args.steps:>7.3f}"
        )
    for optimizer in optimizers.values():
        optimizer.close()
    if args.json is not None:
        args.json.write_text(json.dumps({"params": config.num_params(), "losses": losses}))


if __name__ == "__main__":
    main()
