"""Agreements of the N-rank checkpoint code: one small collective that tells every rank
whether every other rank's local work succeeded, and why not.

Job: :func:`all_gather_json` (JSON values, two all_gathers: sizes, then the bytes, each
waited with the group's timeout), :func:`agree_or_raise` and :func:`raise_failed`, used by
the save (:mod:`swapper.zero.checkpoint.shard_snapshot`, above the models) and by the
resume (:mod:`swapper.zero.checkpoint.shard_resume`, below them): so this module imports
no model and neither half.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from swapper.distributed import DistGroup
from swapper.distributed.groups import (
    all_gather_single,
    peer_failed,
    start_collective,
    wait_work,
)

__all__ = ["agree_or_raise", "all_gather_json", "raise_failed"]


def all_gather_json(group: DistGroup, value: Any, what: str) -> list[Any]:
    """Every rank's ``value`` (JSON-able), by rank: two all_gathers (lengths, then the
    bytes padded to the longest), each waited on with the group's timeout.

    Raises:
        CollectiveError: a collective failed or timed out.
        TypeError, ValueError: ``value`` is not JSON-able (before any collective).
    """
    data = json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
    device = group.control_device
    sizes = torch.empty(group.world_size, dtype=torch.int64, device=device)
    _gather(group, sizes, torch.tensor([len(data)], dtype=torch.int64, device=device), what)
    longest = int(sizes.max().item())
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(group.world_size * longest, dtype=torch.uint8, device=device)
    _gather(group, out, mine.to(device), what)
    rows = out.cpu().view(group.world_size, longest)
    return [json.loads(rows[r, : int(sizes[r])].numpy().tobytes()) for r in range(len(rows))]


def _gather(group: DistGroup, out: torch.Tensor, mine: torch.Tensor, what: str) -> None:
    work = start_collective(
        group, "all_gather", what,
        lambda: all_gather_single(out, mine, group=group.group, async_op=True),
    )  # fmt: skip
    wait_work(group, work, "all_gather", what)


def agree_or_raise(group: DistGroup, error: BaseException | None, what: str) -> None:
    """Agreement point that carries the reasons: every rank says whether its local work
    failed and why (one :func:`all_gather_json`); see :func:`raise_failed`.

    Raises:
        PeerFailedError: another rank failed (the message quotes it).
        CollectiveError: the agreement itself failed or timed out.
        and ``error`` on the rank that passed it.
    """
    mine = None if error is None else f"{type(error).__name__}: {error}"
    raise_failed(group, error, all_gather_json(group, mine, what), what)


def raise_failed(
    group: DistGroup, error: BaseException | None, messages: list[str | None], what: str
) -> None:
    """Given every rank's failure message (None: it succeeded), raise if any failed: on
    the failing rank its own ``error``, on the others a PeerFailedError naming the
    failed ranks and quoting their messages."""
    failed = {r: m for r, m in enumerate(messages) if m is not None}
    if not failed:
        return
    if error is not None:
        raise error
    raise peer_failed(
        group,
        what,
        tuple(sorted(failed)),
        f"{what}: rank(s) {sorted(failed)} of {group.world_size} failed, so rank "
        f"{group.rank} stops too: "
        + "; ".join(f"rank {r}: {m}" for r, m in sorted(failed.items())),
    )
