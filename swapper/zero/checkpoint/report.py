"""What a training snapshot's save reports, and what it checks before it writes anything:
shared by the one-process save (:mod:`swapper.zero.checkpoint.snapshot`) and the N-rank
one (:mod:`swapper.zero.checkpoint.shard_snapshot`), which the first dispatches to, so
neither imports the other's half back.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from swapper.step.optimizer import StepPendingError, StreamedOptimizer
from swapper.step.state import StateDictError
from tiers.errors import SwapConfigError

if TYPE_CHECKING:
    from swapper.zero.local.offload import OffloadedModel
    from swapper.zero.sharded.model import ShardedModel

__all__ = ["SnapshotReport", "check_saveable"]


@dataclasses.dataclass(frozen=True)
class SnapshotReport:
    """What :func:`~swapper.zero.checkpoint.snapshot.save_snapshot` did.

    Attributes:
        name: the snapshot's name.
        step: the optimizer's step count it holds.
        seconds: wall time.
        written_nbytes: tensor bytes written (those dirty in memory), plus the file.
        nbytes: tensor bytes it holds (the state's size), ``rebuilt_nbytes`` included.
        path: its file.
        dropped: snapshots removed (``keep_last``, or one of the same name replaced).
    """

    name: str
    step: int
    seconds: float
    written_nbytes: int
    nbytes: int
    path: Path
    dropped: tuple[str, ...]
    rebuilt_nbytes: int = 0  #: 16-bit parameters left out, rebuilt from masters at resume


def check_saveable(
    model: OffloadedModel | ShardedModel, optimizer: StreamedOptimizer | None
) -> None:
    """Refuse a snapshot of ``optimizer`` that would not resume (see
    :func:`~swapper.zero.checkpoint.snapshot.save_snapshot`).

    Raises:
        SwapConfigError, StateDictError, StepPendingError: as
            :func:`~swapper.zero.checkpoint.snapshot.save_snapshot`.
    """
    if optimizer is not None:
        if optimizer.manager is not model.manager:
            raise SwapConfigError(
                "save_snapshot: the optimizer keeps its state in another manager than the "
                "model's; build it with OffloadAdamW(model.parameters(), tiers=model)"
            )
        optimizer.wait_pending()  # an overlapped update finished (or its failure raised)
        view = optimizer.stored_state
        if view.load_incomplete:
            raise StateDictError(
                "a load_state_dict() or import_dcp() stopped part-way: the optimizer's state "
                "is partly old, partly loaded; load it again before taking a snapshot"
            )
        if view.pending is not None:
            raise StepPendingError(
                f"step {view.pending} failed part-way; call step() again to finish it "
                "before taking a snapshot"
            )
