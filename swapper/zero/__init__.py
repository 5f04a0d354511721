"""Training integration: ZeRO-3-style parameter offload through the tiers."""

from swapper.zero.checkpoint import SnapshotReport, final_digest, save_snapshot
from swapper.zero.config import OffloadConfig
from swapper.zero.dcp_export import export_dcp, import_dcp
from swapper.zero.deepspeed import load_deepspeed
from swapper.zero.dist_config import DistributedConfig
from swapper.zero.export import export_safetensors
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
    "SnapshotReport",
    "WeightsDoNotFitError",
    "export_dcp",
    "export_safetensors",
    "final_digest",
    "import_dcp",
    "load_deepspeed",
    "offload",
    "save_snapshot",
]
