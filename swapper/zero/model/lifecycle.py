# Size: ~670 lines: the lifecycle and its hooks, written once for one rank and N (issue 25),
# are one state machine over the same counters and sections; each model supplies its unit
# through the short methods at the end (the interfaces are in strategy.py).
"""One hook lifecycle for the one-process and the N-rank model (issue 25): the methods
:class:`~swapper.zero.local.offload.OffloadedModel` and
:class:`~swapper.zero.sharded.model.ShardedModel` shared by name, written once.

What differs between one process and N ranks is *how bytes arrive* and *what a hold is
of*, not the lifecycle. How a hold's bytes arrive and leave is an object, the model's
:class:`FetchStrategy` (``model.fetch``): one process holds single parameters fetched
from the tiers (:class:`~swapper.zero.local.fetch.TierFetch`: a ``Slot`` by
``TierManager.fetch``/``release``); N ranks hold modules gathered by collective
(:class:`~swapper.zero.sharded.gathers.Gathers`: a ``ModuleState``), their gradients
reduce-scattered (:mod:`swapper.zero.sharded.grads`). How the state is laid out is the
model's :class:`StateLayout` (``model.layout``): whole tensors
(:class:`~swapper.zero.local.layout.WholeTensors`) or this rank's shards
(:class:`~swapper.zero.sharded.layout.Shards`); the lifecycle's ``zero_grad``,
``drop_grads``, ``iter_state_dict``, ``state_dict`` and ``param_source`` ask it. An
overlapped optimizer's side is the model's :class:`UpdateOverlap` (``model.overlap``).

The module hooks are written here once (``_install_hooks``, ``_pre_forward_hook``,
``_post_forward_hook``, ``_grad_hook``, ``_frozen_after``, ``_release_backward_holds``),
over a *unit*, what one hold is of (:class:`HoldUnit`: one process a ``Slot``, N ranks a
``ModuleState``); a forward's entry in ``core.forward_holds`` is the module and the units
its pre-hook acquired. Each model supplies its unit through the methods marked "unit"
below, and the rest through those marked "strategy" (``docs/architecture.md`` has the
table of both models' answers).

The order in which the lifecycle calls the strategy (each call on the thread that runs
the forward or the backward)::

    forward()            ─► _forward_checks() (outermost forward only: nothing moved yet)
                         ─► _run(args, kwargs) (the module; its hooks acquire/release)
       raised (an error, Ctrl-C):
                         ─► _drop_forward_holds(depth): fetch.release(unit) of every unit
                            the forwards begun inside it hold
    a module's forward   ─► pre-hook: _hooks_off(), _step_boundary(), _check_room(units),
                            _acquire_resident(units) or fetch.acquire(unit) each,
                            _saves_views(); forward hook: _mark_outputs(output, ...),
                            fetch.release(unit) each (or carried: core.keep_held)
    before its backward  ─► _settle_for_backward(), _backward_started(), _check_room(units),
                            fetch.acquire(unit) each (a carried one taken over),
                            _await_grads(unit) at its first backward hold
    a gradient is in     ─► _take_grad(record, grad) (before the release if _grad_first),
                            _grad_may_end(record): _ended_units(record), fetch.release
    a module's backward  ─► _backward_started() (once per backward: queues _backward_ended)
    end of the backward  ─► _backward_ended(): _release_backward_holds(), _after_backward()
    release_stale_holds()─► _drop_forward_holds(0), _release_backward_holds(),
                            _after_failed_pass()
    zero_grad()          ─► overlap.settle("zero_grad"), layout.drop_grads(layout.records())
    close()              ─► overlap.gate(None), _before_close(), hooks removed,
                            _after_unhook(), _close_manager(): _before_manager_close()

Invariants (the subclasses' hooks keep them too): a hold is counted once it is held and
released exactly once (by the module's forward hook, its gradient hook, the end of the
backward, or a failed pass's clean-up); every change of the counters is in a
``signals.held`` section, so an interrupt leaves a hold counted and held, or neither.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from swapper.manager import ManagerStats, TierManager
from swapper.step.config import StepConfig
from swapper.step.sources import ParamGate, ParamSource
from swapper.zero.checkpoint.resume import keeps_store
from swapper.zero.config.offload import OffloadConfig
from swapper.zero.model.autograd import in_autograd
from swapper.zero.model.core import ModelCore
from swapper.zero.model.frozen import FrozenUse, check_not_nested, frozen_use, mark_inputs
from swapper.zero.model.model_buffers import BufferMoves, restore_buffers
from swapper.zero.model.module_apply import unguard_apply
from swapper.zero.model.saved import SavedParams
from swapper.zero.model.strategy import (
    FetchStrategy,
    HoldUnit,
    StateDictCall,
    StateLayout,
    UpdateOverlap,
)
from tiers import signals
from tiers.errors import SwapConfigError

__all__ = [
    "FetchStrategy",
    "HoldUnit",
    "ModelLifecycle",
    "StateDictCall",
    "StateLayout",
    "UpdateOverlap",
]

_M = TypeVar("_M", bound="ModelLifecycle")


class ModelLifecycle(nn.Module):
    """The hook lifecycle both models share (module docstring). Not built directly: a
    subclass's constructor calls this one's (``module``, ``config``), sets ``core``,
    ``fetch``, ``layout``, ``overlap`` and ``_saved``, calls :meth:`_install_hooks`, and
    the subclass supplies its unit and the strategy methods."""

    core: ModelCore[Any, Any]
    #: how a hold's bytes arrive and leave (set by the subclass's constructor)
    fetch: FetchStrategy[Any]
    #: how the state is laid out: whole tensors, or shards (set by the constructor)
    layout: StateLayout[Any]
    #: an overlapped optimizer's side: its gate, and agreements (set by the constructor)
    overlap: UpdateOverlap
    module: nn.Module
    config: OffloadConfig
    _saved: SavedParams
    #: the module, parameter and state-dict hooks the constructor installed
    _handles: list[Any]
    #: the modules whose ``_apply`` is guarded, and the buffers moved to the use device
    _apply_guarded: list[nn.Module]
    _buffer_moves: BufferMoves
    #: the modules wrapped by this class and not closed (a module may be wrapped once)
    _registry: ClassVar[weakref.WeakSet[nn.Module]]
    #: what one hold is of, in log messages ("parameter", "module")
    _hold_unit: ClassVar[str] = "parameter"
    #: the subclass's module's logger (the messages keep the name they always had)
    _log: ClassVar[logging.Logger] = logging.getLogger(__name__)
    #: False once the manager's close() returned (see _close_manager)
    _manager_open = True
    #: modules whose parameters are all frozen (their AfterBackward counts; reset at the
    #: end of every backward)
    _frozen_uses: list[FrozenUse[Any]]
    #: whether the gradient hook hands the gradient over before the backward holds it
    #: ends are released (one process: retained first, as autograd left it), or after
    #: (N ranks: the module's gathered buffer freed before the reduce-scatter needs room)
    _grad_first: ClassVar[bool] = True

    def __init__(self, module: nn.Module, config: OffloadConfig) -> None:
        """The constructors' first step, before anything is set up (:meth:`_check_wrappable`).

        Raises:
            SwapConfigError: as :meth:`_check_wrappable`, or ``config`` is not an
                :class:`~swapper.zero.config.offload.OffloadConfig`.
        """
        super().__init__()
        self._check_wrappable(module)  # (and not inside, nor around, a wrapped one)
        if not isinstance(config, OffloadConfig):
            raise SwapConfigError(f"offload: config must be an OffloadConfig, got {config!r}")
        self.module = module
        self.config = config
        self._frozen_uses = []

    # -- what the optimizer and the user see ------------------------------------------------

    @property
    def manager(self) -> TierManager:
        """The tier manager holding this process's (rank's) parameters and the
        optimizer's state."""
        return self.core.manager

    def step_config(self) -> StepConfig:
        """The optimizer settings ``config`` gives (``config.step``)."""
        return self.config.step

    def stats(self) -> ManagerStats:
        """The manager's counters: bytes moved, stall time, peaks per tier."""
        return self.core.manager.stats()

    def param_source(self) -> ParamSource:
        """The parameters and their retained gradients (one process: whole tensors; N
        ranks: this rank's shards), for the optimizer."""
        return self.layout.param_source()

    def set_param_gate(self, gate: ParamGate | None, *, update_nbytes: int = 0) -> None:
        """Install the gate of an overlapped optimizer (:mod:`swapper.step.deferred`),
        called before a parameter is fetched or its weight read or written; None removes
        it. ``update_nbytes``: the host memory its update holds at once (bytes).

        Raises:
            SwapConfigError: another optimizer's gate is installed, or the host budget
                cannot hold what the forward holds and the update at once (both named;
                :meth:`~swapper.zero.local.overlap.LocalOverlap.install`,
                :meth:`~swapper.zero.sharded.overlap.ShardOverlap.install`, which is an
                agreement over the ranks: PeerFailedError, CollectiveError there).
        """
        self.overlap.install(gate, update_nbytes)

    def step_started(self) -> None:
        """The overlapped optimizer starts a step's update (:mod:`swapper.step.deferred`;
        over N ranks, every rank alike)."""
        self.overlap.step_started()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward (over several ranks: every rank must call it
        alike). If it raises (an error, Ctrl-C), what its modules fetched is released
        before the exception propagates; holds that an aborted backward left are
        released at the next call."""
        holds = self.core.holds
        if holds.forward_depth == 0:
            self._forward_checks()
        depth = len(self.core.forward_holds)
        holds.forward_depth += 1
        try:
            return self._run(args, kwargs)
        except BaseException:
            with signals.held:
                self._drop_forward_holds(depth)
            raise
        finally:
            holds.forward_depth -= 1

    def release_stale_holds(self, *, warn: bool = True) -> int:
        """Release what a forward or backward that raised (an error, Ctrl-C) left held;
        returns how many holds that was. Called by :meth:`forward` and before an
        optimizer step (a warning says so: training goes on after a failed pass), and when
        unwrapping (``warn=False``: the failure is the exception being handled); does
        nothing while a forward or backward runs. Holds kept from a forward for a backward
        that has not run are released too (not counted: a backward fetches them again)."""
        holds = self.core.holds
        if holds.forward_depth or in_autograd():
            return 0
        if not self.core.forward_holds and not holds.in_backward and not holds.carried:
            return 0  # (backward holds exist only while a backward runs)
        with signals.held:
            dropped = self._drop_forward_holds(0)
            with self.core.lock:
                holds.in_backward = False  # a backward that raised never ended
            # Holds kept from a forward whose backward has not run (yet): released, as
            # they would have been without keeping (a later backward fetches again).
            backward, kept = self._release_backward_holds()
            dropped += backward
            self._after_failed_pass()
        if kept:
            self._log.debug(
                "offload: released %d %s hold(s) kept for a backward", kept, self._hold_unit
            )
        if dropped:
            (self._log.warning if warn else self._log.debug)(
                "offload: released %d %s hold(s) left by a failed pass", dropped, self._hold_unit
            )
        return dropped

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the retained 16-bit gradients (the optimizer's ``zero_grad`` does the
        same): the next backward starts them afresh rather than adding to them. With an
        overlapped optimizer, its update (which still reads them) ends first."""
        self.overlap.settle("zero_grad")  # (its update still reads the gradients)
        super().zero_grad(set_to_none=set_to_none)
        self.layout.drop_grads(self.layout.records())

    def drop_grads(self, slots: Iterable[Any], *, keep: bool | None = None) -> None:
        """Drop the retained 16-bit gradients of ``slots`` (records of this model's
        parameters; the optimizer's ``zero_grad`` calls it). One process: with budgets
        that hold everything an entry is kept, marked empty, for the next backward to
        copy into (``keep=False``: unregistered); N ranks: the shards' entries are
        unregistered."""
        self.layout.drop_grads(slots, keep=keep)

    def iter_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, an ordinary full CPU copy of the parameter), one parameter at a time
        (only one copy alive if the caller drops each); the names are the wrapped
        model's own (no ``module.`` prefix). Over N ranks each is gathered (a collective:
        call it on every rank alike).

        Raises:
            OffloadedWriteError: a parameter was written outside the hooks.
            ManagerClosedError: the model was closed (its weights dropped).
            CollectiveError, PeerFailedError: over N ranks, a gather or another rank
                failed.
            and what ``TierManager.fetch`` raises (I/O, corruption).
        """
        return self.layout.iter_state_dict()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped model's state dict with real weights (keys its own, no
        ``module.`` prefix). One process: ``wrapped.module.state_dict(...)``, whose hooks
        put in ordinary CPU copies of the parameters fetched one at a time
        (:mod:`swapper.zero.local.weights`); called by a parent module's ``state_dict``
        (``destination=`` given) it is ``nn.Module``'s, keys under ``module.`` as the
        parent's ``load_state_dict`` expects them. N ranks: the consolidated state dict on
        rank 0 (parameters gathered one at a time; tied parameters under every name;
        buffers as they are), ``{}`` on the others; every rank alike, no arguments
        (TypeError). Raises as :meth:`iter_state_dict`."""
        return self.layout.state_dict(StateDictCall(args, kwargs, super().state_dict))

    def __enter__(self: _M) -> _M:
        return self

    def close(self) -> None:
        """Remove the hooks and drop the tiers (their files deleted, unless the store holds
        training snapshots: then everything is made durable and kept, for a later
        ``resume``); the buffers the wrap moved to the GPU go back. One process: the
        parameters stay placeholders, and ``state_dict()`` of the model raises
        ``ManagerClosedError`` rather than save them empty (``unwrap()`` gives the
        weights back instead). N ranks: this rank's tiers, after the gathers in flight.

        Idempotent; a close cut by a Ctrl-C (while the manager writes what the kept store
        needs, or gathers in flight are waited for) is finished by calling it again: the
        store stays locked against the next ``swapper.offload`` until then."""
        if self.core.closed:
            if self._manager_open:  # an interrupt cut the manager's close: finish it
                self._close_manager()
            return
        gate = self.overlap.gate
        if gate is not None:
            with contextlib.suppress(Exception):  # (the optimizer raises it at its next call)
                gate(None)  # the update stops using the manager first
        self._before_close()
        self.core.closed = True
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._after_unhook()
        unguard_apply(self._apply_guarded)
        with contextlib.suppress(Exception):  # (small; a failed copy leaves one on the GPU)
            restore_buffers(self._buffer_moves)  # where they were before the wrap
        self._close_manager()

    # -- the lifecycle ------------------------------------------------------------------------

    def _check_wrappable(self, module: nn.Module) -> None:
        """The constructor's first check, before anything is set up.

        Raises:
            SwapConfigError: ``module`` is not an ``nn.Module``, is a wrapper of this
                class, or is wrapped by one now (a model is wrapped once), or holds or is
                held by a module wrapped now (:func:`~swapper.zero.model.frozen.check_not_nested`).
        """
        if not isinstance(module, nn.Module):
            raise SwapConfigError(f"offload: expected an nn.Module, got {type(module).__name__}")
        if isinstance(module, type(self)) or module in self._registry:
            raise SwapConfigError(
                f"offload: this {type(module).__name__} is already wrapped; wrap a model once"
            )
        check_not_nested(module, self._registry)  # (a module inside, or around, a wrapped one)

    def _drop_forward_holds(self, depth: int) -> int:
        """Release what the forwards begun above ``depth`` hold (they never finished);
        returns how many holds that was."""
        dropped = 0
        self._saved.pop_from(depth)
        forward_holds = self.core.forward_holds
        while len(forward_holds) > depth:
            for unit in forward_holds.pop()[1]:  # (the units its pre-hook acquired)
                self.fetch.release(unit)
                dropped += 1
        return dropped

    def _backward_started(self) -> None:
        """A module's backward begins: the first of a backward queues its end."""
        holds = self.core.holds
        if holds.in_backward:
            return  # (every module's backward asks: no lock for the common answer)
        with self.core.lock:
            if holds.in_backward:
                return
            holds.in_backward = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_ended)

    def _backward_ended(self) -> None:
        """The backward is over: every hold it (or a forward for it) kept is released."""
        with signals.held:
            with self.core.lock:
                self.core.holds.in_backward = False
            self._release_backward_holds()
        self._after_backward()

    def _close_manager(self) -> None:
        """Close the manager (its files kept when its store holds snapshots: a later
        ``resume``); the module may be wrapped again from then."""
        self._before_manager_close()
        manager = self.core.manager
        manager.close(remove=not keeps_store(manager))
        self._manager_open = False
        self._registry.discard(self.module)

    # -- the hooks, written once: each model supplies its unit ------------------------------

    def _install_hooks(self) -> None:
        """Hook every module that owns parameters (its units: :meth:`_module_units`) and
        each trainable parameter's gradient accumulation; every handle is handed to
        :meth:`_hooked` (one process: kept to be taken off while persistent)."""
        for module, units in self._module_units():
            frozen = frozen_use(units, self._records_of(units))  # all frozen: see frozen.py
            # with_kwargs: a frozen module's inputs given by keyword are marked too
            pre = self._pre_forward_hook(units, frozen)
            self._hooked(module, "pre", module.register_forward_pre_hook(pre, with_kwargs=True))
            # always_call: a forward that raises (the early stop of a non-reentrant
            # checkpoint's recompute raises on purpose) still releases what it acquired
            post = self._post_forward_hook(units, frozen)
            self._hooked(module, "post", module.register_forward_hook(post, always_call=True))
        for record in self.layout.records():
            param = record.param
            if param.requires_grad:
                hook = self._grad_hook(record)
                self._hooked(param, "grad", param.register_post_accumulate_grad_hook(hook))

    def _pre_forward_hook(
        self, units: list[HoldUnit], frozen: FrozenUse[HoldUnit] | None
    ) -> Callable[..., Any]:
        """A module's forward pre-hook: acquire its units (each counted and recorded in
        the forward's entry, or neither), then, where parameters can move before the
        backward, autograd's saved views of them kept as positions
        (:mod:`~swapper.zero.model.saved`); a module whose parameters are all frozen has
        its inputs marked (:func:`~swapper.zero.model.frozen.mark_inputs`)."""
        after = None
        if frozen is not None:  # (recorded: the end of a backward resets its count)
            self._frozen_uses.append(frozen)
            after = self._frozen_after(frozen)
        records = self._records_of(units)
        core = self.core

        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            if self._hooks_off():  # (one process: persistent from here, this hook off)
                return None
            self._step_boundary()
            self._check_room(units)
            taken: list[HoldUnit] = []
            core.forward_holds.append((module, taken))
            with signals.at_waits:  # each one acquired and recorded, or neither
                if self._acquire_resident(units):
                    taken.extend(units)
                else:
                    for unit in units:
                        self.fetch.acquire(unit)
                        taken.append(unit)
                if self._saves_views():
                    self._saved.push(len(core.forward_holds) - 1, records)
            if after is not None and not core.keep_held and torch.is_grad_enabled():
                return mark_inputs(args, kwargs, after)
            return None

        return hook

    def _frozen_after(self, frozen: FrozenUse[HoldUnit]) -> Callable[[], None]:
        """The AfterBackward hook (:mod:`swapper.zero.model.frozen`) of a module whose
        parameters are all frozen: release the holds one backward of it took."""
        core = self.core

        def after() -> None:
            with signals.held:  # uncounted and released, or neither
                with core.lock:
                    if not frozen.pending:
                        return  # (its holds were released already: the backward ended)
                    frozen.pending -= 1
                    for unit in frozen.slots:
                        unit.backward_holds -= 1
                for unit in frozen.slots:
                    self.fetch.release(unit)

        return after

    def _post_forward_hook(
        self, units: list[HoldUnit], frozen: FrozenUse[HoldUnit] | None
    ) -> Callable[..., Any]:
        """A module's forward hook (always called): release what its pre-hook acquired
        (and what forwards begun inside it and never finished hold), or keep it for the
        backward (``core.keep_held``: ``carried``); mark the outputs so that the module's
        backward acquires its units again first (:meth:`_mark_outputs`)."""
        core = self.core

        def before_backward() -> None:
            self._settle_for_backward()
            self._backward_started()
            self._check_room(units)
            with signals.at_waits:  # each one acquired and recorded, or neither
                for unit in units:
                    if unit.carried:  # held since its forward: taken over, nothing fetched
                        with core.lock:
                            unit.carried -= 1
                            core.holds.carried -= 1
                            unit.backward_holds += 1
                        continue
                    self.fetch.acquire(unit)
                    with core.lock:
                        if not unit.backward_holds:
                            self._await_grads(unit)
                        unit.backward_holds += 1
                if frozen is not None:
                    with core.lock:
                        frozen.pending += 1  # (what its AfterBackward releases)

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            with signals.held:
                # This module's entry, and above it those of forwards that began inside
                # it and never finished (abandoned: nothing else will release them).
                held = core.forward_holds
                at = len(held) - 1
                while at >= 0 and held[at][0] is not module:
                    at -= 1
                own: list[HoldUnit] = []
                if at >= 0:
                    self._saved.pop_from(at)
                    self._drop_forward_holds(at + 1)
                    own = held.pop()[1]
                carry = False
                try:
                    if output is not None and torch.is_grad_enabled():
                        output, hooked = self._mark_outputs(output, before_backward)
                        # Kept for the backward when the use tier holds every parameter
                        # anyway (the release and the fetch again cost more than a narrow
                        # module's work); never inside a backward (a recompute's holds
                        # end with it).
                        carry = hooked and core.keep_held and not in_autograd()
                    return output
                finally:
                    if carry:
                        with core.lock:
                            for unit in own:
                                unit.carried += 1
                            core.holds.carried += len(own)
                    else:
                        for unit in own:
                            self.fetch.release(unit)

        return hook

    def _grad_hook(self, record: Any) -> Callable[[torch.Tensor], None]:
        """A parameter's gradient is accumulated (``register_post_accumulate_grad_hook``:
        every use of it has contributed): the gradient is handed over
        (:meth:`_take_grad`) and ``.grad`` dropped; the backward holds its arrival ends
        (:meth:`_ended_units`) are released."""
        core = self.core
        first = self._grad_first

        def hook(param: torch.Tensor) -> None:
            grad = param.grad
            if first:
                self._take_grad(record, grad)
            if grad is not None:
                param.grad = None  # moved: the retained buffer (or the reducer) holds it
            if self._grad_may_end(record):  # (not the common case: no lock, no section)
                with signals.held:
                    for unit in self._ended_units(record):
                        with core.lock:
                            holds, unit.backward_holds = unit.backward_holds, 0
                        for _ in range(holds):
                            self.fetch.release(unit)
            if not first:
                self._take_grad(record, grad)

        return hook

    def _release_backward_holds(self) -> tuple[int, int]:
        """Release every backward hold and every hold kept from a forward for its
        backward; returns how many of each. Signals held by the caller."""
        core = self.core
        with core.lock:
            leftovers = [
                (unit, unit.backward_holds, unit.carried)
                for unit in self._all_units()
                if unit.backward_holds or unit.carried
            ]
            for unit, _, kept in leftovers:
                unit.backward_holds = 0
                unit.carried -= kept
                core.holds.carried -= kept
            for frozen in self._frozen_uses:
                frozen.pending = 0
            self._forget_waits()
        for unit, holds, kept in leftovers:
            for _ in range(holds + kept):
                self.fetch.release(unit)
        return sum(h for _, h, _ in leftovers), sum(k for _, _, k in leftovers)

    # -- the unit: what one hold is of, and what the hooks do with it --------------------------

    def _module_units(self) -> Iterable[tuple[nn.Module, list[HoldUnit]]]:
        """Unit: every module that owns parameters, with the units its hooks acquire
        (one process: its parameters' slots; N ranks: its one module state)."""
        raise NotImplementedError

    def _all_units(self) -> Iterable[HoldUnit]:
        """Unit: every unit (for the end of a backward's clean-up)."""
        raise NotImplementedError

    def _records_of(self, units: list[HoldUnit]) -> list[Any]:
        """Unit: the parameter records ``units`` hold (what autograd's saved views are
        kept as positions of, and what says whether a module is all frozen)."""
        raise NotImplementedError

    def _hooked(self, owner: Any, kind: str, handle: Any) -> None:
        """Unit: keep a hook's handle (``kind``: "pre", "post" or "grad")."""
        raise NotImplementedError

    def _hooks_off(self) -> bool:
        """Unit: whether a pre-hook has nothing to do from now (default: False)."""
        return False

    def _step_boundary(self) -> None:
        """Unit: a module's forward begins (the recorded orders' step boundary)."""
        raise NotImplementedError

    def _check_room(self, units: list[HoldUnit]) -> None:
        """Unit: raise at once if the units cannot be held beside what is (default:
        nothing)."""

    def _acquire_resident(self, units: list[HoldUnit]) -> bool:
        """Unit: acquire all of ``units`` in one fast path where nothing has to move;
        whether it did (default: False, nothing acquired)."""
        return False

    def _saves_views(self) -> bool:
        """Unit: whether this forward keeps autograd's saved views of the parameters as
        positions (:mod:`swapper.zero.model.saved`)."""
        raise NotImplementedError

    def _settle_for_backward(self) -> None:
        """Unit: before a module's backward acquires its units (an overlapped update
        that reads the gradients ends first)."""
        raise NotImplementedError

    def _await_grads(self, unit: HoldUnit) -> None:
        """Unit: the first backward hold of ``unit`` in this backward is taken, under the
        lock (default: nothing)."""

    def _mark_outputs(self, output: Any, before_backward: Callable[[], None]) -> tuple[Any, bool]:
        """Unit: ``output`` as the module returns it, marked so that ``before_backward``
        runs before its backward; and whether any tensor was marked."""
        raise NotImplementedError

    def _take_grad(self, record: Any, grad: torch.Tensor | None) -> None:
        """Unit: hand over a parameter's accumulated gradient (None: it got none)."""
        raise NotImplementedError

    def _grad_may_end(self, record: Any) -> bool:
        """Unit: whether a gradient's arrival may end backward holds (read without the
        lock: a cheap first test)."""
        raise NotImplementedError

    def _ended_units(self, record: Any) -> Iterable[HoldUnit]:
        """Unit: the units whose backward holds the arrival of ``record``'s gradient
        ends (signals held by the caller)."""
        raise NotImplementedError

    def _forget_waits(self) -> None:
        """Unit: the end of a backward, under the lock (default: nothing)."""

    # -- the strategy: what one process and N ranks do differently --------------------------

    def _forward_checks(self) -> None:
        """Strategy: the outermost forward's checks, before anything moves."""
        raise NotImplementedError

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Strategy: run the wrapped module (its hooks hold and release)."""
        raise NotImplementedError

    def _after_backward(self) -> None:
        """Strategy: after a backward's holds are released (read-ahead, gradients)."""
        raise NotImplementedError

    def _after_failed_pass(self) -> None:
        """Strategy: after a failed pass's holds are released (default: nothing)."""

    def _before_close(self) -> None:
        """Strategy: ``close``'s work before the model counts as closed (default:
        nothing)."""

    def _after_unhook(self) -> None:
        """Strategy: ``close``'s work once the hooks are removed (default: nothing)."""

    def _before_manager_close(self) -> None:
        """Strategy: before the manager closes (default: nothing)."""
