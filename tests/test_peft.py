"""Hugging Face PEFT (LoRA) over a frozen offloaded base (issue 27): a tiny random Llama
(no download), r=8 on q/k/v/o/gate/up/down, bf16 base and bf16 adapters
(``get_peft_model(..., autocast_adapter_dtype=False)``), under a device budget of a
quarter of the whole model's 16-bit bytes and a host budget that sends the base to NVMe:
10 steps bit-identical to unlimited budgets and to plain PyTorch (torch.optim.AdamW over
fp32 masters of the adapters); ``save_pretrained`` writes the adapters only and
``PeftModel.from_pretrained`` over a fresh base gives bit-identical logits;
``merge_and_unload()`` after the block gives the merged weights of the plain run.
``get_peft_model`` after ``swapper.offload`` is refused, naming the first adapter.

Needs ``transformers`` and ``peft`` (``pip install swapper[peft]``); skipped without them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"  # tiny models from configs: nothing to download
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_frozen import BETAS, EPS, LR, WEIGHT_DECAY, plain_steps  # noqa: E402

import swapper  # noqa: E402
from swapper import Kind, OffloadAdamW, OffloadConfig, StepConfig, SwapConfigError, Tier  # noqa: E402
from swapper.zero.model.frozen import ParametersChanged  # noqa: E402

# the hyper-parameters of test_frozen.plain_steps, the reference
ADAM = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WEIGHT_DECAY}
STEPS = 10
VOCAB = 96
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _base() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)


def _lora() -> nn.Module:
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)
    torch.manual_seed(1)  # (lora_A's init)
    model = peft.get_peft_model(_base(), config, autocast_adapter_dtype=False)
    with torch.no_grad():  # lora_B starts at zero: give it values, so the logits move
        generator = torch.Generator().manual_seed(2)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    return model


TOTAL_NBYTES = sum(p.numel() * 2 for p in _lora().parameters())
DEVICE_NBYTES = TOTAL_NBYTES // 4
HOST_NBYTES = TOTAL_NBYTES // 2


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (2, 16), generator=generator) for _ in range(STEPS)]


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def _tight(tmp_path: Path) -> OffloadConfig:
    return OffloadConfig.create(
        nvme_dirs=[tmp_path / "nvme"],
        device="cpu",
        device_nbytes=DEVICE_NBYTES,
        host_nbytes=HOST_NBYTES,
        step=StepConfig(sub_group_numel=4096),
    )


def _unlimited() -> OffloadConfig:
    return OffloadConfig.create(device="cpu", step=StepConfig(sub_group_numel=4096))


def _train(model: nn.Module, config: OffloadConfig) -> tuple[list[float], int | None]:
    losses = []
    with (
        swapper.offload(model, config) as wrapped,
        OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as optimizer,
    ):
        for ids in _batches():
            loss = _loss(wrapped, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        stats = wrapped.stats()
        peak = stats.tiers[Tier.DEVICE].peak_nbytes
        assert stats.kind_nbytes.get((Kind.PARAM16, Tier.NVME, Tier.HOST), 0) > 0 or (
            config.manager.device_nbytes is None
        )
    return losses, peak


def _train_plain(model: nn.Module) -> list[float]:
    return plain_steps(model, [lambda ids=ids: _loss(model, ids) for ids in _batches()])


def _logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_batches()[0]).logits.float()


def _same_weights(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for name in sa:
        assert torch.equal(sa[name], sb[name]), f"{name} differs"


def test_lora_quarter_budget_bit_identical_save_reload_merge(tmp_path: Path) -> None:
    tight_model, free_model, plain_model = _lora(), _lora(), _lora()
    tight, peak = _train(tight_model, _tight(tmp_path))
    free, _ = _train(free_model, _unlimited())
    plain = _train_plain(plain_model)

    assert tight == free == plain
    assert len(set(tight)) > 1
    assert peak is not None and 0 < peak <= DEVICE_NBYTES
    _same_weights(tight_model, plain_model)
    _same_weights(free_model, plain_model)

    # save_pretrained (after the block) writes the adapters only
    tight_model.save_pretrained(tmp_path / "adapter")  # type: ignore[operator]
    saved = dict(peft.utils.load_peft_weights(str(tmp_path / "adapter")))
    assert saved and all("lora_" in name for name in saved)
    trainable = {n for n, p in plain_model.named_parameters() if p.requires_grad}
    assert len(saved) == len(trainable)
    # ... and a fresh base with them gives the same logits, bitwise
    # (autocast_adapter_dtype=False: bf16 adapters, as trained; PEFT's default loads fp32)
    reloaded = peft.PeftModel.from_pretrained(
        _base(), str(tmp_path / "adapter"), autocast_adapter_dtype=False
    )
    assert torch.equal(_logits(reloaded), _logits(plain_model))

    # merge_and_unload after the block: real merged weights, those of the plain run
    merged = tight_model.merge_and_unload()  # type: ignore[operator]
    merged_plain = plain_model.merge_and_unload()  # type: ignore[operator]
    _same_weights(merged, merged_plain)
    assert torch.equal(_logits(merged), _logits(merged_plain))


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16-adapters", "fp32-adapters"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_lora_with_checkpointing_quarter_budget_bit_identical(
    reentrant: bool, fp32: bool, tmp_path: Path
) -> None:
    """HF's gradient checkpointing on (enabled before the wrap: the floor is checked);
    PEFT's default fp32 adapters too (their own masters in the reference)."""

    def build() -> nn.Module:
        model = _lora32() if fp32 else _lora()
        inner = model.base_model.model  # type: ignore[union-attr]
        inner.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
        if reentrant:  # (the embedding is frozen: PEFT's way to give the blocks a grad)
            model.enable_input_require_grads()  # type: ignore[operator]
        return model.train()

    tight_model, plain_model = build(), build()
    config = _fp32_tight(tmp_path, tight_model) if fp32 else _tight(tmp_path)
    tight, peak = _train(tight_model, config)
    assert tight == _train_plain(plain_model)
    assert peak is not None and 0 < peak <= DEVICE_NBYTES
    _same_weights(tight_model, plain_model)


def test_save_pretrained_inside_the_block_writes_the_trained_adapters(tmp_path: Path) -> None:
    model = _lora()
    with (
        swapper.offload(model, _tight(tmp_path)) as wrapped,
        OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as optimizer,
    ):
        _loss(wrapped, _batches()[0]).backward()
        optimizer.step()
        model.save_pretrained(tmp_path / "inside")  # type: ignore[operator]
        expected = {n: p.clone() for n, p in wrapped.state_dict().items() if "lora_" in n}
    saved = peft.utils.load_peft_weights(str(tmp_path / "inside"))
    assert len(saved) == len(expected)
    for name, value in saved.items():
        full = name.replace(".weight", ".default.weight")
        assert torch.equal(value, expected[full]), name


def test_get_peft_model_after_offload_is_refused_naming_the_adapter(tmp_path: Path) -> None:
    base = _base()
    config = peft.LoraConfig(r=8, target_modules=TARGETS, lora_dropout=0.0)
    with swapper.offload(base, _tight(tmp_path)) as wrapped:
        peft.get_peft_model(base, config, autocast_adapter_dtype=False)
        with pytest.raises(
            ParametersChanged,
            match=r"lora_A\.default\.weight'.*get_peft_model after swapper\.offload",
        ):
            wrapped(input_ids=_batches()[0])


def test_peft_lora_example_runs(tmp_path: Path) -> None:
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / "peft_lora.py"
    spec = importlib.util.spec_from_file_location("peft_lora_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    out = tmp_path / "adapter"
    argv = ["--steps", "2", "--swap-dir", str(tmp_path / "swap"), "--out", str(out)]
    assert example.main(argv) == 0  # the reloaded adapter gives identical logits
    assert (out / "adapter_model.safetensors").exists()


def _lora32() -> nn.Module:
    """PEFT's defaults: fp32 adapters over the bf16 base (autocast_adapter_dtype=True)."""
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)
    torch.manual_seed(1)
    model = peft.get_peft_model(_base(), config)
    with torch.no_grad():
        generator = torch.Generator().manual_seed(2)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.01)
    return model


def _fp32_tight(tmp_path: Path, model: nn.Module) -> OffloadConfig:
    """The quarter device budget, and a host budget of half the model's 16-bit bytes
    plus the adapters' fp32 gradients (4 B per element, kept in memory: never on NVMe)."""
    grads32 = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
    return OffloadConfig.create(
        nvme_dirs=[tmp_path / "nvme"],
        device="cpu",
        device_nbytes=DEVICE_NBYTES,
        host_nbytes=HOST_NBYTES + grads32,
        step=StepConfig(sub_group_numel=4096),
    )


def test_peft_default_fp32_adapters_quarter_budget_bit_identical(tmp_path: Path) -> None:
    """autocast_adapter_dtype=True (PEFT's default) unchanged: 10 steps under the
    quarter budget, base on NVMe, bit-identical to unlimited budgets and to plain
    AdamW over the fp32 adapters as their own masters; their gradients never on NVMe,
    optimizer state of the adapters only, the frozen base never written back."""
    tight_model, free_model, plain_model = _lora32(), _lora32(), _lora32()
    config = _fp32_tight(tmp_path, tight_model)
    written: set[str] = set()
    losses = []
    with (
        swapper.offload(tight_model, config) as wrapped,
        OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as optimizer,
    ):
        manager = wrapped.manager
        release = manager.release

        def spy(key: str, *, modified: bool = True, cold: bool = False) -> None:
            if modified:
                written.add(key)
            release(key, modified=modified, cold=cold)

        manager.release = spy  # type: ignore[method-assign]
        for ids in _batches():
            loss = _loss(wrapped, ids)
            loss.backward()
            keys = manager.keys()  # (a TierManager is not iterable)
            kinds = {manager.info(k).kind for k in keys if k.startswith("grad/")}
            assert kinds == {Kind.GRAD32}  # fp32 gradients, retained as fp32
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        stats = wrapped.stats()
        keys = manager.keys()
        infos = [manager.info(k) for k in keys]
        state_nbytes = sum(i.nbytes for i in infos if i.kind is Kind.OPTIM_STATE)
    free, _ = _train(free_model, _unlimited())
    plain = _train_plain(plain_model)  # (the fp32 adapters their own masters)

    assert losses == free == plain
    assert len(set(losses)) > 1
    _same_weights(tight_model, plain_model)
    _same_weights(free_model, plain_model)
    assert all(p.dtype == torch.float32 for p in tight_model.parameters() if p.requires_grad)
    peak = stats.tiers[Tier.DEVICE].peak_nbytes
    assert peak is not None and 0 < peak <= DEVICE_NBYTES
    assert stats.kind_nbytes.get((Kind.PARAM16, Tier.NVME, Tier.HOST), 0) > 0  # base on NVMe
    assert not [k for k in stats.kind_nbytes if k[0] is Kind.GRAD32 and Tier.NVME in k[1:]]
    trainable = sum(p.numel() for p in plain_model.parameters() if p.requires_grad)
    assert trainable * 12 <= state_nbytes <= (trainable + 2 * 4096) * 12  # (sub-group padding)
    frozen = {f"param/{n}" for n, p in plain_model.named_parameters() if not p.requires_grad}
    assert not written & frozen  # the base is only read


def test_fp32_gradients_that_do_not_fit_in_memory_are_refused_at_wrap(tmp_path: Path) -> None:
    model = _lora32()
    config = OffloadConfig.create(
        nvme_dirs=[tmp_path / "nvme"], device="cpu", device_nbytes=DEVICE_NBYTES, host_nbytes=4096
    )
    with pytest.raises(SwapConfigError, match=r"fp32 trainable.*lora_.*never on NVMe.*host"):
        swapper.offload(model, config)
    assert all(p.numel() for p in model.parameters())  # nothing moved


def test_fp32_gradients_are_counted_as_the_host_charges_them(tmp_path: Path) -> None:
    """Each fp32 gradient is a host block, 4 KiB-aligned: a host budget above their bytes
    but below what the blocks take is refused at the wrap (counted in bytes, it was
    accepted, and the first step then waited for room the gradients held)."""
    model = _lora32()
    grads = [p.numel() * 4 for p in model.parameters() if p.requires_grad]
    charged = sum(-(-n // 4096) * 4096 for n in grads)
    assert sum(grads) < charged - 4096  # (small adapters: the rounding counts)
    config = OffloadConfig.create(
        nvme_dirs=[tmp_path / "nvme"],
        device="cpu",
        device_nbytes=DEVICE_NBYTES,
        host_nbytes=charged - 4096,
    )
    with pytest.raises(SwapConfigError, match=rf"hold {charged} bytes .*as the host tier charges"):
        swapper.offload(model, config)
    assert all(p.numel() for p in model.parameters())  # nothing moved


def test_a_model_converted_to_fp32_entirely_is_refused_naming_a_parameter() -> None:
    model = _lora32().float()
    with pytest.raises(SwapConfigError, match=r"every parameter is torch\.float32.*'base_model"):
        swapper.offload(model, _unlimited())
    assert all(p.numel() for p in model.parameters())  # nothing moved
