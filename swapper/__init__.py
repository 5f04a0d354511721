"""swapper: a tiered-memory swap service for training models larger than accelerator memory.

The public names below are imported on first use (PEP 562), not when the package is: the
command-line tools (:mod:`swapper.console`) must install their signal handling before
torch is imported, and importing any ``swapper.*`` module runs this file first.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
        InvalidArgumentError,
        StoreLockedError,
        SwapConfigError,
        SwapCorruptionError,
        SwapEOFError,
        SwapError,
        SwapIOError,
        SwapNoSpaceError,
        UnsafeSwapDirError,
    )

__version__ = "0.1.0"

#: public name → the module it comes from
_SOURCES = {
    **dict.fromkeys(
        (
            "EntryState",
            "Kind",
            "ManagerConfig",
            "ManagerStats",
            "Policy",
            "SwapEntry",
            "Tier",
            "TierManager",
        ),
        "swapper.manager",
    ),
    **dict.fromkeys(
        (
            "DynamicLossScaler",
            "OffloadAdamW",
            "StateDictError",
            "StepFailedError",
            "StepPendingError",
            "StepReport",
        ),
        "swapper.step",
    ),
    **dict.fromkeys(("OffloadConfig", "OffloadedModel", "offload"), "swapper.zero"),
    **dict.fromkeys(
        (
            "AioConfig",
            "AioEngine",
            "Backend",
            "InvalidArgumentError",
            "StoreLockedError",
            "SwapConfigError",
            "SwapCorruptionError",
            "SwapEOFError",
            "SwapError",
            "SwapIOError",
            "SwapNoSpaceError",
            "UnsafeSwapDirError",
        ),
        "tiers",
    ),
}

__all__ = [
    "AioConfig",
    "AioEngine",
    "Backend",
    "DynamicLossScaler",
    "EntryState",
    "InvalidArgumentError",
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
    "StoreLockedError",
    "SwapConfigError",
    "SwapCorruptionError",
    "SwapEOFError",
    "SwapEntry",
    "SwapError",
    "SwapIOError",
    "SwapNoSpaceError",
    "Tier",
    "TierManager",
    "UnsafeSwapDirError",
    "__version__",
    "offload",
]


if set(__all__) != {*_SOURCES, "__version__"}:  # pragma: no cover - a bug here
    raise ImportError("swapper.__all__ and swapper._SOURCES disagree")


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'swapper' has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})
