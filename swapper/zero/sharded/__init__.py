"""N > 1 ranks: :class:`~swapper.zero.sharded.model.ShardedModel`, ZeRO-3 over a process group.

Offers: the model and its hooks (``model``), a gather's life (``gathers``), the gathered
buffers charged to the device budget (``gather_budget``), reduce-scatter into retained
gradient shards (``grads``), wrapping (``setup``: check, plan, open the rank's store, place),
the records and the optimizer's view (``state``), writes outside the hooks (``writes``),
state dicts (``state_dicts``) and the overlapped optimizer over ranks (``overlap``).

May import: ``tiers``, :mod:`swapper.manager`, :mod:`swapper.step`,
:mod:`swapper.distributed`, :mod:`swapper.zero.model`, :mod:`swapper.zero.config`, the
records of :mod:`swapper.zero.local` it shares (``params``, ``weights``: issue 25 moves
them into the shared core), and :mod:`swapper.zero.checkpoint` only to resume or snapshot.

``from swapper.zero.sharded import ShardedModel`` (this room's name was the module's) works.
"""

from swapper.zero.sharded.model import ShardedModel

__all__ = ["ShardedModel"]
