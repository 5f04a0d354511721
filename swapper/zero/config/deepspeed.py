"""The DeepSpeed config reader: our :class:`~swapper.zero.OffloadConfig` settings from a
DeepSpeed config's ``zero_optimization`` and ``aio`` sections (``aio`` at the top, or
inside ``zero_optimization`` as Hugging Face's DeepSpeed guide prints it), and what its
training sections (``optimizer``, ``gradient_clipping``, ``fp16``, ``bf16``) ask of the
optimizer and the loop (:mod:`swapper.zero.config.deepspeed_training`).

:func:`deepspeed_settings` returns a mapping of OffloadConfig's flat keys (what
:meth:`OffloadConfig.from_dict` reads, the keywords of :meth:`OffloadConfig.create`);
:meth:`OffloadConfig.from_deepspeed` builds the config from it, and
:func:`~swapper.zero.config.offload.load_deepspeed` (beside the config it builds, so that
this reader never imports it) gives that config with the
:class:`~swapper.zero.config.deepspeed_training.TrainingSettings` of :func:`read_deepspeed`.
What is read and what is accepted and not used is listed with the key sets below;
:meth:`OffloadConfig.from_deepspeed` documents the mapping.

Nothing is dropped silently: every key given that is not honoured (a top-level key not
read here such as ``scheduler`` or ``train_batch_size``, a ZeRO key that swapper's
budgets replace, an ``"auto"`` placeholder) is named in one warning per load (logger
``swapper.zero.config.deepspeed``); keys DeepSpeed does not have are refused. A sub-group
(``sub_group_size``, or ours when absent) whose state (the optimizer's bytes per element:
AdamW 12, SGD with momentum or Adagrad 8) the host budget cannot hold is reduced to a
quarter of the host budget, with one log line saying so.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from swapper.manager.config import Tier
from swapper.step.config import DEFAULT_SUB_GROUP_NUMEL
from swapper.step.layout import ALIGN_NUMEL
from swapper.step.offload_optimizer import state_nbytes_per_element
from swapper.zero.config.deepspeed_training import (
    TRAINING_KEYS,
    TrainingSettings,
    Unhonoured,
    read_training,
)
from tiers.config import AioConfig, read_json_object
from tiers.errors import SwapConfigError
from tiers.units import format_size, parse_size

__all__ = ["deepspeed_settings", "read_deepspeed"]

log = logging.getLogger(__name__)

#: Sub-groups a reduced ``sub_group_size`` leaves room for in the host budget: one
#: computing, one written behind, the rest read ahead (as ``swapper-pressure`` sizes them).
_FIT_SUB_GROUPS = 4


def deepspeed_settings(
    ds: Mapping[str, Any] | str | os.PathLike[str], overrides: Mapping[str, Any]
) -> dict[str, Any]:
    """OffloadConfig settings (our keys) from a DeepSpeed config, ``overrides`` winning.

    ``ds`` is a mapping or a JSON file's path. Logs the one warning of the module
    docstring (and the sub-group line) when there is something to say.

    Raises:
        OSError: ``ds`` is a path that cannot be read.
        SwapConfigError: see :meth:`~swapper.zero.OffloadConfig.from_deepspeed`; with a
            path, the message names the file.
    """
    return read_deepspeed(ds, overrides)[0]


def read_deepspeed(
    ds: Mapping[str, Any] | str | os.PathLike[str], overrides: Mapping[str, Any]
) -> tuple[dict[str, Any], TrainingSettings]:
    """A DeepSpeed config read whole: OffloadConfig's flat settings (our keys, ``overrides``
    winning; what :func:`deepspeed_settings` returns) and the training sections
    (:class:`TrainingSettings`). Logs the one warning of the module docstring.

    Raises:
        OSError: ``ds`` is a path that cannot be read.
        SwapConfigError: as :func:`deepspeed_settings`, and for a training section that
            cannot be honoured (named); with a path, the message names the file.
    """
    if isinstance(ds, (str, os.PathLike)):
        data = read_json_object(ds)
        try:
            return read_deepspeed(data, overrides)
        except SwapConfigError as exc:
            raise SwapConfigError(f"{os.fspath(ds)}: {exc}") from None
    if not isinstance(ds, Mapping):
        raise SwapConfigError(
            f"a DeepSpeed config must be a mapping or a JSON file's path, got {type(ds).__name__}"
        )
    notes = Unhonoured()
    values, needs_nvme = _read_deepspeed(ds, notes)
    training = read_training(ds, notes)
    if training.max_grad_norm is not None:
        values["max_grad_norm"] = training.max_grad_norm
    values.update(overrides)
    if not values.get("nvme_dirs"):
        for field, where in needs_nvme:
            if field not in overrides:
                raise SwapConfigError(
                    f"{where}.device='nvme' but no {where}.nvme_path is given: name a "
                    "swap directory there, or pass nvme_dirs=[...]"
                )
    message = notes.message()
    if message is not None:
        log.warning("%s", message)
    _fit_sub_group(values, overrides, training)
    return values, training


def _fit_sub_group(
    values: dict[str, Any],
    overrides: Mapping[str, Any],
    training: TrainingSettings,
) -> None:
    """Reduce ``sub_group_numel`` (the config's, or our default when it gives none) to a
    quarter of the host budget when the host budget cannot hold one sub-group's state
    (the bytes per element of ``training``'s optimizer: OffloadAdamW's 12, or its
    ``optimizer_class``'s with its settings), which the optimizer would refuse; one log
    line says so. Left alone: a sub-group size
    the caller passed, kept sub-groups (``host_fraction``), no host budget, or a budget
    too small for the smallest sub-group (OffloadAdamW's message gives the figures)."""
    host = values.get("host_nbytes")
    if isinstance(host, str):
        try:
            host = parse_size(host)
        except ValueError:
            return  # refused, with its name, when the config is built
    if (
        not isinstance(host, int)
        or isinstance(host, bool)
        or "sub_group_numel" in overrides
        or values.get("host_fraction")
    ):
        return
    given = values.get("sub_group_numel")
    numel = DEFAULT_SUB_GROUP_NUMEL if given is None else given
    cls = training.optimizer_class
    per_element = (
        state_nbytes_per_element(None)
        if cls is None
        else state_nbytes_per_element(cls, **training.optimizer)
    )
    padded = -(-numel // ALIGN_NUMEL) * ALIGN_NUMEL  # as the optimizer lays it out
    if int(per_element * padded) <= host:
        return
    fitted = int(host // (_FIT_SUB_GROUPS * per_element)) // ALIGN_NUMEL * ALIGN_NUMEL
    if fitted < ALIGN_NUMEL:
        return
    values["sub_group_numel"] = fitted
    where = (
        f"zero_optimization.sub_group_size={numel}"
        if given is not None
        else f"the default sub-group size ({numel} elements; the config gives none)"
    )
    log.warning(
        "%s needs %s of optimizer state per sub-group (%g B per element), more than "
        "host_nbytes=%d (%s) holds: reduced to %d elements (%s each, a quarter of the "
        "host budget: one sub-group steps while others are read ahead and written behind)",
        where,
        format_size(int(per_element * padded)),
        per_element,
        host,
        format_size(host),
        fitted,
        format_size(int(per_element * fitted)),
    )


def _names(tiers: Sequence[Tier]) -> list[str]:
    return [t.value for t in tiers]


#: Top-level keys we read; any other is named in the warning.
_DS_TOP_READ = frozenset({"zero_optimization", "aio", *TRAINING_KEYS})

#: DeepSpeed's switch for fetching parameters by all_reduce (PR #5420), and its alias.
_DS_ALL_REDUCE_FETCH = ("stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params")

#: ``zero_optimization`` keys we read (``aio``: the layout of Hugging Face's guide).
_DS_ZERO_READ = frozenset(
    {
        "stage",
        "sub_group_size",
        "offload_param",
        "offload_optimizer",
        "cpu_offload_param",
        "aio",
        *_DS_ALL_REDUCE_FETCH,
    }
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


def _read_deepspeed(
    ds: Mapping[str, Any], notes: Unhonoured
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """Our settings from a DeepSpeed config's offload sections, and the (field, section)
    pairs that need NVMe; the keys not used go to ``notes``."""
    if "zero_optimization" not in ds:
        raise SwapConfigError(
            "the DeepSpeed config has no zero_optimization section: parameter offload needs "
            "'zero_optimization': {'stage': 3, 'offload_param': {...}}"
        )
    for key in ds:
        if key not in _DS_TOP_READ:
            notes.ignored.append(str(key))
    zero = _ds_section(ds["zero_optimization"], "zero_optimization")
    _check_keys(zero, "zero_optimization", _DS_ZERO_READ, _DS_ZERO_IGNORED, notes)
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
    switches = {key: zero[key] for key in _DS_ALL_REDUCE_FETCH if key in zero}
    for key, value in switches.items():
        if not isinstance(value, bool):
            raise SwapConfigError(f"zero_optimization.{key}={value!r} must be true or false")
    if len(set(switches.values())) > 1:
        raise SwapConfigError(
            f"zero_optimization: {' and '.join(switches)} disagree; give one of them"
        )
    if any(switches.values()):
        values["fetch_collective"] = "all_reduce"
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
        _check_keys(section, where, read, ignored, notes)
        device = _ds_offload_device(section, where)
        values[field_name] = _names(tiers_by_device[device])
        if device == "nvme":
            needs_nvme.append((field_name, where))
            dirs += _ds_paths(section.get("nvme_path"), f"{where}.nvme_path")
    values["nvme_dirs"] = list(dict.fromkeys(os.fspath(Path(d)) for d in dirs))

    top, nested = ds.get("aio"), zero.get("aio")
    if top is not None and nested is not None and top != nested:
        raise SwapConfigError(
            "aio and zero_optimization.aio are both given and differ: give the I/O "
            "settings once (either place is read)"
        )
    if top is not None:
        values["aio"] = _ds_aio(_ds_section(top, "aio"), "aio", notes)
    elif nested is not None:
        where = "zero_optimization.aio"
        values["aio"] = _ds_aio(_ds_section(nested, where), where, notes)
    return values, needs_nvme


def _ds_section(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SwapConfigError(f"{where}={value!r} must be an object of settings")
    return value


def _check_keys(
    section: Mapping[str, Any],
    where: str,
    read: frozenset[str],
    ignored: frozenset[str],
    notes: Unhonoured,
) -> None:
    """Refuse keys DeepSpeed does not have; note those swapper does not need."""
    known = read | ignored
    for key in section:
        if key not in known:
            raise SwapConfigError(
                f"{where}.{key} is not a DeepSpeed setting swapper knows; known: "
                f"{', '.join(sorted(known))}"
            )
        if key in ignored:
            notes.unneeded.append(f"{where}.{key}")


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


def _ds_aio(section: Mapping[str, Any], where: str, notes: Unhonoured) -> AioConfig:
    _check_keys(section, where, _DS_AIO_READ, _DS_AIO_IGNORED, notes)
    if section.get("use_gds"):
        raise SwapConfigError(
            f"{where}.use_gds={section['use_gds']!r}: GPUDirect Storage is not supported by "
            "swapper; set it to false (reads and writes go through pinned host memory)"
        )
    settings: dict[str, Any] = {}
    for key in ("block_size", "queue_depth"):
        if section.get(key) is not None:
            settings[key] = _ds_count(section[key], f"{where}.{key}", minimum=1)
    threads = {
        key: _ds_count(section[key], f"{where}.{key}", minimum=1)
        for key in _DS_AIO_THREADS
        if section.get(key) is not None
    }
    if len(set(threads.values())) > 1:
        given = ", ".join(f"{where}.{key}={value}" for key, value in threads.items())
        raise SwapConfigError(
            f"{given}: each sets the I/O thread count, and they disagree; give one "
            "(intra_op_parallelism is DeepSpeed's current name)"
        )
    if threads:
        settings["num_threads"] = next(iter(threads.values()))
    if section.get("single_submit") is not None:
        single = section["single_submit"]
        if not isinstance(single, bool):
            raise SwapConfigError(f"{where}.single_submit={single!r} must be true or false")
        settings["single_submit"] = single
    try:
        return AioConfig(**settings)
    except SwapConfigError as exc:
        raise SwapConfigError(f"{where}: {exc}") from None
