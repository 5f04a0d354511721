"""A tiny offloaded training run with training snapshots, for tests/test_checkpoint*.py.

Imported by the tests (``train``) and run as a child process by the kill test::

    python tests/ckpt_train.py SWAP_DIR --steps 10 --every 2 [--kill PHASE:STEP:DELAY_MS]

The run always asks for ``resume=True``: a fresh directory starts afresh, a directory a
killed run left continues from its newest usable snapshot. It prints ``resumed <step>``
(0 when fresh), ``phase <name> <step>`` before each phase, and ``digest <final_digest>``
at the end. ``--kill`` SIGKILLs the process ``DELAY_MS`` after phase ``PHASE`` of step
``STEP`` begins (``forward``, ``backward``, ``step``, ``snapshot``), or, for
``snapshot-file`` / ``snapshot-done``, just before / just after the snapshot's file is
written (the tensors are durable by then).

Everything random is seeded, and the data comes from the global RNG, so a resumed run is
bit-identical to an uninterrupted one only if the RNG state is resumed too.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch

import swapper
from swapper import DynamicLossScaler, OffloadAdamW, OffloadConfig, OffloadOptimizer, StepConfig
from swapper.pressure.model import GPT, GPTConfig, init_weights_
from swapper.step import StreamedOptimizer
from swapper.zero.checkpoint.snapshot import final_digest, save_snapshot

# A tiny GPT with tied embedding / head weights: 28 032 parameters.
CONFIG = GPTConfig(vocab_size=64, context=16, d_model=32, n_layers=2, n_heads=2)
DEVICE_NBYTES = 40_000  # the largest module and the tied weight, not the whole model
HOST_NBYTES = 100_000  # less than the optimizer state (12 B x 28 032 = 336 384 B)

#: ``--optimizer NAME`` other than adamw: OffloadOptimizer over these (issue 26)
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, object]]] = {
    "sgd": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
}


def config(swap: Path, *, host_fraction: float = 0.0, sub_group_numel: int = 1024) -> OffloadConfig:
    return OffloadConfig.create(
        device_nbytes=DEVICE_NBYTES,
        host_nbytes=HOST_NBYTES,
        nvme_dirs=[swap],
        device="cpu",
        step=StepConfig(sub_group_numel=sub_group_numel, host_fraction=host_fraction),
    )


def model(*, d_model: int = 32) -> GPT:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, context=16, d_model=d_model, n_layers=2, n_heads=2))
    gpt = gpt.to(torch.bfloat16)
    init_weights_(gpt, seed=0)
    return gpt


def steps(gpt: torch.nn.Module, optimizer: OffloadAdamW, n: int, seed: int = 1) -> None:
    """``n`` training steps of ``gpt`` on seeded random tokens (its own generator)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        gpt.loss(torch.randint(0, 64, (2, 9), generator=g)).backward()  # type: ignore[operator]
        optimizer.step()
        optimizer.zero_grad()


def resume_digest(swap: Path, resume: bool | str = True, **kw: float | int) -> tuple[str, int]:
    """A fresh model resumed from ``swap``: its ``final_digest`` and step count."""
    gpt = model()
    with (
        swapper.offload(gpt, config(swap, **kw), resume=resume) as wrapped,  # type: ignore[arg-type]
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        return final_digest(wrapped, optimizer), optimizer.step_count


def _say(*words: object) -> None:
    print(*words, flush=True)


def _kill_after(delay_ms: float) -> None:
    if delay_ms <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
    timer = threading.Timer(delay_ms / 1000, os.kill, (os.getpid(), signal.SIGKILL))
    timer.daemon = True
    timer.start()


def train(
    swap: Path,
    *,
    steps: int,
    every: int,
    keep_last: int | None = 2,
    dtype: str = "bf16",
    host_fraction: float = 0.0,
    resume: bool | str = True,
    stop_after: int | None = None,
    kill: tuple[str, int, float] | None = None,
    optimizer_name: str = "adamw",
) -> str:
    """Train to ``steps`` (from where a resume starts), a snapshot every ``every`` steps;
    return the final digest. ``stop_after``: close after that step without finishing
    (a clean stop, for in-process tests)."""
    gpt = model()
    if dtype == "fp16":
        gpt = gpt.to(torch.float16)
    wrapped = swapper.offload(gpt, config(swap, host_fraction=host_fraction), resume=resume)
    scaler = DynamicLossScaler(2.0**12) if dtype == "fp16" else None
    optimizer: StreamedOptimizer
    if optimizer_name == "adamw":
        optimizer = OffloadAdamW(
            wrapped.parameters(),
            lr=1e-2,
            tiers=wrapped,
            config=StepConfig(max_grad_norm=1.0),
            loss_scaler=scaler,
        )
    else:
        cls, kwargs = OPTIMIZERS[optimizer_name]
        optimizer = OffloadOptimizer(
            cls,
            wrapped.parameters(),
            tiers=wrapped,
            config=StepConfig(max_grad_norm=1.0),
            loss_scaler=scaler,
            **kwargs,
        )
    _say("resumed", optimizer.step_count)

    def phase(name: str, step: int) -> None:
        _say("phase", name, step)
        if kill is not None and kill[0] == name and kill[1] == step:
            _kill_after(kill[2])

    if kill is not None and kill[0] in ("snapshot-file", "snapshot-done"):
        _arm_snapshot_kill(kill[0], kill[1], optimizer)
    try:
        for step in range(optimizer.step_count + 1, steps + 1):
            tokens = torch.randint(0, CONFIG.vocab_size, (2, 9))
            phase("forward", step)
            loss = gpt.loss(tokens)
            phase("backward", step)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            phase("step", step)
            optimizer.step()
            optimizer.zero_grad()
            if step % every == 0:
                phase("snapshot", step)
                save_snapshot(wrapped, optimizer, keep_last=keep_last, extra={"at": step})
            if stop_after is not None and step >= stop_after:
                break
        return final_digest(wrapped, optimizer)
    finally:
        optimizer.close()
        wrapped.close()


def _arm_snapshot_kill(when: str, step: int, optimizer: StreamedOptimizer) -> None:
    """SIGKILL just before (``snapshot-file``) or after (``snapshot-done``) the snapshot
    file of ``step`` is written: its tensors are durable by then."""
    from tiers.nvme import snapshotting

    original = snapshotting.replace_file

    def replace_file(path: Path, data: bytes, what: str, **options: Any) -> int | None:
        if optimizer.step_count == step and when == "snapshot-file":
            os.kill(os.getpid(), signal.SIGKILL)
        done = original(path, data, what, **options)
        if optimizer.step_count == step and when == "snapshot-done":
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    snapshotting.replace_file = replace_file  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("swap", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--host-fraction", type=float, default=0.0)
    parser.add_argument("--kill", default=None, help="PHASE:STEP:DELAY_MS")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", *OPTIMIZERS])
    args = parser.parse_args()
    kill = None
    if args.kill:
        name, step, delay = args.kill.split(":")
        kill = (name, int(step), float(delay))
    digest = train(
        args.swap,
        steps=args.steps,
        every=args.every,
        dtype=args.dtype,
        host_fraction=args.host_fraction,
        kill=kill,
        optimizer_name=args.optimizer,
    )
    _say("digest", digest)


if __name__ == "__main__":
    sys.exit(main())
