"""LoRA fine-tuning (Hugging Face PEFT) of a frozen base that swapper keeps in tiers
(device / host / NVMe), under a device budget of a quarter of the model's 16-bit bytes.

The base is a tiny, randomly initialised Llama built from a config (no download), trained
on random tokens on the CPU: the point is the wiring, which is the same for a real model.
Runs in well under a minute::

    pip install 'swapper[peft]'
    python examples/peft_lora.py                       # swap files under ./swap
    python examples/peft_lora.py --steps 20 --swap-dir /nvme/swap --out ./adapter

How swapper meets PEFT:

- ``peft.get_peft_model`` *before* ``swapper.offload`` (adapters inserted into a wrapped
  model are refused at its next forward, naming the first one);
- ``autocast_adapter_dtype=False``: the adapters in the base's 16-bit dtype (PEFT's
  default keeps them in fp32, which ``offload`` refuses today: every offloaded parameter
  is bf16 or fp16);
- the frozen base is offloaded like any parameter and released after each module's
  forward and backward; it gets no gradient and no optimizer state, and its NVMe copy is
  written once and only read after (``OffloadAdamW(wrapped.parameters())`` leaves the
  frozen parameters out by itself);
- ``save_pretrained`` writes the adapters only (inside or after the block);
  ``PeftModel.from_pretrained(base, path, autocast_adapter_dtype=False)`` loads them back.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built from a config

import torch

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig, Tier

VOCAB = 256
SEQ = 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_base() -> torch.nn.Module:
    """A tiny random Llama in bf16, made as ``from_pretrained(dtype=torch.bfloat16)`` would."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    """Train, save the adapter, reload it; 0 when the reloaded logits are identical."""
    import peft

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--swap-dir", type=Path, default=Path("swap"))
    parser.add_argument("--out", type=Path, default=None, help="where to save the adapter")
    args = parser.parse_args(argv)

    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(build_base(), lora, autocast_adapter_dtype=False)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    config = OffloadConfig.create(
        nvme_dirs=[args.swap_dir],
        device="cpu",  # a GPU: device="cuda"
        device_nbytes=total // 4,  # a quarter of the model's 16-bit bytes
        host_nbytes=total // 2,  # the rest of the base goes to NVMe
        step=StepConfig(sub_group_numel=16384),  # 192 KiB of optimizer state at a time
    )
    print(f"model {total} B in 16 bits, {trainable} trainable parameters; budgets: device "
          f"{total // 4} B, host {total // 2} B")  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    start = time.perf_counter()
    with (
        swapper.offload(model, config) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-3, tiers=wrapped) as optimizer,
    ):
        for step in range(args.steps):
            ids = torch.randint(0, VOCAB, (4, SEQ), generator=generator)
            loss = wrapped(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            print(f"step {step}: loss {loss.item():.4f}")
        stats = wrapped.stats()
    read = stats.moved(Tier.NVME, Tier.HOST).nbytes
    written = stats.moved(Tier.HOST, Tier.NVME).nbytes
    peak = stats.tiers[Tier.DEVICE].peak_nbytes
    print(f"{time.perf_counter() - start:.1f} s; device peak {peak} B; NVMe read {read} B, "
          f"written {written} B over {args.steps} steps")  # fmt: skip

    out = args.out or Path(tempfile.mkdtemp()) / "adapter"
    model.save_pretrained(out)  # the adapters only
    reloaded = peft.PeftModel.from_pretrained(build_base(), out, autocast_adapter_dtype=False)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=generator)
    with torch.no_grad():
        same = torch.equal(model(input_ids=ids).logits, reloaded(input_ids=ids).logits)
    print(f"adapter saved to {out}; reloaded over a fresh base: logits identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
