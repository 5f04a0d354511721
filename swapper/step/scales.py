"""The int8 moments' block scales of one optimizer, as one manager entry held in memory.

Job: :class:`HeldScales`. With ``StepConfig.moments="int8"`` every sub-group's state
tensor holds its fp32 master weights and its 8-bit codes only (6 B per element); the fp32
scale of each block of 1024 elements, per moment, lies in one small tensor for all
sub-groups (:attr:`~swapper.step.layout.SubGroup.scales_offset`), registered as
``<name>/scales`` (kind ``optim_state``: the tier the state computes in) and fetched for
the optimizer's life, like the sub-groups kept in memory (``host_fraction``). A step
reads and updates it in place and never moves it: 8 B per 1024 elements of memory
(0.8 MB per 100M parameters, in whole 4 KiB host blocks) instead of 0.008 B per
parameter of NVMe traffic each way. A snapshot releases it (``kept_released``), so it
is written, checksummed and verified at resume like any other entry.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swapper.manager import Kind, TierManager
from swapper.step.compress import MomentCodec
from swapper.step.layout import STORED_ALIGN_NBYTES, SubGroup, round_up, scales_numel

__all__ = ["HeldScales"]


class HeldScales:
    """The block scales entry of one pipeline, and whether it is registered and held.

    Args:
        manager: where it lives.
        codec: the pipeline's codec: bound to the held tensor while it is held.
        sub_groups: the pipeline's plan (no entry unless int8 moments).
        name: the pipeline's key prefix; the key is ``<name>/scales``.
    """

    def __init__(
        self, manager: TierManager, codec: MomentCodec, sub_groups: Sequence[SubGroup], name: str
    ) -> None:
        self.manager = manager
        self.codec = codec
        self.key = f"{name}/scales"
        self.numel = scales_numel(sub_groups)  #: fp32 elements (0: no entry)
        self.registered = False
        self.held = False

    @property
    def nbytes(self) -> int:
        """Bytes of the entry (0 unless int8 moments)."""
        return 4 * self.numel

    @property
    def charge(self) -> int:
        """Bytes it takes of a memory budget: a host block is a whole number of 4 KiB."""
        return round_up(self.nbytes, STORED_ALIGN_NBYTES)

    def fresh(self) -> torch.Tensor | None:
        """A zeroed local tensor for them, bound to the codec (None without int8)."""
        scales = torch.zeros(self.numel, dtype=torch.float32) if self.numel else None
        self.codec.bind_scales(scales)
        return scales

    def register(self, scales: torch.Tensor | None) -> None:
        """Register ``scales`` (from :meth:`fresh`, filled by encoding) as the entry and
        unbind them from the codec (:meth:`hold` binds the manager's).

        Raises:
            what :meth:`TierManager.register` raises.
        """
        self.codec.bind_scales(None)
        if scales is not None:
            self.manager.register(self.key, scales, Kind.OPTIM_STATE)
            self.registered = True

    def hold(self) -> None:
        """Fetch the entry (registered) and bind it to the codec until :meth:`release`;
        nothing without int8 moments or when held already.

        Raises:
            what :meth:`TierManager.fetch` raises.
        """
        if not self.numel or self.held:
            return
        self.codec.bind_scales(self.manager.fetch(self.key))
        self.held = True

    def release(self, *, modified: bool) -> None:
        """Undo :meth:`hold` (``modified``: a step changed them in place)."""
        if not self.held:
            return
        self.codec.bind_scales(None)
        self.manager.release(self.key, modified=modified)
        self.held = False

    def unregister(self) -> None:
        """Release (as modified) and unregister the entry (its NVMe copy is deleted)."""
        self.release(modified=True)
        if self.registered:
            self.manager.unregister(self.key)
            self.registered = False
