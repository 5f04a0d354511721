"""Training snapshots, resume, and the portable exports of a wrapped model.

Offers: ``save_snapshot``/resume for one process (``snapshot``, with ``rng`` and
``rebuild``: the 16-bit parameters a snapshot leaves out) and for N ranks
(``shard_snapshot``, ``shard_resume``, ``commit``: the commit record), ``final_digest``
(``digest``), safetensors (``export``) and PyTorch Distributed Checkpoint (``dcp_export``,
``dcp_import`` and their parts ``dcp_io``, ``dcp_planners``, ``dcp_reshard``,
``dcp_templates``).

May import: ``tiers``, :mod:`swapper.manager`, :mod:`swapper.step`,
:mod:`swapper.distributed`, :mod:`swapper.zero.config`, and the two models
(:mod:`swapper.zero.local`, :mod:`swapper.zero.sharded`) whose state it saves; the models
import this room only to resume or snapshot.

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
