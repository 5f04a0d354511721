"""swapper: a tiered-memory swap service for training models larger than accelerator memory."""

from swapper.manager import (
    EntryState,
    Kind,
    ManagerConfig,
    ManagerStats,
    Policy,
    SwapEntry,
    Tier,
    TierManager,
)
from swapper.step import (
    DynamicLossScaler,
    OffloadAdamW,
    StateDictError,
    StepFailedError,
    StepPendingError,
    StepReport,
)
from swapper.zero import OffloadConfig, OffloadedModel, offload
from tiers import (
    AioConfig,
    AioEngine,
    Backend,
    SwapConfigError,
    SwapEOFError,
    SwapError,
    SwapIOError,
    SwapNoSpaceError,
)

__version__ = "0.1.0"

__all__ = [
    "AioConfig",
    "AioEngine",
    "Backend",
    "DynamicLossScaler",
    "EntryState",
    "Kind",
    "ManagerConfig",
    "ManagerStats",
    "OffloadAdamW",
    "OffloadConfig",
    "OffloadedModel",
    "Policy",
    "StateDictError",
    "StepFailedError",
    "StepPendingError",
    "StepReport",
    "SwapConfigError",
    "SwapEOFError",
    "SwapEntry",
    "SwapError",
    "SwapIOError",
    "SwapNoSpaceError",
    "Tier",
    "TierManager",
    "__version__",
    "offload",
]
