"""Training snapshots, resume, and the portable exports of a wrapped model.

Offers: ``save_snapshot`` (``snapshot``, the save half, with ``report``: what a save
reports and checks first) and resume (``resume``, the resume half) for one process, with
``rng`` and ``rebuild`` (the 16-bit parameters a snapshot leaves out); for N ranks
``shard_snapshot`` and ``shard_resume``, ``commit`` (the commit record) and ``agree`` (the
agreements both halves use); ``final_digest``
(``digest``), safetensors (``export``) and PyTorch Distributed Checkpoint (``dcp_export``,
``dcp_import`` and their parts ``dcp_io``, ``dcp_planners``, ``dcp_reshard``,
``dcp_templates``).

Two layers: the resume half (``resume``, ``shard_resume``, ``agree``, ``commit``,
``rebuild``, ``rng``) lies *below* the models, which call it while they are built or
closed; it takes managers, keys and small protocols (``ShardRecord``), never a model. The
save half and the exports (``snapshot``, ``report``, ``shard_snapshot``, ``digest``,
``export``, ``dcp_*``) lie *above* them and take the models.

May import: ``tiers``, :mod:`swapper.manager`, :mod:`swapper.step`,
:mod:`swapper.distributed`, :mod:`swapper.zero.config`; the save half and the exports also
the models (:mod:`swapper.zero.local`, :mod:`swapper.zero.sharded`) whose state they save.

``from swapper.zero.checkpoint import save_snapshot`` and the other public names of the
module this room's name was (now ``snapshot``) work.
"""

from swapper.zero.checkpoint.snapshot import (
    SnapshotReport,
    adopt_param,
    final_digest,
    finish_resume,
    keeps_store,
    open_manager,
    save_snapshot,
)

__all__ = [
    "SnapshotReport",
    "adopt_param",
    "final_digest",
    "finish_resume",
    "keeps_store",
    "open_manager",
    "save_snapshot",
]
