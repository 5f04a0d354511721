"""swapper: a tiered-memory swap service for training models larger than accelerator memory."""

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

__version__ = "0.1.0"

__all__ = [
    "AioConfig",
    "AioEngine",
    "Backend",
    "EntryState",
    "Kind",
    "ManagerConfig",
    "ManagerStats",
    "Policy",
    "SwapEntry",
    "Tier",
    "TierManager",
    "SwapConfigError",
    "SwapEOFError",
    "SwapError",
    "SwapIOError",
    "SwapNoSpaceError",
    "__version__",
]
