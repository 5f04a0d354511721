"""Hugging Face ``transformers`` models end to end through ``swapper.offload`` (issue 15).

Llama, GPT-2, Qwen2 and T5, built from tiny configs (random weights, bf16, no download):
5 steps under tight budgets (the device budget at what ``offload`` accepts, the host budget
below parameters + gradients + optimizer state, so NVMe is used) are bit-identical to plain
PyTorch — fp32 master copies stepped by ``torch.optim.AdamW(fused=True)`` — plain, with
``clip_grad_norm_(max_norm=1.0)``, with 2 micro-steps of gradient accumulation, and with
HF's ``gradient_checkpointing_enable()`` (non-reentrant with early stop, HF's default, and
reentrant). ``save_pretrained`` inside and after the block writes the real weights.

Needs ``transformers`` (``pip install swapper[hf]``); skipped without it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"  # tiny models from configs: nothing to download
transformers = pytest.importorskip("transformers")

import swapper  # noqa: E402
from swapper import OffloadAdamW, OffloadConfig, StepConfig, SwapConfigError, Tier  # noqa: E402

ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
STEPS = 5
VOCAB = 96
HOST_NBYTES = 200_000  # < params + grads + 12 B/param of optimizer state: NVMe is used


def _llama() -> tuple[type, object]:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM, config


def _gpt2() -> tuple[type, object]:  # tied input and output embeddings
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32
    )
    return transformers.GPT2LMHeadModel, config


def _qwen2() -> tuple[type, object]:  # biases on q/k/v
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    return transformers.Qwen2ForCausalLM, config


def _t5() -> tuple[type, object]:  # encoder-decoder, relative attention bias
    config = transformers.T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_ff=64,
        d_kv=16,
        num_layers=2,
        num_heads=2,
        decoder_start_token_id=0,
    )
    return transformers.T5ForConditionalGeneration, config


MODELS: dict[str, Callable[[], tuple[type, object]]] = {
    "llama": _llama,
    "gpt2": _gpt2,
    "qwen2": _qwen2,
    "t5": _t5,
}

#: how each run differs from a plain step: (max_norm, micro-steps, checkpointing)
#: checkpointing: None (off), "non-reentrant" (HF's default), "reentrant"
MODES: dict[str, tuple[float | None, int, str | None]] = {
    "plain": (None, 1, None),
    "clip": (1.0, 1, None),
    "accumulate-2": (None, 2, None),
    "checkpointing": (None, 1, "non-reentrant"),
    "checkpointing-reentrant": (None, 1, "reentrant"),
}


def _build(kind: str, checkpointing: str | None) -> nn.Module:
    """A bf16 model with random weights, made as from_pretrained(dtype=bf16) makes it
    (float buffers such as RoPE's inv_freq stay fp32, as they are after loading)."""
    torch.manual_seed(0)
    model_class, config = MODELS[kind]()
    model = model_class._from_config(config, dtype=torch.bfloat16).train()
    if checkpointing is not None:
        _enable_checkpointing(model, reentrant=checkpointing == "reentrant")
    return model


def _enable_checkpointing(model: nn.Module, *, reentrant: bool = False) -> None:
    """HF's ``gradient_checkpointing_enable()`` (``activation_checkpointing_enable`` in
    transformers 5.x), the kind named: its default is non-reentrant in 5.x, reentrant in
    4.x, so both are named here and each is tested with either version."""
    kwargs = {"use_reentrant": reentrant}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _disable_checkpointing(model: nn.Module) -> None:
    disable = getattr(model, "activation_checkpointing_disable", None)
    (disable or model.gradient_checkpointing_disable)()


def _batches(micro: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        [torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(micro)] for _ in range(STEPS)
    ]


def _loss(model: nn.Module, kind: str, ids: torch.Tensor) -> torch.Tensor:
    labels = ids.flip(1) if kind == "t5" else ids
    return model(input_ids=ids, labels=labels).loss


def _own_nbytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))


def _device_budget(model: nn.Module, checkpointing: bool) -> int:
    """The tightest device budget, worked out here independently of swapper: the largest
    module's parameters plus tied ones (held through the backward); with checkpointing,
    two modules of one layer (one held for its backward while the other is recomputed)."""
    uses: dict[int, int] = {}
    for sub in model.modules():
        for p in sub.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    tied = sum(p.numel() * p.element_size() for p in model.parameters() if uses[id(p)] > 1)
    need = max(_own_nbytes(sub) for sub in model.modules()) + tied
    if checkpointing:
        for layer in model.modules():
            if isinstance(layer, transformers.modeling_layers.GradientCheckpointingLayer):
                owned = sorted((_own_nbytes(s) for s in layer.modules()), reverse=True)
                need = max(need, owned[0] + owned[1] + tied)
    return need


def _state_of_plain(
    optimizer: torch.optim.Optimizer, masters: list[torch.Tensor]
) -> dict[str, torch.Tensor]:
    return {
        "master": torch.cat([m.reshape(-1) for m in masters]),
        **{
            row: torch.cat([optimizer.state[m][row].reshape(-1) for m in masters])
            for row in ("exp_avg", "exp_avg_sq")
        },
    }


@dataclass
class Trained:
    params16: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]  # master, exp_avg, exp_avg_sq: flat, end to end


def _plain(kind: str, mode: str, data: list[list[torch.Tensor]]) -> Trained:
    """The reference: bf16 model, fp32 masters, clip_grad_norm_ on their fp32 grads,
    torch.optim.AdamW(fused=True), masters rounded back into the bf16 parameters."""
    max_norm, _, checkpointing = MODES[mode]
    model = _build(kind, checkpointing)
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    optimizer = torch.optim.AdamW(masters, **ADAM, fused=True)  # type: ignore[arg-type]
    for micro_batches in data:
        for ids in micro_batches:
            _loss(model, kind, ids).backward()
        for param, master in zip(params, masters, strict=True):
            assert param.grad is not None  # every parameter is used
            master.grad = param.grad.float()
            param.grad = None
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(masters, max_norm)
        optimizer.step()
        with torch.no_grad():
            for param, master in zip(params, masters, strict=True):
                param.copy_(master)
    params16 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Trained(params16, _state_of_plain(optimizer, masters))


def _config(tmp_path: Path, device_nbytes: int, max_norm: float | None) -> OffloadConfig:
    return OffloadConfig.create(
        nvme_dirs=[tmp_path / "nvme"],
        device="cpu",
        device_nbytes=device_nbytes,
        host_nbytes=HOST_NBYTES,
        step=StepConfig(sub_group_numel=4096, max_grad_norm=max_norm),
    )


def _offload_state(optimizer: OffloadAdamW) -> dict[str, torch.Tensor]:
    """OffloadAdamW's state, its sub-groups end to end (one param group)."""
    saved = optimizer.state_dict()["state"]
    parts = [saved[sg.index] for sg in optimizer.sub_groups]
    return {row: torch.cat([p[row] for p in parts]) for row in ("master", "exp_avg", "exp_avg_sq")}


def _assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype, name
        assert actual[name].shape == value.shape, name
        differing = int((actual[name] != value).sum())
        assert differing == 0, f"{name}: {differing} of {value.numel()} elements differ"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(MODELS))
def test_training_bit_identical_to_pytorch(
    tmp_path: Path, kind: str, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    max_norm, micro, checkpointing = MODES[mode]
    data = _batches(micro)
    model = _build(kind, checkpointing)
    device_nbytes = _device_budget(model, checkpointing is not None)
    with (
        caplog.at_level(logging.WARNING, logger="swapper"),
        swapper.offload(model, _config(tmp_path, device_nbytes, max_norm)) as wrapped,
        OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as optimizer,  # type: ignore[arg-type]
    ):
        for micro_batches in data:
            for ids in micro_batches:
                _loss(wrapped, kind, ids).backward()
                # every hold released by the backward itself (a recompute stopped early
                # included), not later by the clean-up of a failed pass
                assert all(slot.users == 0 for slot in wrapped.core.by_name.values())
            optimizer.step()
            optimizer.zero_grad()
        state = _offload_state(optimizer)
        params16 = wrapped.state_dict()
        stats = wrapped.stats()
    assert not [r for r in caplog.records if "left by a failed pass" in r.getMessage()]
    assert stats.moved(Tier.HOST, Tier.NVME).nbytes > 0  # tight: NVMe used
    device_peak = stats.tiers[Tier.DEVICE].peak_nbytes
    assert device_peak is not None and 0 < device_peak <= device_nbytes
    expected = _plain(kind, mode, data)
    _assert_bitwise(state, expected.state)  # fp32: what bf16 rounding would hide
    _assert_bitwise(params16, expected.params16)
    # after the block the model holds the same weights as ordinary tensors
    _assert_bitwise({k: v.detach() for k, v in model.state_dict().items()}, expected.params16)


@pytest.mark.parametrize("kind", list(MODELS))
def test_save_pretrained_inside_and_after_writes_real_weights(tmp_path: Path, kind: str) -> None:
    data = _batches(1)[:2]
    ids = data[0][0]
    model = _build(kind, None)
    config = _config(tmp_path, _device_budget(model, False), None)
    with (
        swapper.offload(model, config) as wrapped,
        OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as optimizer,  # type: ignore[arg-type]
    ):
        for micro_batches in data:
            _loss(wrapped, kind, micro_batches[0]).backward()
            optimizer.step()
            optimizer.zero_grad()
        model.save_pretrained(tmp_path / "inside")
        with torch.no_grad():
            inside_logits = _logits(wrapped, kind, ids)
    model.save_pretrained(tmp_path / "after")
    with torch.no_grad():
        after_logits = _logits(model, kind, ids)
    assert torch.equal(inside_logits, after_logits)
    for saved in ("inside", "after"):
        loaded = type(model).from_pretrained(tmp_path / saved, dtype=torch.bfloat16)
        with torch.no_grad():
            logits = _logits(loaded.train(), kind, ids)
        assert torch.equal(logits, after_logits), saved


def _logits(model: nn.Module, kind: str, ids: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)  # (dropout is on in train mode: the same masks each call)
    if kind == "t5":
        return model(input_ids=ids, decoder_input_ids=ids).logits
    return model(input_ids=ids).logits


# -- a recompute that cannot fit: a clear error at once, not a 60 s BudgetTimeout ------------


def _wide_llama() -> nn.Module:
    """Each MLP projection (8 KiB) is the largest module: a recompute needs two of them."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    return transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16).train()


def test_checkpointed_model_below_recompute_floor_refused_at_wrap(tmp_path: Path) -> None:
    model = _wide_llama()
    _enable_checkpointing(model)
    with pytest.raises(SwapConfigError, match=r"recomputed.*raise it to at least 16384"):
        swapper.offload(model, _config(tmp_path, 8192 + 4096, None))


def test_checkpointing_enabled_after_wrap_fails_fast_when_recompute_cannot_fit(
    tmp_path: Path,
) -> None:
    model = _wide_llama()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with swapper.offload(model, _config(tmp_path, 8192 + 4096, None)) as wrapped:
        _enable_checkpointing(model)  # after the wrap-time check
        loss = _loss(wrapped, "llama", ids)
        with pytest.raises(
            SwapConfigError, match=r"activation-checkpointing recompute.*Raise the device budget"
        ):
            loss.backward()
        wrapped.release_stale_holds()
        _disable_checkpointing(model)
        _loss(wrapped, "llama", ids).backward()  # the model still trains


# -- examples/hf_trainer.py: the Hugging Face Trainer through swapper -------------------------


def test_hf_trainer_example_runs(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")  # the Trainer needs it
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / "hf_trainer.py"
    spec = importlib.util.spec_from_file_location("hf_trainer_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "saved"
    rc = example.main(["--steps", "6", "--swap-dir", str(tmp_path / "swap"), "--out", str(out)])
    assert rc == 0  # 6 steps, the loss went down
    # what it saved inside the block loads as the model it trained
    loaded = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert sum(p.numel() for p in loaded.parameters()) > 0
    for name, value in loaded.state_dict().items():
        assert value.numel() > 0, name


class _ScaledHead(nn.Module):
    """Owns a parameter itself (as CLIPModel's logit_scale) and returns a ModelOutput."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> object:
        logits = self.proj(x) * self.scale
        loss = logits.float().pow(2).mean()
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


def test_model_output_of_a_module_owning_parameters_keeps_its_type(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _ScaledHead().to(torch.bfloat16)
    reference = _ScaledHead().to(torch.bfloat16)
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 8).bfloat16()
    with swapper.offload(model, _config(tmp_path, 1024, None)) as wrapped:
        out = wrapped(x)
        assert isinstance(out, transformers.modeling_outputs.CausalLMOutput)
        out.loss.backward()  # attribute access, as the Trainer and users write it
        assert all(slot.has_grad for slot in wrapped.core.by_name.values())
    expected = reference(x)
    assert torch.equal(out.logits, expected.logits)
