"""What every tier's memory block has in common: the bytes as a tensor, typed views of them."""

from __future__ import annotations

import torch

__all__ = ["TierBlock"]


class TierBlock:
    """``nbytes`` bytes held from a tier until ``release()``; subclasses free the memory.

    Attributes:
        nbytes: the size, in bytes.
        charged_nbytes: what the tier's budget counts for it.
    """

    #: Said when a released block is used; subclasses may say more.
    _released_message = "memory block was released"
    _tensor: torch.Tensor | None
    nbytes: int
    charged_nbytes: int

    @property
    def tensor(self) -> torch.Tensor:
        """The block as ``torch.uint8``, exactly ``nbytes`` long.

        Raises:
            RuntimeError: the block was released.
        """
        tensor = self._tensor
        if tensor is None:
            raise RuntimeError(self._released_message)
        return tensor

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The block's bytes as a ``dtype`` tensor of ``shape`` (shares the memory).

        Raises:
            RuntimeError: the block was released, or ``dtype``/``shape`` do not make
                exactly ``nbytes`` bytes.
        """
        return self.tensor.view(dtype).view(shape)

    @property
    def released(self) -> bool:
        return self._tensor is None
