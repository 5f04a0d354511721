"""One process: :class:`~swapper.zero.local.offload.OffloadedModel`, the local fetch.

Offers: the model (``offload``), its hooks and the fetch and release of one parameter
(``offload_hooks``), the parameters' records and the optimizer's view (``params``), the
persistent and resident fast paths for budgets that hold everything (``persist``,
``resident``), the wrap's checks and undo (``placing``) and the real weights through
``state_dict`` (``weights``).

May import: ``tiers``, :mod:`swapper.manager`, :mod:`swapper.step`,
:mod:`swapper.zero.model`, :mod:`swapper.zero.config`; :mod:`swapper.zero.checkpoint` only
where a snapshot is taken or resumed (issue 25 removes the remaining late imports).
"""
