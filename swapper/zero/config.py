"""Settings of the training integration: one frozen dataclass, :class:`OffloadConfig`.

``swapper.offload(model, config)`` keeps a model's 16-bit parameters (and their retained
16-bit gradients) in the tiers, and :class:`~swapper.step.OffloadAdamW` keeps the fp32
optimizer state there; both read their :class:`~swapper.manager.TierManager` settings from
:meth:`OffloadConfig.manager_config`.

A config comes from keyword arguments, from a mapping of our own keys
(:meth:`OffloadConfig.from_dict`), from a JSON file (:meth:`OffloadConfig.from_json`), or
from a DeepSpeed config (:meth:`OffloadConfig.from_deepspeed`). DeepSpeed has no byte
budgets, so a caller loading one usually passes ``device_nbytes=`` and ``host_nbytes=`` as
overrides.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from swapper.manager.config import MEMORY_TIERS, Kind, ManagerConfig, Tier
from swapper.step.config import DEFAULT_SUB_GROUP_NUMEL, StepConfig
from swapper.zero.deepspeed import deepspeed_settings
from tiers.config import AioConfig, parse_enum, read_json_object
from tiers.errors import SwapConfigError
from tiers.units import parse_size

__all__ = ["OffloadConfig"]

_BYTE_FIELDS = ("device_nbytes", "host_nbytes", "prefetch_nbytes")
_TIER_FIELDS = ("param_tiers", "grad_tiers", "optimizer_tiers")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Where a model's training state lives and how it moves. Sizes in bytes.

    Attributes:
        device_nbytes: device-tier budget, for the 16-bit parameters being used
            (``None``: unlimited).
        host_nbytes: pinned host budget, for 16-bit gradients, the optimizer state in
            flight and every I/O staging buffer (``None``: unlimited).
        nvme_dirs: swap directories (normalised to a tuple of :class:`~pathlib.Path`);
            empty for no NVMe tier.
        aio: settings of the AIO engine that reads and writes the swap files.
        param_tiers: where 16-bit parameters may live, in order of preference; the first
            is where they are used and must be a memory tier. ``None`` (the default):
            ``(device, host, nvme)``, without ``nvme`` when ``nvme_dirs`` is empty.
            Normalised to a tuple of :class:`~swapper.manager.Tier`.
        grad_tiers: where retained 16-bit gradients may live. ``None``: ``(host, nvme)``,
            without ``nvme`` when ``nvme_dirs`` is empty.
        optimizer_tiers: where fp32 optimizer state (master weights, Adam moments) may
            live. ``None``: ``(host, nvme)``, without ``nvme`` when ``nvme_dirs`` is empty.
        prefetch_nbytes: read-ahead window: at most this many bytes read ahead and not yet
            used (``None``: half the device budget, or the manager's default when the
            device budget is unlimited). Bytes read ahead sit in host memory, so
            :meth:`manager_config` clamps the window to ``host_nbytes``.
        step: the optimizer's settings (:class:`~swapper.step.StepConfig`); an
            :class:`~swapper.step.OffloadAdamW` over the offloaded model takes those its
            own config leaves ``None``. ``sub_group_numel`` (each sub-group's state is
            12 B per element and the host budget must hold at least one) and
            ``host_fraction`` are normalised to their defaults, 25M and 0, when unset.
            ``accumulate_fp32`` does not apply (16-bit gradients accumulate in their
            retained buffers) and is refused; ``name`` is each optimizer's own.
        device: ``None`` (CUDA if available, else the CPU stand-in), ``"cpu"``,
            ``"cuda"``, ``"cuda:N"``. Whether CUDA is present is checked when the manager
            starts, not here.
        store_name: base name of the swap files.

    Raises:
        SwapConfigError: a setting is invalid; the message names it and says what to fix.
    """

    device_nbytes: int | None = None
    host_nbytes: int | None = None
    nvme_dirs: Sequence[str | os.PathLike[str]] = ()
    aio: AioConfig = dataclasses.field(default_factory=AioConfig)
    param_tiers: Sequence[Tier | str] | None = None
    grad_tiers: Sequence[Tier | str] | None = None
    optimizer_tiers: Sequence[Tier | str] | None = None
    prefetch_nbytes: int | None = None
    step: StepConfig = dataclasses.field(default_factory=StepConfig)
    device: str | None = None
    store_name: str = "swapper-offload"

    def __post_init__(self) -> None:
        for name in _BYTE_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise SwapConfigError(
                    f"{name}={value!r} must be an int number of bytes >= 0, or None "
                    "(from_dict also takes sizes such as '64MiB')"
                )
            if value is not None and value < 0:
                raise SwapConfigError(f"{name}={value} must be >= 0 bytes, or None")
        if self.prefetch_nbytes == 0:
            raise SwapConfigError(
                "prefetch_nbytes=0 must be > 0 bytes, or None for the default window"
            )
        self._set("nvme_dirs", _checked_dirs(self.nvme_dirs))
        if not isinstance(self.aio, AioConfig):
            raise SwapConfigError(
                f"aio={self.aio!r} must be an AioConfig (from_dict also takes a dict)"
            )
        has_nvme = bool(self.nvme_dirs)
        defaults = {
            "param_tiers": (Tier.DEVICE, Tier.HOST, Tier.NVME),
            "grad_tiers": (Tier.HOST, Tier.NVME),
            "optimizer_tiers": (Tier.HOST, Tier.NVME),
        }
        checked: dict[str, tuple[Tier, ...]] = {}
        for name in _TIER_FIELDS:
            given = getattr(self, name)
            if given is None:
                tiers = tuple(t for t in defaults[name] if has_nvme or t is not Tier.NVME)
            else:
                tiers = _checked_tiers(name, given, has_nvme=has_nvme)
            self._set(name, tiers)
            checked[name] = tiers
        param_tiers = checked["param_tiers"]
        if param_tiers[0] not in MEMORY_TIERS:
            raise SwapConfigError(
                f"param_tiers={_names(param_tiers)} must start with a memory tier "
                "('device' or 'host'): parameters are used where the first tier is"
            )
        if self.host_nbytes == 0:
            for name, tiers in checked.items():
                if Tier.DEVICE in tiers and Tier.NVME in tiers:
                    raise SwapConfigError(
                        f"host_nbytes=0, but {name}={_names(tiers)} moves device tensors to "
                        "NVMe, which goes through host staging buffers: give the host tier "
                        "room for the largest tensor, or drop 'device' or 'nvme' from "
                        f"{name}"
                    )
        if not isinstance(self.step, StepConfig):
            raise SwapConfigError(
                f"step={self.step!r} must be a StepConfig (from_dict also takes a dict)"
            )
        if self.step.accumulate_fp32:
            raise SwapConfigError(
                "step.accumulate_fp32=True does not apply to an offloaded model: its 16-bit "
                "gradients accumulate in their retained buffers; leave it False"
            )
        self._set(
            "step",
            self.step.merged(
                StepConfig(sub_group_numel=DEFAULT_SUB_GROUP_NUMEL, host_fraction=0.0)
            ),
        )
        if self.device is not None and (
            not isinstance(self.device, str) or not _DEVICE.match(self.device)
        ):
            raise SwapConfigError(
                f"device={self.device!r} must be None (CUDA if available, else CPU), 'cpu', "
                "'cuda' or 'cuda:N'"
            )
        if not isinstance(self.store_name, str) or not self.store_name:
            raise SwapConfigError(f"store_name={self.store_name!r} must be a non-empty name")
        # Every valid OffloadConfig makes a valid ManagerConfig: the checks above cover the
        # manager's rules with our names; this catches any rule they miss.
        try:
            self.manager_config()
        except SwapConfigError as exc:
            raise SwapConfigError(
                f"these settings make no valid TierManager config: {exc}"
            ) from None

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: normalising in __post_init__ only

    # -- what the integration uses -------------------------------------------------------

    @property
    def placement(self) -> Mapping[Kind, tuple[Tier, ...]]:
        """Where each kind may live, normalised: ``param16 → param_tiers``,
        ``grad16 → grad_tiers``, ``optim_state`` and ``grad32 → optimizer_tiers``
        (the tier fields typed as stored: tuples of :class:`~swapper.manager.Tier`)."""
        optimizer = _stored_tiers(self.optimizer_tiers)
        return {
            Kind.PARAM16: _stored_tiers(self.param_tiers),
            Kind.GRAD16: _stored_tiers(self.grad_tiers),
            Kind.OPTIM_STATE: optimizer,
            Kind.GRAD32: optimizer,
        }

    @property
    def prefetch_window_nbytes(self) -> int | None:
        """The read-ahead window :meth:`manager_config` passes to the manager.

        ``prefetch_nbytes``, or half of ``device_nbytes`` when it is None, clamped to
        ``host_nbytes`` (bytes read ahead wait in host memory, and the manager refuses a
        window larger than the host budget). ``None`` when that leaves nothing (no device
        budget, or a window of 0 bytes): the manager then uses its own default, half the
        host budget or unlimited.
        """
        window = self.prefetch_nbytes
        if window is None and self.device_nbytes is not None:
            window = self.device_nbytes // 2
        if window is not None and self.host_nbytes is not None:
            window = min(window, self.host_nbytes)
        return window or None

    def manager_config(self) -> ManagerConfig:
        """The :class:`~swapper.manager.TierManager` settings these make.

        Budgets, ``nvme_dirs``, ``aio``, ``device`` and ``store_name`` pass through;
        placement is ``param16 → param_tiers``, ``grad16 → grad_tiers`` and
        ``optim_state`` and ``grad32 → optimizer_tiers``; the read-ahead window is
        :attr:`prefetch_window_nbytes`. The optimizer's state sub-groups, larger than
        that window, are then read ahead one at a time: under pressure that measured
        better than a deeper read-ahead, which puts more reads beside the write-behind
        (docs/benchmarks.md). The other manager settings keep their defaults.

        Raises:
            SwapConfigError: never for a config that constructed (``__post_init__`` builds
                one to check); listed for the manager's own validation.
        """
        placement: dict[Kind | str, Sequence[Tier | str]] = {
            kind: tiers for kind, tiers in self.placement.items()
        }
        return ManagerConfig(
            device_nbytes=self.device_nbytes,
            host_nbytes=self.host_nbytes,
            nvme_dirs=self.nvme_dirs,
            aio=self.aio,
            placement=placement,
            prefetch_window_nbytes=self.prefetch_window_nbytes,
            device=self.device,
            store_name=self.store_name,
        )

    def as_dict(self) -> dict[str, Any]:
        """The settings as JSON values; :meth:`from_dict` of the result gives an equal config.

        Tiers and paths become strings, ``aio`` a dict of its fields (its backend as a
        string), the tier lists the normalised ones (so the defaults appear explicitly).
        """
        aio = {f.name: getattr(self.aio, f.name) for f in dataclasses.fields(self.aio)}
        aio["backend"] = self.aio.backend.value
        return {
            "device_nbytes": self.device_nbytes,
            "host_nbytes": self.host_nbytes,
            "nvme_dirs": [os.fspath(d) for d in self.nvme_dirs],
            "aio": aio,
            "param_tiers": _names(self.placement[Kind.PARAM16]),
            "grad_tiers": _names(self.placement[Kind.GRAD16]),
            "optimizer_tiers": _names(self.placement[Kind.OPTIM_STATE]),
            "prefetch_nbytes": self.prefetch_nbytes,
            "step": {f.name: getattr(self.step, f.name) for f in dataclasses.fields(self.step)},
            "device": self.device,
            "store_name": self.store_name,
        }

    # -- loading -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], **overrides: Any) -> OffloadConfig:
        """Build a config from a mapping of our own keys (the field names).

        Sizes (``device_nbytes``, ``host_nbytes``, ``prefetch_nbytes``) may be ints or
        strings such as ``"64MiB"`` (see :func:`tiers.units.parse_size`); ``aio`` may be a
        dict (read by :meth:`AioConfig.from_dict`); tiers are lists of names. ``overrides``
        are the same keys and win over the mapping.

        Raises:
            SwapConfigError: a key is not a setting (all such keys are named), a size does
                not parse, or a value does not validate (named).
        """
        if not isinstance(mapping, Mapping):
            raise SwapConfigError(
                f"an offload config must be a mapping of settings, got {type(mapping).__name__}"
            )
        values = {**mapping, **overrides}
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(
            str(key) for key in values if key not in known and key not in _STEP_ALIASES
        )
        if unknown:
            raise SwapConfigError(
                f"unknown offload setting(s): {', '.join(unknown)} (known: {', '.join(known)}; "
                f"and {', '.join(_STEP_ALIASES)} for step.*)"
            )
        settings = {name: _coerce(name, value) for name, value in values.items() if name in known}
        aliases = {name: values[name] for name in _STEP_ALIASES if name in values}
        if aliases:  # flat keys (DeepSpeed's reader, older files) win over "step"
            settings["step"] = _step_with(settings.get("step", StepConfig()), aliases)
        return cls(**settings)

    @classmethod
    def from_json(cls, path: str | os.PathLike[str], **overrides: Any) -> OffloadConfig:
        """Load a config from a JSON file of our own keys, or from a DeepSpeed config.

        A file with a ``zero_optimization`` key is read as a DeepSpeed config
        (:meth:`from_deepspeed`), any other object as our keys (:meth:`from_dict`).

        Raises:
            OSError: the file cannot be read.
            SwapConfigError: it is not a JSON object, or its settings do not validate; the
                message names the file.
        """
        data = read_json_object(path)
        try:
            if "zero_optimization" in data:
                return cls.from_deepspeed(data, **overrides)
            return cls.from_dict(data, **overrides)
        except SwapConfigError as exc:
            raise SwapConfigError(f"{os.fspath(path)}: {exc}") from None

    @classmethod
    def from_deepspeed(
        cls, ds: Mapping[str, Any] | str | os.PathLike[str], **overrides: Any
    ) -> OffloadConfig:
        """Build a config from a DeepSpeed config (a mapping, or a JSON file's path).

        What is read (everything else at the top level — ``train_batch_size``, ``fp16``,
        ``bf16``, ``optimizer``, ``scheduler``, ... — is not ours and is ignored):

        ``zero_optimization``: ``stage`` must be 3 (parameter offload is ZeRO-3's);
        ``sub_group_size`` → ``sub_group_numel`` (absent: ours, 25M, not DeepSpeed's 1e9);
        the deprecated ``cpu_offload_param: true`` reads as ``offload_param.device: cpu``
        where ``offload_param`` is absent. DeepSpeed's other ZeRO settings (buckets,
        communication, persistence thresholds, quantization, ...) are accepted and
        ignored: they tune collectives and GPU-side caching that swapper does not do, or
        that its byte budgets replace.

        ``offload_param``: ``device`` ``"none"`` (or no section) → ``param_tiers``
        ``(device,)``, ``"cpu"`` → ``(device, host)``, ``"nvme"`` → ``(device, host,
        nvme)``; ``nvme_path`` (a path, or a list of them) → ``nvme_dirs``, read only with
        ``device: nvme``, as DeepSpeed does. ``pin_memory``, ``buffer_count``,
        ``buffer_size`` and ``max_in_cpu`` are ignored: swapper pins host memory whenever
        CUDA is present and sizes its buffers from the byte budgets.

        ``offload_optimizer``: ``device`` ``"none"``/``"cpu"`` (or no section) →
        ``optimizer_tiers`` ``(host,)`` (OffloadAdamW steps on the host either way),
        ``"nvme"`` → ``(host, nvme)``; ``nvme_path`` as above. Where both sections give
        paths, ``nvme_dirs`` holds all of them in order (parameters' first) without
        repeats: swapper stripes every kind over all its directories, so a per-kind disk
        is not kept. ``pin_memory``, ``buffer_count``, ``buffer_size``, ``fast_init``,
        ``pipeline_read``, ``pipeline_write`` (the step pipeline always overlaps reads and
        writes), ``ratio``, ``super_offload`` and ``cpuadam_cores_perc`` are ignored.

        Gradients: ``grad_tiers`` is left to its default, ``(host, nvme)`` with NVMe
        directories, else ``(host,)``.

        ``aio``: ``block_size``, ``queue_depth``, ``single_submit`` and the thread count
        → :class:`AioConfig` (keys not given keep swapper's defaults, not DeepSpeed's).
        The thread count is ``intra_op_parallelism``; ``thread_count`` (older DeepSpeed)
        and ``num_threads`` are honoured as aliases, though current DeepSpeed silently
        ignores them; two of them with different values are refused. ``overlap_events``
        is ignored; ``use_gds: true`` is refused (GPUDirect Storage is not supported).

        ``overrides`` (our field names, e.g. ``device_nbytes``, ``host_nbytes``) win over
        what the config gives.

        Raises:
            OSError: ``ds`` is a path that cannot be read.
            SwapConfigError: ``zero_optimization`` is missing or its stage is not 3, a
                section holds a key DeepSpeed does not have (named with its section), a
                value has the wrong type, ``use_gds`` is true, NVMe offload has no path,
                or the result does not validate. With a path, the message names the file.
        """
        if isinstance(ds, (str, os.PathLike)):
            data = read_json_object(ds)
            try:
                return cls.from_deepspeed(data, **overrides)
            except SwapConfigError as exc:
                raise SwapConfigError(f"{os.fspath(ds)}: {exc}") from None
        return cls.from_dict(deepspeed_settings(ds, overrides))


# -- our own keys ------------------------------------------------------------------------


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


def _stored_tiers(tiers: Sequence[Tier | str] | None) -> tuple[Tier, ...]:
    """A tier field as ``__post_init__`` left it (a tuple of Tier; never None after it)."""
    if not isinstance(tiers, tuple) or not all(isinstance(t, Tier) for t in tiers):
        raise SwapConfigError(f"tier list {tiers!r} was not normalised by OffloadConfig")
    return tiers  # type: ignore[return-value]  # checked element by element above


def _names(tiers: Sequence[Tier]) -> list[str]:
    return [t.value for t in tiers]


def _shown(given: Sequence[Any]) -> list[Any]:
    """A tier list as given, for messages: ``['host', 'nvme']``, not enum reprs."""
    return [t.value if isinstance(t, Tier) else t for t in given]


#: Keys :meth:`OffloadConfig.from_dict` also takes at the top level, for ``step.*``.
_STEP_ALIASES = ("sub_group_numel", "host_fraction")


def _step_with(step: object, values: Mapping[str, Any]) -> StepConfig:
    if not isinstance(step, StepConfig):
        raise SwapConfigError(f"step={step!r} must be a StepConfig or a dict of its settings")
    return dataclasses.replace(step, **values)


def _coerce(name: str, value: Any) -> Any:
    """A JSON value for field ``name`` as the dataclass wants it; the rest is validated."""
    if name in _BYTE_FIELDS and isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as exc:
            raise SwapConfigError(f"{name}={value!r}: {exc}") from None
    if name == "step" and isinstance(value, Mapping):
        known = [f.name for f in dataclasses.fields(StepConfig)]
        unknown = sorted(str(key) for key in value if key not in known)
        if unknown:
            raise SwapConfigError(
                f"unknown step setting(s): {', '.join(unknown)} (known: {', '.join(known)})"
            )
        return StepConfig(**value)
    if name == "aio" and isinstance(value, Mapping):
        try:
            return AioConfig.from_dict(value)
        except SwapConfigError as exc:
            raise SwapConfigError(f"aio: {exc}") from None
    return value
