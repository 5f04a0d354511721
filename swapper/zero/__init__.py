"""Training integration: ZeRO-3-style parameter offload through the tiers."""

from swapper.zero.config import OffloadConfig
from swapper.zero.deepspeed import load_deepspeed
from swapper.zero.dist_config import DistributedConfig
from swapper.zero.offload import OffloadedModel
from swapper.zero.sharded import ShardedModel
from swapper.zero.weights import OffloadedWriteError, WeightsDoNotFitError
from swapper.zero.wrap import offload

__all__ = [
    "DistributedConfig",
    "OffloadConfig",
    "OffloadedModel",
    "OffloadedWriteError",
    "ShardedModel",
    "WeightsDoNotFitError",
    "load_deepspeed",
    "offload",
]
