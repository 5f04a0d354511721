"""The DeepSpeed config reader (swapper/zero/config/deepspeed.py, deepspeed_training.py): the
training sections honoured (optimizer, gradient_clipping, fp16/bf16), the nested ``aio``
layout of Hugging Face's guide, one warning naming every key not honoured, and a
``sub_group_size`` the host budget cannot hold reduced to fit with one log line.
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from swapper.manager.config import ManagerConfig
from swapper.step import OffloadAdamW
from swapper.zero.config.offload import OffloadConfig, load_deepspeed
from tiers.config import AioConfig
from tiers.errors import SwapConfigError

LOGGER = "swapper.zero.config.deepspeed"

#: The NVMe example of Hugging Face transformers' DeepSpeed guide: ``aio`` inside
#: ``zero_optimization``, "auto" placeholders that the Trainer fills.
HF_GUIDE_NVME: dict[str, Any] = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 4,
            "fast_init": False,
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
        "aio": {
            "block_size": 262144,
            "queue_depth": 32,
            "thread_count": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

#: Everything honoured: no warning.
TRAINING: dict[str, Any] = {
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-5, "betas": [0.8, 0.98], "eps": 1e-6, "weight_decay": 0.1},
    },
    "gradient_clipping": 0.5,
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 12,
        "loss_scale_window": 500,
        "min_loss_scale": 0.25,
    },
}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= 30]


def test_hf_guide_nested_aio_is_read_and_one_warning_names_every_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    cfg = OffloadConfig.from_deepspeed(HF_GUIDE_NVME, host_nbytes=64 << 30)
    assert cfg.manager.aio == AioConfig(
        block_size=262144, queue_depth=32, num_threads=1, single_submit=False
    )
    assert cfg.manager.nvme_dirs == (Path("/local_nvme"),)
    assert cfg.step.max_grad_norm is None  # "auto": left unset
    (message,) = _warnings(caplog)
    for key in (
        "scheduler",
        "gradient_accumulation_steps",
        "steps_per_print",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "wall_clock_breakdown",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "gradient_clipping",
        "fp16.enabled",
        "zero_optimization.overlap_comm",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.offload_param.buffer_count",
        "zero_optimization.offload_optimizer.fast_init",
        "zero_optimization.aio.overlap_events",
    ):
        assert key in message, key
    assert message.count("scheduler") == 1


def test_training_sections_are_honoured_without_a_warning(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(TRAINING))
    cfg, training = load_deepspeed(path)
    assert _warnings(caplog) == []
    assert cfg.step.max_grad_norm == 0.5
    assert training.max_grad_norm == 0.5
    assert training.optimizer == {
        "lr": 3e-5,
        "betas": (0.8, 0.98),
        "eps": 1e-6,
        "weight_decay": 0.1,
    }
    assert training.dtype == "fp16" and training.torch_dtype is torch.float16
    scaler = training.make_loss_scaler()
    assert scaler is not None
    assert scaler.loss_scale == 2.0**12
    assert scaler.growth_interval == 500
    assert scaler.min_scale == 0.25
    # what OffloadAdamW takes, as the optimizer would be built
    params = [torch.nn.Parameter(torch.zeros(8, dtype=training.torch_dtype))]
    with OffloadAdamW(
        params,
        **training.optimizer,
        tiers=ManagerConfig(device_nbytes=None, host_nbytes=None, device="cpu"),
        config=cfg.step,
        loss_scaler=scaler,
    ) as opt:
        group = opt.param_groups[0]
        assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (
            3e-5,
            (0.8, 0.98),
            1e-6,
            0.1,
        )
        assert opt.max_grad_norm == 0.5


def test_deepspeed_defaults_for_fp16_and_bf16() -> None:
    ds = {"zero_optimization": {"stage": 3}, "fp16": {"enabled": True}}
    _, training = load_deepspeed(ds)
    assert training.loss_scaler == {"init_scale": 2.0**16, "growth_interval": 1000}
    ds = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "fp16": {"enabled": False}}
    _, training = load_deepspeed(ds)
    assert training.dtype == "bf16" and training.loss_scaler is None
    _, training = load_deepspeed({"zero_optimization": {"stage": 3}, "gradient_clipping": 0.0})
    assert training.max_grad_norm is None and training.dtype is None
    assert training.make_loss_scaler() is None


def test_not_honoured_fp16_and_optimizer_keys_are_named(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    ds = copy.deepcopy(TRAINING)
    ds["fp16"].update(hysteresis=2, loss_scale=128)
    ds["optimizer"]["params"]["torch_adam"] = True
    _, training = load_deepspeed(ds)
    (message,) = _warnings(caplog)
    for key in ("fp16.hysteresis=2", "fp16.loss_scale=128 (static)", "optimizer.params.torch_adam"):
        assert key in message, message
    assert training.loss_scaler is not None and training.loss_scaler["init_scale"] == 128


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"optimizer": {"type": "Lamb", "params": {}}}, ["optimizer.type='Lamb'", "AdamW"]),
        (
            {
                "optimizer": {
                    "type": "Adam",
                    "params": {"adam_w_mode": False, "bias_correction": False},
                }
            },
            ["optimizer.params.bias_correction=False", "torch.optim.Adam"],
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"bias_correction": False}}},
            ["optimizer.params.bias_correction=False"],
        ),
        (
            {"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}},
            ["optimizer.params.amsgrad=True"],
        ),
        ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, ["optimizer.params", "lr=-1"]),
        ({"optimizer": {"type": "AdamW", "params": {"betas": [2, 0]}}}, ["betas="]),
        ({"optimizer": {"type": "SGD", "params": {"lr": -1}}}, ["optimizer.params (SGD)"]),
        ({"optimizer": {"type": "Lion", "params": {}}}, ["optimizer.type='Lion'", "lion"]),
        ({"gradient_clipping": -1}, ["gradient_clipping=-1"]),
        ({"gradient_clipping": "1.0"}, ["gradient_clipping='1.0'"]),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ["both true"]),
        ({"fp16": {"enabled": "yes"}}, ["fp16.enabled='yes'"]),
        ({"fp16": {"enabled": True, "min_loss_scale": 0}}, ["fp16", "min_scale"]),
        ({"fp16": {"enabled": True, "loss_scale_window": 0}}, ["fp16.loss_scale_window=0"]),
        ({"bf16": True}, ["bf16=True must be an object"]),
    ],
)
def test_training_sections_that_cannot_be_honoured_are_refused(
    change: dict[str, Any], words: list[str]
) -> None:
    ds = {"zero_optimization": {"stage": 3}, **change}
    with pytest.raises(SwapConfigError) as info:
        load_deepspeed(ds)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_adam_type_is_adamw_unless_told_otherwise() -> None:
    ds = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "adam", "params": {"lr": 1}}}
    assert load_deepspeed(ds)[1].optimizer == {"lr": 1}
    ds["optimizer"] = {"type": "AdamW", "params": {"adam_w_mode": False}}
    assert load_deepspeed(ds)[1].optimizer == {}  # DeepSpeed runs AdamW whatever it says


def test_aio_in_both_places_must_agree() -> None:
    aio = {"block_size": 1 << 20, "queue_depth": 8}
    ds = {"zero_optimization": {"stage": 3, "aio": dict(aio)}, "aio": dict(aio)}
    assert OffloadConfig.from_deepspeed(ds).manager.aio == AioConfig(
        block_size=1 << 20, queue_depth=8
    )
    ds["aio"]["queue_depth"] = 16
    with pytest.raises(SwapConfigError, match=r"aio and zero_optimization\.aio"):
        OffloadConfig.from_deepspeed(ds)
    ds = {"zero_optimization": {"stage": 3, "aio": {"queue_depth": 0}}}
    with pytest.raises(SwapConfigError, match=r"zero_optimization\.aio\.queue_depth=0"):
        OffloadConfig.from_deepspeed(ds)


# -- sub_group_size ----------------------------------------------------------------------

HOST = 1 << 20  # holds 87 381 elements of state: a typical sub_group_size does not fit
NUMEL = 200_000


def _adamw(cfg: OffloadConfig) -> OffloadAdamW:
    values = torch.randn(NUMEL, generator=torch.Generator().manual_seed(0))
    param = torch.nn.Parameter(values.to(torch.bfloat16))
    return OffloadAdamW([param], tiers=cfg.manager, config=cfg.step)


def _big_sub_group(tmp_path: Path) -> dict[str, Any]:
    """A config whose sub_group_size (5e7) the host budget HOST cannot hold."""
    return {
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 5e7,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "swap")},
        }
    }


def test_a_sub_group_the_host_budget_cannot_hold_is_reduced_with_one_line(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    ds = _big_sub_group(tmp_path)
    cfg = OffloadConfig.from_deepspeed(ds, host_nbytes=HOST, device="cpu")
    expected = HOST // 48 // 1024 * 1024  # a quarter of the budget, whole alignment units
    assert cfg.step.sub_group_numel == expected
    (line,) = _warnings(caplog)
    assert "zero_optimization.sub_group_size=50000000" in line
    assert f"reduced to {expected} elements" in line
    assert f"host_nbytes={HOST}" in line
    with _adamw(cfg) as opt:  # the optimizer takes it (it refused 5e7 under this budget)
        assert opt.sub_group_numel == expected

    caplog.clear()
    del ds["zero_optimization"]["sub_group_size"]  # our default, 25M, does not fit either
    cfg = OffloadConfig.from_deepspeed(ds, host_nbytes="1MiB", device="cpu")
    assert cfg.step.sub_group_numel == expected
    (line,) = _warnings(caplog)
    assert "default sub-group size" in line


def test_the_sub_group_is_fitted_to_the_optimizers_state_bytes(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """SGD with momentum keeps 8 B per element (master + momentum), not AdamW's 12: its
    sub-group is fitted to a quarter of the host budget at 8 B."""
    caplog.set_level(logging.INFO, LOGGER)
    ds = _big_sub_group(tmp_path)
    ds["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    cfg = OffloadConfig.from_deepspeed(ds, host_nbytes=HOST, device="cpu")
    assert cfg.step.sub_group_numel == HOST // 32 // 1024 * 1024
    (line,) = _warnings(caplog)
    assert "(8 B per element)" in line


def test_a_fitting_or_explicit_sub_group_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    ds = {"zero_optimization": {"stage": 3, "sub_group_size": 4096}}
    assert OffloadConfig.from_deepspeed(ds, host_nbytes=HOST).step.sub_group_numel == 4096
    ds["zero_optimization"]["sub_group_size"] = 1e9
    assert OffloadConfig.from_deepspeed(ds).step.sub_group_numel == 10**9  # no host budget
    cfg = OffloadConfig.from_deepspeed(ds, host_nbytes=HOST, sub_group_numel=2048)
    assert cfg.step.sub_group_numel == 2048  # the caller's choice
    assert _warnings(caplog) == []


@pytest.mark.parametrize(
    ("kind", "params", "cls"),
    [
        ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True}, torch.optim.SGD),
        ("Adagrad", {"lr": 0.01, "eps": 1e-10, "weight_decay": 0.0}, torch.optim.Adagrad),
    ],
)
def test_sgd_and_adagrad_map_to_offload_optimizer(
    kind: str, params: dict[str, Any], cls: type, caplog: pytest.LogCaptureFixture
) -> None:
    """optimizer.type SGD / Adagrad → OffloadOptimizer over torch.optim's class with the
    params it honours (issue 26); AdamW stays OffloadAdamW."""
    from swapper import ManagerConfig, OffloadAdamW, OffloadOptimizer

    caplog.set_level(logging.WARNING, LOGGER)
    ds = {"zero_optimization": {"stage": 3}, "optimizer": {"type": kind, "params": params}}
    _, training = load_deepspeed(ds)
    assert training.optimizer_class is cls and dict(training.optimizer) == params
    assert _warnings(caplog) == []
    weights = [torch.zeros(8, dtype=torch.bfloat16)]
    with training.make_optimizer(
        weights, tiers=ManagerConfig(device_nbytes=0, host_nbytes=None)
    ) as opt:
        assert isinstance(opt, OffloadOptimizer) and opt.optimizer_class is cls
        assert {k: opt.param_groups[0][k] for k in params} == params
    _, adamw = load_deepspeed({"zero_optimization": {"stage": 3}, **TRAINING_OPTIMIZER})
    with adamw.make_optimizer(
        weights, tiers=ManagerConfig(device_nbytes=0, host_nbytes=None)
    ) as opt:
        assert isinstance(opt, OffloadAdamW)


def test_adam_with_l2_maps_to_torch_adam(caplog: pytest.LogCaptureFixture) -> None:
    """optimizer.type Adam with adam_w_mode false (Adam with L2 regularisation, not AdamW)
    → OffloadOptimizer over torch.optim.Adam (fused, as DeepSpeed's CPU Adam), amsgrad
    honoured; it was refused (issue 26)."""
    from swapper import ManagerConfig, OffloadOptimizer

    caplog.set_level(logging.WARNING, LOGGER)
    params = {"lr": 0.01, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.1,
              "amsgrad": True, "adam_w_mode": False, "bias_correction": True}  # fmt: skip
    ds = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "Adam", "params": params}}
    _, training = load_deepspeed(ds)
    assert training.optimizer_class is torch.optim.Adam
    expected = {"fused": True, "lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-7}
    assert dict(training.optimizer) == {**expected, "weight_decay": 0.1, "amsgrad": True}
    assert _warnings(caplog) == []
    weights = [torch.zeros(8, dtype=torch.bfloat16)]
    with training.make_optimizer(
        weights, tiers=ManagerConfig(device_nbytes=0, host_nbytes=None)
    ) as opt:
        assert isinstance(opt, OffloadOptimizer) and opt.optimizer_class is torch.optim.Adam
        group = opt.param_groups[0]
        assert group["fused"] and group["amsgrad"] and group["weight_decay"] == 0.1


TRAINING_OPTIMIZER = {"optimizer": TRAINING["optimizer"]}
