"""Training integration: ZeRO-3-style parameter offload through the tiers."""

from swapper.zero.config import OffloadConfig
from swapper.zero.deepspeed import load_deepspeed
from swapper.zero.offload import OffloadedModel, offload
from swapper.zero.weights import OffloadedWriteError, WeightsDoNotFitError

__all__ = [
    "OffloadConfig",
    "OffloadedModel",
    "OffloadedWriteError",
    "WeightsDoNotFitError",
    "load_deepspeed",
    "offload",
]
