"""The whole training iteration of swapper-pressure's GPT beside DeepSpeed ZeRO-Infinity and
plain PyTorch, on one directory, alternating (issue 24's third acceptance point).

Runs in the virtual environment that has DeepSpeed (see tools/deepspeed_compare.py for how
/work/dsvenv was made: DeepSpeed 0.19.8 with its async_io op, the project's torch)::

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=$PWD /work/dsvenv/bin/python \\
        tools/deepspeed_iteration.py --dir /tmp/x --params 20M --rounds 3

Three sides train the same GPT (``swapper.pressure.model``: same init, same batches of
``--batch`` x ``--seq`` tokens, bf16 parameters), one iteration = forward, backward,
optimizer step (AdamW, lr 1e-3, weight decay 0.01, gradients clipped to norm 1), zero_grad:

- **plain**: everything in memory; fp32 master copies updated by
  ``torch.optim.AdamW(fused=True)`` (the pressure runner's plain reference);
- **swapper**: ``OffloadedModel`` + ``OffloadAdamW`` with swapper-pressure's default
  budgets: device a quarter of the 16-bit parameters, host a quarter of the optimizer
  state, sub-groups of a quarter of the host budget, the rest on NVMe in ``--dir``;
- **deepspeed**: ``deepspeed.initialize`` with ZeRO stage 3, ``offload_param`` and
  ``offload_optimizer`` to NVMe in ``--dir`` (its ``DeepSpeedCPUAdam``, its pipelined
  optimizer swapper), bf16, on DeepSpeed's CPU accelerator with a one-rank gloo group.
  Budgets as close to swapper's as its knobs allow: ``sub_group_size`` = swapper's
  sub-group; ``stage3_max_live_parameters`` = the device budget in elements;
  ``offload_param.max_in_cpu`` = 0 and its buffers sized to the largest parameter
  (``buffer_count`` 5, its default);
  ``offload_optimizer.buffer_count`` 12 (a sub-group computing, one read ahead, one
  written behind, 3 state tensors each, and the moments a first step makes outside the
  pool: with 4, its default, the pipelined swapper fails its
  ``assert new_alloc_buffers is not None`` at the first step, as in
  tools/deepspeed_compare.py). DeepSpeed swaps only tensors of at least its
  ``min_aio_bytes`` (1 MiB): at 2M parameters it swaps nothing and the comparison
  means nothing; at 20M every matrix and sub-group is swapped (the tool prints the swap
  files it finds after set-up). DeepSpeed has no single host budget: its buffers are
  fixed pools, so its host memory is not bounded as swapper's is. Its
  writes are never flushed (swapper's step is durable when it returns).

Every round runs ``--iters`` iterations of each side in turn (the order turns every
round) after ``--warmup`` untimed ones in the first round; the figure per side is the
median of its iteration seconds, and the result is
``(deepspeed - plain) / (swapper - plain)`` per round and the median of those (> 2: the
issue's bound). swapper's losses are compared bit for bit with plain PyTorch's (the same
iterations on the same data: swapper is bit-identical to plain by construction); a
difference is printed and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from swapper.cli_args import count_arg
from swapper.pressure.model import GPT, GPTConfig, batches, init_weights_

LR, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, 0.01, 1.0

#: one iteration on the given tokens → (loss, seconds: forward+backward, step+zero_grad)
Iteration = Callable[[torch.Tensor], tuple[float, float, float]]


def _model(config: GPTConfig) -> GPT:
    model = GPT(config).to(torch.bfloat16)
    init_weights_(model, 0)
    return model


class PlainSide:
    """Plain PyTorch in memory: bf16 model, fp32 masters, fused AdamW, clipping."""

    def __init__(self, config: GPTConfig) -> None:
        self.model = _model(config)
        self.params = list(self.model.parameters())
        self.masters = [p.detach().float().requires_grad_(True) for p in self.params]
        self.optimizer = torch.optim.AdamW(
            self.masters, lr=LR, weight_decay=WEIGHT_DECAY, fused=True
        )

    def __call__(self, tokens: torch.Tensor) -> tuple[float, float, float]:
        start = time.perf_counter()
        loss = self.model.loss(tokens)
        loss.backward()
        middle = time.perf_counter()
        for p, m in zip(self.params, self.masters, strict=True):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
        torch.nn.utils.clip_grad_norm_(self.masters, MAX_GRAD_NORM)
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                p.copy_(m)
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        return float(loss.detach()), middle - start, end - middle

    def close(self) -> None:
        pass


class SwapperSide:
    """swapper-pressure's budgeted run: its default budgets and sub-groups."""

    def __init__(self, config: GPTConfig, folder: Path, sub_group: int | None = None) -> None:
        from swapper.pressure.runner import PressureSettings, budgeted_config, default_budgets
        from swapper.step import OffloadAdamW, StepConfig
        from swapper.zero.local.offload import OffloadedModel

        model = _model(config)
        numel = sum(p.numel() for p in model.parameters())
        settings = PressureSettings(sub_group_numel=sub_group)
        device, host, sub_group = default_budgets(settings, numel)
        self.budgets = {"device_nbytes": device, "host_nbytes": host, "sub_group": sub_group}
        self.model = OffloadedModel(
            model, budgeted_config(settings, device, host, sub_group, [folder])
        )
        self.optimizer = OffloadAdamW(
            self.model.parameters(),
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            tiers=self.model,
            config=StepConfig(max_grad_norm=MAX_GRAD_NORM),
        )
        self._gpt = model

    def __call__(self, tokens: torch.Tensor) -> tuple[float, float, float]:
        start = time.perf_counter()
        loss = self._gpt.loss(tokens)
        loss.backward()
        middle = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad()
        end = time.perf_counter()
        return float(loss.detach()), middle - start, end - middle

    def close(self) -> None:
        self.optimizer.close()
        self.model.close()


def deepspeed_config(
    folder: Path, *, batch: int, sub_group: int, live_numel: int, largest_numel: int
) -> dict[str, Any]:
    """The ZeRO-Infinity settings (module docstring says which knob stands for what)."""
    aio = {
        "block_size": 1 << 20,
        "queue_depth": 32,
        "intra_op_parallelism": 1,
        "single_submit": False,
        "overlap_events": True,
    }
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": MAX_GRAD_NORM,
        "bf16": {"enabled": True},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": [0.9, 0.999]},
        },
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": sub_group,
            "stage3_max_live_parameters": live_numel,
            "stage3_max_reuse_distance": live_numel,
            "stage3_prefetch_bucket_size": live_numel // 2,
            "stage3_param_persistence_threshold": 0,
            "offload_param": {
                "device": "nvme",
                "nvme_path": str(folder),
                "pin_memory": False,
                "buffer_count": 5,
                "buffer_size": largest_numel,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": str(folder),
                "pin_memory": False,
                "buffer_count": 12,  # (4, the default, fails: see the module docstring)
                "pipeline_read": True,
                "pipeline_write": True,
            },
        },
        "aio": aio,
        "wall_clock_breakdown": False,
        "steps_per_print": 1 << 30,
    }


class DeepSpeedSide:
    """DeepSpeed ZeRO-3 with parameters and optimizer state on NVMe (ZeRO-Infinity)."""

    def __init__(
        self, config: GPTConfig, folder: Path, batch: int, budgets: dict[str, int]
    ) -> None:
        import deepspeed  # pyright: ignore[reportMissingImports]

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        template = _model(config)
        largest = max(p.numel() for p in template.parameters())
        self.ds_config = deepspeed_config(
            folder,
            batch=batch,
            sub_group=budgets["sub_group"],
            live_numel=max(largest, budgets["device_nbytes"] // 2),
            largest_numel=largest,
        )
        # Built in memory with the other sides' initial weights, then partitioned by
        # initialize (offload_param: to NVMe). (Built under deepspeed.zero.Init and
        # copied in through GatheredParameters, the first loss differed from plain's.)
        model = template
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=self.ds_config
        )
        self._gpt = model

    def __call__(self, tokens: torch.Tensor) -> tuple[float, float, float]:
        start = time.perf_counter()
        loss = self.engine(tokens[:, :-1])
        logits = loss.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
        self.engine.backward(loss)
        middle = time.perf_counter()
        self.engine.step()
        end = time.perf_counter()
        return float(loss.detach()), middle - start, end - middle

    def close(self) -> None:
        self.engine.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--params", type=count_arg, default=20_000_000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per side and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations per side, first")
    parser.add_argument(
        "--sides", default="plain,swapper,deepspeed", help="comma-separated (default all three)"
    )
    parser.add_argument(
        "--sub-group",
        type=count_arg,
        default=None,
        help="optimizer sub-group elements, both sides (default: swapper-pressure's)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    names = [s for s in args.sides.split(",") if s]
    config = GPTConfig.for_params(args.params)
    total = args.warmup + args.rounds * args.iters
    data = batches(
        config, batch=args.batch, seq=args.seq, steps=total, seed=0
    )  # (as swapper-pressure)
    load = os.getloadavg()
    print(
        f"GPT {config}, {args.batch}x{args.seq} tokens; load {load[0]:.2f} {load[1]:.2f}; "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}",
        flush=True,
    )
    seconds: dict[str, list[list[float]]] = {n: [] for n in names}
    parts: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp, contextlib.ExitStack() as stack:
        sides: dict[str, Iteration] = {}
        budgets: dict[str, int] = {}
        if "plain" in names:
            sides["plain"] = PlainSide(config)
        if "swapper" in names or "deepspeed" in names:
            (Path(tmp) / "sw").mkdir()
            sw = SwapperSide(config, Path(tmp) / "sw", args.sub_group)
            budgets = sw.budgets
            if "swapper" in names:
                sides["swapper"] = sw
            stack.callback(sw.close)
        if "deepspeed" in names:
            (Path(tmp) / "ds").mkdir()
            ds = DeepSpeedSide(config, Path(tmp) / "ds", args.batch, budgets)
            sides["deepspeed"] = ds
            stack.callback(ds.close)
        print(f"budgets {budgets}", flush=True)
        if "deepspeed" in names:
            files = [f for f in (Path(tmp) / "ds").rglob("*") if f.is_file()]
            nbytes = sum(f.stat().st_size for f in files)
            print(f"deepspeed swap files: {len(files)}, {nbytes / 2**20:.1f} MiB", flush=True)
        for name in names:  # warm-up, the same batches for every side
            for i in range(args.warmup):
                loss, _, _ = sides[name](data[i])
                losses[name].append(loss)
        step = args.warmup
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            cells = []
            for name in order:
                times = []
                for i in range(args.iters):
                    loss, fb, st = sides[name](data[step + i])
                    losses[name].append(loss)
                    times.append(fb + st)
                    parts[name].append((fb, st))
                seconds[name].append(times)
                cells.append(f"{name} {statistics.median(times):.3f}s")
            step += args.iters
            load = os.getloadavg()[0]
            print(f"  round {r + 1}: " + ", ".join(cells) + f"  (load {load:.2f})", flush=True)
    medians = {n: [statistics.median(t) for t in seconds[n]] for n in names}
    for name in names:
        fb = statistics.median(p[0] for p in parts[name])
        st = statistics.median(p[1] for p in parts[name])
        print(
            f"{name}: {statistics.median(medians[name]):.3f} s an iteration (median of the "
            f"rounds' medians: {', '.join(f'{x:.3f}' for x in medians[name])}); "
            f"forward+backward {fb:.3f} s, step {st:.3f} s"
        )
    result: dict[str, Any] = {"medians": medians, "losses": losses, "budgets": budgets}
    status = 0
    if {"plain", "swapper", "deepspeed"} <= set(names):
        ratios = [
            (d - p) / (s - p) if s != p else float("inf")
            for d, s, p in zip(
                medians["deepspeed"], medians["swapper"], medians["plain"], strict=True
            )
        ]
        result["ratios"] = ratios
        print(
            "(deepspeed - plain) / (swapper - plain) per round "
            f"{', '.join(f'{x:.2f}' for x in ratios)}, median {statistics.median(ratios):.2f}"
        )
    if "plain" in names and "swapper" in names:
        same = losses["plain"] == losses["swapper"]
        result["swapper_losses_equal_plain"] = same
        print(f"swapper's losses bit-identical to plain PyTorch's: {'yes' if same else 'NO'}")
        if not same:
            status = 1
    for name in names:
        print(f"{name} losses " + " ".join(f"{x:.6f}" for x in losses[name]))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
