"""``swapper.offload``: wrap a model so its training state lives in the tiers.

One process (no process group, or a group of one rank): an
:class:`~swapper.zero.local.offload.OffloadedModel`, exactly as before multi-rank support.
A group of N > 1 ranks: a :class:`~swapper.zero.sharded.model.ShardedModel` (ZeRO-3: each
rank keeps 1/N of the parameters, gradients and optimizer state).
"""

from __future__ import annotations

from typing import Any, overload

from torch import nn

from swapper.distributed import DistGroup
from swapper.zero.config.offload import OffloadConfig
from swapper.zero.local.offload import Materialize, OffloadedModel, is_wrapped
from swapper.zero.sharded.model import ShardedModel
from tiers.errors import SwapConfigError

__all__ = ["offload"]


@overload
def offload(
    model: nn.Module,
    config: OffloadConfig,
    process_group: None = None,
    *,
    materialize: Materialize | None = None,
    resume: bool | str = False,
) -> OffloadedModel: ...


@overload
def offload(
    model: nn.Module,
    config: OffloadConfig,
    process_group: Any,
    *,
    materialize: Materialize | None = None,
    resume: bool | str = False,
) -> OffloadedModel | ShardedModel: ...


def offload(
    model: nn.Module,
    config: OffloadConfig,
    process_group: Any = None,
    *,
    materialize: Materialize | None = None,
    resume: bool | str = False,
) -> OffloadedModel | ShardedModel:
    """Wrap ``model`` so its 16-bit parameters live in the tiers (see
    :mod:`swapper.zero.local.offload`).

    The parameters must be bf16 or fp16; a model built on the meta device is given values
    module by module by ``materialize`` (see :class:`OffloadedModel`). Use the result as
    the model; build the optimizer with
    ``swapper.OffloadAdamW(wrapped.parameters(), tiers=wrapped)``.

    With ``process_group`` (a ``torch.distributed`` group, e.g. ``dist.group.WORLD``) of
    N > 1 ranks, every rank keeps only its 1/N of the parameters, gradients and optimizer
    state (:class:`~swapper.zero.sharded.model.ShardedModel`): call it on every rank with the
    same model and ``config.distributed``. ``None``, or a group of one rank, is the
    single-process path, bit for bit.

    ``resume=True`` continues from the newest usable training snapshot in the store
    (:func:`swapper.zero.checkpoint.snapshot.save_snapshot`), or starts afresh when there is none;
    an older snapshot is used only when the newer ones are proven damaged or incomplete
    (an I/O error reading one is raised, never a silent roll-back);
    ``resume="name"`` from that snapshot. With several ranks, every rank must pass the
    same ``resume``; they agree on the newest snapshot whose commit record is valid and
    whose parts every rank reads back whole, at the same world size
    (:mod:`swapper.zero.checkpoint.shard_resume`).

    Raises:
        SwapConfigError: the model is wrapped already; a parameter is not 16-bit; the
            device budget cannot hold the largest module's parameters (names the module
            and the bytes it needs); torch.distributed not initialised while a group is
            given.
        WorldSizeMismatchError: ``resume`` finds snapshots of another world size.
        StoreLayoutError: the NVMe directory holds this store in the other layout (one
            process against several ranks), open elsewhere or left on disk.
        SwapIOError: ``resume=True`` could not read the newest snapshot (an I/O error that
            does not prove it damaged; names the snapshot and file).
        ModelMismatchError, StoreIdentityError, CollectiveError: with several ranks, see
            :class:`~swapper.zero.sharded.model.ShardedModel`.
        and what :class:`TierManager` raises.
    """
    if process_group is not None:
        if not isinstance(config, OffloadConfig):
            raise SwapConfigError(f"offload: config must be an OffloadConfig, got {config!r}")
        group = DistGroup.of(process_group, timeout=config.distributed.timeout_s)
        if group.world_size > 1:
            if isinstance(model, nn.Module) and is_wrapped(model):
                raise SwapConfigError(
                    f"offload: this {type(model).__name__} is already wrapped; wrap a model once"
                )
            return ShardedModel(model, config, group, materialize=materialize, resume=resume)
    return OffloadedModel(model, config, materialize=materialize, resume=resume)
