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

__version__ = "0.1.0"

__all__ = [
    "AioConfig",
    "AioEngine",
    "Backend",
    "SwapConfigError",
    "SwapEOFError",
    "SwapError",
    "SwapIOError",
    "SwapNoSpaceError",
    "__version__",
]
