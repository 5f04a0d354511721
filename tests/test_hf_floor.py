"""The wrap-time device floor of a Hugging Face model with activation checkpointing on is
a budget that never fails later in the backward (issue 27): Llama, GPT-2, Qwen2 and T5
(test_hf's tiny configs, and a T5 whose MLP outweighs its attention, with no dropout and
tied ``shared.weight``: the floor counted T5's attention as the checkpointed layer, and a
backward at that floor failed fetching the block's first norm). Skipped without
transformers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from test_hf import MODELS, VOCAB, _build, _config, _enable_checkpointing, _loss  # noqa: E402

import swapper  # noqa: E402
from swapper import OffloadAdamW, SwapConfigError  # noqa: E402


def _t5_wide_mlp() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_ff=256,  # wi and wo (16 KiB each) outweigh q, k, v, o (2 KiB each)
        d_kv=16,
        num_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
        tie_word_embeddings=True,
        dropout_rate=0.0,  # no dropout node: wo's backward is the first to unpack
    )
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration._from_config(config, dtype=torch.bfloat16)


def _model(kind: str, checkpointing: str) -> nn.Module:
    if kind != "t5-wide-mlp":
        return _build(kind, checkpointing)
    model = _t5_wide_mlp().train()
    _enable_checkpointing(model, reentrant=checkpointing == "reentrant")
    return model


def _floor(kind: str, checkpointing: str, tmp_path: Path) -> int:
    """The smallest device budget ``offload`` accepts (each refusal names the next)."""
    budget = 1
    for attempt in range(10):
        try:
            swapper.offload(
                _model(kind, checkpointing), _config(tmp_path / f"{attempt}", budget, None)
            ).close()
            return budget
        except SwapConfigError as exc:
            found = re.search(r"at least (\d+)", str(exc))
            assert found is not None, str(exc)
            budget = int(found.group(1))
    raise AssertionError("no floor after 10 refusals")


@pytest.mark.parametrize("checkpointing", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("kind", [*MODELS, "t5-wide-mlp"])
def test_a_budget_the_wrap_accepts_trains(kind: str, checkpointing: str, tmp_path: Path) -> None:
    floor = _floor(kind, checkpointing, tmp_path)
    model = _model(kind, checkpointing)
    generator = torch.Generator().manual_seed(1)
    with (
        swapper.offload(model, _config(tmp_path / "run", floor, None)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        for _ in range(2):
            ids = torch.randint(0, VOCAB, (2, 8), generator=generator)
            _loss(wrapped, "t5" if kind.startswith("t5") else kind, ids).backward()
            optimizer.step()
            optimizer.zero_grad()
        peak = wrapped.stats().tiers[swapper.Tier.DEVICE].peak_nbytes
        assert peak is not None and peak <= floor
