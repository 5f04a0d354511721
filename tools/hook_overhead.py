"""What swapper's hooks cost when there is nothing to move: forward + backward of a deep,
narrow GPT through ``swapper.offload`` with unlimited budgets, against the same model in
plain PyTorch, as the number of parameter tensors grows.

``--model llama`` builds a Hugging Face ``LlamaForCausalLM`` instead (hidden 64: 291 and
579 parameter tensors at 32 and 64 layers; needs ``transformers``). Little compute per
module (``--d-model 64``) so that the per-module cost of the hooks (fetch, release, read-
ahead, moving each gradient into its retained 16-bit buffer) shows.
For each depth the plain and the offloaded model (same weights, same batch) alternate
``--iters`` times after ``--warmup`` untimed iterations; the figure is the ratio of the
medians. ``--window`` also runs the offloaded model with that read-ahead window
(``prefetch_nbytes``), the setting under which each fetch used to walk the recorded order.

    python tools/hook_overhead.py --layers 8 16 32 64 --iters 10
    python tools/hook_overhead.py --layers 32 64 --window 1MiB
    python tools/hook_overhead.py --model llama --layers 32 64 --window 1MiB   # 291, 579 tensors
    python tools/hook_overhead.py --layers 32 --iters 15 --warmup 3 --cpu-time --every-hook

No optimizer step is timed (the hooks are the subject); the gradients the offloaded run
keeps accumulate in their retained buffers, as they do over micro-steps.

``--profile N`` also runs ``--iters`` more offloaded iterations under ``cProfile`` (CPU
time, so that other processes on a shared machine do not show) and prints the N
functions that took the most time themselves (where the hooks' cost goes).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import torch

import swapper
from swapper.cli_args import size_arg
from swapper.pressure.model import GPT, GPTConfig
from swapper.zero import OffloadConfig


def _timed(run: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    run()
    return clock() - start


def _llama(layers: int, args: argparse.Namespace) -> torch.nn.Module:
    """A deep narrow Hugging Face Llama (9 tensors per layer + 3), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM  # the optional hf extra

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=args.d_model,
        intermediate_size=2 * args.d_model,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.seq + 1,
    )
    return LlamaForCausalLM(config)


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    if isinstance(model, GPT):
        return model.loss(tokens)
    return model(input_ids=tokens, labels=tokens).loss


def _measure(layers: int, args: argparse.Namespace, window: int | None) -> dict[str, float]:
    torch.manual_seed(0)
    if args.model == "llama":
        plain = _llama(layers, args).to(torch.bfloat16)
    else:
        config = GPTConfig(
            vocab_size=256, context=args.seq, d_model=args.d_model, n_layers=layers, n_heads=4
        )
        plain = GPT(config).to(torch.bfloat16)
    offloaded_model = copy.deepcopy(plain)
    tensors = sum(1 for _ in plain.parameters())
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1))

    def plain_step() -> None:
        _loss(plain, tokens).backward()
        plain.zero_grad(set_to_none=True)

    settings = OffloadConfig.create(prefetch_nbytes=window, device="cpu")
    clock = time.process_time if args.cpu_time else time.perf_counter
    with swapper.offload(offloaded_model, settings) as wrapped:
        if args.every_hook:
            wrapped.set_persistent(False)  # fetch and release around every module again

        def offloaded_step() -> None:
            _loss(offloaded_model, tokens).backward()  # the hooks are on its modules
            if args.every_hook:
                wrapped.zero_grad()  # (retained gradients would otherwise accumulate)

        for _ in range(args.warmup):
            plain_step()
            offloaded_step()
        plain_s: list[float] = []
        offload_s: list[float] = []
        for _ in range(args.iters):
            plain_s.append(_timed(plain_step, clock))
            offload_s.append(_timed(offloaded_step, clock))
        if args.profile:
            profile = cProfile.Profile(time.process_time)
            profile.enable()
            for _ in range(args.iters):
                offloaded_step()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
    p, o = statistics.median(plain_s), statistics.median(offload_s)
    return {"tensors": tensors, "plain_s": p, "swapper_s": o, "ratio": o / p}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument(
        "--model", choices=["gpt", "llama"], default="gpt", help="llama needs transformers"
    )
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--window", type=size_arg, default=None, help="also with this window")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print top N")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time by this process's CPU time (time.process_time), not the wall clock: on a "
        "shared, loaded machine the wall clock measures the neighbours",
    )
    parser.add_argument(
        "--every-hook",
        action="store_true",
        help="persistence off: every module hook fetches and releases (the lifecycle's whole "
        "cost), instead of budgets that hold everything letting the hooks stand aside",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{'layers':>6} {'tensors':>7} {'window':>8} {'plain ms':>9} {'swapper ms':>10} ratio")
    for layers in args.layers:
        for window in [None] if args.window is None else [None, args.window]:
            r = _measure(layers, args, window)
            shown = "none" if window is None else f"{window >> 10}KiB"
            print(
                f"{layers:>6} {int(r['tensors']):>7} {shown:>8} {r['plain_s'] * 1e3:>9.1f} "
                f"{r['swapper_s'] * 1e3:>10.1f} {r['ratio']:.2f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
