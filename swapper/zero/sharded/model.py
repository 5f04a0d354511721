"""``swapper.offload(model, config, process_group)`` over N > 1 ranks: ZeRO-3.

Each rank holds 1/N of every 16-bit parameter (:mod:`swapper.distributed.partition`: flat
shards padded to the alignment, small tensors owned whole by one rank, balanced over the
backward order) in its own :class:`~swapper.manager.TierManager`, whose NVMe files live
in ``<nvme dir>/rank{r}of{N}`` (:func:`~swapper.distributed.claim_store_identity`: a rank
never opens another's store, nor one made under another world size).

Around each module that owns parameters (``recurse=False``):

- forward pre-hook: the module's gather (started by read-ahead, or now) is waited on:
  one collective (``config.distributed.fetch_collective``) from every rank's shards into
  the module's param-major buffer (:func:`~swapper.distributed.start_fetch`; charged to
  the device budget, :mod:`swapper.zero.sharded.gather_budget`), whose views become the
  parameters' ``.data``; then the next ``fetch_ahead`` modules along the order recorded
  in the first step are started. Forward hook: released (the buffer freed, the shards
  stay), the outputs marked (:class:`~swapper.zero.model.autograd.BeforeBackward`) so the
  module is gathered again before its backward. Autograd's saved views of a gathered
  parameter are kept as positions and read from the backward's gather
  (:meth:`~swapper.zero.model.saved.SavedParams.around`): kept as tensors, they kept each freed
  buffer alive outside the device budget until the backward;
- a module's backward holds are released when every one of its parameters that
  requires grad has had its gradient accumulated (a tied parameter: after its last use);
- gradients are collected per :class:`~swapper.zero.sharded.state.GradGroup` (the
  parameters whose first use is one module); when a group's are all in, they are
  reduce-scattered and averaged over the ranks into this rank's retained 16-bit gradient
  shards (kind ``grad16``; added to on later micro-steps), and the full gradients freed.
  At the end of a backward, a group with some gradients missing (parameters unused in
  this pass) is reduced with zeros for them.

Every rank must run the same modules in the same order: the collectives are paired by
the order they are issued in. A gather started by read-ahead is never used after the
parameters changed: the optimizer's first write waits for (and drops) every gather in
flight (with an overlapped optimizer, ``step()`` drops them and each gather waits for
this rank's update of its shards: :mod:`swapper.zero.sharded.overlap`). Writes outside
the hooks: :mod:`swapper.zero.sharded.writes`; a gather's life (start, read-ahead, wait,
settle, free): :mod:`swapper.zero.sharded.gathers`. The hooks themselves are the shared
lifecycle's (:mod:`swapper.zero.model.lifecycle`); this module supplies their unit, one
module's :class:`~swapper.zero.sharded.state.ModuleState` ("the unit" section below).

:class:`~swapper.step.OffloadAdamW` steps only this rank's shards
(:class:`~swapper.zero.sharded.state.ShardedParams`); the global gradient norm and the
fp16 overflow flag are reduced over the ranks, so clipping and skipped steps agree.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from swapper.distributed import (
    DistGroup,
    ModuleLayout,
    PartitionPlan,
    PendingFetch,
)
from swapper.manager import Kind, Tier
from swapper.zero.config.offload import OffloadConfig
from swapper.zero.config.settings import tiers_of
from swapper.zero.model.autograd import mark_outputs
from swapper.zero.model.core import ModelCore
from swapper.zero.model.frozen import check_trainable
from swapper.zero.model.lifecycle import ModelLifecycle
from swapper.zero.model.model_buffers import move_buffers
from swapper.zero.model.module_apply import guard_apply
from swapper.zero.model.readahead import ManagerRecording
from swapper.zero.model.saved import SavedParams
from swapper.zero.sharded.gather_budget import GatherBudget, charges_device
from swapper.zero.sharded.gathers import Gathers
from swapper.zero.sharded.grads import GradReducer
from swapper.zero.sharded.layout import Shards
from swapper.zero.sharded.overlap import ShardOverlap
from swapper.zero.sharded.setup import Materialize, place_model
from swapper.zero.sharded.state import ModuleState, ShardSlot
from swapper.zero.sharded.state_dicts import load_sharded, sharded
from swapper.zero.sharded.writes import WriteGuard
from tiers.errors import SwapConfigError

__all__ = ["ShardedModel"]

log = logging.getLogger(__name__)


#: Models wrapped by a ShardedModel so far (a module may be wrapped once).
_WRAPPED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


class ShardedModel(ModelLifecycle):
    """A module whose 16-bit parameters (and fp32 ones beside them, such as PEFT's
    default adapters: each module's own parameters of one dtype) are partitioned over the
    ranks of ``group``.

    Built by :func:`swapper.offload` when its process group has more than one rank; see
    the module docstring. Every rank must wrap the same model (checked: names, shapes and
    dtypes) with the same ``config.distributed``. A model built on the meta device is
    given values by ``materialize`` one module at a time, each rank keeping only its
    shards (see :func:`~swapper.zero.sharded.setup.place_model`).

    Raises:
        SwapConfigError: wrapped already, a parameter neither 16-bit nor fp32 beside a
            16-bit base, two 16-bit dtypes, a module owning two dtypes, fp32 gradient
            shards beyond the host budget, or the model on the meta device.
        ModelMismatchError: the ranks wrap different models (on every rank).
        StoreIdentityError: this rank's NVMe directories hold another rank's store, or
            one of another world size (on that rank; the others raise PeerFailedError).
        CollectiveError: a collective of the wrap failed or timed out.
        WorldSizeMismatchError, SnapshotNotFoundError, CommitRecordError,
            SnapshotDamagedError: ``resume`` could not be honoured (on every rank; see
            :func:`~swapper.zero.checkpoint.shard_resume.choose_sharded`).
    """

    fetch: Gathers  # a module's gather and release (swapper.zero.sharded.gathers)
    layout: Shards  # this rank's shards (swapper.zero.sharded.layout)
    overlap: ShardOverlap  # an overlapped optimizer's gate and agreements (sharded.overlap)
    _registry = _WRAPPED
    _grad_first = False  # (the gathered buffer freed before the reduce-scatter)
    _hold_unit = "module"
    _log = log

    def __init__(
        self,
        module: nn.Module,
        config: OffloadConfig,
        group: DistGroup,
        *,
        materialize: Materialize | None = None,
        resume: bool | str = False,
    ) -> None:
        super().__init__(module, config)  # (checked: wrappable, an OffloadConfig)
        self.group = group
        self._dist = config.distributed
        #: what the lifecycle and its helpers share (swapper.zero.model.core): the lock,
        #: the manager, the records by id(param) and by name, the counters, per forward
        #: running now the module and the module state its pre-hook gathered
        self.core: ModelCore[ShardSlot, tuple[nn.Module, list[ModuleState]]] = ModelCore(
            tiers_of(config.manager, Kind.PARAM16)[0],
            None,  # (gathers: GatherBudget's room)
        )
        self._device = group.control_device
        self._handles: list[Any] = []
        #: autograd's saved views of gathered parameters (swapper.zero.model.saved)
        self._saved = SavedParams(
            lambda slot: any(state.gathered is not None for state in slot.modules)
        )

        placed = place_model(module, config, group, materialize, resume)
        #: the snapshot resumed from (``resume=``; the optimizer adopts its state), or None
        self.resumed = placed.resumed
        self.plan: PartitionPlan = placed.plan
        self.core.manager = placed.manager
        self._by_index = placed.slots
        self.core.slots = placed.by_id
        self.core.by_name = {slot.name: slot for slot in placed.slots}
        self._states = placed.states
        self._writes = WriteGuard(group, placed.slots)  # writes outside the hooks: raised
        self._budget = GatherBudget(
            placed.manager, group, config.manager.device_nbytes, placed.device_floor,
            self._dist.fetch_collective, self._device,
            charge=charges_device(config.manager, self._device),
        )  # fmt: skip
        reduce_dtype = torch.float32 if self._dist.reduce_dtype == "float32" else None
        self._grads = GradReducer(
            group, placed.manager, placed.slots, placed.groups, placed.group_of,
            self._device, reduce_dtype,
        )  # fmt: skip
        #: an overlapped optimizer's gate and agreements (swapper.zero.sharded.overlap)
        host = placed.manager.config.host_nbytes if self.core.use_tier is Tier.HOST else None
        self.overlap = ShardOverlap(group, self.drain, self._states.values(), self._by_index, host)
        #: a module's gather by collective and its release (swapper.zero.sharded.gathers)
        self.fetch = Gathers(
            self.core, group, self._dist, self._device, self._by_index, self._states,
            self._budget, self._writes, self.overlap,
        )  # fmt: skip
        #: this rank's shards: records, gradient shards, gathered weights (sharded.layout)
        self.layout = Shards(self, self._by_index, self._grads, self.overlap, self._writes)
        # buffers on the gathers' device; model.to() guarded (swapper.zero.model.module_apply)
        self._buffer_moves = move_buffers(module, self._device)
        self._apply_guarded = guard_apply(module, self._device)
        #: the manager's eviction order, recorded over the first whole step
        self._manager_recording = ManagerRecording(placed.manager)
        self._install_hooks()  # (the lifecycle's: swapper.zero.model.lifecycle)
        _WRAPPED.add(module)

    # -- what the optimizer and the user see ----------------------------------------------

    def slot_of(self, param: torch.Tensor) -> ShardSlot | None:
        """The record of one of the model's parameters (None for another tensor)."""
        return self.core.slots.get(id(param))

    def local_nbytes(self) -> dict[str, int]:
        """Bytes this rank stores of the 16-bit parameters and gradients (padding
        included): ``{"param16": ..., "grad16": ...}``."""
        param = sum(s.local_numel * s.dtype.itemsize for s in self._by_index)
        grad = sum(s.local_numel * s.dtype.itemsize for s in self._by_index if s.has_grad)
        return {"param16": param, "grad16": grad}

    def _gathered_now(self) -> list[ShardSlot]:
        """The parameters of the modules whose forward runs now (gathered)."""
        return [
            slot for _, taken in self.core.forward_holds for state in taken for slot in state.slots
        ]

    def drain(self) -> None:
        """Wait for every gather started ahead of use and drop it
        (:meth:`~swapper.zero.sharded.gathers.Gathers.drain`, which says what it raises)."""
        self.fetch.drain()

    def start_gather(self, layout: ModuleLayout, slots: list[ShardSlot], what: str) -> PendingFetch:
        """Start the gather of ``slots`` (a collective: every rank alike;
        :meth:`~swapper.zero.sharded.gathers.Gathers.start`, which says what it raises)."""
        return self.fetch.start(layout, slots, what)

    def end_gather(self, pending: PendingFetch) -> None:
        """A gather from :meth:`start_gather` is no longer used: its buffers go back."""
        self.fetch.end(pending)

    def before_param_write(self, slot: ShardSlot) -> None:
        """Called before the optimizer writes a shard: no gather in flight may deliver
        the old values later, and no module may be using the parameter.

        Raises:
            SwapConfigError: the parameter is in use (a step inside a forward/backward).
        """
        if self.overlap.in_update():
            # An overlapped update writes from its own thread: step() drained the gathers
            # in the caller's thread before it started, and the gate keeps every later
            # gather from reading this shard until it is published. Any other write (a
            # load, a failed update finished by step()) is the caller's: it drains.
            return
        self.drain()
        if any(m.users for m in slot.modules):
            self.release_stale_holds()
        busy = [m.name for m in slot.modules if m.users]
        if busy:
            raise SwapConfigError(
                f"optimizer step while parameter {slot.name!r} is in use by module(s) {busy} "
                "(inside a forward or backward?)"
            )

    # -- the overlapped optimizer (swapper.zero.sharded.overlap) ---------------------------

    def agree_update(self, finish: Callable[[], None] | None) -> bool:
        """Called by the overlapped optimizer's ``step()`` on every rank: see
        :meth:`~swapper.zero.sharded.overlap.ShardOverlap.agree_update`."""
        return self.overlap.agree_update(finish)

    def settle_update(self, what: str) -> None:
        """Wait for an overlapped optimizer's whole update; an agreement while one is open
        (call on every rank alike).

        Raises:
            DeferredStepError: this rank's update failed; PeerFailedError: another's did;
            CollectiveError: the agreement failed or timed out.
        """
        self.overlap.settle(what)

    @property
    def slots(self) -> tuple[ShardSlot, ...]:
        """Every parameter's record, in plan (forward) order."""
        return tuple(self._by_index)

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's shards, for a per-rank checkpoint (see
        :func:`swapper.zero.sharded.state_dicts.sharded`)."""
        self.overlap.settle("sharded_state_dict")
        self._writes.check("sharded_state_dict")
        return sharded(self)

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`sharded_state_dict` returned on this rank (on every rank
        alike; see :func:`swapper.zero.sharded.state_dicts.load_sharded`).

        Raises:
            SwapConfigError: another rank's, world size's or partition's, or malformed;
            PeerFailedError: another rank's check failed.
        """
        self.overlap.settle("load_sharded_state_dict")
        load_sharded(self, state)

    def _after_unhook(self) -> None:
        self._writes.close()

    def _before_manager_close(self) -> None:
        self.fetch.settle_all()  # their buffers are the manager's blocks

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the unit (swapper.zero.model.lifecycle): one module, gathered ---------------------

    def _module_units(self) -> Iterable[tuple[nn.Module, list[Any]]]:
        return ((sub, [state]) for sub, state in self._states.items())

    def _all_units(self) -> Iterable[ModuleState]:
        return self._states.values()

    def _records_of(self, units: list[Any]) -> list[Any]:
        return [slot for state in units for slot in state.slots]

    def _hooked(self, owner: Any, kind: str, handle: Any) -> None:
        self._handles.append(handle)

    def _step_boundary(self) -> None:
        """Record the manager's accesses over the first whole step (as the one-rank path
        does), so its eviction order covers forward, backward and the optimizer."""
        self._manager_recording.boundary(self.fetch.order is not None)

    def _saves_views(self) -> bool:
        # inside a non-reentrant checkpoint's region (swapper.zero.model.saved); elsewhere
        # the pair of _run's around() keeps them
        return not self._saved.ours_on_top() and torch.is_grad_enabled()

    def _settle_for_backward(self) -> None:
        if not self.core.holds.in_backward:
            # the update reads the gradients this backward adds to: it ends first
            self.overlap.settle("the backward after an overlapped optimizer step")

    def _await_grads(self, unit: ModuleState) -> None:
        # released when every one of its parameters that requires grad has its gradient
        unit.waiting = {s.index for s in unit.slots if s.param.requires_grad}

    def _mark_outputs(self, output: Any, before_backward: Callable[[], None]) -> tuple[Any, bool]:
        return mark_outputs(output, before_backward), False  # (a node; nothing carried)

    def _take_grad(self, record: ShardSlot, grad: torch.Tensor | None) -> None:
        self._grads.add(record, grad)  # reduce-scattered once its group is complete

    def _grad_may_end(self, record: ShardSlot) -> bool:
        return True

    def _ended_units(self, record: ShardSlot) -> Iterable[ModuleState]:
        ended = []
        for state in record.modules:
            if record.index in state.waiting:
                state.waiting.discard(record.index)
                if not state.waiting:
                    ended.append(state)
        return ended

    def _forget_waits(self) -> None:
        for state in self._states.values():
            state.waiting.clear()

    # -- the lifecycle's strategy (swapper.zero.model.lifecycle): N ranks ---------------

    def _forward_checks(self) -> None:
        check_trainable(self._by_index)  # (before anything moves, on every rank alike)
        self.release_stale_holds()
        self._writes.check("forward")  # (an agreement: every rank raises alike)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with self._saved.around(self._gathered_now):
            out = self.module(*args, **kwargs)
        if self.core.holds.forward_depth == 1:
            self.overlap.forward_ended()  # (an agreement while an update is open)
        return out

    def _after_failed_pass(self) -> None:
        self._grads.discard()

    def _after_backward(self) -> None:
        self._grads.flush()  # parameters unused in this pass: zeros
        self.fetch.backward_ended()  # (the first: the gather order recorded)
