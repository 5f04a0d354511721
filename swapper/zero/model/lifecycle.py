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
``drop_grads``, ``iter_state_dict`` and ``state_dict`` ask it. The rest a subclass supplies
through the methods marked "strategy" below (template methods still: the hooks' bodies,
see ``docs/architecture.md``).

The order in which the lifecycle calls the strategy (each call on the thread that runs
the forward or the backward)::

    forward()            ─► _forward_checks() (outermost forward only: nothing moved yet)
                         ─► _run(args, kwargs) (the module; its hooks acquire/release)
       raised (an error, Ctrl-C):
                         ─► _drop_forward_holds(depth): fetch.release(unit) of every unit
                            the forwards begun inside it hold (_entry_units)
    a module's backward  ─► _backward_started() (once per backward: queues _backward_ended)
    end of the backward  ─► _backward_ended(): _release_backward_holds(), _after_backward()
    release_stale_holds()─► _drop_forward_holds(0), _release_backward_holds(),
                            _after_failed_pass()
    zero_grad()          ─► _settle_update("zero_grad"), layout.drop_grads(layout.records())
    close()              ─► _update_gate()(None), _before_close(), hooks removed,
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
from typing import Any, ClassVar, Protocol, TypeVar

import torch
from torch import nn

from swapper.manager import ManagerStats, TierManager
from swapper.step.config import StepConfig
from swapper.step.sources import ParamGate
from swapper.zero.checkpoint.resume import keeps_store
from swapper.zero.config.offload import OffloadConfig
from swapper.zero.model.autograd import in_autograd
from swapper.zero.model.core import ModelCore
from swapper.zero.model.frozen import check_not_nested
from swapper.zero.model.model_buffers import BufferMoves, restore_buffers
from swapper.zero.model.module_apply import unguard_apply
from swapper.zero.model.saved import SavedParams
from tiers import signals
from tiers.errors import SwapConfigError

__all__ = ["FetchStrategy", "ModelLifecycle", "StateLayout"]

_M = TypeVar("_M", bound="ModelLifecycle")
#: what one hold is of (one process: a ``Slot``; N ranks: a ``ModuleState``)
_U = TypeVar("_U", contravariant=True)
#: a model's record of one parameter (one process: a ``Slot``; N ranks: a ``ShardSlot``)
_R = TypeVar("_R")


class FetchStrategy(Protocol[_U]):
    """How the bytes of one hold arrive and leave (``model.fetch``): the model's hooks
    call :meth:`acquire` before a unit is used and :meth:`release` after, once per hold;
    the lifecycle calls :meth:`release` for the holds a failed pass left. A unit is
    fetched for its first user and given back after its last.

    One process: :class:`~swapper.zero.local.fetch.TierFetch` (a parameter from the
    tiers); N ranks: :class:`~swapper.zero.sharded.gathers.Gathers` (a module gathered by
    collective)."""

    def acquire(self, unit: _U) -> None:
        """Count a user of ``unit``, its bytes arriving for the first. Cut (an error,
        Ctrl-C), nothing is counted or held."""
        ...

    def release(self, unit: _U) -> None:
        """Give back one hold of ``unit``; after the last, its bytes leave. Never cut
        half-way (signals held)."""
        ...


class StateLayout(Protocol[_R]):
    """How the model's state is laid out in this process (``model.layout``): whole
    tensors (:class:`~swapper.zero.local.layout.WholeTensors`) or this rank's shards
    (:class:`~swapper.zero.sharded.layout.Shards`), ``_R`` the record of one parameter.
    The lifecycle calls :meth:`records` and :meth:`drop_grads` from ``zero_grad``, and
    hands ``iter_state_dict``/``state_dict`` to it."""

    def records(self) -> Iterable[_R]:
        """Every parameter's record."""
        ...

    def drop_grads(self, slots: Iterable[_R], *, keep: bool | None = None) -> None:
        """Drop the retained gradients of ``slots`` (``keep``: may an entry stay,
        marked empty)."""
        ...

    def iter_state_dict(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full CPU copy) of every parameter, one at a time."""
        ...

    def state_dict(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        as_submodule: Callable[..., dict[str, Any]],
    ) -> dict[str, Any]:
        """The model's ``state_dict(*args, **kwargs)`` (``as_submodule``: the wrapper's
        own ``nn.Module.state_dict``, for a parent module's call)."""
        ...


class ModelLifecycle(nn.Module):
    """The hook lifecycle both models share (module docstring). Not built directly: a
    subclass sets ``core``, ``fetch``, ``layout``, ``module``, ``config`` and ``_saved``
    in its constructor and supplies the strategy methods."""

    core: ModelCore[Any, Any]
    #: how a hold's bytes arrive and leave (set by the subclass's constructor)
    fetch: FetchStrategy[Any]
    #: how the state is laid out: whole tensors, or shards (set by the constructor)
    layout: StateLayout[Any]
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
        self._settle_update("zero_grad")
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
        return self.layout.state_dict(args, kwargs, super().state_dict)

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
        gate = self._update_gate()
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
            for unit in self._entry_units(forward_holds.pop()):
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

    # -- the strategy: what one process and N ranks do differently --------------------------

    def _forward_checks(self) -> None:
        """Strategy: the outermost forward's checks, before anything moves."""
        raise NotImplementedError

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Strategy: run the wrapped module (its hooks hold and release)."""
        raise NotImplementedError

    def _entry_units(self, entry: Any) -> Iterable[Any]:
        """Strategy: the units (records, or modules) one ``forward_holds`` entry holds."""
        raise NotImplementedError

    def _release_backward_holds(self) -> tuple[int, int]:
        """Strategy: release every backward hold and every hold kept from a forward for
        its backward; returns how many of each. Signals held by the caller."""
        raise NotImplementedError

    def _after_backward(self) -> None:
        """Strategy: after a backward's holds are released (read-ahead, gradients)."""
        raise NotImplementedError

    def _after_failed_pass(self) -> None:
        """Strategy: after a failed pass's holds are released (default: nothing)."""

    def _settle_update(self, what: str) -> None:
        """Strategy: wait for an overlapped optimizer's update before ``what`` changes
        what it reads."""
        raise NotImplementedError

    def _update_gate(self) -> ParamGate | None:
        """Strategy: the overlapped optimizer's gate installed now, if any (``close``
        calls it with None first: the update stops using the manager)."""
        raise NotImplementedError

    def _before_close(self) -> None:
        """Strategy: ``close``'s work before the model counts as closed (default:
        nothing)."""

    def _after_unhook(self) -> None:
        """Strategy: ``close``'s work once the hooks are removed (default: nothing)."""

    def _before_manager_close(self) -> None:
        """Strategy: before the manager closes (default: nothing)."""
