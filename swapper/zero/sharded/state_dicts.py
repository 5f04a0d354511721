"""A sharded model's parameters as state dicts: consolidated (one full copy, on rank 0)
or sharded (each rank its own shards, for checkpoints).

- :func:`iter_full` / :func:`consolidated`: every parameter gathered one at a time (one
  collective each, on every rank alike), so no rank ever holds more of the model than one
  parameter beyond what it keeps; rank 0 keeps the copies.
- :func:`iter_full_state`: the optimizer's fp32 state of every parameter, whole, one
  parameter at a time (one all_gather each), in the optimizer's flat order: what
  ``final_digest`` hashes, so that it is the same at every world size;
- :func:`sharded` / :func:`load_sharded`: this rank's shards (1-D, padding included)
  with the partition plan's digest, rank and world size; loading checks all three and
  writes the shards back in place. Resharding (N → M) is not done here: it belongs to
  the checkpoint format (PyTorch Distributed Checkpoint, issue 13). The optimizer's
  state is per rank already: save and load ``OffloadAdamW.state_dict()`` beside it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from swapper.distributed import agree, module_layout
from swapper.distributed.groups import all_gather_single, start_collective, wait_work
from swapper.manager import Tier
from tiers import signals
from tiers.errors import SwapConfigError

if TYPE_CHECKING:
    from swapper.step.optimizer import StreamedOptimizer
    from swapper.zero.sharded.model import ShardedModel

__all__ = [
    "SHARDED_FORMAT",
    "consolidated",
    "iter_full",
    "iter_full_state",
    "load_sharded",
    "sharded",
]

#: Version of :func:`sharded`'s dict.
SHARDED_FORMAT = 1


def iter_full(model: ShardedModel) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full CPU copy) of every parameter, gathered one at a time.

    Raises:
        CollectiveError: a gather failed or timed out.
    """
    model.drain()
    for slot in model.slots:
        layout = module_layout(model.plan, [slot.index])
        pending = model.start_gather(layout, [slot], f"parameter {slot.name!r}")
        try:
            full = pending.wait()[slot.index].view(slot.shape).to("cpu", copy=True)
        finally:
            model.end_gather(pending)  # its device bytes go back before the next one
        yield slot.name, full


def iter_full_state(model: ShardedModel, optimizer: StreamedOptimizer) -> Iterator[torch.Tensor]:
    """Each parameter's whole fp32 state ``(3, numel)`` (master, exp_avg, exp_avg_sq;
    no padding), param group by param group, parameter by parameter as the optimizer
    lists them: the order of one process's flat state. Every rank gets every tensor
    (one all_gather each, of the largest rank's shard), and holds one sub-group's state
    and one parameter's at a time. Call it on every rank alike.

    Raises:
        CollectiveError: a gather failed or timed out.
    """
    group = model.group
    device = group.control_device
    view = optimizer.stored_state
    view.require_flat_rows("the optimizer state gathered whole")
    pieces: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for sg in view.sub_groups:
        for p in sg.pieces:
            where = (sg.group_index, p.param_index)
            pieces.setdefault(where, []).append((sg.index, p.param_offset, p.offset, p.numel))
    cached: tuple[int, torch.Tensor] | None = None
    rows = len(view.rows)
    for g, param_group in enumerate(optimizer.param_groups):
        for i, param in enumerate(param_group["params"]):
            slot = model.slot_of(param)
            if slot is None:  # the optimizer refuses such parameters when built
                continue
            placement = slot.placement
            width = max(placement.local_numel(r) for r in range(group.world_size))
            mine = torch.zeros(rows, width, dtype=torch.float32)
            for index, param_offset, offset, numel in pieces.get((g, i), []):
                if cached is None or cached[0] != index:
                    cached = (index, view.read(index))
                mine[:, param_offset : param_offset + numel] = cached[1][:, offset : offset + numel]
            out = torch.empty(group.world_size * rows * width, dtype=torch.float32, device=device)
            what = f"the optimizer state of {slot.name!r}"
            send = mine.reshape(-1).to(device)
            work = start_collective(
                group, "all_gather", what,
                lambda out=out, send=send: all_gather_single(
                    out, send, group=group.group, async_op=True
                ),
            )  # fmt: skip
            wait_work(group, work, "all_gather", what)
            gathered = out.cpu().view(group.world_size, rows, width)
            full = torch.empty(rows, placement.numel, dtype=torch.float32)
            for r in range(group.world_size):
                start, end = placement.real_range(r)
                full[:, start:end] = gathered[r, :, : end - start]
            yield full


def consolidated(model: ShardedModel) -> dict[str, Any]:
    """The full state dict on rank 0 (tied parameters under every name, buffers as they
    are), ``{}`` on the others.

    Raises:
        CollectiveError: a gather failed or timed out.
    """
    keep = model.group.rank == 0
    params: dict[str, torch.Tensor] = {}
    for name, tensor in iter_full(model):
        if keep:
            params[name] = tensor
    if not keep:
        return {}
    out: dict[str, Any] = {}
    for name, value in model.module.state_dict(keep_vars=True).items():
        out[name] = params.get(name, value.detach() if isinstance(value, torch.Tensor) else value)
    for name, param in model.module.named_parameters(remove_duplicate=False):
        slot = model.slot_of(param)
        if slot is not None:
            out[name] = params[slot.name]
    return out


def sharded(model: ShardedModel) -> dict[str, Any]:
    """This rank's shards: ``{"format", "rank", "world_size", "plan", "params": {name:
    1-D CPU copy}}`` (parameters this rank stores nothing of are left out). Local: no
    collective."""
    model.drain()
    params: dict[str, torch.Tensor] = {}
    manager = model.manager
    for slot in model.slots:
        if not slot.local_numel:
            continue
        with signals.at_waits:
            tensor = manager.fetch(slot.key, Tier.HOST)
            try:
                params[slot.name] = tensor.view(-1).to("cpu", copy=True)
            finally:
                manager.release(slot.key, modified=False)
    return {
        "format": SHARDED_FORMAT,
        "rank": model.group.rank,
        "world_size": model.group.world_size,
        "plan": model.plan.digest(),
        "params": params,
    }


def load_sharded(model: ShardedModel, state: Mapping[str, Any]) -> None:
    """Write what :func:`sharded` returned back into this rank's shards; every rank
    checks, then all agree before anything is written, so the ranks load all or none.

    Raises:
        SwapConfigError: it is not such a dict, or of another rank, world size or
            partition (another model or alignment), or a shard is missing or of the wrong
            size or dtype (named); PeerFailedError: another rank's check failed.
        CollectiveError: the agreement failed or timed out.
    """
    error: SwapConfigError | None = None
    try:
        shards = _checked(model, state)
    except SwapConfigError as exc:
        error, shards = exc, {}
    try:
        agree(model.group, error is None, "loading a sharded state dict")
    except BaseException:
        if error is not None:
            raise error from None
        raise
    manager = model.manager
    for slot in model.slots:
        if not slot.local_numel:
            continue
        model.before_param_write(slot)
        with signals.at_waits:
            tensor = manager.fetch(slot.key, Tier.HOST)
            try:
                tensor.view(-1).copy_(shards[slot.name])
            finally:
                manager.release(slot.key, modified=True)


def _checked(model: ShardedModel, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    if not isinstance(state, Mapping) or state.get("format") != SHARDED_FORMAT:
        raise SwapConfigError(
            "load_sharded_state_dict: not a sharded state dict of this version (format "
            f"{SHARDED_FORMAT}); pass what sharded_state_dict() returned"
        )
    rank, world = model.group.rank, model.group.world_size
    if (state.get("rank"), state.get("world_size")) != (rank, world):
        raise SwapConfigError(
            f"load_sharded_state_dict: this state dict is rank {state.get('rank')} of "
            f"{state.get('world_size')}, this process rank {rank} of {world}: load each "
            "rank's own file (resharding is not supported here)"
        )
    if state.get("plan") != model.plan.digest():
        raise SwapConfigError(
            "load_sharded_state_dict: the state dict was saved from another partition "
            "(another model, or other partition settings)"
        )
    params = state.get("params")
    if not isinstance(params, Mapping):
        raise SwapConfigError("load_sharded_state_dict: 'params' is missing")
    out: dict[str, torch.Tensor] = {}
    for slot in model.slots:
        if not slot.local_numel:
            continue
        t = params.get(slot.name)
        if (
            not isinstance(t, torch.Tensor)
            or t.shape != (slot.local_numel,)
            or t.dtype != slot.dtype
        ):
            got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else repr(t)
            raise SwapConfigError(
                f"load_sharded_state_dict: the shard of {slot.name!r} is {got}; need "
                f"({slot.local_numel},) {slot.dtype}"
            )
        out[slot.name] = t
    return out
