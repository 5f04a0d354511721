"""Peak memory while a model built on the meta device is materialised into the tiers.

Builds the pressure GPT of ``--params`` parameters under ``torch.device("meta")`` and wraps
it with ``swapper.offload(..., materialize=...)`` under ``--device-budget`` and
``--host-budget``, the rest spilling to NVMe in a private directory under ``--dir``. Peak
RSS is sampled every millisecond from ``/proc/self/statm`` during the wrap; the figure
reported is the peak above the RSS just before it (torch loaded, the meta model built),
beside the bound ``device budget + host budget + largest module + baseline``: the largest
module counted as its bf16 bytes plus the fp32 values its init draws first, the baseline
being the same figure for a 1M-parameter model (the manager, its engine, its threads).

    python tools/meta_peak.py --params 200M --device-budget 50MiB --host-budget 100MiB --dir .

glibc's mmap threshold is set to 64 KiB first (as ``swapper-pressure`` does) so that a
freed tensor leaves the process at once instead of sitting in the allocator's arenas.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import sys
import tempfile
import threading
import time

import torch

import swapper
from swapper.cli_args import size_arg
from swapper.pressure.model import GPT, GPTConfig
from swapper.pressure.weights import materialize_
from swapper.zero import OffloadConfig
from tiers.units import format_size

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class _Sampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = _rss()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--params", type=size_arg, default=200_000_000)
    parser.add_argument("--device-budget", type=size_arg, default=50 << 20)
    parser.add_argument("--host-budget", type=size_arg, default=100 << 20)
    parser.add_argument("--dir", default=".")
    args = parser.parse_args(argv)
    with contextlib.suppress(OSError):  # freed tensors leave the process at once
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)
    # The baseline: the same path for a tiny model (the manager, its engine and threads).
    baseline, _ = _wrap(GPTConfig.for_params(1_000_000), args)
    config = GPTConfig.for_params(args.params)
    peak, seconds = _wrap(config, args)
    with torch.device("meta"):
        model = GPT(config)
    # The init draws each module's values in fp32, then casts: 6 bytes per element at once.
    largest = max(sum(p.numel() * 6 for p in m.parameters(recurse=False)) for m in model.modules())
    bound = args.device_budget + args.host_budget + largest + baseline
    print(
        f"{config.num_params() / 1e6:.1f}M parameters "
        f"({format_size(2 * config.num_params())} bf16) "
        f"materialised in {seconds:.1f} s; peak RSS above the start {format_size(peak)}, bound "
        f"{format_size(bound)} = device budget {format_size(args.device_budget)} + host budget "
        f"{format_size(args.host_budget)} + largest module {format_size(largest)} "
        "(bf16 + its fp32 init) "
        f"+ baseline {format_size(baseline)} (a 1M-parameter model the same way)"
    )
    return 0 if peak <= bound else 1


def _wrap(config: GPTConfig, args: argparse.Namespace) -> tuple[int, float]:
    """Materialise a meta GPT of ``config`` into the tiers: (peak RSS above the start, s)."""
    with torch.device("meta"):
        model = GPT(config)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="meta-peak-") as tmp:
        settings = OffloadConfig.create(
            device_nbytes=args.device_budget,
            host_nbytes=args.host_budget,
            nvme_dirs=[tmp],
            device="cpu",
        )
        before = _rss()
        sampler = _Sampler()
        sampler.start()
        start = time.perf_counter()

        def materialize(module: torch.nn.Module, place: object) -> None:
            materialize_(module, dtype=torch.bfloat16, seed=0, on_module=place)  # type: ignore[arg-type]

        with swapper.offload(model, settings, materialize=materialize) as wrapped:
            seconds = time.perf_counter() - start
            sampler.stop.set()
            sampler.join()
            wrapped.close()
    return sampler.peak - before, seconds


if __name__ == "__main__":
    sys.exit(main())
