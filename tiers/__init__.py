"""Where bytes live and how they move: AIO engine, host buffers, swap files.

This package knows nothing of training and never imports :mod:`swapper`.
"""

from tiers.aio import AioEngine, IOFuture
from tiers.config import AioConfig, Backend
from tiers.errors import (
    BackendUnavailableError,
    EngineClosedError,
    EngineCloseTimeout,
    InvalidArgumentError,
    IOTimeoutError,
    StoreLockedError,
    SwapConfigError,
    SwapCorruptionError,
    SwapEOFError,
    SwapError,
    SwapIOError,
    SwapNoSpaceError,
    UnsafeSwapDirError,
)
from tiers.files import SwapFile, make_private_dir

__all__ = [
    "AioConfig",
    "AioEngine",
    "Backend",
    "BackendUnavailableError",
    "EngineCloseTimeout",
    "EngineClosedError",
    "IOFuture",
    "IOTimeoutError",
    "InvalidArgumentError",
    "StoreLockedError",
    "SwapConfigError",
    "SwapCorruptionError",
    "SwapEOFError",
    "SwapError",
    "SwapFile",
    "SwapIOError",
    "SwapNoSpaceError",
    "UnsafeSwapDirError",
    "make_private_dir",
]
