"""The interfaces of the model core (issue 25): what the one hook lifecycle
(:class:`~swapper.zero.model.lifecycle.ModelLifecycle`) asks of each model's strategy
objects and of its unit. One process and N ranks differ in *how bytes arrive*
(:class:`FetchStrategy`, ``model.fetch``), *how the state is laid out*
(:class:`StateLayout`, ``model.layout``), *how an overlapped optimizer is gated*
(:class:`UpdateOverlap`, ``model.overlap``) and *what one hold is of*
(:class:`HoldUnit`); the lifecycle is the same.

May import: :mod:`swapper.step`'s public seams, torch; nothing of the models.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar

import torch

from swapper.step.sources import ParamGate, ParamSource

__all__ = [
    "FetchStrategy",
    "HoldUnit",
    "StateDictCall",
    "StateLayout",
    "UpdateOverlap",
]

#: what one hold is of (one process: a ``Slot``; N ranks: a ``ModuleState``)
_U = TypeVar("_U", contravariant=True)
#: a model's record of one parameter (one process: a ``Slot``; N ranks: a ``ShardSlot``)
_R = TypeVar("_R")


class HoldUnit(Protocol):
    """What one hold is of (one process: a ``Slot``, one parameter; N ranks: a
    ``ModuleState``, one module gathered): the counters the hooks change, under the
    core's lock, in ``signals.held`` sections."""

    #: holds outstanding (forward and backward)
    users: int
    #: of which taken for a backward (released by the gradient hook, an AfterBackward, or
    #: the end of the backward)
    backward_holds: int
    #: holds kept from a forward for its backward (never on N ranks)
    carried: int


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


class UpdateOverlap(Protocol):
    """An overlapped optimizer's side in the model (``model.overlap``;
    :mod:`swapper.step.deferred` runs a step's update while the next forward runs): one
    process, :class:`~swapper.zero.local.overlap.LocalOverlap` (a gate on the
    parameters); N ranks, :class:`~swapper.zero.sharded.overlap.ShardOverlap` (the gate
    and the ranks' agreements). The lifecycle's ``set_param_gate`` and ``step_started``
    hand over to it, ``zero_grad`` and ``close`` ask it."""

    @property
    def gate(self) -> ParamGate | None:
        """The gate installed now (None: none)."""
        ...

    def install(self, gate: ParamGate | None, update_nbytes: int) -> None:
        """Install the optimizer's gate (None: remove it); ``update_nbytes``: the host
        memory its update holds at once."""
        ...

    def step_started(self) -> None:
        """The optimizer starts a step's update."""
        ...

    def settle(self, what: str) -> None:
        """Wait for the update before ``what`` changes what it reads."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class StateDictCall:
    """One call of the model's ``state_dict(*args, **kwargs)``, handed to its layout;
    ``as_submodule`` is the wrapper's own ``nn.Module.state_dict`` (for a parent module's
    call: keys under ``module.``)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    as_submodule: Callable[..., dict[str, Any]]

    @property
    def from_parent(self) -> bool:
        """Whether a parent module's ``state_dict`` made the call (``destination=``
        given, or positional arguments)."""
        return bool(self.args) or "destination" in self.kwargs


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

    def param_source(self) -> ParamSource:
        """The optimizer's view of the parameters and their retained gradients (whole
        tensors, or this rank's shards)."""
        ...

    def state_dict(self, call: StateDictCall) -> dict[str, Any]:
        """The model's ``state_dict(*call.args, **call.kwargs)``."""
        ...
