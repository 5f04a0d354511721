"""``swapper-pressure --export DIR``: the final training state in its portable forms.

One layout at every ``--nproc``::

    DIR/model.safetensors (or model-0000k-of-0000n.safetensors) + model.safetensors.index.json
                          the 16-bit weights (swapper.zero.export_safetensors)
    DIR/dcp/.metadata, DIR/dcp/__<rank>_0.distcp
                          weights and fp32 optimizer state as a PyTorch Distributed
                          Checkpoint (swapper.zero.checkpoint.dcp_export.export_dcp; one file per
                          rank that wrote it), loadable at any world size

With several ranks every rank calls :func:`export_final` alike (both exports are
collective: DCP's save over the model's group, the safetensors gathers a parameter at a
time with rank 0 writing).

This module imports no torch at import time: the command line checks the directory with
:func:`existing_export` before torch loads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiers.units import format_size

if TYPE_CHECKING:
    from swapper.step import StreamedOptimizer
    from swapper.zero.local.offload import OffloadedModel
    from swapper.zero.sharded.model import ShardedModel

__all__ = ["DCP_SUBDIR", "INDEX_NAME", "existing_export", "export_final", "export_json"]

#: Where in ``--export DIR`` the Distributed Checkpoint goes.
DCP_SUBDIR = "dcp"
#: The safetensors index (swapper.zero.checkpoint.export.INDEX_NAME; not imported: no torch here).
INDEX_NAME = "model.safetensors.index.json"


def existing_export(directory: Path) -> Path | None:
    """The file that shows an export is already in ``directory`` (the safetensors index
    or the DCP metadata), or None: an export refuses to write over one."""
    for path in (directory / INDEX_NAME, directory / DCP_SUBDIR / ".metadata"):
        if path.exists():
            return path
    return None


class _Progress:
    """``progress(done, total)`` for an export: says each quarter reached, once."""

    def __init__(self, what: str, say: Callable[[str], None]) -> None:
        self._what, self._say, self._next = what, say, 1

    def __call__(self, done: int, total: int) -> None:
        while self._next <= 4 and done * 4 >= total * self._next:
            self._say(
                f"  export: {self._what} {25 * self._next}% ({format_size(done)} of "
                f"{format_size(total)})"
            )
            self._next += 1


def export_final(
    model: OffloadedModel | ShardedModel,
    optimizer: StreamedOptimizer,
    directory: Path,
    say: Callable[[str], None] | None = None,
) -> float:
    """Write the model's 16-bit weights as safetensors and its weights and optimizer
    state as a Distributed Checkpoint in ``directory`` (module docstring); on every rank
    alike with a sharded model. Returns the seconds both took (this rank's). ``say``
    receives a progress line at each quarter of each export (rank 0's bytes for the
    safetensors, this rank's for the DCP).

    Raises:
        SwapConfigError: ``directory`` holds an export already (on every rank).
        SwapIOError: a file could not be written (named).
        and what :func:`~swapper.zero.checkpoint.export.export_safetensors` and
        :func:`~swapper.zero.checkpoint.dcp_export.export_dcp` raise (collective failures
        among them).
    """
    from swapper.zero.checkpoint.dcp_export import export_dcp
    from swapper.zero.checkpoint.export import export_safetensors

    start = time.perf_counter()
    weights = _Progress("safetensors", say) if say is not None else None
    export_safetensors(model, directory, progress=weights)
    state = _Progress("DCP", say) if say is not None else None
    export_dcp(model, directory / DCP_SUBDIR, optimizer, progress=state)
    return time.perf_counter() - start


def export_json(directory: Path | None, seconds: float | None) -> dict[str, Any]:
    """The ``--json`` keys of an export (``None`` values when there was none)."""
    return {
        "export_seconds": seconds,
        "export": None
        if directory is None
        else {
            "dir": str(directory),
            "safetensors_index": str(directory / INDEX_NAME),
            "dcp": str(directory / DCP_SUBDIR),
        },
    }
