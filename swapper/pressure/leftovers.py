"""What an earlier ``swapper-pressure --checkpoint-every`` left in ``--dir``, asked before
any work: its snapshots (kept for ``--resume``) and whether a run still has them open.

A second run over the same ``--dir`` without ``--resume`` would otherwise get, seconds in,
the store layer's "a store named 'swapper-offload' is already there: reopen it with
NvmeStore.open(...)", advice for library code. Here it gets one line that says what to do
on the command line, before torch loads. This module imports no torch.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from tiers.files import lock_holder

__all__ = ["CHECKPOINT_DIR", "checkpoint_in_the_way"]

#: Where --checkpoint-every keeps its store inside each --dir: the name of
#: swapper.pressure.ranks.CHECKPOINT_DIR, here without importing torch.
CHECKPOINT_DIR = "swapper-pressure-checkpoint"


def _files(checkpoint: Path) -> list[Path]:
    """The files in ``checkpoint`` and its ``rank*of*`` directories (one level: where the
    runs put them)."""
    found = [p for p in checkpoint.iterdir() if p.is_file()]
    for sub in checkpoint.glob("rank*of*"):
        if sub.is_dir():
            found += [p for p in sub.iterdir() if p.is_file()]
    return found


def checkpoint_in_the_way(dirs: Sequence[Path], *, resume: bool) -> str | None:
    """Why a checkpointing run over ``dirs`` cannot start, as one line naming the flag
    that gets past it; None when nothing is in the way.

    In the way: a checkpoint whose store is open in a live process (named by its pid,
    with or without ``resume``), or, without ``resume``, the snapshots of an earlier run.
    Lock files alone (a run that ended, its store removed) are not in the way.
    """
    for d in dirs:
        checkpoint = d / CHECKPOINT_DIR
        if not checkpoint.is_dir():
            continue
        try:
            files = _files(checkpoint)
        except OSError as exc:
            return f"--dir {d}: cannot list {checkpoint}: {exc.strerror}"
        for lock in (p for p in files if p.suffix == ".lock"):
            pid = lock_holder(lock)
            if pid is not None:
                who = f"process {pid}" if pid else "another process"
                return (
                    f"--dir {d}: its checkpoint {checkpoint} is in use by {who} (a "
                    "swapper-pressure run still going?): wait for it to end, or give "
                    "another --dir"
                )
        if not resume and any(p.suffix != ".lock" for p in files):
            return (
                f"--dir {d} holds the snapshots of an earlier run in {checkpoint}: add "
                "--resume to continue from them, give another --dir, or delete them "
                f"(rm -r {shlex.quote(str(checkpoint))}) to start afresh"
            )
    return None
