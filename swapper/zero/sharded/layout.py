"""The N-rank :class:`~swapper.zero.model.lifecycle.StateLayout`: each parameter flat and cut
into padded shards, this rank's in its tiers (a
:class:`~swapper.zero.sharded.state.ShardSlot` each), its retained 16-bit gradient a shard
beside it (reduce-scattered, :mod:`swapper.zero.sharded.grads`); a full tensor exists only
gathered, one at a time.

What the lifecycle asks of it (``model.layout``): every record, the drop of retained
gradient shards, the full weights gathered one at a time (``iter_state_dict``, a collective
each) and the consolidated ``state_dict`` (rank 0). The one-process layout is
:class:`~swapper.zero.local.layout.WholeTensors`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from swapper.zero.model.strategy import StateDictCall
from swapper.zero.sharded.state import ShardedDoors, ShardedParams, ShardSlot
from swapper.zero.sharded.state_dicts import consolidated, iter_full

if TYPE_CHECKING:
    from swapper.zero.sharded.grads import GradReducer
    from swapper.zero.sharded.overlap import ShardOverlap
    from swapper.zero.sharded.writes import WriteGuard

__all__ = ["Shards"]


class Shards:
    """This rank's shards (module docstring). Handed over by the model: its public calls
    (``model``: what gathers a parameter), every record in plan order, the gradient
    reducer, the overlapped optimizer's agreements and the write guard."""

    def __init__(
        self,
        model: ShardedDoors,
        by_index: list[ShardSlot],
        grads: GradReducer,
        overlap: ShardOverlap,
        writes: WriteGuard,
    ) -> None:
        self._model = model
        self._by_index = by_index
        self._grads = grads
        self._overlap = overlap
        self._writes = writes

    def param_source(self) -> ShardedParams:
        """This rank's shards and their retained gradients, for the optimizer."""
        return ShardedParams(self._model)

    def records(self) -> Iterable[ShardSlot]:
        """Every parameter's record, in plan (forward) order."""
        return self._by_index

    def drop_grads(self, slots: Iterable[ShardSlot], *, keep: bool | None = None) -> None:
        """Unregister the retained gradient shards of ``slots`` (``keep``: the one-process
        layout's; a shard's entry is always unregistered)."""
        self._grads.drop(slots)

    def iter_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full CPU copy) of every parameter, gathered one at a time (a collective
        each: every rank alike). Raises CollectiveError (a gather failed or timed out),
        OffloadedWriteError or PeerFailedError (:mod:`swapper.zero.sharded.writes`)."""
        self._overlap.settle("iter_state_dict")
        self._writes.check("iter_state_dict")
        return iter_full(self._model)

    def state_dict(self, call: StateDictCall) -> dict[str, Any]:
        """The consolidated state dict on rank 0 (parameters gathered one at a time; tied
        parameters under every name; buffers as they are); ``{}`` on the other ranks.
        Every rank alike. Raises TypeError for any argument (``call.as_submodule`` is
        not used: a sharded model is not saved as a submodule), else as
        :meth:`iter_state_dict`."""
        if call.args or call.kwargs:
            raise TypeError("state_dict() of a sharded model takes no arguments")
        self._overlap.settle("state_dict")
        self._writes.check("state_dict")
        return consolidated(self._model)
