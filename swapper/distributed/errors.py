"""Typed errors of the multi-rank layer (:mod:`swapper.distributed`).

Every one names the collective or file at fault, the module or parameter it concerns and
the rank that raised it, and says what to do. A :class:`CollectiveError` means the
process group's state is unknown (a collective may still be pending on some rank): the
run cannot go on with that group; destroy it and restart from the last checkpoint.
"""

from __future__ import annotations

from tiers.errors import SwapConfigError, SwapError

__all__ = [
    "CollectiveError",
    "ModelMismatchError",
    "PeerFailedError",
    "StoreIdentityError",
    "StoreLayoutError",
]


class CollectiveError(SwapError, RuntimeError):
    """A collective failed or did not finish within the group's timeout on this rank.

    Attributes:
        collective: the operation (``"all_gather"``, ``"reduce_scatter"``, ...).
        what: the module or parameter it was for.
        rank: this rank.
        world_size: the group's size.
        timed_out: True when the monitored wait gave up (a peer stalled or died silently),
            False when the backend reported an error (e.g. a peer's connection closed).
    """

    def __init__(
        self,
        message: str,
        *,
        collective: str,
        what: str,
        rank: int,
        world_size: int,
        timed_out: bool,
    ) -> None:
        super().__init__(message)
        self.collective = collective
        self.what = what
        self.rank = rank
        self.world_size = world_size
        self.timed_out = timed_out


class PeerFailedError(CollectiveError):
    """Another rank reported a local failure at an agreement point (:func:`agree`), so
    every rank raises this one instead of going on. ``failed_ranks`` lists them."""

    def __init__(
        self,
        message: str,
        *,
        collective: str,
        what: str,
        rank: int,
        world_size: int,
        failed_ranks: tuple[int, ...],
    ) -> None:
        super().__init__(
            message,
            collective=collective,
            what=what,
            rank=rank,
            world_size=world_size,
            timed_out=False,
        )
        self.failed_ranks = failed_ranks


class ModelMismatchError(SwapConfigError):
    """The ranks wrap different models: the (name, shape, dtype) lists differ.

    Raised on every rank. Attributes: ``index`` (position of the first differing
    parameter in forward order), ``name`` (its name on this rank, or None past the end),
    ``rank`` (this rank), ``other_rank`` (the first rank whose entry differs from rank 0's).
    """

    def __init__(
        self, message: str, *, index: int, name: str | None, rank: int, other_rank: int
    ) -> None:
        super().__init__(message)
        self.index = index
        self.name = name
        self.rank = rank
        self.other_rank = other_rank


class StoreIdentityError(SwapConfigError):
    """A rank's NVMe store was opened as another rank or under another world size.

    Attributes: ``path`` (the identity file or directory at fault), ``expected`` and
    ``found`` (``(rank, world_size)`` pairs; ``found`` is None when the files exist but
    carry no identity).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str,
        expected: tuple[int, int],
        found: tuple[int, int] | None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.expected = expected
        self.found = found


class StoreLayoutError(StoreIdentityError):
    """A store of one process and a store of several ranks, under one name in one NVMe
    directory: opening one while the other is open there, or left there on disk.

    One process keeps its files in ``<dir>/<store>.*``, rank r of N in
    ``<dir>/rank{r}of{N}/<store>.*``; neither would see the other's lock, so without this
    check two runs would share the directory (and its snapshots' names) unawares.

    Attributes (besides :class:`StoreIdentityError`'s, ``path`` being the file or
    directory found): ``directory`` (the configured NVMe directory), ``wanted`` and
    ``existing`` (the two layouts in words, e.g. ``"one process"``, ``"2 ranks"``).
    """

    def __init__(
        self,
        message: str,
        *,
        directory: str,
        path: str,
        wanted: str,
        existing: str,
        expected: tuple[int, int],
        found: tuple[int, int] | None,
    ) -> None:
        super().__init__(message, path=path, expected=expected, found=found)
        self.directory = directory
        self.wanted = wanted
        self.existing = existing
