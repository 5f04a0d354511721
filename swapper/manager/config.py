"""Settings of a :class:`~swapper.manager.TierManager`: tiers, kinds, policy, the config."""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, cast

from tiers.config import DIRECT_ALIGNMENT, AioConfig, enum_names, parse_enum
from tiers.errors import SwapConfigError
from tiers.units import parse_size

__all__ = [
    "DEFAULT_PLACEMENT",
    "TIER_RANK",
    "Kind",
    "ManagerConfig",
    "Policy",
    "Tier",
    "size_setting",
]


class Tier(str, enum.Enum):
    """Where bytes can live, fastest first."""

    DEVICE = "device"  #: accelerator memory (CPU tensors under a budget without CUDA)
    HOST = "host"  #: pinned host memory
    NVME = "nvme"  #: swap files

    @property
    def rank(self) -> int:
        """0 for the fastest tier; a victim always moves to a higher rank."""
        return _RANK[self]


_RANK = {Tier.DEVICE: 0, Tier.HOST: 1, Tier.NVME: 2}
#: each tier's rank (:attr:`Tier.rank`) as a table, for a loop that reads it often
TIER_RANK: Mapping[Tier, int] = MappingProxyType(_RANK)
MEMORY_TIERS = (Tier.DEVICE, Tier.HOST)


class Kind(str, enum.Enum):
    """What a tensor is; each kind has its own placement list."""

    PARAM16 = "param16"  #: 16-bit parameters
    GRAD16 = "grad16"  #: 16-bit gradients, retained after backward
    OPTIM_STATE = "optim_state"  #: fp32 master weights and Adam moments
    #: fp32 gradients; only the incumbent's way of stepping writes them (see
    #: ``swapper-bench step --legacy-grad-swap``), ours builds them from grad16 in memory
    GRAD32 = "grad32"


class Policy(str, enum.Enum):
    """How eviction victims are chosen."""

    AUTO = "auto"  #: BELADY once an access order is recorded, LRU until then
    LRU = "lru"  #: least recently used first
    BELADY = "belady"  #: next use furthest away first (by the recorded access order)


#: param16 and grad16 want the device, then host; optimizer state is streamed from host.
DEFAULT_PLACEMENT: Mapping[Kind, tuple[Tier, ...]] = MappingProxyType(
    {
        Kind.PARAM16: (Tier.DEVICE, Tier.HOST, Tier.NVME),
        Kind.GRAD16: (Tier.DEVICE, Tier.HOST, Tier.NVME),
        Kind.OPTIM_STATE: (Tier.HOST, Tier.NVME),
        Kind.GRAD32: (Tier.HOST, Tier.NVME),
    }
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """Settings of a :class:`~swapper.manager.TierManager`. Sizes in bytes, times in seconds.

    Every size may also be given as a string (``host_nbytes="1GiB"``), read by
    :func:`tiers.units.parse_size`; the field holds the int after construction.

    Attributes:
        device_nbytes: device tier budget (``None``: unlimited).
        host_nbytes: host tier budget, which also bounds every buffer used for I/O
            (staging, reads, writes). ``None``: unlimited.
        nvme_dirs: swap directories; empty for no NVMe tier (then ``nvme`` is dropped from
            the default placement, and naming it in ``placement`` is an error).
        aio: settings of the AIO engine.
        placement: kind → tiers in order of preference; kinds not given keep
            :data:`DEFAULT_PLACEMENT`. Registration takes the first tier with room.
        policy: how victims are chosen (see :class:`Policy`).
        prefetch_window_nbytes: at most this many bytes read ahead and not yet fetched
            (``None``: half the host budget, or unlimited with an unlimited host budget);
            counted apart for optimizer state and for the other kinds (a step's read-ahead
            never waits for the parameters' and the other way round). A tensor larger
            than the window is read ahead alone.
        write_behind_nbytes: at most this many bytes being written to NVMe at once
            (``None``: half the host budget, or unlimited).
        stats_interval_s: log a stats line at INFO at most this often (``None``: never).
        timeout_s: how long an operation waits for room or for another thread's transfer
            before raising; also how long a fetch waits for its read from NVMe, and an
            eviction for its write, before its waiters get
            :class:`~tiers.errors.IOTimeoutError` naming the file and offset (the request
            stays in flight, its memory kept, until the disk completes it). A wait for a
            request still in flight goes on past it while the disk keeps completing
            requests (slow, not stuck): it fails once the disk has completed nothing for
            ``timeout_s`` (:mod:`swapper.manager.watchdog`).
        close_timeout_s: how long :meth:`~swapper.manager.TierManager.close` waits for
            writes in flight.
        device: ``None`` (CUDA if available, else the CPU stand-in), ``"cpu"``, ``"cuda"``,
            ``"cuda:N"``.
        store_name: base name of the NVMe store's files.
        stripe_nbytes: tensors larger than this are striped over ``nvme_dirs``.
        checksum: record a content hash (XXH3-64) of every chunk written to NVMe.
        verify: check every chunk read from NVMe against the digest recorded when it was
            written, before the tensor is handed out; a mismatch raises
            :class:`~tiers.errors.SwapCorruptionError` (the entry stays registered, on
            NVMe). Off only for disks you trust: nothing is checked without ``checksum``.
        host_arena_nbytes: size of each host arena (see :mod:`tiers.host`).
        mover_threads: threads that run ``evict`` and ``prefetch`` requests.
        write_budget_bytes_per_day: the most the run may write to NVMe per day (a drive's
            rated endurance spread over its life, e.g. ``600e12 / (5 * 365)``); ``None``:
            no budget. Checked at the end of each optimizer step
            (:meth:`~swapper.manager.TierManager.check_write_budget`): when the rate
            measured since the first step projects over it, one
            :class:`~swapper.manager.wear.WriteBudgetWarning` names the rate, the budget
            and what would lower it.
        write_budget_strict: instead of the warning, the step that crosses the budget
            raises :class:`~swapper.manager.wear.WriteBudgetExceededError`, after making
            every tensor durable (the step is complete: training can resume from there).

    Raises:
        SwapConfigError: a setting is invalid; the message names it and says what to fix.
    """

    device_nbytes: int | None
    host_nbytes: int | None
    nvme_dirs: Sequence[str | os.PathLike[str]] = ()
    aio: AioConfig = dataclasses.field(default_factory=AioConfig)
    placement: Mapping[Kind | str, Sequence[Tier | str]] | None = None
    policy: Policy | str = Policy.AUTO
    prefetch_window_nbytes: int | None = None
    write_behind_nbytes: int | None = None
    stats_interval_s: float | None = None
    timeout_s: float = 60.0
    close_timeout_s: float = 60.0
    device: str | None = None
    store_name: str = "swapper-store"
    stripe_nbytes: int = 16 << 20
    checksum: bool = True
    verify: bool = True
    host_arena_nbytes: int = 64 << 20
    mover_threads: int = 2
    write_budget_bytes_per_day: float | None = None
    write_budget_strict: bool = False

    def __post_init__(self) -> None:
        for name in (
            "device_nbytes",
            "host_nbytes",
            "prefetch_window_nbytes",
            "write_behind_nbytes",
        ):
            self._set(name, size_setting(name, getattr(self, name), allow_none=True))
        for name in ("stripe_nbytes", "host_arena_nbytes"):
            value = size_setting(name, getattr(self, name), allow_none=False) or 0
            self._set(name, value)
            if value <= 0 or value % DIRECT_ALIGNMENT:
                raise SwapConfigError(
                    f"{name}={value} must be a positive multiple of {DIRECT_ALIGNMENT} bytes"
                )
        if isinstance(self.nvme_dirs, (str, os.PathLike)):
            raise SwapConfigError("nvme_dirs must be a list of directories, not a single path")
        self._set("nvme_dirs", tuple(Path(d) for d in self.nvme_dirs))
        if not isinstance(self.aio, AioConfig):
            raise SwapConfigError(f"aio={self.aio!r} must be an AioConfig")
        self._set("policy", parse_enum(Policy, self.policy, "policy"))
        placement = self._checked_placement()
        self._set("placement", placement)
        for name in ("timeout_s", "close_timeout_s"):
            value = getattr(self, name)
            if not _is_number(value) or not value > 0:
                raise SwapConfigError(f"{name}={value!r} must be a number of seconds > 0")
        interval = self.stats_interval_s
        if interval is not None and (not _is_number(interval) or not interval > 0):
            raise SwapConfigError(f"stats_interval_s={interval!r} must be seconds > 0 or None")
        budget = self.write_budget_bytes_per_day
        if budget is not None and (
            not _is_number(budget) or not math.isfinite(budget) or not budget > 0
        ):
            raise SwapConfigError(
                f"write_budget_bytes_per_day={budget!r} must be a number of bytes > 0 or None "
                "(e.g. 1e12 for 1 TB a day)"
            )
        if not isinstance(self.write_budget_strict, bool):
            raise SwapConfigError(
                f"write_budget_strict={self.write_budget_strict!r} must be True or False"
            )
        if self.write_budget_strict and budget is None:
            raise SwapConfigError(
                "write_budget_strict=True needs write_budget_bytes_per_day (the budget to hold)"
            )
        if self.device is not None and not isinstance(self.device, str):
            raise SwapConfigError(f"device={self.device!r} must be None, 'cpu' or 'cuda[:N]'")
        if not isinstance(self.store_name, str) or not self.store_name:
            raise SwapConfigError(f"store_name={self.store_name!r} must be a non-empty name")
        if not isinstance(self.checksum, bool):
            raise SwapConfigError(f"checksum={self.checksum!r} must be True or False")
        if not isinstance(self.verify, bool):
            raise SwapConfigError(f"verify={self.verify!r} must be True or False")
        threads = self.mover_threads
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
            raise SwapConfigError(f"mover_threads={threads!r} must be an int from 1 to 64")
        self._check_windows(placement)

    @property
    def tier_order(self) -> Mapping[Kind, tuple[Tier, ...]]:
        """``placement`` as the constructor normalised it: every kind, its tiers as
        :class:`Tier` in order of preference."""
        return cast("Mapping[Kind, tuple[Tier, ...]]", self.placement)

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: normalising in __post_init__ only

    def _checked_placement(self) -> Mapping[Kind, tuple[Tier, ...]]:
        given = {} if self.placement is None else self.placement
        if not isinstance(given, Mapping):
            raise SwapConfigError(f"placement={given!r} must be a mapping of kind to tiers")
        placement = dict(DEFAULT_PLACEMENT)
        if not self.nvme_dirs:
            placement = {k: tuple(t for t in v if t is not Tier.NVME) for k, v in placement.items()}
        for raw_kind, raw_tiers in given.items():
            try:
                kind = parse_enum(Kind, raw_kind, "kind")
            except SwapConfigError:
                raise SwapConfigError(
                    f"placement: {raw_kind!r} is not a kind (kinds: {enum_names(Kind)})"
                ) from None
            if isinstance(raw_tiers, (str, Tier)) or not isinstance(raw_tiers, Sequence):
                raise SwapConfigError(
                    f"placement[{kind.value!r}]={raw_tiers!r} must be a list of tiers"
                )
            try:
                tiers = tuple(parse_enum(Tier, t, "tier") for t in raw_tiers)
            except SwapConfigError:
                raise SwapConfigError(
                    f"placement[{kind.value!r}]={list(raw_tiers)!r} names an unknown tier "
                    f"(tiers: {enum_names(Tier)})"
                ) from None
            if not tiers or len(set(tiers)) != len(tiers):
                raise SwapConfigError(
                    f"placement[{kind.value!r}]={[t.value for t in tiers]} must name each "
                    "tier at most once, and at least one"
                )
            if Tier.NVME in tiers and not self.nvme_dirs:
                raise SwapConfigError(
                    f"placement[{kind.value!r}] names 'nvme' but nvme_dirs is empty: give "
                    "swap directories or leave nvme out"
                )
            placement[kind] = tiers
        for kind, tiers in placement.items():
            if not tiers:
                raise SwapConfigError(
                    f"placement[{kind.value!r}] is empty once nvme is dropped (nvme_dirs is "
                    "empty): name a memory tier for it"
                )
        return MappingProxyType(placement)

    def _check_windows(self, placement: Mapping[Kind, tuple[Tier, ...]]) -> None:
        host = self.host_nbytes
        for name in ("prefetch_window_nbytes", "write_behind_nbytes"):
            value = getattr(self, name)
            if value is None:
                self._set(name, None if host is None else host // 2)
            elif value <= 0:
                raise SwapConfigError(f"{name}={value} must be > 0 bytes")
            elif host is not None and value > host:
                # Every byte read ahead or written behind sits in a host buffer meanwhile.
                raise SwapConfigError(
                    f"{name}={value} is larger than host_nbytes={host}: bytes in flight "
                    "live in host memory, so the window cannot exceed its budget"
                )
        uses_device_and_nvme = any(
            Tier.DEVICE in tiers and Tier.NVME in tiers for tiers in placement.values()
        )
        if uses_device_and_nvme and host == 0:
            raise SwapConfigError(
                "host_nbytes=0, but device tensors reach NVMe through host staging buffers: "
                "give the host tier room for the largest such tensor"
            )


def size_setting(name: str, value: object, *, allow_none: bool) -> int | None:
    """Setting ``name``'s size in bytes: an int ``>= 0``, or a string that
    :func:`tiers.units.parse_size` reads (``"64MiB"``, ``"1.5GB"``, ``"4096"``), the one
    parser of every size swapper takes (flags, JSON, DeepSpeed files, keywords).

    Raises:
        SwapConfigError: anything else (or ``None`` where not allowed), naming the setting.
    """
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as exc:
            raise SwapConfigError(f"{name}={value!r}: {exc}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        extra = " or None" if allow_none else ""
        raise SwapConfigError(
            f"{name}={value!r} must be a number of bytes >= 0 (an int, or a size such as "
            f"'64MiB'){extra}"
        )
    return value


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
