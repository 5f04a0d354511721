"""``final_digest``: one hash over a run's 16-bit parameters and optimizer state, to
compare two runs cheaply (the same state gives the same digest at every world size and
sub-group size)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch
import xxhash

from swapper.step.optimizer import StreamedOptimizer
from swapper.step.resume import optimizer_meta
from swapper.zero.sharded.model import ShardedModel
from swapper.zero.sharded.state_dicts import iter_full_state

if TYPE_CHECKING:
    from swapper.zero.local.offload import OffloadedModel

__all__ = ["final_digest"]


def final_digest(
    model: OffloadedModel | ShardedModel, optimizer: StreamedOptimizer | None = None
) -> str:
    """A hash over the 16-bit parameters and the optimizer's state, to compare two runs.

    In a fixed order: each parameter by name (sorted), its name, shape, dtype and bytes;
    then the optimizer's step count, loss scaler state and param group settings, and its
    fp32 master weights, exp_avg and exp_avg_sq, each over all parameters in their flat
    order (one streaming hash per row, so the sub-group size does not change it). Reads
    one parameter or sub-group at a time. Returns ``"xxh3-128:<32 hex digits>"``.

    With several ranks (call it on every rank alike; every rank gets the digest), each
    parameter and its optimizer state are gathered whole, one parameter at a time, and
    hashed in the same order: the digest of the same state is the same at every world
    size (:func:`~swapper.zero.sharded.state_dicts.iter_full_state`).
    """
    per_param: dict[str, int] = {}
    for name, tensor in model.iter_state_dict():
        h = xxhash.xxh3_64()
        h.update(f"{name}|{list(tensor.shape)}|{tensor.dtype}|".encode())
        h.update(_bytes(tensor))
        per_param[name] = h.intdigest()
    total = xxhash.xxh3_128()
    for name in sorted(per_param):
        total.update(b"%s=%016x;" % (name.encode(), per_param[name]))
    if optimizer is not None:
        optimizer.wait_pending()
        meta = optimizer_meta(optimizer)
        counters = {k: meta[k] for k in ("step", "groups", "loss_scaler")}
        total.update(json.dumps(counters, sort_keys=True).encode())
        view = optimizer.stored_state
        if meta.get("rule_state") is not None:  # (a rule's scalars, e.g. each piece's step)
            total.update(json.dumps(meta["rule_state"], sort_keys=True).encode())
        rows = [xxhash.xxh3_64() for _ in view.rows]  # (AdamW: master, exp_avg, exp_avg_sq)
        if view.parameter_rows:  # per-parameter state: each sub-group's state whole
            if isinstance(model, ShardedModel):
                view.require_flat_rows("final_digest over ranks")
            rows = [xxhash.xxh3_64()]
            for _, state in view.iter_states():
                rows[0].update(_bytes(state))
        elif isinstance(model, ShardedModel):  # several ranks: gathered whole
            for state in iter_full_state(model, optimizer):
                for row, h in enumerate(rows):
                    h.update(_bytes(state[row]))
        else:
            for sg, state in view.iter_states():
                for row, h in enumerate(rows):
                    h.update(_bytes(state[row, : sg.numel]))
        for h in rows:
            total.update(b"%016x;" % h.intdigest())
    return f"xxh3-128:{total.hexdigest()}"


def _bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes, a view of its own memory where it is a contiguous
    CPU tensor (no copy: a sub-group's row is 64 MB at 16 M elements), else over a copy."""
    flat = tensor.detach().reshape(-1).contiguous().cpu()
    return flat.view(torch.uint8).numpy().data
