"""Multi-rank ZeRO-3 on torch.distributed: partition plan, collectives, per-rank stores.

- :mod:`~swapper.distributed.partition`: who owns which elements (pure);
- :mod:`~swapper.distributed.balance`: the backward offload balance figures (pure);
- :mod:`~swapper.distributed.layout`: a module's fetch buffer and collective segments (pure);
- :mod:`~swapper.distributed.groups`: the process group, timeouts, agreement, model check;
- :mod:`~swapper.distributed.collectives`: fetch, gradient reduce-scatter, norm/overflow;
- :mod:`~swapper.distributed.shards`: a rank's shard of a full tensor, local norm sums;
- :mod:`~swapper.distributed.identity`: per-rank NVMe directories and store identity.
"""

from swapper.distributed.balance import (
    BalanceReport,
    balance_report,
    contiguous_windows,
    plan_windows,
)
from swapper.distributed.collectives import (
    FETCH_METHODS,
    PendingFetch,
    ReduceScatterStats,
    reduce_norm_and_overflow,
    reduce_scatter_grads,
    start_fetch,
)
from swapper.distributed.errors import (
    CollectiveError,
    ModelMismatchError,
    PeerFailedError,
    StoreIdentityError,
    StoreLayoutError,
)
from swapper.distributed.groups import (
    DEFAULT_TIMEOUT,
    DistGroup,
    agree,
    check_same_model,
    check_same_settings,
    gather_codes,
)
from swapper.distributed.identity import (
    claim_store_identity,
    identity_path,
    rank_dirs,
    refuse_other_layout,
)
from swapper.distributed.layout import ModuleLayout, Piece, module_layout
from swapper.distributed.partition import (
    ALIGN_NUMEL,
    ParamInfo,
    ParamPlacement,
    PartitionPlan,
    describe_modules,
    plan_contiguous,
    plan_partition,
)
from swapper.distributed.shards import local_sq_sum, shard_of

__all__ = [
    "ALIGN_NUMEL",
    "DEFAULT_TIMEOUT",
    "FETCH_METHODS",
    "BalanceReport",
    "CollectiveError",
    "DistGroup",
    "ModelMismatchError",
    "ModuleLayout",
    "ParamInfo",
    "ParamPlacement",
    "PartitionPlan",
    "PeerFailedError",
    "PendingFetch",
    "Piece",
    "ReduceScatterStats",
    "StoreIdentityError",
    "StoreLayoutError",
    "agree",
    "balance_report",
    "check_same_model",
    "check_same_settings",
    "claim_store_identity",
    "contiguous_windows",
    "describe_modules",
    "gather_codes",
    "identity_path",
    "local_sq_sum",
    "module_layout",
    "plan_contiguous",
    "plan_partition",
    "plan_windows",
    "rank_dirs",
    "reduce_norm_and_overflow",
    "reduce_scatter_grads",
    "refuse_other_layout",
    "shard_of",
    "start_fetch",
]
