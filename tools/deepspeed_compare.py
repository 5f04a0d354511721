"""swapper's optimizer step beside DeepSpeed's pipelined optimizer swapper, on one directory,
alternating (issue 24).

Runs in a separate virtual environment that has DeepSpeed (never the project's ``.venv``)::

    python3 -m venv /work/dsvenv
    # torch from the project's venv, not a second copy (a .pth line naming its site-packages)
    echo /work/main/.venv/lib/python3.11/site-packages \\
        > /work/dsvenv/lib/python3.11/site-packages/shared_torch.pth
    /work/dsvenv/bin/pip install deepspeed==0.19.8      # its async_io op needs libaio-dev
    PYTHONPATH=$PWD /work/dsvenv/bin/python tools/deepspeed_compare.py --dir /tmp/x \\
        --params 256M --sub-group 32M --rounds 3

What each side does, per step, over ``--params`` fp32 master weights in sub-groups of
``--sub-group`` elements, with bf16 parameters and bf16 gradients in memory (``--sides``
names the sides run, default ``deepspeed,swapper``):

- **deepspeed** (the pipelined optimizer swapper, no gradient swap): DeepSpeed ZeRO-3's
  optimizer step loop as ``stage3.py`` runs it with ``offload_optimizer: {device: nvme,
  pipeline_read: true, pipeline_write: true}``, but with the fp32 gradient built in memory
  from the bf16 one (the comparison issue 24 calls "the pipelined optimizer swapper, no
  grad swap"): per sub-group ``swap_in_optimizer_state`` (reading the next one ahead),
  ``DeepSpeedCPUAdam.step``, the bf16 copy, ``swap_out_optimizer_state`` (written behind).
  24 B per parameter move (12 read, 12 written).
- **deepspeed-zero3** (ZeRO-3's step with its fp32-gradient swap): the same swapper class
  driven as ``stage3.py`` drives it when the gradients are offloaded to NVMe. At the
  gradient-accumulation boundary (``_offload_grad_partition_at_boundary`` and
  ``_swap_out_offload_fp32_gradients``) each sub-group's bf16 gradient is cast to fp32
  (``grad_buffer.to(fp32)``) and written by ``swap_out_gradients`` (one piece per
  sub-group at offset 0: aligned, the fewest requests, the case most favourable to
  DeepSpeed); then the same step loop, where ``swap_in_optimizer_state`` reads each
  sub-group's fp32 gradient back beside its state (``_swap_in_optimizer_state``: the
  gradient file into ``parameter.grad``). Timed from the first gradient cast to the last
  state written: 32 B per parameter (12 + 4 written, 12 + 4 read). Not a full engine (a
  ``deepspeed.initialize`` with NVMe offload would also swap the 16-bit parameters and
  needs a model and its forward/backward; this times the step's part only).
- **swapper**: ``OffloadAdamW.step()`` over the same parameters (its state on NVMe in the
  same directory; host budget 4 sub-groups); 24 B per parameter, durable when it returns.

DeepSpeed's writes are not flushed (it never fsyncs its swap files): a power cut can lose a
step it finished; swapper's step is durable when it returns.

Rounds rotate the sides' order (each side comes first in turn); the figures are medians and
the ratio ``<deepspeed side> / swapper`` (> 1: swapper faster) is printed per round and as
the median of the rounds'. Not built here (issue 24 asks for it too): a ZeRO-Infinity
iteration of the pressure runner's GPT.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from swapper.cli_args import count_arg

TENSOR_NUMEL = 10_000_000


def _bf16_params(params: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    weights, grads = [], []
    left = params
    while left:
        n = min(TENSOR_NUMEL, left)
        weights.append(torch.randn(n, generator=gen).to(torch.bfloat16))
        grads.append((torch.randn(n, generator=gen) * 1e-3).to(torch.bfloat16))
        left -= n
    return weights, grads


class DeepSpeedSide:
    """DeepSpeed's PipelinedOptimizerSwapper driven as ZeRO-3's step drives it."""

    def __init__(
        self, folder: Path, params: int, sub_group: int, seed: int, *, grad_swap: bool = False
    ) -> None:
        import deepspeed  # pyright: ignore[reportMissingImports]
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # pyright: ignore[reportMissingImports]
        from deepspeed.runtime.swap_tensor.aio_config import (  # pyright: ignore[reportMissingImports]
            get_aio_config,
        )
        from deepspeed.runtime.swap_tensor.pipelined_optimizer_swapper import (  # pyright: ignore[reportMissingImports]
            PipelinedOptimizerSwapper,
        )
        from deepspeed.runtime.zero.offload_config import (  # pyright: ignore[reportMissingImports]
            DeepSpeedZeroOffloadOptimizerConfig,
        )

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        self.grad_swap = grad_swap
        weights, self.grads16 = _bf16_params(params, seed)
        flat16 = torch.cat(weights)
        flat_grad = torch.cat(self.grads16)
        self.sub16 = list(flat16.split(sub_group))
        self.subgrad16 = list(flat_grad.split(sub_group))
        self.fp32 = []
        for i in range(len(self.sub16)):
            p = torch.nn.Parameter(torch.empty(0, dtype=torch.float32), requires_grad=False)
            p.ds_id = f"sg{i}"  # pyright: ignore[reportAttributeAccessIssue]
            self.fp32.append(p)
        self.optimizer = DeepSpeedCPUAdam([{"params": []}], lr=1e-4, weight_decay=0.01)
        swap_config = DeepSpeedZeroOffloadOptimizerConfig(
            device="nvme",
            nvme_path=folder,
            pipeline_read=True,
            pipeline_write=True,
            # a sub-group in use (3 state tensors), the next read ahead (3), the last being
            # written behind (3), and the moments a first step creates outside the pool
            # (2): 4, the default, runs out at the first pipelined step; with the gradient
            # swap each sub-group read also takes a buffer for its fp32 gradient (+3)
            buffer_count=16 if grad_swap else 12,
            pin_memory=False,
        )
        self.swapper = PipelinedOptimizerSwapper(
            swap_config=swap_config,
            aio_config=get_aio_config({}),
            base_folder=str(folder),
            optimizer=self.optimizer,
            largest_numel=max(s.numel() for s in self.sub16),
            device="cpu",
            dtype=torch.float32,
            timers=None,
        )
        # as stage3: fp32 masters written from the 16-bit partitions, then the states made
        self.swapper.initialize_parameters(parameters=self.fp32, src_tensors=self.sub16)
        self._loop(initialize=True)

    def _loop(self, *, initialize: bool) -> None:
        n = len(self.fp32)
        for i, p in enumerate(self.fp32):
            nxt = self.fp32[i + 1] if i + 1 < n and not initialize else None
            self.swapper.swap_in_optimizer_state(parameter=p, async_parameter=nxt)
            if initialize:
                p.grad = torch.zeros_like(p)
            elif not self.grad_swap:
                p.grad = self.subgrad16[i].float()  # in memory: no gradient swap
            elif p.grad is None or p.grad.numel() != p.numel():  # read by swap_in (stage3)
                raise RuntimeError(f"DeepSpeed did not read sub-group {i}'s fp32 gradient back")
            self.optimizer.param_groups[0]["params"] = [p]
            if initialize:
                lr = self.optimizer.param_groups[0]["lr"]
                self.optimizer.param_groups[0]["lr"] = 0.0
                self.optimizer.step()
                self.optimizer.param_groups[0]["lr"] = lr
            else:
                self.optimizer.step()
                self.sub16[i].copy_(p.detach())
            self.optimizer.param_groups[0]["params"] = []
            p.grad = None
            self.swapper.swap_out_optimizer_state(parameter=p, async_swap=nxt is not None)

    def _swap_out_gradients(self) -> None:
        # stage3's boundary: each sub-group's gradient partition cast to fp32 and swapped out
        for p, grad16 in zip(self.fp32, self.subgrad16, strict=True):
            self.swapper.swap_out_gradients(
                parameter=p, gradient_offsets=[0], gradient_tensors=[grad16.float()]
            )

    def step(self) -> float:
        start = time.perf_counter()
        if self.grad_swap:
            self._swap_out_gradients()
        self._loop(initialize=False)
        return time.perf_counter() - start


class SwapperSide:
    """``OffloadAdamW`` over the same sizes, its state on NVMe in ``folder``."""

    def __init__(self, folder: Path, params: int, sub_group: int, seed: int) -> None:
        from swapper.manager import ManagerConfig
        from swapper.step import OffloadAdamW, StepConfig
        from tiers.config import AioConfig

        weights, grads = _bf16_params(params, seed)
        self.params = []
        for w, g in zip(weights, grads, strict=True):
            p = torch.nn.Parameter(w)
            p.grad = g
            self.params.append(p)
        state = 12 * sub_group
        self.optimizer = OffloadAdamW(
            self.params,
            lr=1e-4,
            weight_decay=0.01,
            tiers=ManagerConfig(
                device_nbytes=0, host_nbytes=4 * state, nvme_dirs=[folder], aio=AioConfig()
            ),
            config=StepConfig(sub_group_numel=sub_group),
        )

    def step(self) -> float:
        self.optimizer.step()
        report = self.optimizer.last_step
        if report is None:
            raise RuntimeError("OffloadAdamW.step() returned without a report")
        return report.seconds

    def close(self) -> None:
        self.optimizer.close()


SIDES = ("deepspeed", "deepspeed-zero3", "swapper")


def _sides_arg(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIDES]
    if unknown or "swapper" not in names or len(names) < 2 or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"--sides {text!r}: name swapper and at least one of deepspeed, deepspeed-zero3, "
            "each once, separated by commas"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--params", type=count_arg, default=256_000_000)
    parser.add_argument("--sub-group", type=count_arg, default=32_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--sides",
        type=_sides_arg,
        default=["deepspeed", "swapper"],
        help="comma-separated: swapper and deepspeed and/or deepspeed-zero3",
    )
    args = parser.parse_args(argv)
    names: list[str] = args.sides
    results: dict[str, list[float]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        sides: dict[str, Any] = {}
        for name in names:
            (Path(tmp) / name).mkdir()
            print(f"setting up {name}'s state", flush=True)
            if name == "swapper":
                sides[name] = SwapperSide(Path(tmp) / name, args.params, args.sub_group, 0)
            else:
                sides[name] = DeepSpeedSide(
                    Path(tmp) / name,
                    args.params,
                    args.sub_group,
                    0,
                    grad_swap=name == "deepspeed-zero3",
                )
        try:
            for r in range(args.warmup + args.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                cells = []
                for name in order:
                    seconds = sides[name].step()
                    cells.append(f"{name} {seconds:.2f}s")
                    if r >= args.warmup:
                        results[name].append(seconds)
                label = "warm-up" if r < args.warmup else f"round {r + 1 - args.warmup}"
                print(f"  {label}: " + ", ".join(cells), flush=True)
            if "deepspeed" in sides and "deepspeed-zero3" in sides:
                # the same gradients and steps: the gradient swap must not change the result
                # (a gradient read back stale would)
                same = all(
                    torch.equal(a, b)
                    for a, b in zip(
                        sides["deepspeed"].sub16, sides["deepspeed-zero3"].sub16, strict=True
                    )
                )
                print(
                    "deepspeed-zero3's bf16 parameters after its steps "
                    + ("equal deepspeed's, bit for bit" if same else "DIFFER from deepspeed's"),
                    flush=True,
                )
        finally:
            sides["swapper"].close()
    print(
        f"step at {args.params:,} params, sub-groups of {args.sub_group:,}: "
        + ", ".join(f"{n} {statistics.median(results[n]):.3f} s" for n in names)
        + " (medians)"
    )
    for name in names:
        if name == "swapper":
            continue
        ratios = [d / s for d, s in zip(results[name], results["swapper"], strict=True)]
        print(
            f"{name} / swapper per round {', '.join(f'{x:.2f}' for x in ratios)}, median "
            f"{statistics.median(ratios):.2f} (> 1: swapper faster)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
