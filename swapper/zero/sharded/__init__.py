"""N > 1 ranks: :class:`~swapper.zero.sharded.model.ShardedModel`, ZeRO-3 over a process group.

Offers: the model (``model``: the lifecycle's N-rank strategy and the unit of its shared
hooks, one module gathered, a :class:`~swapper.zero.model.lifecycle.ModelLifecycle`), a
gather's life (``gathers``:
``Gathers``, the model's ``FetchStrategy``), the gathered buffers charged to the device
budget (``gather_budget``), reduce-scatter into retained gradient shards (``grads``),
wrapping (``setup``: check, plan, open the rank's store, place), the records, the
optimizer's view and ``ShardedDoors``, what the helpers ask of the model (``state``), writes
outside the hooks (``writes``), state dicts (``state_dicts``) and the overlapped optimizer
over ranks (``overlap``: ``ShardOverlap``, the model's ``UpdateOverlap``).

May import: ``tiers``, :mod:`swapper.manager`, :mod:`swapper.step`,
:mod:`swapper.distributed`, :mod:`swapper.zero.model`, :mod:`swapper.zero.config`, the
pieces of :mod:`swapper.zero.local` it shares (``params``: ``copy_in``/``copy_out``,
``add_into``; ``weights``: the write guard), and the resume half of
:mod:`swapper.zero.checkpoint` (``resume``, ``shard_resume``: below the models).

``from swapper.zero.sharded import ShardedModel`` (this room's name was the module's) works.
"""

from swapper.zero.sharded.model import ShardedModel

__all__ = ["ShardedModel"]
