"""One process: :class:`~swapper.zero.local.offload.OffloadedModel`, the local fetch.

Offers: the model (``offload``), the lifecycle's one-process strategy: the unit of the
shared hooks, one parameter (``offload_hooks``, a
:class:`~swapper.zero.model.lifecycle.ModelLifecycle`), the fetch and release of one
parameter (``fetch``: ``TierFetch``, the model's ``FetchStrategy``), an overlapped
optimizer's gate (``overlap``: ``LocalOverlap``, the model's ``UpdateOverlap``), the
parameters' records and the model's core (``params``: ``Slot``, ``LocalCore``), the
optimizer's view (``tiered``), the persistent and resident fast paths for budgets that hold
everything (``persist``, ``resident``), the wrap's checks and undo (``placing``) and the
real weights through ``state_dict`` (``weights``).

The helpers take the core (``LocalCore``) or a small protocol of public calls, never the
model: the room's modules import each other one way (``params`` at the bottom, ``offload``
at the top; ``tests/test_structure.py`` counts it).

May import: ``tiers``, :mod:`swapper.manager`, :mod:`swapper.step`,
:mod:`swapper.zero.model`, :mod:`swapper.zero.config`, and the resume half of
:mod:`swapper.zero.checkpoint` (``resume``, below the models).
"""
