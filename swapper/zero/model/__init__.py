"""The pieces of the hook lifecycle that the one-process and the N-rank model share.

Offers: autograd plumbing (``autograd``: re-fetch before a module's backward, "inside a
backward?"), saved views of managed parameters (``saved``), what an activation-checkpointing
recompute holds (``recompute``), the read-ahead plan along the recorded order
(``readahead``), the model's buffers on the use device (``model_buffers``), the guard of
``model.to(...)`` while wrapped (``module_apply``), and frozen parameters: an all-frozen
module's release when its backward is over, the trainable set fixed at wrap time
(``frozen``).

May import: ``tiers``, :mod:`swapper.manager`, :mod:`swapper.step` (its public seams), and
nothing else of :mod:`swapper.zero`: both models build on this room, never the reverse.
"""
