"""Where bytes live and how they move: AIO engine, host buffers, swap files.

This package knows nothing of training and never imports :mod:`swapper`.
"""

from tiers.aio import AioEngine, IOFuture
from tiers.config import AioConfig, Backend
from tiers.errors import (
    BackendUnavailableError,
    BufferPoolTimeout,
    EngineClosedError,
    EngineCloseTimeout,
    SwapConfigError,
    SwapEOFError,
    SwapError,
    SwapIOError,
    SwapNoSpaceError,
)
from tiers.files import SwapFile, make_private_dir

__all__ = [
    "AioConfig",
    "AioEngine",
    "Backend",
    "BackendUnavailableError",
    "BufferPoolTimeout",
    "EngineCloseTimeout",
    "EngineClosedError",
    "IOFuture",
    "SwapConfigError",
    "SwapEOFError",
    "SwapError",
    "SwapFile",
    "SwapIOError",
    "SwapNoSpaceError",
    "make_private_dir",
]
