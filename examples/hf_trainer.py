"""Fine-tune a Hugging Face ``transformers`` model with the ``Trainer`` while swapper keeps
its 16-bit weights, gradients and AdamW state in tiers (device / host / NVMe) under tight
budgets.

The model is a tiny, randomly initialised Llama built from a config (no download), trained
on random tokens on the CPU: the point is the wiring, which is the same for a real model.
Runs in well under a minute::

    pip install 'swapper[hf]'
    python examples/hf_trainer.py                      # swap files under ./swap
    python examples/hf_trainer.py --steps 20 --swap-dir /nvme/swap --out ./tiny-llama

The Trainer is ``swapper.hf.Trainer``, ``transformers.Trainer`` with one more argument,
``offload=`` (an ``OffloadConfig``, or a DeepSpeed JSON file's path): the line marked
``# swapper:`` below. It wraps the model while ``train()`` runs (after turning on
``args.gradient_checkpointing``, so the device budget is checked against what a recompute
holds), makes swapper's optimizer over the trainable parameters with the arguments'
learning rate and schedule, clips at ``args.max_grad_norm`` and logs the real
``grad_norm``, clears swapper's gradients after each step, and saves and resumes
checkpoints through swapper's snapshots (``train(resume_from_checkpoint=...)`` is
bit-exact). After ``train()`` the model holds its trained weights as ordinary tensors.
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
import swapper.hf
from swapper import OffloadConfig, StepConfig
from tiers.units import format_size

VOCAB = 256
SEQ = 32


def build_model() -> torch.nn.Module:
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
    return transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)


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

    model = build_model()
    # Tight budgets: the device tier holds about two of the largest modules (the embedding,
    # 32 KiB; a recompute holds two projections of one layer), the host tier less than
    # the weights, gradients and 12 B/parameter of AdamW state: the rest goes to NVMe.
    config = OffloadConfig.create(
        device=args.device,  # the device tier: "cuda" on a GPU machine
        device_nbytes=64 * 1024,
        host_nbytes=1024 * 1024,
        nvme_dirs=[args.swap_dir],
        step=StepConfig(sub_group_numel=32 * 1024),
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
        max_grad_norm=1.0,  # clipped by swapper's step; the real norm is logged
        gradient_checkpointing=not args.no_checkpointing,  # (non-reentrant: HF's default)
        use_cpu=args.device == "cpu",  # on a GPU the Trainer's model.to() is accepted
        save_strategy="no",
        report_to="none",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    started = time.perf_counter()
    trainer = swapper.hf.Trainer(  # swapper:
        model=model, args=training_args, train_dataset=dataset(args.steps * 8), offload=config
    )
    result = trainer.train()
    seconds = time.perf_counter() - started
    logs = [row for row in trainer.state.log_history if "loss" in row]
    losses = [row["loss"] for row in logs]
    norms = [row["grad_norm"] for row in logs]
    print(
        f"trained {args.steps} steps in {seconds:.1f} s; loss per step: "
        + " ".join(f"{x:.3f}" for x in losses)
    )
    print(
        f"parameters: {format_size(params_nbytes)} in bf16; gradient norm per step (before "
        "clipping to 1.0): " + " ".join(f"{x:.3f}" for x in norms)
    )
    if args.out is not None:
        trainer.save_model(str(args.out))  # the trained weights (the model is plain again)
        print(f"saved to {args.out}")
    if not losses or losses[-1] >= losses[0]:
        print("the loss did not go down", file=sys.stderr)
        return 1
    return 0 if result.global_step == args.steps else 1


if __name__ == "__main__":
    sys.exit(main())
