"""Wrapping a model over N ranks: check, plan, open this rank's store, place its shards.

Job of :func:`place_model`, called by :class:`~swapper.zero.sharded.model.ShardedModel`:

1. every rank describes its model (modules that own parameters, in ``named_modules``
   order) and checks that all ranks wrap the same one (one small collective; a mismatch
   raises :class:`~swapper.distributed.ModelMismatchError` on every rank) before anything
   else, so that what follows is decided alike everywhere;
2. the partition plan (:func:`~swapper.distributed.plan_partition`);
3. this rank's manager, its NVMe directories ``<dir>/rank{r}of{N}`` claimed first
   (:func:`~swapper.distributed.claim_store_identity`);
4. each parameter's shard registered (kind ``param16``) and its full copy dropped
   (``.data`` becomes an empty placeholder); the module layouts and gradient groups.

Steps 3 and 4 are local: a failure on one rank (a store of another rank, an I/O error)
is announced at one agreement point (:func:`~swapper.distributed.agree`), so every rank
raises (the failing one its own error, the others
:class:`~swapper.distributed.PeerFailedError`) and none waits for the others at a later
collective. A rank that fails gets its parameters' bytes back and its store removed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn

from swapper.distributed import (
    DistGroup,
    ParamInfo,
    PartitionPlan,
    agree,
    check_same_model,
    check_same_settings,
    describe_modules,
    module_layout,
    plan_contiguous,
    plan_partition,
    shard_of,
)
from swapper.distributed.identity import claim_store_identity
from swapper.manager import Kind, Tier, TierManager
from swapper.step.resume import ResumedState
from swapper.zero.checkpoint.shard_resume import adopt_shard, choose_sharded, finish_sharded_resume
from swapper.zero.config.offload import OffloadConfig
from swapper.zero.config.settings import tiers_of
from swapper.zero.local.placing import back_to_meta, positions, refuse_fp32_grads
from swapper.zero.sharded.gather_budget import (
    GatherNeed,
    charges_device,
    check_device_floor,
    device_floor,
    gather_need,
    tied_modules,
)
from swapper.zero.sharded.state import GradGroup, ModuleState, ShardSlot
from tiers.errors import SwapConfigError

__all__ = [
    "Materialize",
    "Placed",
    "dtype_refusal",
    "gather_floor",
    "module_dtype_refusal",
    "place_model",
]

#: materialize(model, place): see :func:`place_model` (the one-process path's contract).
Materialize = Callable[[nn.Module, Callable[[str, nn.Module], None]], None]

#: The dtype the plan records for a meta parameter (made bf16 or fp16 by materialize).
_SIXTEEN_BIT = "16-bit"


@dataclasses.dataclass
class Placed:
    """What :func:`place_model` made.

    Attributes:
        plan: the partition plan (same on every rank).
        manager: this rank's manager, holding its parameter shards.
        slots: every parameter's record, by plan index.
        by_id: ``id(param)`` → its record (to find a Parameter object; never a stored key).
        states: every module that owns parameters → its gather state.
        groups: the gradient groups, in plan (forward) order.
        group_of: plan index → its gradient group (parameters that require grad).
        device_floor: device bytes a step's gathers need at once (0: the device budget
            is unlimited); see :mod:`swapper.zero.sharded.gather_budget`.
    """

    plan: PartitionPlan
    manager: TierManager
    slots: list[ShardSlot]
    by_id: dict[int, ShardSlot]
    states: dict[nn.Module, ModuleState]
    groups: list[GradGroup]
    group_of: dict[int, GradGroup]
    device_floor: int = 0
    resumed: ResumedState | None = None


def _shared_settings(config: OffloadConfig) -> dict[str, object]:
    """The settings every rank must pass alike (they decide which collectives run, in
    which order; see :func:`~swapper.distributed.groups.check_same_settings`)."""
    d = config.distributed
    return {
        "distributed.fetch_collective": d.fetch_collective,
        "distributed.fetch_ahead": d.fetch_ahead,
        "distributed.reduce_dtype": d.reduce_dtype,
        "distributed.ownership": d.ownership,
        "distributed.timeout_s": d.timeout_s,
        "manager.device_nbytes": config.manager.device_nbytes,  # bounds the gathers ahead
        "step.max_grad_norm": config.step.max_grad_norm,  # a norm all_reduce or none
        # no collective, but shards stored in different formats would train one model
        # with two optimizers' numerics
        "step.moments": config.step.moments or "fp32",
    }


def place_model(
    module: nn.Module,
    config: OffloadConfig,
    group: DistGroup,
    materialize: Materialize | None = None,
    resume: bool | str = False,
) -> Placed:
    """Check, plan and place ``module`` on this rank (see the module docstring).

    With ``materialize`` (a model built on the meta device), ``materialize(module,
    place)`` gives the modules' parameters values one module at a time and calls
    ``place(name, module)`` after each, which keeps this rank's shards and drops the full
    values before the next module is made: each rank flattens only its own portion, and
    no rank ever holds the whole model.

    With ``resume`` (True or a snapshot name), the ranks first agree on a committed
    snapshot and switch their stores to it (:func:`~swapper.zero.checkpoint.shard_resume.
    choose_sharded`); each shard is then the snapshot's (its shape checked, the model's
    values unused), and ``Placed.resumed`` says what was resumed.

    Raises:
        ModelMismatchError: the ranks wrap different models (on every rank).
        SwapConfigError: a parameter is neither 16-bit nor fp32 beside a 16-bit base,
            two 16-bit dtypes, or a module owning two dtypes (:func:`dtype_refusal`,
            :func:`module_dtype_refusal`, naming them; on every rank: the models are the
            same by then), or this rank's fp32 gradient shards do not fit their memory
            tier (:func:`~swapper.zero.local.placing.refuse_fp32_grads`), or a parameter
            is still on the meta device (or made fp32) after ``materialize``, or the
            device budget cannot hold the gathers of one module at once
            (:func:`~swapper.zero.sharded.gather_budget.check_device_floor`; raised
            before anything is placed).
        StoreIdentityError, SwapIOError, ...: this rank's own failure to open its store
            or place its shards; PeerFailedError: another rank's.
        CollectiveError: a collective failed or timed out.
        WorldSizeMismatchError, SnapshotNotFoundError, CommitRecordError,
            SnapshotDamagedError, StateDictError: ``resume`` could not be honoured (see
            :func:`~swapper.zero.checkpoint.shard_resume.choose_sharded`).
    """
    named = _owning(module)
    infos = describe_modules(named)
    if materialize is not None:
        # Meta parameters get their dtype when materialised: planned as 16-bit (2 B)
        # here, checked as each is placed.
        infos = [dataclasses.replace(i, itemsize=2, dtype=_SIXTEEN_BIT) for i in infos]
    check_same_model(group, infos)
    check_same_settings(group, _shared_settings(config))
    refusal = dtype_refusal([(i.name, i.dtype) for i in infos]) or module_dtype_refusal(named)
    if refusal is not None:  # the same model on every rank by now: all raise alike
        raise SwapConfigError(refusal)
    plan = _plan(infos, group.world_size, config)
    manager: TierManager | None = None
    # (param, its bytes before the wrap; None: materialised by materialize=, on meta before)
    originals: list[tuple[nn.Parameter, torch.Tensor | None, ShardSlot]] = []
    before = positions(module) if materialize is not None else None  # (a failure puts back)
    error: BaseException | None = None
    placed: Placed | None = None
    # Collectives on every rank alike, before anything is placed (raises alike everywhere).
    chosen = None if resume is False else choose_sharded(config, group, resume, plan.digest())
    resumed = None if chosen is None else chosen.resumed
    try:
        charged = charges_device(config.manager, group.control_device)
        floor = check_device_floor(
            _module_needs(named, plan, config, group.world_size),
            config.manager.device_nbytes if charged else None,
            config.distributed.fetch_collective,
        )
        grad_tier = tiers_of(config.manager, Kind.GRAD32)[0]  # (memory only: never NVMe)
        refuse_fp32_grads(
            _fp32_grads(named, plan, group.rank),
            grad_tier,
            config.manager.host_nbytes if grad_tier is Tier.HOST else config.manager.device_nbytes,
        )
        if chosen is None:
            manager = _open_manager(config, group)
        elif resumed is None:  # nothing to resume: a new store in this rank's directories
            manager = TierManager(chosen.config)
        else:  # the store stands at the chosen snapshot: its shards are adopted
            manager = TierManager.open(chosen.config)
        placed = _place(module, named, plan, manager, group.rank, originals, materialize, resumed)
        if resumed is not None:
            finish_sharded_resume(manager, placed.slots, resumed)
            placed.resumed = resumed
        placed.device_floor = floor
    except BaseException as exc:  # every rank learns of it at the agreement, then it is raised
        # (a KeyboardInterrupt too: else the parameters would stay emptied and the
        # manager open, its store locked, with nobody to close it)
        error = exc
    try:
        agree(group, error is None, "wrapping the model (swapper.offload)")
    except BaseException:
        # Nothing lost: the parameters emptied so far get their own bytes back; those
        # materialize= made (their values only ever lived in the tiers, closed now) become
        # meta Parameters again.
        for param, data, _ in originals:
            if data is not None:
                param.data = data
        back_to_meta(
            module, [(param, slot) for param, data, slot in originals if data is None], before
        )
        if manager is not None:
            manager.close(remove=resumed is None)  # a resumed store keeps its snapshots
        if error is not None:
            raise error from None
        raise
    if placed is None:  # unreachable: agree raised when this rank failed
        raise SwapConfigError("offload: placing the model failed") from error
    return placed


def gather_floor(module: nn.Module, config: OffloadConfig, world_size: int) -> int:
    """Device bytes that wrapping ``module`` over ``world_size`` ranks with ``config``
    needs at least (the floor of :mod:`swapper.zero.sharded.gather_budget`; its budgets are not
    read). A model on the meta device will do: its parameters count as 16-bit.

    Raises:
        InvalidArgumentError: ``world_size`` < 1 (from the partition plan).
    """
    named = _owning(module)
    infos = [
        dataclasses.replace(i, itemsize=2, dtype=_SIXTEEN_BIT) for i in describe_modules(named)
    ]
    plan = _plan(infos, world_size, config)
    return device_floor(_module_needs(named, plan, config, world_size))[0]


def _plan(infos: list[ParamInfo], world_size: int, config: OffloadConfig) -> PartitionPlan:
    """The partition ``config.distributed.ownership`` asks for."""
    if config.distributed.ownership == "contiguous":
        return plan_contiguous(infos, world_size)
    return plan_partition(infos, world_size)


def _owning(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module that owns parameters, in ``named_modules`` order."""
    return [
        (n, m)
        for n, m in module.named_modules()
        if next(m.parameters(recurse=False), None) is not None
    ]


def _module_needs(
    named: list[tuple[str, nn.Module]],
    plan: PartitionPlan,
    config: OffloadConfig,
    world_size: int,
) -> list[tuple[str, GatherNeed, bool]]:
    """(name, device bytes of its gather, holds a tied parameter) of every module that
    owns parameters, from the plan (before anything is placed)."""
    placements = {p.info.name: p for p in plan.params}
    index_of: dict[int, int] = {}
    for name, sub in named:
        for pname, param in sub.named_parameters(recurse=False):
            full_name = f"{name}.{pname}" if name else pname
            if id(param) not in index_of and full_name in placements:
                index_of[id(param)] = placements[full_name].index
    ids = [(name, [id(p) for p in sub.parameters(recurse=False)]) for name, sub in named]
    tied = tied_modules(ids)
    on_device = tiers_of(config.manager, Kind.PARAM16)[0] is Tier.DEVICE
    method = config.distributed.fetch_collective
    needs: list[tuple[str, GatherNeed, bool]] = []
    for name, members in ids:
        indices = [index_of[i] for i in members if i in index_of]
        layout = module_layout(plan, indices)
        needs.append((name, gather_need(layout, world_size, method, on_device), name in tied))
    return needs


def _open_manager(config: OffloadConfig, group: DistGroup) -> TierManager:
    manager_config = config.manager
    if manager_config.nvme_dirs:
        dirs = claim_store_identity(
            manager_config.nvme_dirs, manager_config.store_name, group.rank, group.world_size
        )
        manager_config = dataclasses.replace(manager_config, nvme_dirs=dirs)
    return TierManager(manager_config)


def _not_16_bit(name: str, shape: Sequence[int], dtype: object) -> str:
    return (
        f"offload: parameter {name!r} (shape {list(shape)}) is "
        f"{str(dtype).removeprefix('torch.')}; convert the model to bf16 or fp16 first "
        "(model.to(torch.bfloat16)), or materialise it in one of them"
    )


#: dtypes a parameter may have (as text): one 16-bit dtype, fp32 beside it
_SIXTEEN = ("torch.bfloat16", "torch.float16", _SIXTEEN_BIT)
_FP32 = "torch.float32"


def dtype_refusal(params: Sequence[tuple[str, str]]) -> str | None:
    """Why ``(name, dtype)`` parameters cannot be sharded, or None when they can: all of
    one 16-bit dtype, with or without fp32 parameters beside them (PEFT's default fp32
    adapters over a bf16 base: each fp32 trainable parameter its own master, its fp32
    gradient reduce-scattered in fp32 and retained in memory, never on NVMe). The message
    names the dtypes and, for each, how many parameters have it and the first few names,
    so the odd ones out are easy to find.

    Refused: a dtype other than bf16, fp16 and fp32; every parameter fp32 (a model
    converted entirely: twice the bytes in the tiers, and its optimizer a second fp32
    copy); bf16 and fp16 together (one 16-bit dtype: the optimizer's step and the
    exports assume it). A module owning parameters of two dtypes is refused by
    :func:`module_dtype_refusal` (its gather is one buffer of one dtype).
    """
    by_dtype: dict[str, list[str]] = {}
    for name, dtype in params:
        by_dtype.setdefault(dtype, []).append(name)
    sixteen = [d for d in by_dtype if d in _SIXTEEN]
    wrong = [d for d in by_dtype if d not in _SIXTEEN and d != _FP32]
    if not by_dtype or (not wrong and len(sixteen) == 1):
        return None

    def shown(dtype: str) -> str:
        names = by_dtype[dtype]
        listed = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
        return f"{dtype.removeprefix('torch.')}: {len(names)} ({listed})"

    counts = "; ".join(shown(d) for d in sorted(by_dtype, key=lambda d: -len(by_dtype[d])))
    if wrong:
        why = "they must be bf16 or fp16 (fp32 is accepted beside a 16-bit base)"
    elif not sixteen:
        why = (
            "they must be bf16 or fp16 (fp32 parameters are accepted only beside a "
            "16-bit base, such as PEFT's fp32 adapters)"
        )
    else:
        why = (
            "with several ranks the 16-bit ones must share one dtype (bf16 or fp16; "
            "several 16-bit dtypes are not supported yet)"
        )
    return (
        f"offload: parameters by dtype: {counts}; {why}: convert the model with "
        ".to(torch.bfloat16) (or materialise it in one 16-bit dtype) before "
        "swapper.offload(..., process_group)"
    )


def module_dtype_refusal(named: Sequence[tuple[str, nn.Module]]) -> str | None:
    """Why these modules (name, module; each one's own parameters) cannot be gathered,
    or None: with several ranks a module's parameters are gathered into one buffer by
    one collective and their gradients reduce-scattered by one more, so each module's
    own parameters must share a dtype (PEFT's adapters are modules of their own,
    ``lora_A.default``/``lora_B.default``, so fp32 adapters over a bf16 base pass).
    Meta parameters are not looked at (materialised in one 16-bit dtype). The message
    names the first module at fault and its parameters' dtypes."""
    for name, sub in named:
        own = [(n, p) for n, p in sub.named_parameters(recurse=False) if not p.is_meta]
        if len({p.dtype for _, p in own}) > 1:
            listed = ", ".join(f"{n!r} {str(p.dtype).removeprefix('torch.')}" for n, p in own)
            return (
                f"offload: module {name!r} owns parameters of several dtypes ({listed}); "
                "with several ranks a module's parameters are gathered as one buffer of "
                "one dtype: make them one dtype, or move the fp32 ones into a submodule "
                "of their own (as PEFT keeps its adapters, in lora_A/lora_B Linear modules)"
            )
    return None


def _fp32_grads(
    named: Sequence[tuple[str, nn.Module]], plan: PartitionPlan, rank: int
) -> list[tuple[str, Sequence[int], int]]:
    """(name, shape, bytes of this rank's gradient shard) of every fp32 trainable
    parameter: retained in memory (``Kind.GRAD32``), never on NVMe."""
    placements = {p.info.name: p for p in plan.params}
    out: list[tuple[str, Sequence[int], int]] = []
    seen: set[int] = set()
    for name, sub in named:
        for pname, param in sub.named_parameters(recurse=False):
            full_name = f"{name}.{pname}" if name else pname
            placement = placements.get(full_name)
            if id(param) in seen or placement is None or placement.info.dtype != _FP32:
                continue
            seen.add(id(param))
            if param.requires_grad:
                out.append((full_name, param.shape, placement.local_numel(rank) * 4))
    return out


def _place(
    module: nn.Module,
    named: list[tuple[str, nn.Module]],
    plan: PartitionPlan,
    manager: TierManager,
    rank: int,
    originals: list[tuple[nn.Parameter, torch.Tensor | None, ShardSlot]],
    materialize: Materialize | None,
    resumed: ResumedState | None = None,
) -> Placed:
    """Register this rank's shard of every parameter (each full copy dropped once its
    shard is registered: ``originals`` records what to give back on failure, and keeps no
    materialised parameter's bytes alive, which would hold the whole model), module by
    module (as ``materialize`` makes them, if given); build the module layouts and
    gradient groups. With ``resume``, the shards are the snapshot's (checked, not
    registered)."""
    placements = {p.info.name: p for p in plan.params}
    # Parameters with values before the wrap (the objects: their ids stay theirs while
    # the dict lives); the others are made by materialize= and go back to meta on failure.
    had_values = {id(p): p for p in module.parameters() if not p.is_meta}
    by_index: list[ShardSlot | None] = [None] * len(plan.params)
    by_id: dict[int, ShardSlot] = {}

    def place(name: str, sub: nn.Module) -> None:
        for pname, param in sub.named_parameters(recurse=False):
            if id(param) in by_id:
                continue  # placed with an earlier module (a tied parameter)
            full_name = f"{name}.{pname}" if name else pname
            placement = placements.get(full_name)
            if placement is None:
                raise SwapConfigError(
                    f"offload: parameter {full_name!r} appeared while materialising; "
                    "materialize must keep the model's structure"
                )
            if param.is_meta:
                raise SwapConfigError(
                    f"offload: parameter {full_name!r} is on the meta device; pass "
                    "materialize= to give the model's parameters values module by module"
                )
            fp32 = param.dtype == torch.float32 and placement.info.dtype == _FP32
            if param.dtype not in (torch.bfloat16, torch.float16) and not fp32:
                # (a materialised parameter is planned as 16-bit: it must be made so)
                raise SwapConfigError(_not_16_bit(full_name, param.shape, param.dtype))
            slot = ShardSlot(
                name=full_name,
                param=param,
                placement=placement,
                shape=param.shape,
                dtype=param.dtype,
                placeholder=torch.empty(0, dtype=param.dtype),
                local_numel=placement.local_numel(rank),
                trainable=param.requires_grad,
            )
            if resumed is not None:  # its bytes are the snapshot's
                adopt_shard(manager, resumed, slot)
            elif (shard := shard_of(placement, param.detach(), rank)) is not None:
                manager.register(slot.key, shard, Kind.PARAM16)
            # A materialised parameter's full copy is not kept for a failure's undo: kept,
            # every module made so far stayed in memory (the whole model by the end: 4.3 GB
            # a rank at 2.17 B parameters on 2 ranks, over the rank's budgets).
            made = id(param) not in had_values
            originals.append((param, None if made else param.data, slot))
            param.data = slot.placeholder  # the full copy is dropped here
            by_id[id(param)] = slot
            by_index[placement.index] = slot

    if materialize is not None:
        materialize(module, place)
    for name, sub in named:
        place(name, sub)  # those materialize did not place (or all, without it)
    slots = [s for s in by_index if s is not None]
    refusal = dtype_refusal([(s.name, str(s.dtype)) for s in slots])
    if refusal is not None:  # materialised in several dtypes
        raise SwapConfigError(refusal)
    states: dict[nn.Module, ModuleState] = {}
    for name, sub in named:
        own = [by_id[id(p)] for p in sub.parameters(recurse=False)]
        state = ModuleState(name, sub, own, module_layout(plan, [s.index for s in own]))
        states[sub] = state
        for slot in own:
            slot.modules.append(state)
    by_module: dict[int, list[ShardSlot]] = {}
    for slot in slots:
        if slot.param.requires_grad:
            by_module.setdefault(slot.placement.info.module_index, []).append(slot)
    groups: list[GradGroup] = []
    group_of: dict[int, GradGroup] = {}
    for _, members in sorted(by_module.items()):
        grad_group = GradGroup(module_layout(plan, [s.index for s in members]), members)
        groups.append(grad_group)
        for slot in members:
            group_of[slot.index] = grad_group
    return Placed(plan, manager, slots, by_id, states, groups, group_of)
