"""Every setting of the training integration, in one place.

Offers: the configuration tree :class:`~swapper.zero.config.offload.OffloadConfig`
(``offload``), the flat settings users write and their translation (``settings``), the
multi-rank section (``distributed``), and the DeepSpeed config reader (``deepspeed``,
``deepspeed_training``).

May import: ``tiers``, :mod:`swapper.manager` and :mod:`swapper.step` (their configs), and
nothing else of :mod:`swapper.zero`: every other room reads its settings from here.

``from swapper.zero.config import OffloadConfig`` (this room's name was the module's) works.
"""

from swapper.zero.config.offload import OffloadConfig

__all__ = ["OffloadConfig"]
