"""The training state in PyTorch Distributed Checkpoint format, one tensor at a time.

Job: :func:`export_dcp`, the portable form of an offloaded model and its
:class:`~swapper.step.OffloadAdamW` that ``torch.distributed.checkpoint.load`` reads
into ordinary tensors, per parameter (no sub-groups, no swapper needed):

* ``model.<name>``: the 16-bit parameter (bf16/fp16, its shape);
* ``optim.<row>.<name>`` for row in ``master``, ``exp_avg``, ``exp_avg_sq``: the
  parameter's fp32 state, its shape, gathered from the sub-groups it spans;
* ``optim.step`` (int) and ``optim.param_groups`` (the hyper-parameters, as the
  optimizer's ``state_dict`` has them), stored as pickled bytes.

Streamed: DCP plans from placeholder tensors of the right shape and dtype (one element
of storage each, expanded), and each tensor is fetched from the tiers only when the
writer asks for it (``resolve_data``), written to a file of its own and dropped; a
sub-group's state is read once for all the parameters in it that come in a row. Single
process here (DCP's no-process-group mode); several ranks are a later step.

:func:`import_dcp` reads such a checkpoint back into an offloaded model and optimizer of
the same parameters, whatever their sub-group size, a tensor at a time.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from swapper.step.layout import STATE_ROWS
from swapper.step.state import StateDictError
from swapper.zero.weights import fetch_copy, write_through
from tiers.errors import SwapConfigError

if TYPE_CHECKING:
    from swapper.step.optimizer import OffloadAdamW
    from swapper.zero.offload import OffloadedModel

__all__ = ["export_dcp", "import_dcp"]


class _SubGroupCache:
    """The last sub-group state read (parameters come in flat order: each is read once)."""

    def __init__(self, optimizer: OffloadAdamW) -> None:
        self._optimizer = optimizer
        self._index = -1
        self._state: torch.Tensor | None = None

    def get(self, index: int) -> torch.Tensor:
        if index != self._index or self._state is None:
            self._state = None  # the old one goes before the new one is read
            self._state = self._optimizer._pipeline.read(index)
            self._index = index
        return self._state


def _optimizer_entries(
    model: OffloadedModel, optimizer: OffloadAdamW
) -> dict[str, tuple[torch.Size, torch.dtype, Callable[[], torch.Tensor]]]:
    cache = _SubGroupCache(optimizer)
    spans: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for sg in optimizer.sub_groups:
        for piece in sg.pieces:
            spans.setdefault((sg.group_index, piece.param_index), []).append(
                (sg.index, piece.offset, piece.param_offset, piece.numel)
            )
    out: dict[str, tuple[torch.Size, torch.dtype, Callable[[], torch.Tensor]]] = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            slot = model._slots.get(id(param))
            if slot is None:
                raise SwapConfigError("export_dcp: the optimizer's parameters are not the model's")
            parts = spans.get((g, i), [])
            for row, row_name in enumerate(STATE_ROWS):

                def gather(
                    row: int = row, parts: list[Any] = parts, shape: Any = slot.shape
                ) -> torch.Tensor:
                    flat = torch.empty(shape.numel(), dtype=torch.float32)
                    for index, offset, param_offset, numel in parts:
                        state = cache.get(index)
                        flat[param_offset : param_offset + numel] = state[
                            row, offset : offset + numel
                        ]
                    return flat.view(shape)

                out[f"optim.{row_name}.{slot.name}"] = (slot.shape, torch.float32, gather)
    return out


def export_dcp(
    model: OffloadedModel, directory: str | os.PathLike[str], optimizer: OffloadAdamW | None = None
) -> Path:
    """Write the model's parameters (and the optimizer's state) as a Distributed
    Checkpoint in ``directory`` (module docstring), one tensor in memory at a time.

    Returns:
        ``directory``.

    Raises:
        SwapConfigError: ``directory`` holds a checkpoint already (``.metadata``), or the
            optimizer is not the model's, or a process group is initialised (several
            ranks are not supported yet).
        and what ``torch.distributed.checkpoint.save`` and the tiers raise.
    """
    # (imported here: torch.distributed.checkpoint is heavy, and only an export needs it)
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.planner import WriteItem
    from torch.distributed.checkpoint.state_dict_saver import save

    out = Path(directory)
    if (out / ".metadata").exists():
        raise SwapConfigError(f"{out / '.metadata'} exists: export into an empty directory")
    if dist.is_available() and dist.is_initialized():
        raise SwapConfigError("export_dcp: several ranks are not supported yet (single process)")
    if optimizer is not None:
        optimizer.wait_pending()  # an overlapped update finished (or its failure raised)
    entries: dict[str, tuple[torch.Size, torch.dtype, Callable[[], torch.Tensor]]] = {}
    for name, shape, dtype in model.named_offloaded():
        slot = model._by_name[name]

        def fetch(slot: Any = slot) -> torch.Tensor:
            return fetch_copy(model, slot)

        entries[f"model.{name}"] = (shape, dtype, fetch)
    state_dict: dict[str, Any] = {}
    if optimizer is not None:
        if optimizer.manager is not model.manager:
            raise SwapConfigError("export_dcp: the optimizer keeps its state elsewhere")
        entries.update(_optimizer_entries(model, optimizer))
        state_dict["optim.step"] = optimizer.step_count
        state_dict["optim.param_groups"] = [
            {k: v for k, v in g.items() if k not in ("params", "param_names")}
            for g in optimizer.param_groups
        ]
    for fqn, (shape, dtype, _) in entries.items():
        # planned from this: the right size and dtype, one element of storage
        state_dict[fqn] = torch.zeros((), dtype=dtype).expand(shape)

    class _Streaming(DefaultSavePlanner):
        def resolve_data(self, write_item: WriteItem) -> Any:
            entry = entries.get(write_item.index.fqn)
            if entry is None:
                return super().resolve_data(write_item)
            return entry[2]()

    out.mkdir(parents=True, exist_ok=True)
    writer = FileSystemWriter(out, single_file_per_rank=False, thread_count=1)
    with warnings.catch_warnings():  # "assuming ... a single process": that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save(state_dict, storage_writer=writer, planner=_Streaming())
    return out


def import_dcp(
    model: OffloadedModel, directory: str | os.PathLike[str], optimizer: OffloadAdamW | None = None
) -> None:
    """Load what :func:`export_dcp` wrote into ``model``'s parameters (and ``optimizer``'s
    state, step and hyper-parameters), one tensor at a time; the optimizer may cut its
    state into sub-groups of another size than the exporter's.

    A parameter's three state rows are read once and kept while the sub-groups it spans
    are written; each sub-group is durable before the next is filled. Until the whole
    optimizer state is in, ``step()`` refuses (as after a failed ``load_state_dict``).

    Raises:
        StateDictError: a tensor is missing from the checkpoint or of another shape or
            dtype (names the directory and the tensor).
        SwapConfigError: a parameter is in use (inside a forward or backward).
        and what the tiers raise.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load

    where = Path(directory)
    if optimizer is not None and optimizer._deferred is not None:
        optimizer._deferred.forget_failed()  # the load replaces what it would finish

    def read(target: dict[str, Any]) -> dict[str, Any]:
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                load(
                    target,
                    checkpoint_id=where,
                    planner=DefaultLoadPlanner(allow_partial_load=False),
                )
        except (CheckpointException, RuntimeError, ValueError, KeyError) as exc:
            names = ", ".join(sorted(target))[:200]
            raise StateDictError(f"DCP checkpoint {where}: cannot load {names}: {exc}") from None
        return target

    for name, shape, dtype in model.named_offloaded():
        tensor = read({f"model.{name}": torch.empty(shape, dtype=dtype)})[f"model.{name}"]
        write_through(model, model._by_name[name], tensor)
    if optimizer is None:
        return
    meta = read(
        {
            "optim.step": 0,
            "optim.param_groups": [
                {k: v for k, v in g.items() if k not in ("params", "param_names")}
                for g in optimizer.param_groups
            ],
        }
    )
    step = meta["optim.step"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise StateDictError(f"DCP checkpoint {where}: optim.step={step!r} is not an int >= 0")
    names = {
        (g, i): model._slots[id(p)].name
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
    }
    rows: dict[tuple[int, int], list[torch.Tensor]] = {}  # the parameters being spread
    optimizer._load_incomplete = True
    for sg in optimizer.sub_groups:
        needed = {(sg.group_index, piece.param_index) for piece in sg.pieces}
        for gone in set(rows) - needed:  # done with: dropped before more are read
            del rows[gone]
        for key in sorted(needed - set(rows)):
            name = names[key]
            shape = model._by_name[name].shape
            target = {f"optim.{r}.{name}": torch.empty(shape) for r in STATE_ROWS}
            got = read(target)
            rows[key] = [got[f"optim.{r}.{name}"].reshape(-1) for r in STATE_ROWS]

        def fill(state: torch.Tensor, sg: Any = sg) -> None:
            state.zero_()
            for piece in sg.pieces:
                flat = rows[(sg.group_index, piece.param_index)]
                for r in range(len(STATE_ROWS)):
                    state[r, piece.offset : piece.offset + piece.numel] = flat[r][
                        piece.param_offset : piece.param_offset + piece.numel
                    ]

        optimizer._pipeline.write(sg.index, fill, step)
    for group, saved in zip(optimizer.param_groups, meta["optim.param_groups"], strict=True):
        group.update(saved)
    optimizer._step_count = step
    optimizer._pending = None
    optimizer._load_incomplete = False
