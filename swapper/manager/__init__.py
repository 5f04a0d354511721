"""The tier manager: one :class:`SwapEntry` per tensor, placed in device memory, pinned host
memory or NVMe under per-tier byte budgets, with read-ahead, write-behind and eviction by
LRU or by recorded access order (Belady). See :mod:`swapper.manager.entry` for the state
diagram and :mod:`swapper.manager.core` for threads and locking."""

from swapper.manager.config import DEFAULT_PLACEMENT, Kind, ManagerConfig, Policy, Tier
from swapper.manager.core import TierManager
from swapper.manager.entry import EntryInfo, EntryState, SwapEntry
from swapper.manager.errors import (
    EntryInUseError,
    IllegalTransitionError,
    KeyExistsError,
    ManagerClosedError,
    ManagerIOTimeout,
    ManagerTimeout,
    NotDurableError,
    NotInUseError,
    UnknownKeyError,
)
from swapper.manager.policy import AccessOrder
from swapper.manager.shared import BehindFuture
from swapper.manager.stats import (
    ManagerStats,
    TierStats,
    TransferStats,
    background_work,
    in_background_work,
)
from swapper.manager.wear import WriteBudgetExceededError, WriteBudgetWarning

__all__ = [
    "DEFAULT_PLACEMENT",
    "AccessOrder",
    "BehindFuture",
    "EntryInUseError",
    "EntryInfo",
    "EntryState",
    "IllegalTransitionError",
    "KeyExistsError",
    "Kind",
    "ManagerClosedError",
    "ManagerConfig",
    "ManagerIOTimeout",
    "ManagerStats",
    "ManagerTimeout",
    "NotDurableError",
    "NotInUseError",
    "Policy",
    "SwapEntry",
    "Tier",
    "TierManager",
    "TierStats",
    "TransferStats",
    "UnknownKeyError",
    "WriteBudgetExceededError",
    "WriteBudgetWarning",
    "background_work",
    "in_background_work",
]
