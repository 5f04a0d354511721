"""Training snapshots of an offloaded model and its optimizer: the save half, above the
models (the resume half, below them, is :mod:`swapper.zero.checkpoint.resume`).

Job: everything a run needs to continue bit-exactly after a stop or a crash, as one
retained snapshot of the store the model's manager already writes to:

* the tensors: the 16-bit parameters (``param16/param/<name>``), the optimizer's state
  sub-groups (``optim_state/<name>/state/<i>``: fp32 master, exp_avg, exp_avg_sq), and
  retained 16-bit gradients if any (dropped at resume); those dirty in memory are
  written first, those already current on NVMe are only named (:mod:`swapper.manager.snapshot`),
  except the 16-bit parameters that are exactly their fp32 masters rounded (those a step
  left dirty): neither written nor named, rebuilt from the masters at resume and checked
  against a digest (:mod:`swapper.zero.checkpoint.rebuild`), so a snapshot right after a step
  writes next to nothing;
* the rest, as the snapshot's JSON ``extra`` (one file with the tensors' extents, written
  atomically after they are durable, so a snapshot exists whole or not at all)::

      {"format": "swapper-training-snapshot", "version": 2, "step": 12,
       "optimizer": <swapper.step.resume.optimizer_meta> | null,
       "rng": {"cpu": "<base64 of torch.get_rng_state()>", "cuda": ["<base64>", ...]},
       "extra": <the user's JSON object> | null,
       "rebuilt": <swapper.zero.checkpoint.rebuild's list: parameters left out>}

  (version 1, before ``rebuilt``, is read too.)

Resume (``swapper.offload(..., resume=True | "name")``) is
:mod:`swapper.zero.checkpoint.resume`'s.

Crash safety comes from the store: a snapshot's file appears (rename) only once every
extent it names is durable, and those extents are never reused while it exists; a kill
at any moment leaves the previous snapshots whole, and what the killed run did after its
last snapshot is discarded at resume.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from swapper.manager.snapshot import snapshot_manager
from swapper.step.optimizer import StreamedOptimizer
from swapper.step.resume import optimizer_meta
from swapper.zero.checkpoint.digest import final_digest
from swapper.zero.checkpoint.rebuild import choose_left_out
from swapper.zero.checkpoint.report import SnapshotReport, check_saveable
from swapper.zero.checkpoint.resume import (
    FORMAT,
    VERSION,
    adopt_param,
    finish_resume,
    keeps_store,
    open_manager,
)
from swapper.zero.checkpoint.rng import rng_state as _rng_state
from swapper.zero.checkpoint.shard_snapshot import save_sharded
from swapper.zero.sharded.model import ShardedModel
from tiers.errors import SwapConfigError

if TYPE_CHECKING:
    from swapper.zero.local.offload import OffloadedModel

# (the resume half's public names stay importable from here: this module was both halves)
__all__ = ["SnapshotReport", "adopt_param", "final_digest", "finish_resume", "keeps_store"]
__all__ += ["open_manager", "save_snapshot"]

log = logging.getLogger(__name__)


def save_snapshot(
    model: OffloadedModel | ShardedModel,
    optimizer: StreamedOptimizer | None = None,
    *,
    name: str | None = None,
    extra: Mapping[str, Any] | None = None,
    keep_last: int | None = None,
) -> SnapshotReport:
    """Retain everything needed to continue training bit-exactly as one snapshot of the
    model's store (module docstring). Call it between steps (after ``zero_grad``: retained
    gradients would be written too, and are not resumed). With several ranks, call it on
    every rank alike: each rank's store snapshot is its part, and rank 0 writes one commit
    record once every part is durable (:mod:`swapper.zero.checkpoint.shard_snapshot`; the report is
    then a ``ShardedSnapshotReport``, with the record's path).

    Args:
        optimizer: the model's :class:`OffloadAdamW` (its state and counters are saved).
        name: default ``step-<step, 9 digits>``; a snapshot of that name is replaced.
        extra: the caller's JSON-able metadata (str keys; lists, not tuples), returned at
            resume as ``model.resumed.extra``.
        keep_last: keep only this many newest snapshots (>= 1; several ranks: applied
            to the records and every rank's parts once the new record is durable).

    Raises:
        SwapConfigError: the model has no NVMe tier, or the optimizer is not the model's;
            ``name`` or ``keep_last`` is unusable.
        StepPendingError: a step failed part-way (finish it with ``step()`` first).
        StateDictError: a load of the optimizer's state stopped part-way.
        TypeError, ValueError: ``extra`` or a param group setting cannot be kept as JSON.
        and what :func:`~swapper.manager.snapshot.snapshot_manager` raises (no snapshot).
        PeerFailedError, CollectiveError: several ranks, another rank failed (quoted) or
            a collective failed or timed out (no commit record: no snapshot).
    """
    if isinstance(model, ShardedModel):  # several ranks
        return save_sharded(model, optimizer, name=name, extra=extra, keep_last=keep_last)
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        # (0 would drop the snapshot just taken, and report it as kept)
        raise SwapConfigError(f"keep_last={keep_last!r} must be None or an int >= 1")
    check_saveable(model, optimizer)
    started = time.perf_counter()
    step = optimizer.step_count if optimizer is not None else 0
    if name is None:
        name = f"step-{step:09d}"
    model.release_stale_holds()  # a forward or backward that raised
    model.end_persistence()  # (its holds released first: swapper.zero.local.persist)
    model.drop_kept_grads()  # (entries zero_grad kept empty: not written)
    left = choose_left_out(model.manager, optimizer)  # (before the kept sub-groups go)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "optimizer": None if optimizer is None else optimizer_meta(optimizer),
        "rng": _rng_state(),
        "extra": None if extra is None else dict(extra),
        "rebuilt": left.record,
    }
    kept = optimizer.stored_state.kept_released() if optimizer is not None else nullcontext()
    with kept:
        done = snapshot_manager(
            model.manager,
            name,
            extra=meta,
            keep_last=keep_last,
            replace=True,
            leave_out=left.versions,
        )
    info = done.info
    seconds = time.perf_counter() - started  # (choosing the left-out params included)
    log.info(
        "snapshot %s: step %d, %d bytes written of %d named (+ %d rebuilt at resume), %.3f s",
        name,
        step,
        done.written_nbytes + info.file_nbytes,
        info.nbytes,
        left.nbytes,
        seconds,
    )
    return SnapshotReport(
        name=info.name,
        step=step,
        seconds=seconds,
        written_nbytes=done.written_nbytes + info.file_nbytes,
        nbytes=info.nbytes + left.nbytes,
        path=info.path,
        dropped=done.dropped,
        rebuilt_nbytes=left.nbytes,
    )
