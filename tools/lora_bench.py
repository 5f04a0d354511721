"""LoRA over a frozen base on NVMe, at >= 1B base parameters (issue 27, the benchmark).

Builds the pressure GPT (``--params``, bf16) on the meta device with LoRA adapters (rank
``--rank``, on every block's qkv, proj, fc and mlp.proj; bf16 adapters, or fp32 ones as
PEFT keeps them by default with ``--adapters fp32``) over frozen ``nn.Linear`` bases;
materialises it module by module straight into swapper's tiers (device and host budgets
far below the base: the base lives on NVMe), and trains the adapters with
``OffloadAdamW``. Then builds the same model in memory, plain PyTorch (``torch.optim.AdamW``
fused over fp32 masters of the adapters, the reference), and alternates one offloaded and
one plain step for ``--rounds`` rounds on the same batches.

Prints, per offloaded step: seconds, NVMe bytes read and written by kind, of the 16-bit
parameter bytes written the frozen ones (a frozen key's first copy on NVMe: its bytes go
there once, when the host first evicts it, so after the first step this is 0), and
whether a frozen parameter was ever written back (it must not be: frozen weights are read
only, so a copy on NVMe stays current and is never written again);
the peak RSS of the offloaded run (measured before the plain model exists) against the
budgets; and the median seconds per step of both, with their ratio.

    python tools/lora_bench.py --params 1.1G --dir /tmp/lora-bench --json out.json

Disk: the base's 16-bit bytes (2.2 GB at 1.1 B parameters) plus the adapters' state.
Memory: the budgets, the plain model (2 B per parameter) and the activations.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Collection
from pathlib import Path

import torch
from torch import nn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig, Tier
from swapper.cli_args import count_arg, size_arg
from swapper.manager import ManagerStats, TierManager
from swapper.pressure.memory import peak_rss, reset_peak_rss, return_freed_memory
from swapper.pressure.model import GPT, GPTConfig, batches
from swapper.pressure.weights import materialize_
from tiers.units import format_size

TARGETS = ("qkv", "proj", "fc")
LR = 1e-4


class LoraLinear(nn.Module):
    """``base(x) + lora_b(lora_a(x))`` over a frozen ``base``; fp32 adapters take their
    input cast up and give their output cast down, as PEFT's do."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lora = self.lora_b(self.lora_a(x.to(self.lora_a.weight.dtype)))
        return self.base(x) + lora.to(x.dtype)


def build_meta(config: GPTConfig, rank: int) -> GPT:
    """The GPT on the meta device, each block's projections adapted."""
    with torch.device("meta"):
        model = GPT(config)
    for block in model.blocks:
        for parent in (block.attn, block.mlp):
            for name in TARGETS:
                base = getattr(parent, name, None)
                if isinstance(base, nn.Linear):
                    setattr(parent, name, LoraLinear(base, rank))
    return model


def prepare(name: str, module: nn.Module, adapters: torch.dtype) -> None:
    """A freshly materialised module's parameters: adapters trainable (in ``adapters``'
    dtype), everything else frozen."""
    lora = name.rsplit(".", 1)[-1].startswith("lora_")
    for param in module.parameters(recurse=False):
        param.requires_grad_(lora)
        if lora and param.dtype != adapters:
            param.data = param.data.to(adapters)


def materialized(
    adapters: torch.dtype, place: Callable[[str, nn.Module], None]
) -> Callable[[nn.Module, Callable[[str, nn.Module], None]], None]:
    """``materialize=`` for the wrap: each module made, prepared, shown to ``place``,
    then put in the tiers."""

    def materialize(model: nn.Module, put: Callable[[str, nn.Module], None]) -> None:
        def on_module(name: str, module: nn.Module) -> None:
            prepare(name, module, adapters)
            place(name, module)  # (before the wrap empties the parameters)
            put(name, module)

        materialize_(model, dtype=torch.bfloat16, seed=0, on_module=on_module)

    return materialize


def nvme_moves(before: ManagerStats, after: ManagerStats) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes read from and written to NVMe between two stats, by kind."""
    read: dict[str, int] = {}
    written: dict[str, int] = {}
    for key, nbytes in after.kind_nbytes.items():
        kind, src, dst = key
        delta = nbytes - before.kind_nbytes.get(key, 0)
        if delta and src is Tier.NVME:
            read[kind.value] = read.get(kind.value, 0) + delta
        if delta and dst is Tier.NVME:
            written[kind.value] = written.get(kind.value, 0) + delta
    return read, written


def on_nvme(manager: TierManager, keys: Collection[str]) -> set[str]:
    """Which of ``keys`` have a copy on NVMe now."""
    return {key for key in keys if manager.info(key).on_nvme}


def plain_model(config: GPTConfig, rank: int, adapters: torch.dtype) -> GPT:
    model = build_meta(config, rank)

    def on_module(name: str, module: nn.Module) -> None:
        prepare(name, module, adapters)

    materialize_(model, dtype=torch.bfloat16, seed=0, on_module=on_module)
    return model


def plain_step(
    model: GPT, optimizer: torch.optim.Optimizer, masters: list[tuple[nn.Parameter, torch.Tensor]],
    tokens: torch.Tensor,
) -> float:  # fmt: skip
    loss = model.loss(tokens)
    loss.backward()
    for param, master in masters:
        if master is not param:
            master.grad = param.grad.float() if param.grad is not None else None
            param.grad = None
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        for param, master in masters:
            if master is not param:
                param.copy_(master)
    return loss.item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="LoRA over a frozen base on NVMe (issue 27)")
    parser.add_argument("--params", type=count_arg, default=1_100_000_000, help="e.g. 1.1G")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=2, help="offloaded steps before rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device-budget", type=size_arg, default=512 << 20)
    parser.add_argument("--host-budget", type=size_arg, default=1 << 30)
    parser.add_argument("--dir", type=Path, required=True, help="swap directory (removed after)")
    parser.add_argument("--sub-group", type=count_arg, default=1 << 20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-reference", action="store_true", help="skip the plain model")
    args = parser.parse_args(argv)
    return_freed_memory()

    config = GPTConfig.for_params(args.params)
    adapters = torch.float32 if args.adapters == "fp32" else torch.bfloat16
    device_nbytes, host_nbytes = args.device_budget, args.host_budget
    steps = args.warmup + args.rounds
    data = batches(config, batch=args.batch, seq=args.seq, steps=steps, seed=1)
    args.dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, object] = {"argv": sys.argv[1:] if argv is None else argv}

    frozen_written: set[str] = set()
    placed: dict[str, int] = {"base": 0, "adapters": 0}

    def count(_name: str, module: nn.Module) -> None:
        for param in module.parameters(recurse=False):
            key = "adapters" if param.requires_grad else "base"
            placed[key] += param.numel()

    offload_config = OffloadConfig.create(
        nvme_dirs=[args.dir / "nvme"],
        device="cpu",
        device_nbytes=device_nbytes,
        host_nbytes=host_nbytes,
        step=StepConfig(sub_group_numel=args.sub_group),
    )
    reset_peak_rss()
    start = time.perf_counter()
    model = build_meta(config, args.rank)
    offloaded_s: list[float] = []
    plain_s: list[float] = []
    rows: list[dict[str, object]] = []
    with (
        swapper.offload(
            model, offload_config, materialize=materialized(adapters, count)
        ) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=LR, tiers=wrapped) as optimizer,
    ):
        wrap_s = time.perf_counter() - start
        print(
            f"model: {placed['base']:,} frozen + {placed['adapters']:,} trainable "
            f"({args.adapters}) parameters, {config.n_layers} layers, d_model "
            f"{config.d_model}; wrapped in {wrap_s:.1f} s; budgets device "
            f"{format_size(device_nbytes)}, host {format_size(host_nbytes)}",
            flush=True,
        )
        manager = wrapped.manager
        release = manager.release
        frozen_keys = {f"param/{n}" for n, p in model.named_parameters() if not p.requires_grad}

        def spy(key: str, *, modified: bool = True, cold: bool = False) -> None:
            if modified and key in frozen_keys:
                frozen_written.add(key)
            release(key, modified=modified, cold=cold)

        manager.release = spy  # type: ignore[method-assign]

        frozen_nbytes = {k: manager.info(k).nbytes for k in frozen_keys}
        frozen_on_nvme = on_nvme(manager, frozen_keys)  # (the wrap wrote these)
        out["frozen_nvme_at_wrap"] = sum(frozen_nbytes[k] for k in frozen_on_nvme)

        def offloaded_step(i: int) -> None:
            before = wrapped.stats()
            t0 = time.perf_counter()
            loss = model.loss(data[i])  # (the module's own forward: hooks are on it)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            seconds = time.perf_counter() - t0
            read, written = nvme_moves(before, wrapped.stats())
            # A frozen key is written to NVMe only when it first gets a copy there: it is
            # never released modified (the spy), so the copy stays current.
            now = on_nvme(manager, frozen_keys)
            frozen = sum(frozen_nbytes[k] for k in now - frozen_on_nvme)
            frozen_on_nvme.update(now)
            row = {"step": i + 1, "seconds": seconds, "loss": loss.item(),
                   "nvme_read": read, "nvme_written": written,
                   "frozen_nvme_written": frozen}  # fmt: skip
            rows.append(row)
            print(f"offloaded step {i + 1}: {seconds:.2f} s, loss {loss.item():.4f}, "
                  f"NVMe read {read}, written {written} (of which frozen parameters "
                  f"{frozen})", flush=True)  # fmt: skip
            if i >= args.warmup:
                offloaded_s.append(seconds)

        for i in range(args.warmup):
            offloaded_step(i)
        rss = peak_rss()
        stats = wrapped.stats()
        print(
            f"peak RSS {format_size(rss)} (budgets: device {format_size(device_nbytes)} + "
            f"host {format_size(host_nbytes)}); device peak "
            f"{format_size(stats.tiers[Tier.DEVICE].peak_nbytes or 0)}, host peak "
            f"{format_size(stats.tiers[Tier.HOST].peak_nbytes or 0)}",
            flush=True,
        )
        out["peak_rss"] = rss
        reference = None
        if not args.no_reference:
            reference = plain_model(config, args.rank, adapters)
            trainable = [p for p in reference.parameters() if p.requires_grad]
            masters = [(p, p if p.dtype == torch.float32 else p.detach().float().clone())
                       for p in trainable]  # fmt: skip
            plain_opt = torch.optim.AdamW([m for _, m in masters], lr=LR, fused=True)
            plain_step(reference, plain_opt, masters, data[0])  # (warm-up: allocation)
        for r in range(args.rounds):
            offloaded_step(args.warmup + r)
            if reference is not None:
                t0 = time.perf_counter()
                loss = plain_step(reference, plain_opt, masters, data[args.warmup + r])
                plain_s.append(time.perf_counter() - t0)
                print(f"plain step: {plain_s[-1]:.2f} s, loss {loss:.4f}", flush=True)
        out["frozen_written_back"] = sorted(frozen_written)
        out["nvme_base_nbytes"] = placed["base"] * 2
    off = statistics.median(offloaded_s)
    line = f"offloaded: median {off:.2f} s/step over {len(offloaded_s)} rounds"
    if plain_s:
        ref = statistics.median(plain_s)
        line += f"; plain PyTorch: median {ref:.2f} s/step; ratio {off / ref:.2f}"
        out["plain_seconds"] = plain_s
    print(line)
    print(f"frozen parameters written back: {len(frozen_written)}")
    out.update(
        offloaded_seconds=offloaded_s, steps=rows, config=vars(config) | {"rank": args.rank},
        adapters=args.adapters, base_params=placed["base"], adapter_params=placed["adapters"],
    )  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    shutil.rmtree(args.dir / "nvme", ignore_errors=True)
    return 1 if frozen_written else 0


if __name__ == "__main__":
    sys.exit(main())
