"""The hook lifecycle that the one-process and the N-rank model share, and its pieces.

Offers: the lifecycle itself (``lifecycle``: ``ModelLifecycle``, with the module hooks
written once; its two subclasses are the models' strategies and units), the interfaces
it asks of them (``strategy``: ``FetchStrategy``, ``StateLayout``, ``UpdateOverlap``,
``HoldUnit``, ``StateDictCall``), the core object its helpers take instead of the model
(``core``: ``ModelCore``, ``Holds``), autograd plumbing (``autograd``: re-fetch before a
module's backward, "inside a backward?"), saved views of managed parameters (``saved``),
what an activation-checkpointing recompute holds (``recompute``), the read-ahead plan
along the recorded order (``readahead``), the model's buffers on the use device
(``model_buffers``), the guard of ``model.to(...)`` while wrapped (``module_apply``),
and frozen parameters: an all-frozen module's release when its backward is over, the
trainable set fixed at wrap time (``frozen``).

May import: ``tiers``, :mod:`swapper.manager`, :mod:`swapper.step` (its public seams),
:mod:`swapper.zero.config`, and of :mod:`swapper.zero.checkpoint` only the resume half
(``resume``, below the models: ``keeps_store`` at close); nothing of the models: both
build on this room, never the reverse.
"""
