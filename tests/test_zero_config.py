"""swapper.zero.config.offload: OffloadConfig (a manager and a step section) built by create() from
flat settings, validation, from_dict (flat or nested) / from_json / from_deepspeed, and an
as_dict round trip over random configs."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swapper.manager import Kind, ManagerConfig, Policy, Tier
from swapper.step import StepConfig
from swapper.zero.config.offload import OffloadConfig, sub_group_arena_nbytes
from swapper.zero.config.settings import fp32_grad_tiers, tiers_of
from tiers.config import AioConfig, Backend
from tiers.errors import SwapConfigError, SwapError

MiB = 1 << 20
GiB = 1 << 30

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME

#: The ZeRO-Infinity example of DeepSpeed's configuration docs (NVMe offload of parameters
#: and optimizer state, an aio section), with the usual training keys around it.
ZERO_INFINITY: dict[str, Any] = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": True,
        "overlap_comm": True,
        "reduce_bucket_size": 1e7,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_gather_16bit_weights_on_model_save": True,
        "sub_group_size": 1e9,
        "offload_optimizer": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 4,
            "fast_init": False,
            "pipeline_read": True,
            "pipeline_write": True,
            "ratio": 1.0,
        },
        "offload_param": {
            "device": "nvme",
            "nvme_path": "/local_nvme",
            "pin_memory": True,
            "buffer_count": 5,
            "buffer_size": 1e8,
            "max_in_cpu": 1e9,
        },
    },
    "aio": {
        "block_size": 262144,
        "queue_depth": 32,
        "thread_count": 1,
        "single_submit": False,
        "overlap_events": True,
    },
}


def _placed(cfg: OffloadConfig, kind: Kind) -> tuple[Tier, ...]:
    """Where ``cfg`` places ``kind`` (its manager's normalised placement)."""
    return tiers_of(cfg.manager, kind)


def _tiers(cfg: OffloadConfig) -> tuple[tuple[Tier, ...], ...]:
    """(param16, grad16, optim_state) tiers: what param_tiers, grad_tiers and
    optimizer_tiers became."""
    return tuple(_placed(cfg, k) for k in (Kind.PARAM16, Kind.GRAD16, Kind.OPTIM_STATE))


def _ds(**zero_changes: Any) -> dict[str, Any]:
    """A copy of :data:`ZERO_INFINITY` with ``zero_optimization`` keys replaced (None: drop)."""
    ds = copy.deepcopy(ZERO_INFINITY)
    for key, value in zero_changes.items():
        if value is None:
            ds["zero_optimization"].pop(key, None)
        else:
            ds["zero_optimization"][key] = value
    return ds


# -- defaults and construction -----------------------------------------------------------


def test_defaults() -> None:
    cfg = OffloadConfig.create()
    assert cfg.manager.device_nbytes is None
    assert cfg.manager.host_nbytes is None
    assert cfg.manager.nvme_dirs == ()
    assert cfg.manager.aio == AioConfig()
    # without swap directories the default tier lists leave nvme out
    assert _placed(cfg, Kind.PARAM16) == (D, H)
    assert _placed(cfg, Kind.GRAD16) == (H,)
    assert _placed(cfg, Kind.OPTIM_STATE) == (H,)
    assert cfg.manager.prefetch_window_nbytes is None  # no budgets: unlimited
    assert cfg.step.sub_group_numel == 25_000_000
    assert cfg.step.host_fraction == 0.0
    assert cfg.manager.device is None
    assert cfg.manager.store_name == "swapper-offload"
    # the other manager settings keep the manager's defaults
    assert cfg.manager.policy == ManagerConfig(device_nbytes=None, host_nbytes=None).policy
    assert OffloadConfig() == cfg


def test_defaults_with_nvme_dirs(tmp_path: Path) -> None:
    cfg = OffloadConfig.create(nvme_dirs=[str(tmp_path), tmp_path / "b"])
    assert cfg.manager.nvme_dirs == (tmp_path, tmp_path / "b")
    assert all(isinstance(d, Path) for d in cfg.manager.nvme_dirs)
    assert _placed(cfg, Kind.PARAM16) == (D, H, N)
    assert _placed(cfg, Kind.GRAD16) == (H, N)
    assert _placed(cfg, Kind.OPTIM_STATE) == (H, N)


def test_frozen_and_keyword_only() -> None:
    cfg = OffloadConfig.create()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.manager = cfg.manager  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.manager.host_nbytes = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        OffloadConfig(1)  # type: ignore[misc]


def test_tier_names_normalised_to_enums(tmp_path: Path) -> None:
    cfg = OffloadConfig.create(
        nvme_dirs=[tmp_path],
        param_tiers=["host", "nvme"],
        grad_tiers=["nvme"],
        optimizer_tiers=[Tier.HOST, "device"],
        step=StepConfig(host_fraction=1),
    )
    assert _placed(cfg, Kind.PARAM16) == (H, N)
    assert _placed(cfg, Kind.GRAD16) == (N,)
    assert _placed(cfg, Kind.OPTIM_STATE) == (H, D)
    assert all(isinstance(t, Tier) for tiers in _tiers(cfg) for t in tiers)
    assert cfg.step.host_fraction == 1.0 and isinstance(cfg.step.host_fraction, float)


@pytest.mark.parametrize(
    ("kwargs", "setting", "hint"),
    [
        ({"device_nbytes": -1}, "device_nbytes=-1", ">= 0"),
        ({"device_nbytes": True}, "device_nbytes=True", "number of bytes"),
        ({"host_nbytes": 1.5}, "host_nbytes=1.5", "such as '64MiB'"),
        ({"host_nbytes": "1 GiBs"}, "host_nbytes='1 GiBs'", "unknown size unit"),
        ({"prefetch_nbytes": -5}, "prefetch_nbytes=-5", ">= 0"),
        ({"prefetch_nbytes": 0}, "prefetch_nbytes=0", "> 0 bytes"),
        ({"nvme_dirs": "/tmp/x"}, "nvme_dirs='/tmp/x'", "list of directories"),
        ({"nvme_dirs": ["/a", "/a"]}, "nvme_dirs", "twice"),
        ({"nvme_dirs": [""]}, "nvme_dirs", "not a directory path"),
        ({"nvme_dirs": [3]}, "nvme_dirs", "not a directory path"),
        ({"aio": {"block_size": 4096}}, "aio=", "must be an AioConfig"),
        ({"param_tiers": []}, "param_tiers=[]", "at least one tier"),
        ({"grad_tiers": ()}, "grad_tiers=[]", "at least one tier"),
        ({"optimizer_tiers": "host"}, "optimizer_tiers='host'", "list of tiers"),
        ({"param_tiers": ["device", "gpu"]}, "param_tiers=['device', 'gpu']", "not a tier"),
        ({"grad_tiers": ["host", "host"]}, "grad_tiers=['host', 'host']", "twice"),
        ({"optimizer_tiers": [1]}, "optimizer_tiers=[1]", "not a tier"),
        ({"param_tiers": ["device", "nvme"]}, "param_tiers=['device', 'nvme']", "nvme_dirs"),
        ({"grad_tiers": ["host", "nvme"]}, "grad_tiers=['host', 'nvme']", "nvme_dirs is empty"),
        ({"optimizer_tiers": ["nvme"]}, "optimizer_tiers=['nvme']", "nvme_dirs is empty"),
        ({"device": 0}, "device=0", "'cpu', 'cuda' or 'cuda:N'"),
        ({"device": "gpu"}, "device='gpu'", "'cpu', 'cuda' or 'cuda:N'"),
        ({"device": "cuda:x"}, "device='cuda:x'", "'cuda:N'"),
        ({"store_name": ""}, "store_name=''", "non-empty"),
        ({"store_name": None}, "store_name=None", "non-empty"),
    ],
)
def test_validation_names_the_setting(kwargs: dict[str, Any], setting: str, hint: str) -> None:
    with pytest.raises(SwapConfigError) as info:
        OffloadConfig.create(**kwargs)
    msg = str(info.value)
    assert setting in msg
    assert hint in msg
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, SwapError)


def test_param_tiers_must_start_with_a_memory_tier(tmp_path: Path) -> None:
    with pytest.raises(SwapConfigError, match=r"param_tiers=\['nvme', 'host'\].*memory tier"):
        OffloadConfig.create(nvme_dirs=[tmp_path], param_tiers=["nvme", "host"])
    # host first is fine: parameters used on the host
    assert _placed(OffloadConfig.create(param_tiers=["host"]), Kind.PARAM16) == (H,)


def test_host_zero_refused_where_device_tensors_reach_nvme(tmp_path: Path) -> None:
    with pytest.raises(SwapConfigError, match=r"host_nbytes=0.*param_tiers"):
        OffloadConfig.create(nvme_dirs=[tmp_path], host_nbytes=0)
    # without that path a host budget of 0 is a valid (if odd) choice
    cfg = OffloadConfig.create(nvme_dirs=[tmp_path], host_nbytes=0, param_tiers=["device", "host"])
    assert cfg.manager.host_nbytes == 0


@pytest.mark.parametrize("device", [None, "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_values(device: str | None) -> None:
    # CUDA's presence is checked when a manager starts, not by the config
    assert OffloadConfig.create(device=device).manager.device == device


# -- the manager section --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "with_nvme", "placement"),
    [
        ({}, False, ((D, H), (H,), (H,))),
        ({}, True, ((D, H, N), (H, N), (H, N))),
        ({"param_tiers": ["device"]}, True, ((D,), (H, N), (H, N))),
        (
            {"param_tiers": ["host", "nvme"], "grad_tiers": ["host"], "optimizer_tiers": ["nvme"]},
            True,
            ((H, N), (H,), (N,)),
        ),
        (
            {"grad_tiers": ["device", "host"], "optimizer_tiers": ["device", "host", "nvme"]},
            True,
            ((D, H, N), (D, H), (D, H, N)),
        ),
        ({"param_tiers": ["device", "host"], "optimizer_tiers": ["host"]}, False, None),
    ],
)
def test_manager_section_placement(
    tmp_path: Path,
    kwargs: dict[str, Any],
    with_nvme: bool,
    placement: tuple[tuple[Tier, ...], ...] | None,
) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"] if with_nvme else []
    aio = AioConfig(block_size=64 * 1024, num_threads=2)
    cfg = OffloadConfig.create(
        device_nbytes=8 * MiB,
        host_nbytes=64 * MiB,
        nvme_dirs=dirs,
        aio=aio,
        device="cpu",
        store_name="run1",
        **kwargs,
    )
    mc = cfg.manager
    assert isinstance(mc, ManagerConfig)
    assert mc.device_nbytes == 8 * MiB
    assert mc.host_nbytes == 64 * MiB
    assert mc.nvme_dirs == tuple(dirs)
    assert mc.aio is aio
    assert mc.device == "cpu"
    assert mc.store_name == "run1"
    # fp32 gradients (of fp32 trainable parameters) stay on the gradients' memory tiers,
    # never NVMe (issue 27: they are never written to disk)
    assert _placed(cfg, Kind.GRAD32) == fp32_grad_tiers(_placed(cfg, Kind.GRAD16))
    assert N not in _placed(cfg, Kind.GRAD32)
    if placement is not None:
        assert _tiers(cfg) == placement


@pytest.mark.parametrize(
    ("device", "host", "prefetch", "window"),
    [
        (None, None, None, None),  # all unlimited: the manager's default (unlimited)
        (8 * MiB, None, None, 4 * MiB),  # half the device budget
        (8 * MiB, 64 * MiB, None, 4 * MiB),
        (8 * MiB, 1 * MiB, None, 1 * MiB),  # half the device budget, clamped to host
        (None, 64 * MiB, None, None),  # no device budget: the manager's (half the host)
        (8 * MiB, 64 * MiB, 2 * MiB, 2 * MiB),  # as given
        (None, None, 3 * MiB, 3 * MiB),
        (8 * MiB, 4096, 32 * MiB, 4096),  # small host, larger prefetch: clamped
        (None, 1, 1 * GiB, 1),
        (1, 64 * MiB, None, None),  # half of 1 byte is nothing: the manager's default
        (8 * MiB, 0, None, None),  # host 0: the manager's default (0)
        (8 * MiB, 0, 5 * MiB, None),
    ],
)
def test_prefetch_window_always_fits_the_host_budget(
    device: int | None, host: int | None, prefetch: int | None, window: int | None
) -> None:
    cfg = OffloadConfig.create(device_nbytes=device, host_nbytes=host, prefetch_nbytes=prefetch)
    mc = cfg.manager
    if window is not None:
        assert mc.prefetch_window_nbytes == window
    elif host is not None:
        assert mc.prefetch_window_nbytes == host // 2
    else:
        assert mc.prefetch_window_nbytes is None
    if mc.host_nbytes is not None and mc.prefetch_window_nbytes is not None:
        assert mc.prefetch_window_nbytes <= mc.host_nbytes


# -- from_dict / from_json ---------------------------------------------------------------


def test_from_dict_sizes_and_aio_dict(tmp_path: Path) -> None:
    cfg = OffloadConfig.from_dict(
        {
            "device_nbytes": "2GiB",
            "host_nbytes": "64MiB",
            "prefetch_nbytes": "1.5GB",
            "nvme_dirs": [str(tmp_path)],
            "aio": {"backend": "threads", "block_size": "8MiB", "queue_depth": 16},
            "param_tiers": ["device", "host", "nvme"],
            "grad_tiers": ["host"],
            "optimizer_tiers": ["host", "nvme"],
            "sub_group_numel": 1_000_000,
            "host_fraction": 0.25,
            "device": "cpu",
            "store_name": "exp",
        }
    )
    assert cfg.manager.device_nbytes == 2 * GiB
    assert cfg.manager.host_nbytes == 64 * MiB
    assert cfg.manager.nvme_dirs == (tmp_path,)
    assert cfg.manager.aio == AioConfig(backend=Backend.THREADS, block_size=8 * MiB, queue_depth=16)
    assert _placed(cfg, Kind.PARAM16) == (D, H, N)
    assert _placed(cfg, Kind.GRAD16) == (H,)
    assert _placed(cfg, Kind.OPTIM_STATE) == (H, N)
    assert cfg.step.sub_group_numel == 1_000_000
    assert cfg.step.host_fraction == 0.25
    assert cfg.manager.device == "cpu"
    assert cfg.manager.store_name == "exp"
    assert cfg.manager.prefetch_window_nbytes == 64 * MiB  # clamped to host


def test_from_dict_overrides_win() -> None:
    cfg = OffloadConfig.from_dict({"host_nbytes": "1GiB", "device": "cpu"}, host_nbytes="2GiB")
    assert cfg.manager.host_nbytes == 2 * GiB
    assert cfg.manager.device == "cpu"
    aio = AioConfig(num_threads=4)
    assert OffloadConfig.from_dict({"aio": {"num_threads": 2}}, aio=aio).manager.aio is aio
    assert OffloadConfig.from_dict({}) == OffloadConfig.create()


@pytest.mark.parametrize(
    ("mapping", "overrides", "named"),
    [
        ({"host_bytes": 1}, {}, ["host_bytes"]),
        ({"zz": 1, "aa": 2}, {}, ["aa, zz"]),
        ({}, {"prefetch": 1}, ["prefetch"]),
    ],
)
def test_from_dict_unknown_keys_named(
    mapping: dict[str, Any], overrides: dict[str, Any], named: list[str]
) -> None:
    with pytest.raises(SwapConfigError) as info:
        OffloadConfig.from_dict(mapping, **overrides)
    msg = str(info.value)
    assert "unknown offload setting" in msg
    for name in named:
        assert name in msg
    assert "known: device_nbytes" in msg


@pytest.mark.parametrize(
    ("mapping", "words"),
    [
        ({"host_nbytes": "lots"}, ["host_nbytes='lots'", "not a size"]),
        ({"device_nbytes": "3XB"}, ["device_nbytes='3XB'", "unknown size unit"]),
        ({"aio": {"block_size": 1000}}, ["aio:", "block_size=1000"]),
        ({"aio": {"speed": 1}}, ["aio:", "speed"]),
        ({"sub_group_numel": "25M"}, ["sub_group_numel='25M'"]),
        # the step's settings: flat keys fold into step, or a "step" object
        ({"sub_group_numel": 0}, ["sub_group_numel=0", "> 0"]),
        ({"sub_group_numel": -3}, ["sub_group_numel=-3", "> 0"]),
        ({"sub_group_numel": 2.5e7}, ["sub_group_numel=25000000.0", "int number of elements"]),
        ({"sub_group_numel": True}, ["sub_group_numel=True", "int number of elements"]),
        ({"host_fraction": -0.1}, ["host_fraction=-0.1", "between 0 and 1"]),
        ({"host_fraction": 1.5}, ["host_fraction=1.5", "between 0 and 1"]),
        ({"host_fraction": float("nan")}, ["host_fraction=nan", "between 0 and 1"]),
        ({"host_fraction": True}, ["host_fraction=True", "between 0 and 1"]),
        ({"host_fraction": "0.5"}, ["host_fraction='0.5'", "between 0 and 1"]),
        ({"step": {"readahead": -1}}, ["readahead=-1", "int >= 0"]),
        ({"step": {"speed": 1}}, ["unknown step setting(s): speed", "sub_group_numel"]),
        ({"step": [1]}, ["step=[1] must be a StepConfig"]),
        ({"step": {"accumulate_fp32": True}}, ["step.accumulate_fp32=True does not apply"]),
    ],
)
def test_from_dict_bad_values_named(mapping: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(SwapConfigError) as info:
        OffloadConfig.from_dict(mapping)
    for word in words:
        assert word in str(info.value)


def test_from_dict_refuses_a_non_mapping() -> None:
    with pytest.raises(SwapConfigError, match="mapping"):
        OffloadConfig.from_dict([("host_nbytes", 1)])  # type: ignore[arg-type]


def test_from_json_own_keys(tmp_path: Path) -> None:
    path = tmp_path / "offload.json"
    path.write_text(
        json.dumps(
            {
                "host_nbytes": "256MiB",
                "nvme_dirs": [str(tmp_path / "swap")],
                "aio": {"queue_depth": 64},
                "grad_tiers": ["host"],
            }
        )
    )
    cfg = OffloadConfig.from_json(path, device_nbytes="1GiB")
    assert cfg.manager.host_nbytes == 256 * MiB
    assert cfg.manager.device_nbytes == GiB
    assert cfg.manager.nvme_dirs == (tmp_path / "swap",)
    assert cfg.manager.aio.queue_depth == 64
    assert _placed(cfg, Kind.PARAM16) == (D, H, N)
    assert _placed(cfg, Kind.GRAD16) == (H,)
    assert OffloadConfig.from_json(str(path), device_nbytes="1GiB") == cfg


def test_from_json_deepspeed(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO_INFINITY))
    cfg = OffloadConfig.from_json(path, device_nbytes=4 * GiB, host_nbytes="16GiB")
    assert cfg == OffloadConfig.from_deepspeed(
        ZERO_INFINITY, device_nbytes=4 * GiB, host_nbytes=16 * GiB
    )
    assert cfg.manager.nvme_dirs == (Path("/local_nvme"),)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("{not json", ["not valid JSON"]),
        ("[1, 2]", ["JSON object"]),
        ('{"host_nbytes": "x"}', ["host_nbytes='x'"]),
        ('{"hots_nbytes": 1}', ["hots_nbytes"]),
        ('{"zero_optimization": {"stage": 2}}', ["zero_optimization.stage=2", "stage 3"]),
    ],
)
def test_from_json_errors_name_the_file(tmp_path: Path, text: str, words: list[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(SwapConfigError) as info:
        OffloadConfig.from_json(path)
    msg = str(info.value)
    assert str(path) in msg
    assert msg.count(str(path)) == 1
    for word in words:
        assert word in msg


def test_from_json_missing_file(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        OffloadConfig.from_json(tmp_path / "absent.json")


# -- from_deepspeed ----------------------------------------------------------------------


def test_from_deepspeed_zero_infinity_maps_every_field() -> None:
    cfg = OffloadConfig.from_deepspeed(
        ZERO_INFINITY, device_nbytes=4 * GiB, host_nbytes=16 * GiB, device="cpu"
    )
    # from zero_optimization
    assert cfg.step.sub_group_numel == 1_000_000_000  # "sub_group_size": 1e9
    assert _placed(cfg, Kind.PARAM16) == (D, H, N)  # offload_param.device = nvme
    assert _placed(cfg, Kind.GRAD16) == (H, N)  # grads follow param offload, NVMe since dirs exist
    assert _placed(cfg, Kind.OPTIM_STATE) == (H, N)  # offload_optimizer.device = nvme
    assert cfg.manager.nvme_dirs == (Path("/local_nvme"),)  # same path in both sections: once
    # from aio
    assert cfg.manager.aio.block_size == 262144
    assert cfg.manager.aio.queue_depth == 32
    assert cfg.manager.aio.num_threads == 1  # thread_count honoured
    assert cfg.manager.aio.single_submit is False
    # not in DeepSpeed: swapper's defaults, or the overrides
    assert cfg.manager.aio.backend is Backend.AUTO
    assert cfg.manager.aio.direct is True
    assert cfg.manager.device_nbytes == 4 * GiB
    assert cfg.manager.host_nbytes == 16 * GiB
    assert cfg.manager.device == "cpu"
    assert cfg.step.host_fraction == 0.0
    assert cfg.manager.store_name == "swapper-offload"
    assert _placed(cfg, Kind.GRAD32) == (H,)  # fp32 gradients: memory only
    assert cfg.manager.prefetch_window_nbytes == 2 * GiB


def test_from_deepspeed_reads_a_path(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ZERO_INFINITY))
    assert OffloadConfig.from_deepspeed(path) == OffloadConfig.from_deepspeed(ZERO_INFINITY)
    assert OffloadConfig.from_deepspeed(str(path)) == OffloadConfig.from_deepspeed(ZERO_INFINITY)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_ds(stage=1)))
    with pytest.raises(
        SwapConfigError, match=rf"^{re.escape(str(bad))}: zero_optimization.stage=1"
    ):
        OffloadConfig.from_deepspeed(bad)


@pytest.mark.parametrize(
    ("param", "optimizer", "tiers"),
    [
        (None, None, ((D,), (H,), (H,))),  # no offload sections
        ({"device": "none"}, {"device": "none"}, ((D,), (H,), (H,))),
        ({"device": "cpu"}, {"device": "cpu"}, ((D, H), (H,), (H,))),
        ({"device": "cpu", "pin_memory": True}, None, ((D, H), (H,), (H,))),
        (
            {"device": "nvme", "nvme_path": "/p"},
            {"device": "cpu"},
            ((D, H, N), (H, N), (H,)),
        ),
        (
            {"device": "cpu"},
            {"device": "nvme", "nvme_path": "/o"},
            ((D, H), (H, N), (H, N)),
        ),
        (
            {"device": "none"},
            {"device": "nvme", "nvme_path": "/o"},
            ((D,), (H, N), (H, N)),
        ),
        # a path without device: nvme is not used (as in DeepSpeed)
        ({"device": "cpu", "nvme_path": "/p"}, None, ((D, H), (H,), (H,))),
    ],
)
def test_from_deepspeed_offload_devices(
    param: dict[str, Any] | None,
    optimizer: dict[str, Any] | None,
    tiers: tuple[tuple[Tier, ...], ...],
) -> None:
    ds: dict[str, Any] = {"zero_optimization": {"stage": 3}}
    if param is not None:
        ds["zero_optimization"]["offload_param"] = param
    if optimizer is not None:
        ds["zero_optimization"]["offload_optimizer"] = optimizer
    cfg = OffloadConfig.from_deepspeed(ds)
    assert (
        _placed(cfg, Kind.PARAM16),
        _placed(cfg, Kind.GRAD16),
        _placed(cfg, Kind.OPTIM_STATE),
    ) == tiers
    assert bool(cfg.manager.nvme_dirs) == (
        N in _placed(cfg, Kind.OPTIM_STATE) or N in _placed(cfg, Kind.PARAM16)
    )
    assert cfg.manager.aio == AioConfig()  # no aio section: swapper's defaults
    assert cfg.step.sub_group_numel == 25_000_000  # no sub_group_size: ours


def test_from_deepspeed_nvme_paths_merged_in_order() -> None:
    ds = _ds()
    ds["zero_optimization"]["offload_param"]["nvme_path"] = ["/nvme0", "/nvme1"]
    ds["zero_optimization"]["offload_optimizer"]["nvme_path"] = "/nvme2"
    cfg = OffloadConfig.from_deepspeed(ds)
    assert cfg.manager.nvme_dirs == (Path("/nvme0"), Path("/nvme1"), Path("/nvme2"))
    ds["zero_optimization"]["offload_optimizer"]["nvme_path"] = ["/nvme1", "/nvme0/", "/n3"]
    cfg = OffloadConfig.from_deepspeed(ds)
    assert cfg.manager.nvme_dirs == (Path("/nvme0"), Path("/nvme1"), Path("/n3"))


def test_from_deepspeed_nvme_without_path() -> None:
    ds = _ds()
    del ds["zero_optimization"]["offload_param"]["nvme_path"]
    cfg = OffloadConfig.from_deepspeed(ds)  # the optimizer's path serves both
    assert cfg.manager.nvme_dirs == (Path("/local_nvme"),)
    del ds["zero_optimization"]["offload_optimizer"]["nvme_path"]
    with pytest.raises(SwapConfigError) as info:
        OffloadConfig.from_deepspeed(ds)
    assert "zero_optimization.offload_param.nvme_path" in str(info.value)
    assert "nvme_dirs=" in str(info.value)
    # the caller's nvme_dirs fill the gap
    cfg = OffloadConfig.from_deepspeed(ds, nvme_dirs=["/scratch"])
    assert cfg.manager.nvme_dirs == (Path("/scratch"),)
    assert _placed(cfg, Kind.PARAM16) == (D, H, N)


def test_from_deepspeed_overrides_win() -> None:
    cfg = OffloadConfig.from_deepspeed(
        ZERO_INFINITY,
        device_nbytes="1GiB",
        host_nbytes=GiB,
        nvme_dirs=["/other"],
        sub_group_numel=1000,
        param_tiers=["device", "host"],
        aio={"num_threads": 8},
        prefetch_nbytes="2GiB",
    )
    assert cfg.manager.device_nbytes == GiB
    assert cfg.manager.nvme_dirs == (Path("/other"),)
    assert cfg.step.sub_group_numel == 1000
    assert _placed(cfg, Kind.PARAM16) == (D, H)
    assert cfg.manager.aio == AioConfig(num_threads=8)
    assert cfg.manager.prefetch_window_nbytes == GiB  # clamped to host


def test_from_deepspeed_unknown_override_named() -> None:
    with pytest.raises(SwapConfigError, match=r"unknown offload setting.*host_budget"):
        OffloadConfig.from_deepspeed(ZERO_INFINITY, host_budget=1)


@pytest.mark.parametrize("key", ["intra_op_parallelism", "thread_count", "num_threads"])
def test_from_deepspeed_thread_count_names(key: str) -> None:
    ds = _ds()
    del ds["aio"]["thread_count"]
    ds["aio"][key] = 6
    assert OffloadConfig.from_deepspeed(ds).manager.aio.num_threads == 6


def test_from_deepspeed_thread_count_names_agreeing() -> None:
    ds = _ds()
    ds["aio"].update(thread_count=4, intra_op_parallelism=4, num_threads=4.0)
    assert OffloadConfig.from_deepspeed(ds).manager.aio.num_threads == 4


@pytest.mark.parametrize(
    ("values", "named"),
    [
        (
            {"thread_count": 2, "intra_op_parallelism": 4},
            ["intra_op_parallelism=4", "thread_count=2"],
        ),
        ({"thread_count": 2, "num_threads": 3}, ["thread_count=2", "num_threads=3"]),
        (
            {"intra_op_parallelism": 1, "thread_count": 1, "num_threads": 8},
            ["intra_op_parallelism=1", "num_threads=8"],
        ),
    ],
)
def test_from_deepspeed_thread_counts_disagreeing(values: dict[str, int], named: list[str]) -> None:
    ds = _ds()
    del ds["aio"]["thread_count"]
    ds["aio"].update(values)
    with pytest.raises(SwapConfigError) as info:
        OffloadConfig.from_deepspeed(ds)
    for name in named:
        assert f"aio.{name}" in str(info.value)


@pytest.mark.parametrize(
    ("where", "key"),
    [
        ((), "zero_optimization_extra"),  # top level: not ours, ignored (checked below)
        (("zero_optimization",), "offload_parm"),
        (("zero_optimization",), "stage3_max_live_params"),
        (("zero_optimization", "offload_param"), "nvme_paths"),
        (("zero_optimization", "offload_param"), "fast_init"),  # an optimizer-only key
        (("zero_optimization", "offload_optimizer"), "max_in_cpu"),  # a param-only key
        (("zero_optimization", "offload_optimizer"), "device_type"),
        (("aio",), "blocksize"),
        (("aio",), "threads"),
    ],
)
def test_from_deepspeed_unknown_keys_named_with_their_section(
    where: tuple[str, ...], key: str
) -> None:
    ds = _ds()
    section = ds
    for name in where:
        section = section[name]
    section[key] = 1
    if not where:
        OffloadConfig.from_deepspeed(ds)  # other top-level keys are DeepSpeed's business
        return
    with pytest.raises(SwapConfigError) as info:
        OffloadConfig.from_deepspeed(ds)
    msg = str(info.value)
    assert f"{'.'.join(where)}.{key} is not a DeepSpeed setting swapper knows" in msg
    assert "known: " in msg


@pytest.mark.parametrize("stage", [0, 1, 2, None, "3", True])
def test_from_deepspeed_stage_must_be_3(stage: Any) -> None:
    ds = _ds(stage=stage)
    with pytest.raises(SwapConfigError) as info:
        OffloadConfig.from_deepspeed(ds)
    msg = str(info.value)
    assert "zero_optimization.stage=" in msg
    assert "needs ZeRO stage 3" in msg


def test_from_deepspeed_needs_zero_optimization() -> None:
    with pytest.raises(SwapConfigError, match="no zero_optimization section"):
        OffloadConfig.from_deepspeed({"train_batch_size": 8, "aio": {}})
    with pytest.raises(SwapConfigError, match="zero_optimization=True must be an object"):
        OffloadConfig.from_deepspeed({"zero_optimization": True})


def test_from_deepspeed_use_gds_refused() -> None:
    ds = _ds()
    ds["aio"]["use_gds"] = True
    with pytest.raises(SwapConfigError, match=r"aio.use_gds=True: GPUDirect Storage"):
        OffloadConfig.from_deepspeed(ds)
    ds["aio"]["use_gds"] = False
    OffloadConfig.from_deepspeed(ds)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"sub_group_size": 0}, ["zero_optimization.sub_group_size=0", "integer >= 1"]),
        ({"sub_group_size": 1.5}, ["zero_optimization.sub_group_size=1.5"]),
        ({"sub_group_size": "auto"}, ["zero_optimization.sub_group_size='auto'"]),
        ({"offload_param": {"device": "gpu"}}, ["offload_param.device='gpu'", "'none', 'cpu'"]),
        ({"offload_optimizer": {"device": "hpu"}}, ["offload_optimizer.device='hpu'"]),
        ({"offload_param": "cpu"}, ["zero_optimization.offload_param='cpu'", "object"]),
        (
            {"offload_param": {"device": "nvme", "nvme_path": 5}},
            ["offload_param.nvme_path=5", "directory path"],
        ),
    ],
)
def test_from_deepspeed_bad_values_named(change: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(SwapConfigError) as info:
        OffloadConfig.from_deepspeed(_ds(**change))
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize(
    ("aio", "words"),
    [
        ({"block_size": 1000}, ["aio:", "block_size=1000", "multiple of 4096"]),
        ({"queue_depth": 0}, ["aio.queue_depth=0"]),
        ({"single_submit": "yes"}, ["aio.single_submit='yes'", "true or false"]),
        ({"thread_count": 0}, ["aio.thread_count=0"]),
    ],
)
def test_from_deepspeed_bad_aio_values_named(aio: dict[str, Any], words: list[str]) -> None:
    ds = _ds()
    ds["aio"].update(aio)
    with pytest.raises(SwapConfigError) as info:
        OffloadConfig.from_deepspeed(ds)
    for word in words:
        assert word in str(info.value)


def test_from_deepspeed_ignored_keys_accepted() -> None:
    """Every DeepSpeed key we list as ignored really is (a sample of each section)."""
    ds = _ds(
        allgather_partitions=True,
        allgather_bucket_size=5e8,
        reduce_scatter=True,
        round_robin_gradients=False,
        elastic_checkpoint=False,
        ignore_unused_parameters=True,
        load_from_fp32_weights=True,
        memory_efficient_linear=True,
        zero_hpz_partition_size=1,
        zero_quantized_weights=False,
        zero_quantized_gradients=False,
        mics_shard_size=-1,
        mics_hierarchical_params_gather=False,
        stage3_gather_fp16_weights_on_model_save=False,
        cpu_offload=False,
        cpu_offload_use_pin_memory=False,
        legacy_stage1=False,
        prefetch_bucket_size="auto",  # Hugging Face's "auto" placeholders are fine here
        reduce_bucket_size="auto",
    )
    ds["zero_optimization"]["offload_optimizer"].update(
        buffer_size=1e8, super_offload=False, cpuadam_cores_perc=0.8
    )
    ds["aio"]["use_gds"] = False
    cfg = OffloadConfig.from_deepspeed(ds)
    assert cfg == OffloadConfig.from_deepspeed(ZERO_INFINITY)


def test_from_deepspeed_deprecated_cpu_offload_param() -> None:
    cfg = OffloadConfig.from_deepspeed(
        {"zero_optimization": {"stage": 3, "cpu_offload_param": True}}
    )
    assert _placed(cfg, Kind.PARAM16) == (D, H)
    # offload_param, where given, decides
    cfg = OffloadConfig.from_deepspeed(
        {"zero_optimization": {"stage": 3, "cpu_offload_param": True, "offload_param": None}}
    )
    assert _placed(cfg, Kind.PARAM16) == (D, H)
    cfg = OffloadConfig.from_deepspeed(
        {
            "zero_optimization": {
                "stage": 3,
                "cpu_offload_param": True,
                "offload_param": {"device": "none"},
            }
        }
    )
    assert _placed(cfg, Kind.PARAM16) == (D,)


def test_from_deepspeed_refuses_other_shapes() -> None:
    with pytest.raises(SwapConfigError, match="mapping or a JSON file"):
        OffloadConfig.from_deepspeed(3)  # type: ignore[arg-type]
    with pytest.raises(SwapConfigError, match=r"aio=.*object"):
        OffloadConfig.from_deepspeed({**_ds(), "aio": [1]})


def test_from_deepspeed_emitted_bench_config_is_not_a_deepspeed_config(tmp_path: Path) -> None:
    """``swapper-bench --emit-config``'s file has no zero_optimization: refused clearly."""
    path = tmp_path / "emitted.json"
    path.write_text(json.dumps({"swapper": {"aio": {}}, "deepspeed": {"aio": {}}}))
    with pytest.raises(SwapConfigError, match=r"unknown offload setting.*deepspeed, swapper"):
        OffloadConfig.from_json(path)


# -- nested sections and direct construction ---------------------------------------------


def test_as_dict_has_three_sections(tmp_path: Path) -> None:
    cfg = OffloadConfig.create(
        device_nbytes=8 * MiB,
        host_nbytes=64 * MiB,
        nvme_dirs=[tmp_path],
        param_tiers=["device", "host", "nvme"],
        policy="lru",
        step=StepConfig(sub_group_numel=4096),
    )
    data = cfg.as_dict()
    assert set(data) == {"manager", "step", "distributed"}
    manager = data["manager"]
    assert set(manager) == {f.name for f in dataclasses.fields(ManagerConfig)}
    assert manager["nvme_dirs"] == [str(tmp_path)]
    assert manager["placement"] == {
        "param16": ["device", "host", "nvme"],
        "grad16": ["host", "nvme"],
        "optim_state": ["host", "nvme"],
        "grad32": ["host"],
    }
    assert manager["policy"] == "lru"
    assert manager["prefetch_window_nbytes"] == 4 * MiB  # half the device budget
    assert manager["aio"]["backend"] == "auto"
    assert AioConfig.from_dict(manager["aio"]) == cfg.manager.aio
    assert data["step"]["sub_group_numel"] == 4096
    assert OffloadConfig.from_dict(data) == cfg


def test_from_dict_nested_sections_take_offload_defaults(tmp_path: Path) -> None:
    cfg = OffloadConfig.from_dict(
        {
            "manager": {
                "host_nbytes": "64MiB",
                "nvme_dirs": [str(tmp_path)],
                "placement": {"param16": ["host", "nvme"]},
                "aio": {"queue_depth": 8},
                "mover_threads": 3,
            },
            "step": {"max_grad_norm": 1.0},
        }
    )
    flat = OffloadConfig.create(
        host_nbytes=64 * MiB,
        nvme_dirs=[tmp_path],
        param_tiers=["host", "nvme"],
        aio=AioConfig(queue_depth=8),
        mover_threads=3,
        step=StepConfig(max_grad_norm=1.0),
    )
    assert cfg == flat
    assert _tiers(cfg) == ((H, N), (H, N), (H, N))
    assert cfg.manager.store_name == "swapper-offload"
    assert cfg.step.sub_group_numel == 25_000_000
    # without swap directories the defaults leave nvme out, as create() does
    assert _tiers(OffloadConfig.from_dict({"manager": {}})) == ((D, H), (H,), (H,))
    assert OffloadConfig.from_dict({"manager": {}}) == OffloadConfig()


def test_from_dict_nested_with_flat_overrides(tmp_path: Path) -> None:
    data = OffloadConfig.create(device_nbytes=8 * MiB, nvme_dirs=[tmp_path]).as_dict()
    cfg = OffloadConfig.from_dict(data, host_nbytes="1GiB", store_name="b", sub_group_numel=512)
    assert cfg.manager.host_nbytes == GiB
    assert cfg.manager.store_name == "b"
    assert cfg.manager.device_nbytes == 8 * MiB
    assert cfg.step.sub_group_numel == 512
    mc = dataclasses.replace(cfg.manager, mover_threads=5)
    assert OffloadConfig.from_dict(data, manager=mc).manager is mc
    with pytest.raises(SwapConfigError, match=r"param_tiers, prefetch_nbytes beside a 'manager'"):
        OffloadConfig.from_dict(data, param_tiers=["host"], prefetch_nbytes=1)


def test_from_json_reads_what_as_dict_writes(tmp_path: Path) -> None:
    cfg = OffloadConfig.create(host_nbytes=64 * MiB, nvme_dirs=[tmp_path / "swap"], policy="lru")
    path = tmp_path / "offload.json"
    path.write_text(json.dumps(cfg.as_dict()))
    assert OffloadConfig.from_json(path) == cfg
    # the read-ahead window was the manager's default (half the host budget): it follows
    # an overridden host budget instead of outgrowing it
    smaller = OffloadConfig.from_json(path, host_nbytes=MiB)
    assert smaller.manager.prefetch_window_nbytes == MiB // 2
    assert smaller.manager.policy is Policy.LRU


@pytest.mark.parametrize(
    ("mapping", "words"),
    [
        ({"manager": {"host_budget": 1}}, ["unknown manager setting(s): host_budget", "known:"]),
        ({"manager": [1]}, ["manager=[1] must be a ManagerConfig"]),
        ({"manager": {"placement": {"param16": ["gpu"]}}}, ["manager:", "unknown tier"]),
        ({"manager": {"placement": {"params": ["host"]}}}, ["manager:", "'params' is not a kind"]),
        ({"manager": {"host_nbytes": "lots"}}, ["host_nbytes='lots'"]),
        ({"manager": {"aio": {"speed": 1}}}, ["aio:", "speed"]),
        (
            {"manager": {"placement": {"param16": ["nvme"]}, "nvme_dirs": ["/s"]}},
            ["manager.placement['param16']=['nvme']", "memory tier"],
        ),
        ({"manager": {"device": "gpu"}}, ["manager.device='gpu'", "'cuda:N'"]),
        ({"manager": {}, "step": {"accumulate_fp32": True}}, ["step.accumulate_fp32=True"]),
    ],
)
def test_from_dict_nested_errors_named(mapping: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(SwapConfigError) as info:
        OffloadConfig.from_dict(mapping)
    for word in words:
        assert word in str(info.value)


def test_direct_construction_checks_the_sections() -> None:
    manager = ManagerConfig(device_nbytes=None, host_nbytes=None)
    cfg = OffloadConfig(manager=manager)
    assert cfg.manager is manager
    assert cfg.step.sub_group_numel == 25_000_000  # normalised as create() does
    with pytest.raises(SwapConfigError, match=r"manager=.*must be a ManagerConfig"):
        OffloadConfig(manager={"host_nbytes": 1})  # type: ignore[arg-type]
    with pytest.raises(SwapConfigError, match=r"step=.*must be a StepConfig"):
        OffloadConfig(step={"readahead": 1})  # type: ignore[arg-type]
    with pytest.raises(SwapConfigError, match=r"manager.placement\['param16'\].*memory tier"):
        OffloadConfig(
            manager=ManagerConfig(
                device_nbytes=None,
                host_nbytes=None,
                nvme_dirs=["/s"],
                placement={"param16": ["nvme"]},
            )
        )


def test_create_passes_manager_settings_through() -> None:
    cfg = OffloadConfig.create(policy="belady", write_behind_nbytes=MiB, timeout_s=5.0)
    assert cfg.manager.policy is Policy.BELADY
    assert cfg.manager.write_behind_nbytes == MiB
    assert cfg.manager.timeout_s == 5.0
    with pytest.raises(SwapConfigError, match=r"unknown offload setting\(s\): placement"):
        OffloadConfig.create(placement={})
    with pytest.raises(SwapConfigError, match="no valid TierManager config: mover_threads=0"):
        OffloadConfig.create(mover_threads=0)
    cfg = OffloadConfig.from_dict({"policy": "lru", "stripe_nbytes": "1MiB"})
    assert cfg.manager.policy is Policy.LRU
    assert cfg.manager.stripe_nbytes == MiB


# -- round trip --------------------------------------------------------------------------

_TIERS = [D, H, N]


@st.composite
def _configs(draw: st.DrawFn) -> OffloadConfig:
    ndirs = draw(st.integers(0, 3))
    dirs = [f"/swap/d{i}" for i in range(ndirs)]
    allowed = _TIERS if ndirs else [D, H]

    def tier_list(*, first_memory: bool = False) -> list[Tier] | None:
        if draw(st.booleans()):
            return None
        tiers = draw(st.lists(st.sampled_from(allowed), min_size=1, unique=True))
        if first_memory and tiers[0] is N:
            tiers.reverse()
            if tiers[0] is N:
                tiers = [H, *tiers]
        return tiers

    sizes = st.none() | st.integers(0, 1 << 42)
    aio = AioConfig(
        backend=draw(st.sampled_from(list(Backend))),
        block_size=4096 * draw(st.integers(1, 4096)),
        queue_depth=draw(st.integers(1, 1024)),
        num_threads=draw(st.integers(1, 64)),
        direct=draw(st.booleans()),
        close_timeout_s=draw(st.floats(0.001, 1e6)),
        single_submit=draw(st.booleans()),
    )
    host = draw(sizes)
    param_tiers = tier_list(first_memory=True)
    grad_tiers = tier_list()
    optimizer_tiers = tier_list()
    if host == 0:
        host = 1  # host 0 with device and nvme in one list is refused; tested above
    return OffloadConfig.create(
        device_nbytes=draw(sizes),
        host_nbytes=host,
        nvme_dirs=dirs,
        aio=aio,
        param_tiers=param_tiers,
        grad_tiers=grad_tiers,
        optimizer_tiers=optimizer_tiers,
        prefetch_nbytes=draw(st.none() | st.integers(1, 1 << 42)),
        step=StepConfig(
            sub_group_numel=draw(st.integers(1, 1 << 40)),
            host_fraction=draw(st.floats(0.0, 1.0)),
            max_grad_norm=draw(st.none() | st.floats(0.5, 10.0)),
            readahead=draw(st.none() | st.integers(0, 4)),
            name=draw(st.text(min_size=1, max_size=10)),
        ),
        device=draw(st.sampled_from([None, "cpu", "cuda", "cuda:0", "cuda:3"])),
        store_name=draw(st.text(min_size=1, max_size=20)),
        policy=draw(st.sampled_from(list(Policy))),
        stats_interval_s=draw(st.none() | st.floats(0.001, 1e6)),
        timeout_s=draw(st.floats(0.001, 1e6)),
        stripe_nbytes=4096 * draw(st.integers(1, 1 << 20)),
        checksum=draw(st.booleans()),
        verify=draw(st.booleans()),
        mover_threads=draw(st.integers(1, 64)),
    )


@given(_configs())
def test_as_dict_round_trips(cfg: OffloadConfig) -> None:
    data = cfg.as_dict()
    # JSON values only, and the same through a JSON file's text
    data_via_json = json.loads(json.dumps(data))
    assert data_via_json == data
    assert OffloadConfig.from_dict(data) == cfg
    assert OffloadConfig.from_dict(data_via_json) == cfg
    assert AioConfig.from_dict(data["manager"]["aio"]) == cfg.manager.aio
    # fp32 gradients on the gradients' memory tiers only, and the window fits the host budget
    mc = cfg.manager
    assert _placed(cfg, Kind.GRAD32) == fp32_grad_tiers(_placed(cfg, Kind.GRAD16))
    if mc.host_nbytes is not None and mc.prefetch_window_nbytes is not None:
        assert mc.prefetch_window_nbytes <= mc.host_nbytes


@st.composite
def _direct_configs(draw: st.DrawFn) -> OffloadConfig:
    """Configs built from a ManagerConfig directly: any placement per kind (grad32 apart
    from optim_state too) and windows given outright, which create() never makes."""
    dirs = [f"/swap/d{i}" for i in range(draw(st.integers(0, 2)))]
    allowed = _TIERS if dirs else [D, H]
    placement: dict[Kind | str, list[Tier]] = {}
    for kind in Kind:
        if draw(st.booleans()):
            tiers = draw(st.lists(st.sampled_from(allowed), min_size=1, unique=True))
            if kind is Kind.PARAM16 and tiers[0] is N:
                tiers = [H, *[t for t in tiers if t is not H]]
            placement[kind] = tiers
    host = draw(st.none() | st.integers(2, 1 << 40))
    window = st.none() | st.integers(1, host if host is not None else 1 << 40)
    manager = ManagerConfig(
        device_nbytes=draw(st.none() | st.integers(0, 1 << 40)),
        host_nbytes=host,
        nvme_dirs=dirs,
        placement=placement,
        prefetch_window_nbytes=draw(window),
        write_behind_nbytes=draw(window),
        close_timeout_s=draw(st.floats(0.001, 1e6)),
        host_arena_nbytes=4096 * draw(st.integers(1, 1 << 16)),
        store_name=draw(st.sampled_from(["swapper-store", "x"])),
    )
    return OffloadConfig(manager=manager, step=StepConfig(accumulate_fp32=False))


@given(_direct_configs())
def test_as_dict_round_trips_direct_configs(cfg: OffloadConfig) -> None:
    data = json.loads(json.dumps(cfg.as_dict()))
    assert OffloadConfig.from_dict(data) == cfg


def test_sizes_as_strings_everywhere_through_one_parser() -> None:
    """issue 28 item 7: create, ManagerConfig, from_dict and DeepSpeed files all take
    "1MiB" (create refused it); every one reads it with tiers.units.parse_size."""
    from swapper.manager import ManagerConfig

    cfg = OffloadConfig.create(
        host_nbytes="1MiB", device_nbytes="512KiB", prefetch_nbytes="64KiB", device="cpu"
    )
    assert (cfg.manager.host_nbytes, cfg.manager.device_nbytes) == (1 << 20, 512 << 10)
    assert cfg.manager.prefetch_window_nbytes == 64 << 10
    manager = ManagerConfig(
        device_nbytes=None,
        host_nbytes="2MiB",  # type: ignore[arg-type]  # (the annotation says what it holds)
        write_behind_nbytes="1.5MiB",  # type: ignore[arg-type]
        stripe_nbytes="8MiB",  # type: ignore[arg-type]
    )
    assert manager.host_nbytes == 2 << 20 and manager.write_behind_nbytes == 3 << 19
    assert manager.stripe_nbytes == 8 << 20
    from_json = OffloadConfig.from_dict({"host_nbytes": "1MiB", "device": "cpu"})
    assert from_json.manager.host_nbytes == 1 << 20
    with pytest.raises(SwapConfigError, match=r"stripe_nbytes='8 furlongs'.*unknown size unit"):
        ManagerConfig(
            device_nbytes=None,
            host_nbytes=None,
            stripe_nbytes="8 furlongs",  # type: ignore[arg-type]
        )


def test_host_arena_holds_one_sub_group_of_optimizer_state() -> None:
    """A sub-group's state larger than the default 64 MiB arena got a mapping of its own,
    made and faulted in at every fetch; the arena is sized to hold it instead."""
    step = StepConfig(sub_group_numel=16_000_000)  # 192 MB of fp32 state
    config = OffloadConfig.create(host_nbytes="3GiB", step=step)
    assert config.manager.host_arena_nbytes >= 12 * 16_000_000
    assert config.manager.host_arena_nbytes % (2 << 20) == 0
    # an explicit setting wins; small sub-groups and unlimited budgets keep the default
    default = 64 << 20  # ManagerConfig.host_arena_nbytes
    pinned = OffloadConfig.create(host_nbytes="3GiB", step=step, host_arena_nbytes=32 << 20)
    assert pinned.manager.host_arena_nbytes == 32 << 20
    small = OffloadConfig.create(host_nbytes="3GiB", step=StepConfig(sub_group_numel=1 << 20))
    assert small.manager.host_arena_nbytes == default
    assert OffloadConfig.create(step=step).manager.host_arena_nbytes == default
    assert sub_group_arena_nbytes(100 << 20, 16_000_000) is None  # larger than the budget
