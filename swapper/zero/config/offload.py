"""Settings of the training integration: one configuration tree, :class:`OffloadConfig`.

``swapper.offload(model, config)`` keeps a model's 16-bit parameters (and their retained
16-bit gradients) in the tiers, and :class:`~swapper.step.OffloadAdamW` keeps the fp32
optimizer state there. An :class:`OffloadConfig` is three sections and nothing else:

- ``manager``: the :class:`~swapper.manager.ManagerConfig` of the
  :class:`~swapper.manager.TierManager` that holds it all (budgets, swap directories,
  placement of each kind, read-ahead window, ...), whose ``aio`` is the I/O settings
  (:class:`~tiers.config.AioConfig`);
- ``step``: the optimizer's :class:`~swapper.step.StepConfig`;
- ``distributed``: how the ranks of a process group share the state
  (:class:`~swapper.zero.config.distributed.DistributedConfig`), used with several ranks only.

No setting is defined twice. :meth:`OffloadConfig.create` takes the flat keywords a
training script writes (``device_nbytes=``, ``param_tiers=``, ``prefetch_nbytes=``, ...;
translated by :mod:`swapper.zero.config.settings`); a config also comes from a mapping
(:meth:`OffloadConfig.from_dict`: those flat keys, or nested ``manager`` and ``step``
sections as :meth:`OffloadConfig.as_dict` writes them), from a JSON file
(:meth:`OffloadConfig.from_json`), or from a DeepSpeed config
(:meth:`OffloadConfig.from_deepspeed`, read by :mod:`swapper.zero.config.deepspeed`). DeepSpeed
has no byte budgets, so a caller loading one usually passes ``device_nbytes=`` and
``host_nbytes=`` as overrides.

Environment variables are read in one place, :meth:`tiers.config.AioConfig.from_env`
(``SWAPPER_AIO_*``), and only when a caller asks: ``create(aio=AioConfig.from_env())``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

from swapper.manager.config import MEMORY_TIERS, Kind, ManagerConfig, Tier
from swapper.step.config import DEFAULT_SUB_GROUP_NUMEL, StepConfig
from swapper.zero.config.deepspeed import deepspeed_settings, read_deepspeed
from swapper.zero.config.deepspeed_training import TrainingSettings
from swapper.zero.config.distributed import DistributedConfig
from swapper.zero.config.settings import (
    FLAT_KEYS,
    PASSTHROUGH_KEYS,
    STEP_ALIASES,
    check_device,
    coerce_flat,
    json_value,
    manager_json,
    manager_section,
    manager_settings,
    step_section,
    step_with,
    tiers_of,
)
from tiers.config import AioConfig, read_json_object
from tiers.errors import SwapConfigError

__all__ = ["OffloadConfig", "load_deepspeed"]


def _default_manager() -> ManagerConfig:
    return OffloadConfig.create().manager


@dataclasses.dataclass(frozen=True, kw_only=True)
class OffloadConfig:
    """Where a model's training state lives and how it moves: the configuration tree.

    Most callers build one with :meth:`create` (flat keywords) or load one
    (:meth:`from_dict`, :meth:`from_json`, :meth:`from_deepspeed`); ``OffloadConfig()`` is
    ``OffloadConfig.create()``.

    Attributes:
        manager: the :class:`~swapper.manager.TierManager` settings: budgets in bytes
            (``device_nbytes`` for the 16-bit parameters being used, ``host_nbytes`` for
            16-bit gradients, optimizer state in flight and every I/O staging buffer),
            ``nvme_dirs``, ``aio`` (the I/O settings), ``placement`` (``param16`` must
            start with a memory tier: parameters are used where it is), the read-ahead
            window ``prefetch_window_nbytes`` (parameters are read ahead along the
            recorded order up to it), ``device`` (``None``, ``"cpu"``, ``"cuda"``,
            ``"cuda:N"``; whether CUDA is present is checked when the manager starts) and
            ``store_name``. The default: ``create()``'s.
        step: the optimizer's settings; an :class:`~swapper.step.OffloadAdamW` over the
            offloaded model takes those its own config leaves ``None``.
            ``sub_group_numel`` (each sub-group's state is 12 B per element and the host
            budget must hold at least one) and ``host_fraction`` are normalised to their
            defaults, 25M and 0, when unset. ``accumulate_fp32`` does not apply (16-bit
            gradients accumulate in their retained buffers) and is refused; ``name`` is
            each optimizer's own.
        distributed: how the ranks of a process group share the state
            (:class:`~swapper.zero.config.distributed.DistributedConfig`: ``fetch_collective``,
            ``fetch_ahead``, ``timeout_s``, ``reduce_dtype``); used only when
            :func:`swapper.offload` is given a group of more than one rank.

    Raises:
        SwapConfigError: a section is not of its type, ``manager.placement['param16']``
            does not start with a memory tier, ``manager.device`` is not a device, or
            ``step.accumulate_fp32`` is set; the message says what to fix.
    """

    manager: ManagerConfig = dataclasses.field(default_factory=_default_manager)
    step: StepConfig = dataclasses.field(default_factory=StepConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.manager, ManagerConfig):
            raise SwapConfigError(
                f"manager={self.manager!r} must be a ManagerConfig (OffloadConfig.create "
                "takes flat settings; from_dict also takes a dict)"
            )
        params = tiers_of(self.manager, Kind.PARAM16)
        if params[0] not in MEMORY_TIERS:
            raise SwapConfigError(
                f"manager.placement['param16']={[t.value for t in params]} must start with "
                "a memory tier ('device' or 'host'): parameters are used where the first "
                "tier is"
            )
        check_device(self.manager.device, "manager.device")
        if not isinstance(self.step, StepConfig):
            raise SwapConfigError(
                f"step={self.step!r} must be a StepConfig (from_dict also takes a dict)"
            )
        if not isinstance(self.distributed, DistributedConfig):
            raise SwapConfigError(
                f"distributed={self.distributed!r} must be a DistributedConfig (from_dict "
                "also takes a dict)"
            )
        if self.step.accumulate_fp32:
            raise SwapConfigError(
                "step.accumulate_fp32=True does not apply to an offloaded model: its 16-bit "
                "gradients accumulate in their retained buffers; leave it False"
            )
        # frozen: normalising in __post_init__ only
        object.__setattr__(
            self,
            "step",
            self.step.merged(
                StepConfig(
                    sub_group_numel=DEFAULT_SUB_GROUP_NUMEL, host_fraction=0.0, moments="fp32"
                )
            ),
        )

    @classmethod
    def create(
        cls,
        *,
        device_nbytes: int | str | None = None,
        host_nbytes: int | str | None = None,
        nvme_dirs: Sequence[str | os.PathLike[str]] = (),
        aio: AioConfig | None = None,
        param_tiers: Sequence[Tier | str] | None = None,
        grad_tiers: Sequence[Tier | str] | None = None,
        optimizer_tiers: Sequence[Tier | str] | None = None,
        prefetch_nbytes: int | str | None = None,
        step: StepConfig | None = None,
        distributed: DistributedConfig | None = None,
        device: str | None = None,
        store_name: str = "swapper-offload",
        **manager: Any,
    ) -> OffloadConfig:
        """A config from the flat settings a training script writes. Sizes in bytes: an
        int, or a string such as ``"1GiB"`` (:func:`tiers.units.parse_size`, as in
        ``from_dict``, JSON, DeepSpeed files and the command-line flags).

        Args:
            device_nbytes: device-tier budget, for the 16-bit parameters being used
                (``None``: unlimited).
            host_nbytes: pinned host budget, for 16-bit gradients, the optimizer state in
                flight and every I/O staging buffer (``None``: unlimited).
            nvme_dirs: swap directories; empty for no NVMe tier.
            aio: the I/O settings (``None``: ``AioConfig()``; the environment's are
                ``AioConfig.from_env()``).
            param_tiers: where 16-bit parameters may live, in order of preference; the
                first is where they are used and must be a memory tier. ``None``:
                ``(device, host, nvme)``, without ``nvme`` when ``nvme_dirs`` is empty.
            grad_tiers: where retained 16-bit gradients may live. ``None``: ``(host,
                nvme)``, without ``nvme`` when ``nvme_dirs`` is empty.
            optimizer_tiers: where fp32 optimizer state (master weights, Adam moments) may
                live; the same default as ``grad_tiers``.
            prefetch_nbytes: parameter read-ahead window: at most this many bytes read
                ahead and not yet used (``None``: half the device budget, or the manager's
                default, half the host budget, when the device budget is unlimited).
                Clamped to ``host_nbytes``: bytes read ahead sit in host memory.
            step: the optimizer's settings (``None``: ``StepConfig()``).
            distributed: how several ranks share the state (``None``:
                ``DistributedConfig()``; unused in one process).
            device: ``None`` (CUDA if available, else the CPU stand-in), ``"cpu"``,
                ``"cuda"``, ``"cuda:N"``.
            store_name: base name of the swap files.
            manager: other :class:`~swapper.manager.ManagerConfig` fields, passed through
                (``policy``, ``write_behind_nbytes``, ``timeout_s``, ``mover_threads``, ...).

        Raises:
            SwapConfigError: a setting is invalid, or is not a setting; the message names
                it as written here and says what to fix.
        """
        step = StepConfig() if step is None else step
        settings = manager_settings(
            device_nbytes=device_nbytes,
            host_nbytes=host_nbytes,
            nvme_dirs=nvme_dirs,
            aio=aio,
            param_tiers=param_tiers,
            grad_tiers=grad_tiers,
            optimizer_tiers=optimizer_tiers,
            prefetch_nbytes=prefetch_nbytes,
            device=device,
            store_name=store_name,
            other=manager,
        )
        if "host_arena_nbytes" not in manager and isinstance(step, StepConfig):
            arena = sub_group_arena_nbytes(settings.host_nbytes, step.sub_group_numel)
            if arena is not None:
                settings = dataclasses.replace(settings, host_arena_nbytes=arena)
        return cls(
            manager=settings,
            step=step,
            distributed=DistributedConfig() if distributed is None else distributed,
        )

    def as_dict(self) -> dict[str, Any]:
        """The config as JSON values, in three sections: ``{"manager": {...}, "step": {...},
        "distributed": {...}}``.

        Every field of each section appears, normalised (the placement of every kind, the
        step's defaults filled in), except the manager's read-ahead and write-behind
        windows, ``None`` where they are its default, half the host budget; enums and paths
        become strings, ``aio`` an object of its fields. :meth:`from_dict` of the result
        gives an equal config.
        """
        return {
            "manager": manager_json(self.manager),
            "step": json_value(self.step),
            "distributed": self.distributed.as_dict(),
        }

    # -- loading -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, mapping: Mapping[str, Any], **overrides: Any) -> OffloadConfig:
        """Build a config from a mapping, in either of two shapes.

        Flat: the keywords of :meth:`create` as keys, and ``sub_group_numel`` and
        ``host_fraction`` for ``step.*`` (winning over a ``step`` object). Nested: a
        ``manager`` section (the :class:`~swapper.manager.ManagerConfig` fields; fields not
        given take :func:`~swapper.zero.config.settings.manager_section`'s defaults) and a
        ``step`` section, and a ``distributed`` section (the
        :class:`~swapper.zero.config.distributed.DistributedConfig` fields), as :meth:`as_dict`
        writes them; the flat key ``fetch_collective`` wins over ``distributed``'s; flat
        keys that are manager fields of the same name (``device_nbytes``, ``host_nbytes``,
        ``nvme_dirs``, ``aio``, ``device``, ``store_name``, ...) are applied over the
        section, and the step keys over ``step``.

        Sizes may be ints or strings such as ``"64MiB"`` (see
        :func:`tiers.units.parse_size`); ``aio`` and ``step`` may be objects of their
        settings; tiers are lists of names. ``overrides`` are the same keys and win over
        the mapping.

        Raises:
            SwapConfigError: a key is not a setting (all such keys are named), a flat tier
                list or ``prefetch_nbytes`` is given beside a ``manager`` section, a size
                does not parse, or a value does not validate (named).
        """
        if not isinstance(mapping, Mapping):
            raise SwapConfigError(
                f"an offload config must be a mapping of settings, got {type(mapping).__name__}"
            )
        values = {**mapping, **overrides}
        flat_known = (*FLAT_KEYS, *PASSTHROUGH_KEYS)
        unknown = sorted(
            str(key)
            for key in values
            if key not in flat_known
            and key not in STEP_ALIASES
            and key not in ("manager", "distributed", "fetch_collective")
        )
        if unknown:
            raise SwapConfigError(
                f"unknown offload setting(s): {', '.join(unknown)} (known: "
                f"{', '.join(flat_known)}; {', '.join(STEP_ALIASES)} for step.*; "
                "fetch_collective for distributed.*; or sections 'manager', 'step' and "
                "'distributed')"
            )
        distributed = DistributedConfig.from_dict(values.get("distributed", {}))
        if "fetch_collective" in values:  # the flat key (DeepSpeed's reader) wins
            distributed = dataclasses.replace(
                distributed, fetch_collective=values["fetch_collective"]
            )
        step = step_section(values.get("step", StepConfig()))
        aliases = {name: values[name] for name in STEP_ALIASES if name in values}
        if aliases:  # flat keys (DeepSpeed's reader, older files) win over "step"
            step = step_with(step, aliases)
        if "manager" in values:
            translated = sorted(
                key for key in values if key in ("param_tiers", "grad_tiers", "optimizer_tiers")
            ) + (["prefetch_nbytes"] if "prefetch_nbytes" in values else [])
            if translated:
                raise SwapConfigError(
                    f"{', '.join(translated)} beside a 'manager' section: give "
                    "manager.placement and manager.prefetch_window_nbytes there instead, "
                    "or only flat settings"
                )
            flat = {
                key: value
                for key, value in values.items()
                if key in flat_known and key not in ("manager", "step")
            }
            return cls(
                manager=manager_section(values["manager"], flat),
                step=step,
                distributed=distributed,
            )
        settings = {
            name: coerce_flat(name, value)
            for name, value in values.items()
            if name in flat_known and name != "step"
        }
        return dataclasses.replace(cls.create(step=step, **settings), distributed=distributed)

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

        What is read is below; ``gradient_clipping`` → ``step.max_grad_norm``; the other
        training sections (``optimizer``, ``fp16``, ``bf16``) are read by
        :func:`load_deepspeed`, which returns them beside this
        config. Every key given that is not honoured (``scheduler``, ``train_batch_size``,
        the ZeRO and offload keys listed as not needed below, ``"auto"`` placeholders,
        ...) is named in one warning (logger ``swapper.zero.config.deepspeed``); a
        ``sub_group_size`` (or ours) whose state the host budget cannot hold is reduced
        to a quarter of it, with one log line.

        ``zero_optimization``: ``stage`` must be 3 (parameter offload is ZeRO-3's);
        ``stage3_use_all_reduce_for_fetch_params`` (or its alias
        ``use_all_reduce_for_fetch_params``) ``true`` → ``distributed.fetch_collective``
        ``"all_reduce"`` (absent or ``false``: ``"all_gather"``);
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

        ``aio`` (at the top, or inside ``zero_optimization`` as Hugging Face's DeepSpeed
        guide prints it; both given must agree): ``block_size``, ``queue_depth``,
        ``single_submit`` and the thread count
        → :class:`AioConfig` (keys not given keep swapper's defaults, not DeepSpeed's).
        The thread count is ``intra_op_parallelism``; ``thread_count`` (older DeepSpeed)
        and ``num_threads`` are honoured as aliases, though current DeepSpeed silently
        ignores them; two of them with different values are refused. ``overlap_events``
        is ignored; ``use_gds: true`` is refused (GPUDirect Storage is not supported).

        ``overrides`` (the flat keys of :meth:`create`, e.g. ``device_nbytes``,
        ``host_nbytes``) win over what the config gives.

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
        return cls.from_dict(deepspeed_settings(ds, overrides))  # flat keys: create()


def load_deepspeed(
    ds: Mapping[str, Any] | str | os.PathLike[str], **overrides: Any
) -> tuple[OffloadConfig, TrainingSettings]:
    """A DeepSpeed config read whole: the offload config
    (:meth:`~swapper.zero.OffloadConfig.from_deepspeed`'s, ``gradient_clipping`` in its
    ``step.max_grad_norm``) and what the training sections ask of the optimizer and the
    loop::

        config, training = load_deepspeed("ds.json", device_nbytes=..., host_nbytes=...)
        model = model.to(training.torch_dtype or torch.bfloat16)  # 16-bit params
        with swapper.offload(model, config) as wrapped:
            opt = OffloadAdamW(wrapped.parameters(), **training.optimizer, tiers=wrapped,
                               loss_scaler=training.make_loss_scaler())
            # or, for any optimizer.type it maps (AdamW, SGD, Adagrad, Lion):
            opt = training.make_optimizer(wrapped.parameters(), tiers=wrapped)

    One warning names every key not honoured (use this rather than calling
    ``from_deepspeed`` as well, which would warn again).

    Raises:
        OSError: ``ds`` is a path that cannot be read.
        SwapConfigError: as :meth:`~swapper.zero.OffloadConfig.from_deepspeed`, and for a
            training section that cannot be honoured (named); with a path, the message
            names the file.
    """
    values, training = read_deepspeed(ds, overrides)
    try:
        return OffloadConfig.from_dict(values), training
    except SwapConfigError as exc:
        if isinstance(ds, (str, os.PathLike)):
            raise SwapConfigError(f"{os.fspath(ds)}: {exc}") from None
        raise


#: The host tier's default arena (``ManagerConfig.host_arena_nbytes``).
_DEFAULT_ARENA_NBYTES = 64 << 20
_HUGE_PAGE_NBYTES = 2 << 20


def sub_group_arena_nbytes(host_nbytes: int | None, sub_group_numel: int | None) -> int | None:
    """The host arena size (bytes) that holds one optimizer sub-group's state (12 B per
    element with fp32 moments, rounded up to 2 MiB) in one arena block, where that is
    larger than the default 64 MiB and the host budget is limited and holds it; None
    (keep the default) otherwise.

    Why: a block larger than an arena gets its own mapping, made (huge pages prefaulted)
    and unmapped again at every fetch. With sub-groups of 16 M elements (192 MB of state)
    every state read of every step mapped and faulted 192 MB afresh: 136 times a step at
    2.17 B parameters.
    """
    if host_nbytes is None or sub_group_numel is None:
        return None
    state = 12 * sub_group_numel
    arena = -(-state // _HUGE_PAGE_NBYTES) * _HUGE_PAGE_NBYTES
    if arena <= _DEFAULT_ARENA_NBYTES or arena > host_nbytes:
        return None
    return arena
