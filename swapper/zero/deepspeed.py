"""The DeepSpeed config reader: our :class:`~swapper.zero.OffloadConfig` settings from a
DeepSpeed config's ``zero_optimization`` and ``aio`` sections.

:func:`deepspeed_settings` returns a mapping of OffloadConfig's flat keys (what
:meth:`OffloadConfig.from_dict` reads, the keywords of :meth:`OffloadConfig.create`);
:meth:`OffloadConfig.from_deepspeed` builds the config from it. What is read and what is
accepted and ignored is listed with the key sets below;
:meth:`OffloadConfig.from_deepspeed` documents the mapping.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from swapper.manager.config import Tier
from tiers.config import AioConfig, read_json_object
from tiers.errors import SwapConfigError

__all__ = ["deepspeed_settings"]


def deepspeed_settings(
    ds: Mapping[str, Any] | str | os.PathLike[str], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """OffloadConfig settings (our keys) from a DeepSpeed config, ``overrides`` winning.

    ``ds`` is a mapping or a JSON file's path.

    Raises:
        OSError: ``ds`` is a path that cannot be read.
        SwapConfigError: see :meth:`~swapper.zero.OffloadConfig.from_deepspeed`; with a
            path, the message names the file.
    """
    if isinstance(ds, (str, os.PathLike)):
        data = read_json_object(ds)
        try:
            return deepspeed_settings(data, overrides)
        except SwapConfigError as exc:
            raise SwapConfigError(f"{os.fspath(ds)}: {exc}") from None
    if not isinstance(ds, Mapping):
        raise SwapConfigError(
            f"a DeepSpeed config must be a mapping or a JSON file's path, got {type(ds).__name__}"
        )
    values, needs_nvme = _read_deepspeed(ds)
    values.update(overrides)
    if not values.get("nvme_dirs"):
        for field, where in needs_nvme:
            if field not in overrides:
                raise SwapConfigError(
                    f"{where}.device='nvme' but no {where}.nvme_path is given: name a "
                    "swap directory there, or pass nvme_dirs=[...]"
                )
    return values


def _names(tiers: Sequence[Tier]) -> list[str]:
    return [t.value for t in tiers]


#: ``zero_optimization`` keys we read.
_DS_ZERO_READ = frozenset(
    {"stage", "sub_group_size", "offload_param", "offload_optimizer", "cpu_offload_param"}
)

#: ``zero_optimization`` keys DeepSpeed has (with the names its aliases also accept) that
#: swapper accepts and ignores: collective bucketing and overlap (single-process offload
#: has no collectives to tune), GPU-side persistence and live-parameter limits (the device
#: budget bounds these), quantized communication, checkpoint gathering, MiCS/hpZ
#: partitioning, and deprecated switches whose meaning the offload sections carry
#: (``cpu_offload`` = optimizer offload to CPU, which is where our optimizer state is
#: anyway; ``cpu_offload_use_pin_memory``: swapper pins whenever CUDA is present).
_DS_ZERO_IGNORED = frozenset(
    {
        "allgather_bucket_size",
        "allgather_partitions",
        "allgather_sequential",
        "contiguous_gradients",
        "cpu_offload",
        "cpu_offload_use_pin_memory",
        "elastic_checkpoint",
        "enable_sanity_checks",
        "gather_16bit_weights_on_model_save",
        "ignore_unused_parameters",
        "leaf_module",
        "legacy_stage1",
        "load_from_fp32_weights",
        "log_trace_cache_warnings",
        "max_live_parameters",
        "max_reuse_distance",
        "memory_efficient_linear",
        "mics_hierarchical_params_gather",
        "mics_shard_size",
        "model_persistence_threshold",
        "module_granularity_threshold",
        "overlap_comm",
        "override_module_apply",
        "param_persistence_threshold",
        "pipeline_loading_checkpoint",
        "prefetch_bucket_size",
        "reduce_bucket_size",
        "reduce_scatter",
        "round_robin_gradients",
        "save_muon_momentum_buffer_in_memory",
        "stage3_allgather_sequential",
        "stage3_gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_model_persistence_threshold",
        "stage3_module_granularity_threshold",
        "stage3_param_persistence_threshold",
        "stage3_prefetch_bucket_size",
        "stage3_use_all_reduce_for_fetch_params",
        "use_all_reduce_for_fetch_params",
        "use_multi_rank_bucket_allreduce",
        "zenflow",
        "zero_hpz_partition_size",
        "zero_quantized_gradients",
        "zero_quantized_nontrainable_weights",
        "zero_quantized_weights",
        "zeropp_loco_param",
    }
)

_DS_PARAM_READ = frozenset({"device", "nvme_path"})
#: swapper pins host memory whenever CUDA is present and sizes its buffers (count, size,
#: parameters kept in host memory) from the byte budgets.
_DS_PARAM_IGNORED = frozenset({"pin_memory", "buffer_count", "buffer_size", "max_in_cpu"})

_DS_OPTIMIZER_READ = frozenset({"device", "nvme_path"})
#: Buffers: as above. ``pipeline_read``/``pipeline_write``: the step pipeline always
#: overlaps read-ahead and write-behind. ``fast_init``: state starts in the tiers directly.
#: ``ratio``, ``super_offload``, ``cpuadam_cores_perc``: how DeepSpeed splits the step
#: between GPU and CPU Adam; OffloadAdamW has one way of stepping.
_DS_OPTIMIZER_IGNORED = frozenset(
    {
        "pin_memory",
        "buffer_count",
        "buffer_size",
        "fast_init",
        "pipeline_read",
        "pipeline_write",
        "ratio",
        "super_offload",
        "cpuadam_cores_perc",
    }
)

#: DeepSpeed reads ``intra_op_parallelism``; ``thread_count`` is its older name and
#: ``num_threads`` ours. Current DeepSpeed ignores the two; swapper honours all three.
_DS_AIO_THREADS = ("intra_op_parallelism", "thread_count", "num_threads")
_DS_AIO_READ = frozenset(
    {"block_size", "queue_depth", "single_submit", "use_gds", *_DS_AIO_THREADS}
)
#: ``overlap_events``: each request has its own future, so completions always overlap.
_DS_AIO_IGNORED = frozenset({"overlap_events"})

_PARAM_TIERS_BY_DEVICE = {
    "none": (Tier.DEVICE,),
    "cpu": (Tier.DEVICE, Tier.HOST),
    "nvme": (Tier.DEVICE, Tier.HOST, Tier.NVME),
}
_OPTIMIZER_TIERS_BY_DEVICE = {
    "none": (Tier.HOST,),
    "cpu": (Tier.HOST,),
    "nvme": (Tier.HOST, Tier.NVME),
}


def _read_deepspeed(ds: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Our settings from a DeepSpeed config, and the (field, section) pairs that need NVMe."""
    if "zero_optimization" not in ds:
        raise SwapConfigError(
            "the DeepSpeed config has no zero_optimization section: parameter offload needs "
            "'zero_optimization': {'stage': 3, 'offload_param': {...}}"
        )
    zero = _ds_section(ds["zero_optimization"], "zero_optimization")
    _check_keys(zero, "zero_optimization", _DS_ZERO_READ, _DS_ZERO_IGNORED)
    stage = zero.get("stage", 0)
    if stage != 3 or isinstance(stage, bool):
        raise SwapConfigError(
            f"zero_optimization.stage={stage!r}: parameter offload needs ZeRO stage 3; set "
            "'stage': 3"
        )
    values: dict[str, Any] = {}
    needs_nvme: list[tuple[str, str]] = []
    if zero.get("sub_group_size") is not None:
        values["sub_group_numel"] = _ds_count(
            zero["sub_group_size"], "zero_optimization.sub_group_size", minimum=1
        )
    dirs: list[str] = []

    sections = (
        ("offload_param", "param_tiers", _DS_PARAM_READ, _DS_PARAM_IGNORED, _PARAM_TIERS_BY_DEVICE),
        (
            "offload_optimizer",
            "optimizer_tiers",
            _DS_OPTIMIZER_READ,
            _DS_OPTIMIZER_IGNORED,
            _OPTIMIZER_TIERS_BY_DEVICE,
        ),
    )
    for key, field_name, read, ignored, tiers_by_device in sections:
        section = zero.get(key)
        if section is None and key == "offload_param" and zero.get("cpu_offload_param") is True:
            section = {"device": "cpu"}  # DeepSpeed's deprecated spelling of the same
        if section is None:
            values[field_name] = _names(tiers_by_device["none"])
            continue
        where = f"zero_optimization.{key}"
        section = _ds_section(section, where)
        _check_keys(section, where, read, ignored)
        device = _ds_offload_device(section, where)
        values[field_name] = _names(tiers_by_device[device])
        if device == "nvme":
            needs_nvme.append((field_name, where))
            dirs += _ds_paths(section.get("nvme_path"), f"{where}.nvme_path")
    values["nvme_dirs"] = list(dict.fromkeys(os.fspath(Path(d)) for d in dirs))

    if ds.get("aio") is not None:
        values["aio"] = _ds_aio(_ds_section(ds["aio"], "aio"))
    return values, needs_nvme


def _ds_section(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SwapConfigError(f"{where}={value!r} must be an object of settings")
    return value


def _check_keys(
    section: Mapping[str, Any], where: str, read: frozenset[str], ignored: frozenset[str]
) -> None:
    known = read | ignored
    for key in section:
        if key not in known:
            raise SwapConfigError(
                f"{where}.{key} is not a DeepSpeed setting swapper knows; known: "
                f"{', '.join(sorted(known))}"
            )


def _ds_offload_device(section: Mapping[str, Any], where: str) -> str:
    device = section.get("device", "none")
    if device is None:
        device = "none"
    if device not in ("none", "cpu", "nvme"):
        raise SwapConfigError(f"{where}.device={device!r} must be 'none', 'cpu' or 'nvme'")
    return str(device)


def _ds_paths(value: object, where: str) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(items, Sequence) or not all(
        isinstance(p, (str, os.PathLike)) and os.fspath(p) for p in items
    ):
        raise SwapConfigError(f"{where}={value!r} must be a directory path or a list of them")
    return [os.fspath(p) for p in items]


def _ds_count(value: object, where: str, *, minimum: int) -> int:
    """An int from DeepSpeed's JSON, where counts are often written as floats (``1e9``)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SwapConfigError(f"{where}={value!r} must be an integer >= {minimum}")
    return value


def _ds_aio(section: Mapping[str, Any]) -> AioConfig:
    _check_keys(section, "aio", _DS_AIO_READ, _DS_AIO_IGNORED)
    if section.get("use_gds"):
        raise SwapConfigError(
            f"aio.use_gds={section['use_gds']!r}: GPUDirect Storage is not supported by "
            "swapper; set it to false (reads and writes go through pinned host memory)"
        )
    settings: dict[str, Any] = {}
    for key in ("block_size", "queue_depth"):
        if section.get(key) is not None:
            settings[key] = _ds_count(section[key], f"aio.{key}", minimum=1)
    threads = {
        key: _ds_count(section[key], f"aio.{key}", minimum=1)
        for key in _DS_AIO_THREADS
        if section.get(key) is not None
    }
    if len(set(threads.values())) > 1:
        given = ", ".join(f"aio.{key}={value}" for key, value in threads.items())
        raise SwapConfigError(
            f"{given}: each sets the I/O thread count, and they disagree; give one "
            "(intra_op_parallelism is DeepSpeed's current name)"
        )
    if threads:
        settings["num_threads"] = next(iter(threads.values()))
    if section.get("single_submit") is not None:
        single = section["single_submit"]
        if not isinstance(single, bool):
            raise SwapConfigError(f"aio.single_submit={single!r} must be true or false")
        settings["single_submit"] = single
    try:
        return AioConfig(**settings)
    except SwapConfigError as exc:
        raise SwapConfigError(f"aio: {exc}") from None
