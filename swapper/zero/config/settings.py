"""The flat settings users write, translated into the configuration tree.

:meth:`~swapper.zero.OffloadConfig.create` (and :meth:`~swapper.zero.OffloadConfig.from_dict`
of a flat mapping) takes the keywords a training script writes — budgets, swap
directories, one tier list per kind, a read-ahead window for parameters — and
:func:`manager_settings` turns them into the :class:`~swapper.manager.ManagerConfig` that
the :class:`~swapper.zero.OffloadConfig` holds, with the offload defaults (parameters on the
device, gradients and optimizer state on the host, NVMe after them where there are swap
directories). Each flat setting is checked here under its own name, so a message names
what the caller wrote, not the manager field it becomes.

The JSON coercions (sizes as ``"64MiB"``, ``aio`` and ``step`` as objects) of both the
flat keys and the nested ``manager`` / ``step`` sections live here too.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from swapper.manager.config import MEMORY_TIERS, Kind, ManagerConfig, Tier, size_setting
from swapper.step.config import StepConfig
from tiers.config import AioConfig, parse_enum
from tiers.errors import SwapConfigError

__all__ = [
    "FLAT_KEYS",
    "MANAGER_KEYS",
    "PASSTHROUGH_KEYS",
    "STEP_ALIASES",
    "check_device",
    "coerce_flat",
    "fp32_grad_tiers",
    "json_value",
    "manager_json",
    "manager_section",
    "manager_settings",
    "offload_placement",
    "step_section",
    "step_with",
    "tiers_of",
]

#: The keywords of :meth:`~swapper.zero.OffloadConfig.create` that have offload names of
#: their own (and the flat keys of ``from_dict``), in the order messages list them.
FLAT_KEYS = (
    "device_nbytes",
    "host_nbytes",
    "nvme_dirs",
    "aio",
    "param_tiers",
    "grad_tiers",
    "optimizer_tiers",
    "prefetch_nbytes",
    "step",
    "device",
    "store_name",
)

#: Every field of :class:`ManagerConfig`, the keys of a nested ``manager`` section.
MANAGER_KEYS = tuple(f.name for f in dataclasses.fields(ManagerConfig))

#: The manager fields a flat setting does not translate (``placement`` comes from the tier
#: lists, ``prefetch_window_nbytes`` from ``prefetch_nbytes``): passed through unchanged.
PASSTHROUGH_KEYS = tuple(
    name
    for name in MANAGER_KEYS
    if name not in FLAT_KEYS and name not in ("placement", "prefetch_window_nbytes")
)

#: Keys also taken at the top level of ``from_dict``, for ``step.*`` (as DeepSpeed's
#: ``sub_group_size`` and ``gradient_clipping`` map to two of them).
STEP_ALIASES = ("sub_group_numel", "host_fraction", "max_grad_norm")

#: Settings in bytes, which JSON may give as sizes such as ``"64MiB"``.
_BYTE_KEYS = frozenset(
    {
        "device_nbytes",
        "host_nbytes",
        "prefetch_nbytes",
        "prefetch_window_nbytes",
        "write_behind_nbytes",
        "stripe_nbytes",
        "host_arena_nbytes",
    }
)
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_TIER_KEYS = ("param_tiers", "grad_tiers", "optimizer_tiers")


def offload_placement(*, has_nvme: bool) -> dict[Kind, tuple[Tier, ...]]:
    """The offload defaults: ``param16`` on device, host, NVMe; ``grad16`` and
    ``optim_state`` on host, NVMe; NVMe left out when there are no swap directories;
    ``grad32`` (the retained gradients of fp32 parameters) on host only
    (:func:`fp32_grad_tiers`)."""
    params = (Tier.DEVICE, Tier.HOST, Tier.NVME)
    rest = (Tier.HOST, Tier.NVME)
    if not has_nvme:
        params, rest = params[:2], rest[:1]
    grad32 = fp32_grad_tiers(rest)
    return {Kind.PARAM16: params, Kind.GRAD16: rest, Kind.OPTIM_STATE: rest, Kind.GRAD32: grad32}


def fp32_grad_tiers(grad_tiers: Sequence[Tier]) -> tuple[Tier, ...]:
    """Where an offloaded model retains fp32 gradients (of fp32 trainable parameters
    beside a 16-bit base, e.g. PEFT's adapters): the memory tiers of ``grad_tiers``, or
    the host when it has none. Never NVMe: fp32 gradients are never written to disk
    (the wrap checks that they fit: ``swapper.zero.local.placing.check_fp32_grads``)."""
    memory = tuple(tier for tier in grad_tiers if tier in MEMORY_TIERS)
    return memory or (Tier.HOST,)


def check_device(device: object, name: str = "device") -> None:
    """Refuse a device the manager could not start on.

    Raises:
        SwapConfigError: not ``None``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    """
    if device is not None and (not isinstance(device, str) or not _DEVICE.match(device)):
        raise SwapConfigError(
            f"{name}={device!r} must be None (CUDA if available, else CPU), 'cpu', "
            "'cuda' or 'cuda:N'"
        )


def manager_settings(
    *,
    device_nbytes: int | str | None,
    host_nbytes: int | str | None,
    nvme_dirs: Sequence[str | os.PathLike[str]],
    aio: AioConfig | None,
    param_tiers: Sequence[Tier | str] | None,
    grad_tiers: Sequence[Tier | str] | None,
    optimizer_tiers: Sequence[Tier | str] | None,
    prefetch_nbytes: int | str | None,
    device: str | None,
    store_name: str,
    other: Mapping[str, Any],
) -> ManagerConfig:
    """The manager settings the flat keywords of ``OffloadConfig.create`` make.

    Placement is ``param16 → param_tiers``, ``grad16 → grad_tiers``, ``optim_state →
    optimizer_tiers`` (each ``None``: :func:`offload_placement`), ``grad32`` → the memory
    tiers of ``grad_tiers`` (:func:`fp32_grad_tiers`). The read-ahead
    window is ``prefetch_nbytes``, or half of ``device_nbytes`` when it is ``None``,
    clamped to ``host_nbytes`` (bytes read ahead wait in host memory); when that leaves
    nothing (no device budget, or 0 bytes) the manager's own default, half the host budget
    or unlimited. The optimizer's sub-groups, larger than that window, are then read ahead
    one at a time: under pressure that measured better than a deeper read-ahead, which
    puts more reads beside the write-behind (docs/benchmarks.md). ``other`` holds manager
    fields passed through unchanged (:data:`PASSTHROUGH_KEYS`).

    Raises:
        SwapConfigError: a setting is invalid (named as the caller wrote it), or ``other``
            names a key that is not a passthrough manager field.
    """
    # one parser for every size: ints, or strings such as "64MiB" (tiers.units.parse_size)
    device_nbytes = size_setting("device_nbytes", device_nbytes, allow_none=True)
    host_nbytes = size_setting("host_nbytes", host_nbytes, allow_none=True)
    prefetch_nbytes = size_setting("prefetch_nbytes", prefetch_nbytes, allow_none=True)
    if prefetch_nbytes == 0:
        raise SwapConfigError("prefetch_nbytes=0 must be > 0 bytes, or None for the default window")
    dirs = _checked_dirs(nvme_dirs)
    if aio is None:
        aio = AioConfig()
    elif not isinstance(aio, AioConfig):
        raise SwapConfigError(f"aio={aio!r} must be an AioConfig (from_dict also takes a dict)")
    defaults = offload_placement(has_nvme=bool(dirs))
    given = dict(zip(_TIER_KEYS, (param_tiers, grad_tiers, optimizer_tiers), strict=True))
    kinds = dict(zip(_TIER_KEYS, (Kind.PARAM16, Kind.GRAD16, Kind.OPTIM_STATE), strict=True))
    checked = {
        name: defaults[kinds[name]]
        if tiers is None
        else _checked_tiers(name, tiers, has_nvme=bool(dirs))
        for name, tiers in given.items()
    }
    if checked["param_tiers"][0] not in MEMORY_TIERS:
        raise SwapConfigError(
            f"param_tiers={_names(checked['param_tiers'])} must start with a memory tier "
            "('device' or 'host'): parameters are used where the first tier is"
        )
    if host_nbytes == 0:
        for name, tiers in checked.items():
            if Tier.DEVICE in tiers and Tier.NVME in tiers:
                raise SwapConfigError(
                    f"host_nbytes=0, but {name}={_names(tiers)} moves device tensors to "
                    "NVMe, which goes through host staging buffers: give the host tier "
                    f"room for the largest tensor, or drop 'device' or 'nvme' from {name}"
                )
    check_device(device)
    if not isinstance(store_name, str) or not store_name:
        raise SwapConfigError(f"store_name={store_name!r} must be a non-empty name")
    unknown = sorted(str(key) for key in other if key not in PASSTHROUGH_KEYS)
    if unknown:
        raise SwapConfigError(
            f"unknown offload setting(s): {', '.join(unknown)} (known: "
            f"{', '.join(FLAT_KEYS + PASSTHROUGH_KEYS)})"
        )
    window = prefetch_nbytes
    if window is None and device_nbytes is not None:
        window = device_nbytes // 2
    if window is not None and host_nbytes is not None:
        window = min(window, host_nbytes)
    optimizer = checked["optimizer_tiers"]
    placement: dict[Kind | str, Sequence[Tier | str]] = {
        Kind.PARAM16: checked["param_tiers"],
        Kind.GRAD16: checked["grad_tiers"],
        Kind.OPTIM_STATE: optimizer,
        Kind.GRAD32: fp32_grad_tiers(checked["grad_tiers"]),
    }
    try:
        return ManagerConfig(
            device_nbytes=device_nbytes,
            host_nbytes=host_nbytes,
            nvme_dirs=dirs,
            aio=aio,
            placement=placement,
            prefetch_window_nbytes=window or None,
            device=device,
            store_name=store_name,
            **other,
        )
    except SwapConfigError as exc:
        raise SwapConfigError(f"these settings make no valid TierManager config: {exc}") from None


def _checked_dirs(dirs: object) -> tuple[Path, ...]:
    if isinstance(dirs, (str, bytes, os.PathLike)) or not isinstance(dirs, Sequence):
        raise SwapConfigError(
            f"nvme_dirs={dirs!r} must be a list of directories, not a single path"
        )
    paths: list[Path] = []
    for d in dirs:
        if not isinstance(d, (str, os.PathLike)) or not os.fspath(d):
            raise SwapConfigError(f"nvme_dirs: {d!r} is not a directory path")
        path = Path(d)
        if path in paths:
            raise SwapConfigError(f"nvme_dirs names {os.fspath(path)!r} twice: list it once")
        paths.append(path)
    return tuple(paths)


def _checked_tiers(name: str, given: object, *, has_nvme: bool) -> tuple[Tier, ...]:
    if isinstance(given, (str, Tier)) or not isinstance(given, Sequence):
        raise SwapConfigError(
            f"{name}={given!r} must be a list of tiers, e.g. ['host', 'nvme'] "
            "(tiers: device, host, nvme)"
        )
    tiers: list[Tier] = []
    for raw in given:
        try:
            tier = parse_enum(Tier, raw, name)
        except SwapConfigError:
            raise SwapConfigError(
                f"{name}={_shown(given)} names {raw!r}, which is not a tier "
                "(tiers: device, host, nvme)"
            ) from None
        if tier in tiers:
            raise SwapConfigError(
                f"{name}={_shown(given)} names {tier.value!r} twice: list each tier once"
            )
        tiers.append(tier)
    if not tiers:
        raise SwapConfigError(f"{name}=[] must name at least one tier (device, host, nvme)")
    if Tier.NVME in tiers and not has_nvme:
        raise SwapConfigError(
            f"{name}={_names(tiers)} names 'nvme' but nvme_dirs is empty: give swap "
            "directories in nvme_dirs, or leave nvme out"
        )
    return tuple(tiers)


def _names(tiers: Sequence[Tier]) -> list[str]:
    return [t.value for t in tiers]


def _shown(given: Sequence[Any]) -> list[Any]:
    """A tier list as given, for messages: ``['host', 'nvme']``, not enum reprs."""
    return [t.value if isinstance(t, Tier) else t for t in given]


# -- JSON ----------------------------------------------------------------------------------


def json_value(value: Any) -> Any:
    """A setting's value as JSON: enums by value, paths as strings, tuples as lists,
    mappings (placement) with string keys, dataclasses (``aio``) as dicts of fields."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {json_value(k): json_value(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: json_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def manager_json(manager: ManagerConfig) -> dict[str, Any]:
    """``manager``'s fields as JSON (:func:`json_value`), the read-ahead and write-behind
    windows ``None`` where they are the manager's default (half the host budget).

    ``None`` normalises to exactly that value again, so reading the result back gives an
    equal ManagerConfig; the value itself would not always (a host budget of 1 byte
    normalises the windows to 0, which the manager refuses when given), and ``None`` keeps
    following ``host_nbytes`` when a reader overrides it.
    """
    data = json_value(manager)
    host = manager.host_nbytes
    default = None if host is None else host // 2
    for name in ("prefetch_window_nbytes", "write_behind_nbytes"):
        if data[name] == default:
            data[name] = None
    return data


def coerce_flat(name: str, value: Any) -> Any:
    """A JSON value of flat key or manager field ``name`` as the constructors want it:
    sizes parsed, ``aio`` read by :meth:`AioConfig.from_dict`; the rest is validated there.

    Raises:
        SwapConfigError: a size does not parse, or the ``aio`` object does not validate.
    """
    if name in _BYTE_KEYS and isinstance(value, str):
        return size_setting(name, value, allow_none=False)
    if name == "aio" and isinstance(value, Mapping):
        try:
            return AioConfig.from_dict(value)
        except SwapConfigError as exc:
            raise SwapConfigError(f"aio: {exc}") from None
    return value


def step_section(value: Any) -> Any:
    """``step`` as given: a :class:`StepConfig`, or a JSON object of its settings.

    Raises:
        SwapConfigError: the object names a key that is not a step setting, or a value
            does not validate.
    """
    if not isinstance(value, Mapping):
        return value  # a StepConfig, or refused by OffloadConfig with its type named
    known = [f.name for f in dataclasses.fields(StepConfig)]
    unknown = sorted(str(key) for key in value if key not in known)
    if unknown:
        raise SwapConfigError(
            f"unknown step setting(s): {', '.join(unknown)} (known: {', '.join(known)})"
        )
    return StepConfig(**value)


def step_with(step: object, values: Mapping[str, Any]) -> StepConfig:
    """``step`` with the top-level step keys (:data:`STEP_ALIASES`) applied over it.

    Raises:
        SwapConfigError: ``step`` is not a StepConfig, or a value does not validate.
    """
    if not isinstance(step, StepConfig):
        raise SwapConfigError(f"step={step!r} must be a StepConfig or a dict of its settings")
    return dataclasses.replace(step, **values)


def manager_section(value: Any, flat: Mapping[str, Any]) -> ManagerConfig:
    """A nested ``manager`` section (a :class:`ManagerConfig` or a JSON object of its
    fields), with ``flat`` manager fields of the same names applied over it.

    In an object, sizes may be strings (``"64MiB"``), ``aio`` an object, ``placement`` an
    object of kind → tier names. Fields not given take the offload defaults where they
    differ from the manager's (budgets ``None``, ``store_name`` ``"swapper-offload"``,
    kinds missing from ``placement`` as in :func:`offload_placement`), else the manager's.

    Raises:
        SwapConfigError: not a ManagerConfig or a mapping, a key that is not a manager
            field (all named), or a value that does not validate.
    """
    values = {name: coerce_flat(name, v) for name, v in flat.items()}
    if isinstance(value, ManagerConfig):
        return dataclasses.replace(value, **values) if values else value
    if not isinstance(value, Mapping):
        raise SwapConfigError(
            f"manager={value!r} must be a ManagerConfig or an object of its settings"
        )
    unknown = sorted(str(key) for key in value if key not in MANAGER_KEYS)
    if unknown:
        raise SwapConfigError(
            f"unknown manager setting(s): {', '.join(unknown)} (known: {', '.join(MANAGER_KEYS)})"
        )
    settings: dict[str, Any] = {
        "device_nbytes": None,
        "host_nbytes": None,
        "store_name": "swapper-offload",
    }
    settings.update({name: coerce_flat(name, v) for name, v in value.items()})
    settings.update(values)
    given = settings.get("placement")
    nvme_dirs = settings.get("nvme_dirs", ())
    has_nvme = bool(nvme_dirs) and not isinstance(nvme_dirs, (str, os.PathLike))
    if given is None or isinstance(given, Mapping):
        placement: dict[Kind | str, Any] = {**offload_placement(has_nvme=has_nvme)}
        for kind, tiers in (given or {}).items():
            try:
                placement[parse_enum(Kind, kind, "kind")] = tiers
            except SwapConfigError:
                placement[kind] = tiers  # refused by ManagerConfig, naming the kinds
        settings["placement"] = placement
    try:
        return ManagerConfig(**settings)
    except SwapConfigError as exc:
        raise SwapConfigError(f"manager: {exc}") from None


def tiers_of(manager: ManagerConfig, kind: Kind) -> tuple[Tier, ...]:
    """Where ``kind`` may live under ``manager``'s placement (normalised by ManagerConfig:
    every kind present, a tuple of :class:`Tier`).

    Raises:
        SwapConfigError: the placement was not normalised (never for a constructed
            ManagerConfig).
    """
    placement = manager.placement
    tiers = None if placement is None else placement.get(kind)
    if not isinstance(tiers, tuple) or not all(isinstance(t, Tier) for t in tiers):
        raise SwapConfigError(f"placement[{kind.value!r}]={tiers!r} was not normalised")
    return tiers  # type: ignore[return-value]  # checked element by element above
