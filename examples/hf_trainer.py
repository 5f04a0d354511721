"""Fine-tune a Hugging Face ``transformers`` model with the ``Trainer`` while swapper keeps
its 16-bit weights, gradients and AdamW state in tiers (device / host / NVMe) under tight
budgets.

The model is a tiny, randomly initialised Llama built from a config (no download), trained
on random tokens on the CPU: the point is the wiring, which is the same for a real model.
Runs in well under a minute::

    pip install 'swapper[hf]'
    python examples/hf_trainer.py                      # swap files under ./swap
    python examples/hf_trainer.py --steps 20 --swap-dir /nvme/swap --out ./tiny-llama

How swapper meets the Trainer (each such line below is marked ``# swapper:``):

- wrap the model with ``swapper.offload(model, config)`` and give the Trainer the model
  itself (its hooks now fetch the weights; the wrapper's ``config`` attribute is swapper's,
  and the Trainer writes to ``model.config``);
- give the Trainer swapper's optimizer: ``optimizers=(OffloadAdamW(...), None)`` (the
  Trainer makes its learning-rate schedule over it as usual), and a callback that calls the
  optimizer's ``zero_grad()`` after each step: the Trainer calls only ``model.zero_grad()``,
  which does not reach the gradients swapper retains;
- clip in swapper (``StepConfig(max_grad_norm=...)``) with ``max_grad_norm=0`` in the
  ``TrainingArguments``: gradients are moved into swapper's buffers as backward makes them,
  so the Trainer's clipping would see none (its logged ``grad_norm`` is 0; swapper's is
  ``optimizer.last_step.grad_norm``);
- enable activation checkpointing on the model before wrapping it, so that ``offload``
  checks the device budget against what a recompute holds (with
  ``TrainingArguments(gradient_checkpointing=True)`` it is enabled later, and a budget too
  small fails at the first backward instead);
- leaving the ``with`` block gives the model back with real weights; ``save_pretrained``
  works inside the block too.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built from a config

import torch

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig, Tier
from tiers.units import format_size

VOCAB = 256
SEQ = 32


def build_model(checkpointing: bool) -> torch.nn.Module:
    """A tiny random Llama in bf16, made as ``from_pretrained(dtype=torch.bfloat16)`` would."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    if checkpointing:  # HF's default: non-reentrant
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    return model


def zero_grads_callback(optimizer: OffloadAdamW) -> object:
    """A ``TrainerCallback`` calling ``optimizer.zero_grad()`` at the end of each step."""
    import transformers

    class ZeroGrads(transformers.TrainerCallback):
        def on_step_end(
            self, args: object, state: object, control: object, **kwargs: object
        ) -> None:
            optimizer.zero_grad()  # swapper: the Trainer's model.zero_grad() does not

    return ZeroGrads()


def dataset(n: int) -> list[dict[str, torch.Tensor]]:
    """Counting sequences from a random start (start, start+1, ...): each next token
    follows from the one before, so the loss falls within a few steps."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        start = int(torch.randint(0, VOCAB, (1,), generator=g))
        ids = (start + torch.arange(SEQ)) % VOCAB
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (default 8)")
    parser.add_argument("--swap-dir", type=Path, default=Path("swap"), help="NVMe swap directory")
    parser.add_argument("--out", type=Path, default=None, help="save_pretrained here at the end")
    parser.add_argument(
        "--no-checkpointing", action="store_true", help="train without activation checkpointing"
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the forward runs (default cpu; cuda: the Trainer moves the inputs there)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")

    model = build_model(checkpointing=not args.no_checkpointing)
    # Tight budgets: the device tier holds about two of the largest modules (the embedding,
    # 32 KiB; a recompute holds two projections of one layer), the host tier less than
    # the weights, gradients and 12 B/parameter of AdamW state: the rest goes to NVMe.
    config = OffloadConfig.create(  # swapper:
        device=args.device,  # the device tier: "cuda" on a GPU machine
        device_nbytes=64 * 1024,
        host_nbytes=1024 * 1024,
        nvme_dirs=[args.swap_dir],
        step=StepConfig(sub_group_numel=32 * 1024, max_grad_norm=1.0),
    )
    with tempfile.TemporaryDirectory(prefix="hf-trainer-") as trainer_dir:
        return train(args, model, config, Path(trainer_dir))


def train(
    args: argparse.Namespace, model: torch.nn.Module, config: OffloadConfig, trainer_dir: Path
) -> int:
    """Train ``model`` with the Trainer through swapper; 0 if the loss went down."""
    import transformers

    params_nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    training_args = transformers.TrainingArguments(
        output_dir=str(trainer_dir),  # (nothing is saved there: save_strategy="no")
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        weight_decay=0.01,
        warmup_steps=1,
        max_grad_norm=0.0,  # swapper: clipped by OffloadAdamW (StepConfig.max_grad_norm)
        use_cpu=args.device == "cpu",  # on a GPU the Trainer's model.to() is accepted
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    started = time.perf_counter()
    with (
        swapper.offload(model, config) as wrapped,  # swapper:
        OffloadAdamW(  # swapper:
            wrapped.parameters(), lr=1e-2, weight_decay=0.01, tiers=wrapped
        ) as optimizer,
    ):
        trainer = transformers.Trainer(
            model=model,  # its hooks fetch the weights from swapper's tiers
            args=training_args,
            train_dataset=dataset(args.steps * 8),
            optimizers=(optimizer, None),  # swapper: the Trainer schedules its lr
            callbacks=[zero_grads_callback(optimizer)],  # swapper:
        )
        result = trainer.train()
        stats = wrapped.stats()
        last = optimizer.last_step
    # Left the block: the model holds its trained weights as ordinary tensors again.
    seconds = time.perf_counter() - started
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    print(
        f"trained {args.steps} steps in {seconds:.1f} s; loss per step: "
        + " ".join(f"{x:.3f}" for x in losses)
    )
    print(
        f"parameters: {format_size(params_nbytes)} in bf16; written to NVMe: "
        f"{format_size(stats.moved(Tier.HOST, Tier.NVME).nbytes)}, read back: "
        f"{format_size(stats.moved(Tier.NVME, Tier.HOST).nbytes)}; last step's gradient "
        f"norm (before clipping to 1.0): {last.grad_norm if last else float('nan'):.3f}"
    )
    if args.out is not None:
        model.save_pretrained(args.out)
        print(f"saved to {args.out}")
    if not losses or losses[-1] >= losses[0]:
        print("the loss did not go down", file=sys.stderr)
        return 1
    return 0 if result.global_step == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
