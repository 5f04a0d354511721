"""``swapper.hf.Trainer`` (issue 27): the Hugging Face Trainer in one line. A tiny random
Llama under tight budgets: the logged ``grad_norm`` is the real pre-clip norm (equal to
``clip_grad_norm_`` over the fp32 gradients of a plain run), ``train(resume_from_checkpoint=)``
after a stop at step 4 of 8 ends with the uninterrupted run's weights, bitwise; a DeepSpeed
file as ``offload=``; the refusals.

Needs ``transformers`` and ``accelerate`` (``pip install swapper[hf]``); skipped without.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import swapper.hf  # noqa: E402
from swapper import OffloadConfig, StepConfig, SwapConfigError  # noqa: E402

VOCAB, SEQ, ROWS = 96, 16, 4
_TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
LR, MAX_NORM = 1e-2, 0.5


def _model() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    return model.train()


def _rows(n: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=generator)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


MODEL_NBYTES = sum(p.numel() * 2 for p in _model().parameters())


def _config(swap: Path) -> OffloadConfig:
    return OffloadConfig.create(
        nvme_dirs=[swap],
        device="cpu",
        device_nbytes=MODEL_NBYTES // 3,
        host_nbytes=MODEL_NBYTES,
        step=StepConfig(sub_group_numel=8192),
    )


def _args(out: Path, **kwargs: Any) -> Any:
    settings: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": 8,
        "per_device_train_batch_size": ROWS,
        "learning_rate": LR,
        "lr_scheduler_type": "linear",
        "warmup_steps": 2,
        "max_grad_norm": MAX_NORM,
        "use_cpu": True,
        "save_strategy": "no",
        "report_to": "none",
        "logging_steps": 1,
        "disable_tqdm": True,
        "seed": 0,
        "data_seed": 0,
    }
    settings.update(kwargs)
    return transformers.TrainingArguments(**settings)


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("max_norm", [MAX_NORM, 0.0], ids=["clipped", "no-clipping"])
def test_grad_norm_logged_is_clip_grad_norm_of_a_plain_run(max_norm: float, tmp_path: Path) -> None:
    """One step on one batch (every row alike: the Trainer's shuffle changes nothing):
    the logged grad_norm equals clip_grad_norm_ over the plain run's fp32 gradients, and
    the clipped update gives the plain run's weights (fp32 masters, AdamW, the schedule);
    with max_grad_norm=0 the norm is logged (transformers 5; 4.x logs none then, as its own
    Trainer does) and nothing is clipped."""
    row = _rows(1)[0]
    data = [row] * ROWS
    model = _model()
    trainer = swapper.hf.Trainer(
        model=model,
        args=_args(tmp_path / "out", max_steps=1, warmup_steps=0, max_grad_norm=max_norm),
        train_dataset=data,
        offload=_config(tmp_path / "swap"),
    )
    trainer.train()
    logged = [r["grad_norm"] for r in trainer.state.log_history if "grad_norm" in r]

    plain = _model()
    batch = {k: torch.stack([r[k] for r in data]) for k in row}
    # (as the installed Trainer counts them: transformers 5 over the shifted labels, 4.x not)
    items = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
    loss = plain(**batch, num_items_in_batch=items).loss
    loss.backward()
    params = [p for p in plain.parameters()]
    masters = [p.detach().float().clone() for p in params]
    for param, master in zip(params, masters, strict=True):
        assert param.grad is not None
        master.grad = param.grad.float()
    norm = torch.nn.utils.clip_grad_norm_(masters, max_norm or float("inf"))
    if max_norm or _TRANSFORMERS_5:
        assert logged == [pytest.approx(float(norm), rel=0, abs=0)]
    else:  # transformers 4.x computes no norm and logs none with max_grad_norm=0
        assert logged == []
    assert float(norm) > MAX_NORM  # (with max_norm=MAX_NORM: it clipped)
    optimizer = torch.optim.AdamW(masters, lr=LR, weight_decay=0.0, fused=True)
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, 0, 1)
    optimizer.step()
    scheduler.step()
    with torch.no_grad():
        for param, master in zip(params, masters, strict=True):
            param.copy_(master)
    expected, got = _weights(plain), _weights(model)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_resume_after_a_stop_at_step_4_of_8_is_bit_exact(tmp_path: Path) -> None:
    data = _rows(32)
    whole = _model()
    args = _args(tmp_path / "whole", gradient_checkpointing=True)
    trainer = swapper.hf.Trainer(
        model=whole, args=args, train_dataset=data, offload=_config(tmp_path / "swap-whole")
    )
    trainer.train()
    norms = [r["grad_norm"] for r in trainer.state.log_history if "grad_norm" in r]
    assert len(norms) == 8 and all(n > 0 for n in norms)

    class StopAt4(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 4:
                control.should_training_stop = True

    out = tmp_path / "parts"
    args = _args(out, gradient_checkpointing=True, save_strategy="steps", save_steps=4)
    first = swapper.hf.Trainer(
        model=_model(),
        args=args,
        train_dataset=data,
        offload=_config(tmp_path / "swap-parts"),
        callbacks=[StopAt4()],
    )
    first.train()
    assert first.state.global_step == 4
    record = json.loads((out / "checkpoint-4" / swapper.hf.SNAPSHOT_FILE).read_text())
    assert record["snapshot"] == "checkpoint-4"
    assert not (out / "checkpoint-4" / "optimizer.pt").exists()  # (not the whole state)

    resumed_model = _model()  # fresh weights: they come from the snapshot
    second = swapper.hf.Trainer(
        model=resumed_model,
        args=args,
        train_dataset=data,
        offload=_config(tmp_path / "swap-parts"),
    )
    second.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert second.state.global_step == 8
    resumed_norms = [r["grad_norm"] for r in second.state.log_history if "grad_norm" in r]
    assert resumed_norms[-4:] == norms[-4:]
    expected, got = _weights(whole), _weights(resumed_model)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_deepspeed_file_as_offload(tmp_path: Path) -> None:
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_clipping": MAX_NORM,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(tmp_path / "swap")},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "swap")},
        },
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    model = _model()
    before = _weights(model)
    trainer = swapper.hf.Trainer(
        model=model,
        args=_args(tmp_path / "out", max_steps=2),
        train_dataset=_rows(8),
        offload=str(path),
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(v, before[k]) for k, v in _weights(model).items())

    ds["gradient_clipping"] = 2.0  # disagrees with max_grad_norm
    path.write_text(json.dumps(ds))
    with pytest.raises(SwapConfigError, match=r"max_grad_norm=2\.0.*0\.5.*auto"):
        swapper.hf.Trainer(model=_model(), args=_args(tmp_path / "o2"), offload=str(path))


def test_optimizers_given_and_a_checkpoint_without_snapshot_are_refused(tmp_path: Path) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(SwapConfigError, match="do not pass optimizers="):
        swapper.hf.Trainer(
            model=model,
            args=_args(tmp_path / "out"),
            offload=_config(tmp_path / "swap"),
            optimizers=(optimizer, None),
        )
    trainer = swapper.hf.Trainer(
        model=model, args=_args(tmp_path / "out"), train_dataset=_rows(8),
        offload=_config(tmp_path / "swap"),
    )  # fmt: skip
    (tmp_path / "bare").mkdir()
    with pytest.raises(SwapConfigError, match=r"swapper_snapshot\.json cannot be read"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "bare"))
    assert all(p.numel() for p in model.parameters())  # nothing moved


def test_gradient_checkpointing_budget_is_checked_when_train_starts(tmp_path: Path) -> None:
    """args.gradient_checkpointing is turned on before the wrap: a device budget below
    what a recompute holds is refused at train(), naming the floor, before anything moves
    (the same budget trains without checkpointing)."""
    from swapper.manager import Tier
    from swapper.zero.local.placing import check_modules

    plain_floor = _floor(_model(), check_modules, Tier)
    model = _model()
    model.gradient_checkpointing_enable()  # type: ignore[operator]
    recompute_floor = _floor(model, check_modules, Tier)
    assert recompute_floor > plain_floor
    config = OffloadConfig.create(
        nvme_dirs=[tmp_path / "swap"], device="cpu", device_nbytes=plain_floor,
        host_nbytes=MODEL_NBYTES, step=StepConfig(sub_group_numel=8192),
    )  # fmt: skip
    model = _model()
    args = _args(tmp_path / "out", max_steps=1, gradient_checkpointing=True)
    trainer = swapper.hf.Trainer(model=model, args=args, train_dataset=_rows(4), offload=config)
    with pytest.raises(SwapConfigError, match=rf"raise it to at least {recompute_floor}"):
        trainer.train()
    assert all(p.numel() for p in model.parameters())  # nothing moved
    args = _args(tmp_path / "out2", max_steps=1)
    trainer = swapper.hf.Trainer(model=_model(), args=args, train_dataset=_rows(4), offload=config)
    trainer.train()  # without checkpointing the budget is enough


def _floor(model: nn.Module, check: Any, tier: Any) -> int:
    """The device floor the wrap reports for ``model`` (its check at 1 byte)."""
    import re

    with pytest.raises(SwapConfigError) as info:
        check(model, tier.DEVICE, 1)
    found = re.search(r"raise it to at least (\d+)", str(info.value))
    assert found is not None
    return int(found.group(1))


@pytest.mark.parametrize("reentrant", [None, True], ids=["default", "reentrant"])
def test_peft_default_adapters_through_the_trainer(tmp_path: Path, reentrant: bool | None) -> None:
    """PEFT's fp32 adapters (its defaults) over the bf16 base, gradient checkpointing on,
    under the quarter budget: trains, and save_model writes the adapters only. Reentrant
    checkpointing over PEFT's frozen embedding: transformers 5 makes the inputs require
    grad itself; with 4.x (reentrant by default) the backward failed ("element 0 of
    tensors does not require grad") until swapper.hf did it, as PEFT and 5.x do (run in
    a 4.57 venv: docs/notes/2026-11-28-peft-3.md)."""
    pytest.importorskip("peft")
    import test_peft

    model = test_peft._lora32()
    config = test_peft._fp32_tight(tmp_path, model)
    rows = [{k: v % test_peft.VOCAB for k, v in row.items()} for row in _rows(12)]
    kwargs = None if reentrant is None else {"use_reentrant": reentrant}
    args = _args(
        tmp_path / "out",
        max_steps=3,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs=kwargs,
    )
    trainer = swapper.hf.Trainer(model=model, args=args, train_dataset=rows, offload=config)
    trainer.train()
    norms = [r["grad_norm"] for r in trainer.state.log_history if "grad_norm" in r]
    assert len(norms) == 3 and all(n > 0 for n in norms)
    trainer.save_model(str(tmp_path / "adapter"))
    saved = test_peft.peft.utils.load_peft_weights(str(tmp_path / "adapter"))
    assert saved and all("lora_" in name and v.dtype == torch.float32 for name, v in saved.items())


def _world_args(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """In a spawned rank (test_dist_train's harness: gloo, a timeout on the group):
    TrainingArguments as under ``torchrun --nproc_per_node 2`` (its environment
    variables), then swapper.hf.Trainer with them."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    args = _args(Path(tmp, "out"), ddp_backend="gloo", ddp_timeout=30)
    model = _model()
    try:
        swapper.hf.Trainer(
            model=model, args=args, train_dataset=_rows(8), offload=_config(Path(tmp, f"s{rank}"))
        )
    except SwapConfigError as exc:
        return {"world": args.world_size, "error": str(exc), "kept": all(
            p.numel() for p in model.parameters()
        )}  # fmt: skip
    return {"world": args.world_size, "error": None}


@pytest.mark.dist
def test_several_ranks_are_refused_naming_why(tmp_path: Path) -> None:
    """Under torchrun the Trainer would wrap the model in DistributedDataParallel, whose
    broadcast and gradient all-reduce cannot work on parameters that live in the tiers
    (swapper.hf._refuse_several_ranks): refused when the Trainer is made, before
    anything moves."""
    from test_dist_train import _spawn

    for result in _spawn(_world_args, 2, tmp_path):
        assert result["world"] == 2
        assert result["error"] is not None
        assert "world_size=2" in result["error"]
        assert "DistributedDataParallel" in result["error"]
        assert result["kept"]
