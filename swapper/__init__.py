"""swapper: a tiered-memory swap service for training models larger than accelerator memory.

The public names below are imported on first use (PEP 562), not when the package is: the
command-line tools (:mod:`swapper.console`) must install their signal handling before
torch is imported, and importing any ``swapper.*`` module runs this file first.
``from swapper import TierManager``, ``swapper.TierManager``, ``from swapper import *``
and ``swapper.step.…`` after a bare ``import swapper`` work as before; the
``TYPE_CHECKING`` imports say the same to type checkers, and a test keeps them,
:data:`_LAZY` and ``__all__`` in step.
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
        DeferredStepError,
        DynamicLossScaler,
        OffloadAdamW,
        OffloadOptimizer,
        StateDictError,
        StepConfig,
        StepFailedError,
        StepPendingError,
        StepReport,
    )
    from swapper.zero import (
        DistributedConfig,
        OffloadConfig,
        OffloadedModel,
        load_deepspeed,
        offload,
    )
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

#: Public name → the module it is imported from on first use.
_LAZY: dict[str, str] = {
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
            "load_deepspeed",
        ),
        "swapper.manager",
    ),
    **dict.fromkeys(
        (
            "DeferredStepError",
            "DynamicLossScaler",
            "OffloadAdamW",
            "OffloadOptimizer",
            "StateDictError",
            "StepConfig",
            "StepFailedError",
            "StepPendingError",
            "StepReport",
        ),
        "swapper.step",
    ),
    **dict.fromkeys(
        ("DistributedConfig", "OffloadConfig", "OffloadedModel", "load_deepspeed", "offload"),
        "swapper.zero",
    ),
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
    "DeferredStepError",
    "DistributedConfig",
    "DynamicLossScaler",
    "EntryState",
    "InvalidArgumentError",
    "Kind",
    "ManagerConfig",
    "ManagerStats",
    "OffloadAdamW",
    "OffloadConfig",
    "OffloadOptimizer",
    "OffloadedModel",
    "Policy",
    "StateDictError",
    "StepConfig",
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
    "load_deepspeed",
    "offload",
]


def __getattr__(name: str) -> Any:
    """Import a public name on first use, then keep it as a global. A submodule's name
    imports it (``import swapper; swapper.step.Piece`` works as when the package
    imported its subpackages eagerly)."""
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the submodule exists but something it imports does not
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
