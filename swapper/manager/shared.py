"""Small pure helpers shared by the manager's parts (:mod:`swapper.manager.context`,
``core``, ``mover``, ``jobs``, ``placement``, ``snapshot``): key and enum checks, the
store's key of an entry, a request's share of a window, I/O errors named by key, and the
cached tensor view of an entry's block."""

from __future__ import annotations

import errno
from concurrent.futures import Future

import torch

from swapper.manager.config import Kind, Tier
from swapper.manager.entry import SwapEntry
from tiers.budget import ByteBudget
from tiers.errors import IOTimeoutError, SwapIOError
from tiers.nvme.futures import StoreFuture

__all__ = [
    "BehindFuture",
    "charged",
    "check_key",
    "entry_view",
    "forget_view",
    "in_flight",
    "named_error",
    "release_when_written",
    "store_key_of",
    "to_kind",
    "to_tier",
    "window_share",
]


def check_key(key: object) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"key must be a non-empty str, got {key!r}")


def to_kind(kind: Kind | str) -> Kind:
    if type(kind) is Kind:
        return kind  # (Kind(kind) costs an enum lookup per registration)
    try:
        return Kind(kind)
    except ValueError:
        names = ", ".join(k.value for k in Kind)
        raise ValueError(f"kind={kind!r} is not one of: {names}") from None


def to_tier(tier: Tier | str) -> Tier:
    try:
        return Tier(tier)
    except ValueError:
        names = ", ".join(t.value for t in Tier)
        raise ValueError(f"tier={tier!r} is not one of: {names}") from None


def charged(entry: SwapEntry) -> int:
    """Bytes evicting ``entry`` frees in its tier (0 when it holds no memory)."""
    return 0 if entry.block is None else entry.block.charged_nbytes


def in_flight(entry: SwapEntry) -> str:
    """Where ``entry``'s latest read or write stands, for a message that gives up on it:
    the piece still in flight (file, offset, length), the flush it waits for, or done."""
    io = entry.io
    if io is None or io.done():
        return "no request in flight"
    if not isinstance(io, StoreFuture):  # (a stand-in store's future: nothing to name)
        return "a request in flight"
    piece = io.stuck()
    if piece is None:
        return f"its {io.op.value} waits for the flush that makes it durable"
    return f"stuck: the {piece.describe()}"


def store_key_of(entry: SwapEntry) -> str:
    """The store's key: the kind rides along so that a reopened store knows it."""
    return f"{entry.kind.value}/{entry.key}"


def window_share(budget: ByteBudget, nbytes: int) -> int:
    """What one request takes of a window: its size, or the whole window if larger (a
    tensor larger than the window then goes alone rather than never)."""
    limit = budget.limit_nbytes
    return nbytes if limit is None else min(nbytes, limit)


def named_error(error: BaseException, doing: str, key: str) -> BaseException:
    """An I/O error re-raised with the manager's key in its message; the file stays.
    A timeout (:class:`~tiers.errors.IOTimeoutError`, an OSError too) names it already."""
    if not isinstance(error, OSError) or isinstance(error, IOTimeoutError):
        return error
    cls = type(error) if isinstance(error, SwapIOError) else SwapIOError
    code = error.errno if error.errno is not None else errno.EIO
    named = cls(code, f"{doing} key={key!r} failed: {error.strerror or error}", error.filename)
    named.__cause__ = error
    return named


def entry_view(entry: SwapEntry) -> torch.Tensor:
    """The tensor of an entry that is in memory (lock held): one view per block, made at
    its first fetch and handed to every fetch after (two ``Tensor.view`` calls, ~3 µs,
    were a tenth of a resident fetch's cost). Callers must not change its metadata
    (``resize_``, ``set_``, in-place ``unsqueeze_``): it is shared."""
    block = entry.block
    if block is None:
        raise RuntimeError(f"key={entry.key!r} is {entry.state.value} without memory")
    view = entry.view
    if view is None or entry.view_block is not block:
        view = block.view(entry.dtype, entry.shape)
        entry.view, entry.view_block = view, block
    return view


def forget_view(entry: SwapEntry) -> None:
    """Drop the cached view of a block that is being released (lock held): a view keeps
    the block's memory alive (on CUDA the allocator could not reuse it)."""
    entry.view = entry.view_block = None


class BehindFuture(Future[None]):
    """What :meth:`TierManager.register_behind` returns: done once the key is settled (in
    memory, or durable on NVMe), with the write's named error if it failed.

    :attr:`released` is done (with None) once nothing reads the caller's tensor any more:
    at once when the manager took a copy into memory; when every piece of the write has
    ended when it was written, which is before the flush that makes it durable (the
    future itself waits for that flush). A failed flush fails the future and drops the
    key; it never reads the tensor again. So a caller that streams state through a few
    buffers may refill one from :attr:`released` on while its durability is still made.
    """

    def __init__(self) -> None:
        super().__init__()
        self.released: Future[None] = Future()

    def release(self) -> None:
        """Mark the caller's tensor as no longer read (idempotent)."""
        if not self.released.done():
            self.released.set_result(None)


def release_when_written(io: Future[int], behind: BehindFuture) -> None:
    """Release ``behind``'s tensor when the write ``io`` no longer reads it: a store
    write's :attr:`~tiers.nvme.futures.StoreFuture.released`, else (a future without
    parts, e.g. a test's stand-in store) its completion."""
    ended = io.released if isinstance(io, StoreFuture) else io
    ended.add_done_callback(lambda _done: behind.release())
