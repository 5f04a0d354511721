"""How much do swapper's module hooks cost per parameter tensor?

A deep, narrow bf16 model (``--layers`` blocks of Linear(width, width) + LayerNorm(width):
4 parameter tensors per block, little compute per module, so the hooks show) runs
forward+backward in plain PyTorch and wrapped by :func:`swapper.offload` with no budgets
(every parameter stays in memory: what is measured is the hooks' bookkeeping, not I/O),
and, with ``--window``, with a read-ahead window of that many bytes. Prints the median
milliseconds per forward+backward over ``--rounds`` and the ratio to plain PyTorch.

    python tools/hook_overhead.py --layers 18 72 144 --rounds 5 --window 1048576
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import swapper
from swapper import OffloadConfig


def _model(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    modules: list[nn.Module] = []
    for _ in range(layers):
        modules += [nn.Linear(width, width), nn.LayerNorm(width)]
    return nn.Sequential(*modules).to(torch.bfloat16)


def _median_ms(run: Callable[[], None], rounds: int) -> float:
    for _ in range(2):  # warm-up; the first swapper step also records the fetch order
        run()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[18, 72, 144])
    parser.add_argument("--width", type=int, default=64, help="elements (default 64)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--window", type=int, default=None, help="read-ahead window, bytes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x = torch.randn(4, args.width).to(torch.bfloat16)

    def step(model: nn.Module) -> Callable[[], None]:
        def run() -> None:
            model(x).float().sum().backward()
            model.zero_grad()

        return run

    windows: list[int | None] = [None] if args.window is None else [None, args.window]
    for layers in args.layers:
        tensors = 4 * layers
        plain_ms = _median_ms(step(_model(layers, args.width)), args.rounds)
        line = f"{tensors:5d} tensors: plain {plain_ms:8.2f} ms"
        for window in windows:
            model = _model(layers, args.width)
            config = OffloadConfig.create(device="cpu", prefetch_nbytes=window)
            with swapper.offload(model, config) as wrapped:
                ms = _median_ms(step(wrapped), args.rounds)
            label = "no budgets" if window is None else f"window {window} B"
            line += f" | {label}: {ms:8.2f} ms ({ms / plain_ms:5.1f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
