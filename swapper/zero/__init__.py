"""Training integration: ZeRO-3-style parameter offload through the tiers.

Rooms (each ``__init__`` says what it offers and what it may import): ``model`` (what the
two hook lifecycles share), ``local`` (one process: ``OffloadedModel``), ``sharded`` (N
ranks: ``ShardedModel``), ``checkpoint`` (snapshots, resume, safetensors and DCP exports),
``config`` (every setting); ``wrap`` chooses the model. The paths modules had before the
rooms still import (:mod:`swapper.zero._moved`).
"""

from swapper.zero import _moved
from swapper.zero.checkpoint.dcp_export import export_dcp
from swapper.zero.checkpoint.dcp_import import import_dcp
from swapper.zero.checkpoint.export import export_safetensors
from swapper.zero.checkpoint.snapshot import SnapshotReport, final_digest, save_snapshot
from swapper.zero.config.distributed import DistributedConfig
from swapper.zero.config.offload import OffloadConfig, load_deepspeed
from swapper.zero.local.offload import OffloadedModel
from swapper.zero.local.weights import OffloadedWriteError, WeightsDoNotFitError
from swapper.zero.sharded.model import ShardedModel
from swapper.zero.wrap import offload

_moved.install()  # (old paths are asked for after this package is imported, never during)

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
