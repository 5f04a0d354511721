"""The seam between the tier manager and the tiers, as types.

:mod:`swapper.manager` drives memory tiers (:class:`~tiers.host.HostTier`,
:class:`~tiers.device.DeviceTier`), their blocks and one NVMe store
(:class:`~tiers.nvme.NvmeStore`) only through these protocols, so a reader of the manager
knows which method runs and what it promises without opening the tier it is given. The
same name means the same thing everywhere:

* ``release`` gives memory back to its tier and its bytes to the tier's budget; it is
  idempotent, and ``after`` is an event (from :meth:`tiers.device.DeviceTier.mark_ready`) that must
  pass before the memory may be handed out again.
* ``view`` reinterprets a block's bytes (no copy); ``tensor`` is the raw ``uint8`` bytes.
* ``try_alloc`` never waits; ``charge`` is what the budget counts for a size.
* ``write`` and ``read`` on a store return a future that completes when the bytes are
  durable (write) or have landed in the caller's buffer (read); until then the buffer
  belongs to the I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future
from typing import Protocol

import torch

from tiers.budget import ByteBudget

__all__ = ["MemoryBlock", "MemoryTier", "Store"]


class MemoryBlock(Protocol):
    """Bytes held from a memory tier until :meth:`release`. Sizes in bytes."""

    nbytes: int
    charged_nbytes: int

    @property
    def tensor(self) -> torch.Tensor:
        """The block as ``torch.uint8``, exactly ``nbytes`` long (RuntimeError once released)."""
        ...

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The bytes as a ``dtype`` tensor of ``shape``, sharing the memory."""
        ...

    def release(self, after: torch.cuda.Event | None = None) -> None:
        """Give the memory back (idempotent); reused only once ``after`` has passed."""
        ...


class MemoryTier(Protocol):
    """Device or host memory under a byte budget."""

    @property
    def budget(self) -> ByteBudget: ...

    def charge(self, nbytes: int) -> int:
        """What the budget counts for a block of ``nbytes`` (alignment included)."""
        ...

    def try_alloc(self, nbytes: int, *, what: str) -> MemoryBlock | None:
        """A block now, or None when the budget has no room (never waits).

        Raises:
            BudgetExceededError: ``nbytes`` can never fit the budget.
        """
        ...

    def close(self) -> None: ...


class Store(Protocol):
    """Tensors by key in files (the NVMe tier)."""

    def __contains__(self, key: object) -> bool: ...

    def __iter__(self) -> Iterator[str]: ...

    def write(self, key: str, tensor: torch.Tensor) -> Future[int]:
        """Write ``tensor`` under ``key``; ``tensor`` must not change until the future ends."""
        ...

    def read(self, key: str, out: torch.Tensor) -> Future[int]:
        """Read ``key`` into ``out`` (verified when the store checks reads)."""
        ...

    def delete(self, key: str) -> None: ...

    def save_manifest(self) -> None: ...

    def close(self, *, remove: bool = False) -> None: ...
