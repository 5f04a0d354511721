"""Why does verifying reads cost disk speed here: CPU time, or memory bandwidth?

Verifying a read hashes every byte (XXH3-64, about 10-12 GB/s on one core of the
development VM), on verifier threads that release the GIL, so on a machine with a free
core the hash costs no wall time of its own. What it cannot avoid is reading every byte
once more from memory. This tool separates the two costs: it reads one file with the
project's AIO engine (O_DIRECT, the same settings as ``swapper-bench tiers``) while
another thread does nothing (``none``), hashes a buffer that fits in the CPU cache without
pause (``cpu``: a core kept busy, little memory traffic), or hashes a buffer far larger
than the cache without pause (``memory``: a core streaming through DRAM, as verification
does), alternating the three over several rounds, and prints the read GB/s of each with
its ratio to ``none``.

If ``cpu`` reads as fast as ``none`` and ``memory`` reads slower, the disk and the hash
compete for memory bandwidth (on a VM whose virtual disk is served from the host's memory,
every byte read is a copy by the host), and verification costs read speed in proportion
to the memory traffic it adds, whatever the threads or the chunk size.

The file lives in a private temporary directory under ``--dir`` and is removed at exit.

    python tools/verify_cost.py --dir /tmp --size 1GiB --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from swapper.cli_args import size_arg
from tiers.aio import AioEngine
from tiers.buffers import allocate
from tiers.config import AioConfig
from tiers.nvme.futures import digest

#: One hash of this many bytes per loop; the cache-resident buffer is this size.
_CACHE_NBYTES = 256 << 10
#: The memory-streaming buffer: far larger than any CPU cache.
_DRAM_NBYTES = 512 << 20
_CHUNK_NBYTES = 4 << 20


class _Load:
    """A thread hashing ``buffer`` in ``chunk``-sized pieces until stopped."""

    def __init__(self, buffer: torch.Tensor, chunk: int) -> None:
        self._buffer = buffer
        self._chunk = chunk
        self._stop = threading.Event()
        self.nbytes = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        buffer, chunk = self._buffer, self._chunk
        while not self._stop.is_set():
            for start in range(0, buffer.numel(), chunk):
                digest(buffer[start : start + chunk])  # what verification runs
            self.nbytes += buffer.numel()

    def __enter__(self) -> _Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _read_pass(engine: AioEngine, path: Path, out: torch.Tensor) -> float:
    """Read the whole file into ``out``; GB/s."""
    start = time.perf_counter()
    engine.pread(out, path, 0).result()
    return out.numel() / (time.perf_counter() - start) / 1e9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Verification's cost: CPU or memory bandwidth")
    parser.add_argument("--dir", type=Path, default=Path("."), help="where the test file goes")
    parser.add_argument("--size", type=size_arg, default=1 << 30, help="file size (1GiB)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three loads")
    args = parser.parse_args(argv)
    aio = AioConfig(block_size=8 << 20, queue_depth=32)
    cache_buffer = torch.randint(0, 256, (_CACHE_NBYTES,), dtype=torch.uint8)
    dram_buffer = torch.randint(0, 256, (_DRAM_NBYTES,), dtype=torch.uint8)
    loads = {
        "none": None,
        "cpu": (cache_buffer, _CACHE_NBYTES),
        "memory": (dram_buffer, _CHUNK_NBYTES),
    }
    speeds: dict[str, list[float]] = {name: [] for name in loads}
    hashed: dict[str, float] = {name: 0.0 for name in loads}
    with (
        tempfile.TemporaryDirectory(dir=args.dir, prefix="verify-cost-") as tmp,
        AioEngine(aio) as engine,
        allocate(args.size) as buffer,
    ):
        path = Path(tmp) / "read.bin"
        buffer.tensor.random_(0, 256)
        engine.pwrite(buffer.tensor, path, 0).result()
        _read_pass(engine, path, buffer.tensor)  # warm-up
        for _ in range(args.rounds):
            for name, load in loads.items():
                if load is None:
                    speeds[name].append(_read_pass(engine, path, buffer.tensor))
                    continue
                with _Load(*load) as running:
                    time.sleep(0.05)  # let the load reach its pace
                    before, start = running.nbytes, time.perf_counter()
                    speeds[name].append(_read_pass(engine, path, buffer.tensor))
                    seconds = time.perf_counter() - start
                    hashed[name] += (running.nbytes - before) / seconds / 1e9
    base = statistics.median(speeds["none"])
    print(f"O_DIRECT read of {args.size} bytes, medians of {args.rounds} rounds (GB = 1e9 B)")
    print("load     read GB/s  ratio  load hashed GB/s   all rounds")
    for name, values in speeds.items():
        median = statistics.median(values)
        rate = hashed[name] / args.rounds
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name:<8} {median:9.2f}  {median / base:5.2f}  {rate:16.1f}   {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
