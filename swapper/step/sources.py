"""Where :class:`~swapper.step.OffloadAdamW` finds the 16-bit parameters and gradients.

A step touches them through four calls, each on a range of one parameter's flattened
elements, so the optimizer does not care whether they are ordinary tensors
(:class:`LocalParams`) or live in the tier manager (``swapper.zero``'s source).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from swapper.step.clip import grad_norm32

if TYPE_CHECKING:
    from swapper.manager import TierManager
    from swapper.step.config import StepConfig

__all__ = [
    "AgreedModel",
    "ConsumingSource",
    "GatedModel",
    "LocalParams",
    "ParamGate",
    "ParamSource",
    "ResidentSource",
    "SharedStep",
    "TieredModel",
    "WholeSource",
]

#: ``gate(param)``: called by a model's hooks before they fetch ``param`` (and before a
#: weight of it is read or written outside them); returns once no pending optimizer
#: update will change it. ``gate(None)``: wait until no update is pending at all. Raises
#: what the pending update failed with (see :mod:`swapper.step.deferred`).
ParamGate = Callable[[torch.Tensor | None], None]


class ParamSource(Protocol):
    """The 16-bit parameters of an optimizer and their retained gradients."""

    def shape(self, param: torch.Tensor) -> torch.Size:
        """The parameter's real shape (its ``.data`` may be a placeholder)."""
        ...

    def dtype(self, param: torch.Tensor) -> torch.dtype:
        """The parameter's dtype."""
        ...

    def contiguous(self, param: torch.Tensor) -> bool:
        """Whether its elements are laid out contiguously (row-major)."""
        ...

    def read_param(self, param: torch.Tensor, start: int, out: torch.Tensor) -> None:
        """Copy elements ``[start, start + out.numel())`` of the flattened parameter into
        ``out`` (fp32, converted exactly)."""
        ...

    def read_grad(self, param: torch.Tensor, start: int, out: torch.Tensor) -> bool:
        """Copy the same range of its gradient into ``out``; False (``out`` untouched)
        when it has no gradient."""
        ...

    def write_param(self, param: torch.Tensor, start: int, source: torch.Tensor) -> None:
        """Round ``source`` (fp32) into elements ``[start, start + source.numel())``."""
        ...

    def grad_norms(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The fp32 L2 norm of each parameter's gradient that exists, for the global
        norm, rounded as ``clip_grad_norm_`` rounds it (:func:`swapper.step.clip.grad_norm32`);
        a source holding one rank's shards returns one norm, the global one, reduced over
        the ranks (inf when any rank found inf/NaN)."""
        ...

    def zero_grad(self, params: Sequence[torch.Tensor]) -> None:
        """Drop the gradients."""
        ...


class LocalParams:
    """Parameters that are ordinary tensors, with their gradients in ``.grad``."""

    def shape(self, param: torch.Tensor) -> torch.Size:
        return param.shape

    def dtype(self, param: torch.Tensor) -> torch.dtype:
        return param.dtype

    def contiguous(self, param: torch.Tensor) -> bool:
        return param.is_contiguous()

    def read_param(self, param: torch.Tensor, start: int, out: torch.Tensor) -> None:
        out.copy_(param.detach().view(-1)[start : start + out.numel()])

    def read_grad(self, param: torch.Tensor, start: int, out: torch.Tensor) -> bool:
        grad = param.grad
        if grad is None:
            return False
        out.copy_(grad.reshape(-1)[start : start + out.numel()])
        return True

    def write_param(self, param: torch.Tensor, start: int, source: torch.Tensor) -> None:
        param.detach().view(-1)[start : start + source.numel()].copy_(source)

    def grad_norms(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return grad_norm32([p.grad for p in params if p.grad is not None])

    def zero_grad(self, params: Sequence[torch.Tensor]) -> None:
        for p in params:
            p.grad = None


@runtime_checkable
class ResidentSource(Protocol):
    """A :class:`ParamSource` that can hold its parameters and gradients for a whole step
    when nothing has to move (one fetch each per step instead of one per piece)."""

    def resident(self, params: Sequence[torch.Tensor]) -> AbstractContextManager[bool]:
        """Around one step over ``params``; a no-op when anything may have to move.
        Yields whether everything is held, on the CPU (the step may then convert every
        gradient at once: :mod:`swapper.step.flat_grads`)."""
        ...


@runtime_checkable
class AheadSource(Protocol):
    """A :class:`ParamSource` whose parameters and gradients may be on NVMe: the step
    asks for those of the sub-groups after the one computing to be read ahead, beside
    their optimizer state (at 2.17 B parameters the step read 3.2 GB of gradients and
    1.9 GB of parameters, each on demand as its sub-group came up)."""

    def read_ahead(self, params: Sequence[torch.Tensor], partial: Sequence[torch.Tensor]) -> None:
        """Ask for the retained gradients of ``params``, and the parameters ``partial``
        (those the step writes in part: it needs their other bytes), to be read into
        memory (a hint: returns at once; what has no room is left where it is)."""
        ...


@runtime_checkable
class ConsumingSource(Protocol):
    """A :class:`ParamSource` that can let go of a gradient as soon as the step has read
    all of it. Between the step and ``zero_grad`` nothing reads a retained gradient
    again (its norm, taken before the step, is kept), so under a host budget one the
    step's own state needs room for can be dropped instead of written to NVMe and read
    by nobody (docs/notes/2026-11-28-speed-3.md found them at 20M parameters;
    docs/notes/2026-11-29-iteration-5.md has what dropping them saves)."""

    def consumed(self, params: Sequence[torch.Tensor]) -> None:
        """Every piece of these parameters' gradients has been read by an update that
        has been applied (a failed step's rerun never reads them again). The source may
        drop them now; until ``zero_grad`` they still count as present (for the norm),
        and reading one again, or adding a backward's gradient to one, raises."""
        ...

    def check_unconsumed(self, params: Sequence[torch.Tensor]) -> None:
        """Called by a new step (not a failed step's rerun) before anything changes:
        raises (naming the parameter) when one of ``params`` has a gradient a step
        consumed and no ``zero_grad`` has cleared since; a second ``step()`` on the same
        gradients, which PyTorch would apply twice, fails here instead of part-way."""
        ...


@runtime_checkable
class SharedStep(Protocol):
    """A :class:`ParamSource` whose step is shared with other processes (one rank's
    shards of a model partitioned over a process group)."""

    def agree_step(self, ok: bool) -> None:
        """Called by the optimizer on every rank after its part of a step, ``ok=False``
        from a rank whose part failed (which then raises its own error).

        Raises:
            PeerFailedError: some rank's part failed (on every rank).
            CollectiveError: the agreement failed or timed out.
        """
        ...


@runtime_checkable
class WholeSource(Protocol):
    """A :class:`SharedStep` source that can say which parameters this rank holds whole
    (what an optimizer that is not element-wise needs: Adafactor's row and column means
    read all of a parameter, in its shape)."""

    def whole_shape(self, param: torch.Tensor) -> torch.Size | None:
        """The parameter's real shape where this rank holds all of it; ``torch.Size([0])``
        where another rank holds it whole (this rank has none of it); None where it is
        sharded over the ranks (this rank holds a flat, padded part of it)."""
        ...


@runtime_checkable
class TieredModel(Protocol):
    """A model whose parameters live in a tier manager (what :func:`swapper.offload`
    returns); :class:`~swapper.step.OffloadAdamW` keeps its state in the same manager."""

    @property
    def manager(self) -> TierManager: ...

    def param_source(self) -> ParamSource:
        """Access to its parameters and their retained gradients."""
        ...

    def step_config(self) -> StepConfig:
        """The optimizer settings its config gives (``OffloadConfig.step``); the
        optimizer takes those its own config leaves ``None``."""
        ...


@runtime_checkable
class GatedModel(Protocol):
    """A model whose hooks call a :data:`ParamGate` before they use a parameter (what an
    overlapped step needs: :mod:`swapper.step.deferred`)."""

    def set_param_gate(self, gate: ParamGate | None, *, update_nbytes: int = 0) -> None:
        """Install ``gate`` (None: remove it); ``update_nbytes``: the host memory the
        overlapped update holds at once, beside what the forward holds.

        Raises:
            SwapConfigError: another gate is installed (one overlapped optimizer per
                model), or the budgets cannot hold the forward's parameters and the update
                at once (named).
        """
        ...

    def release_stale_holds(self, *, warn: bool = True) -> int:
        """Release what a forward or backward that raised left fetched (before an update
        writes the parameters from another thread)."""
        ...

    def step_started(self) -> None:
        """An overlapped update starts now (the model records its manager's eviction
        order over a whole overlapped cycle: from the first forward after the first step
        to the first forward after the next)."""
        ...


@runtime_checkable
class AgreedModel(Protocol):
    """A :class:`GatedModel` partitioned over ranks (what ``swapper.offload`` returns with a
    process group): its overlapped updates are agreed over the ranks at points every rank
    reaches in the same order, never from the update's thread
    (:mod:`swapper.zero.sharded.overlap`)."""

    def agree_update(self, finish: Callable[[], None] | None) -> bool:
        """Called by ``step()`` on every rank, first, once this rank's update ended;
        ``finish`` finishes it in the caller's thread when it failed (else None). Returns
        True when some rank finished a failed update: ``step()`` then starts no new step.

        Raises:
            what ``finish`` raised, on its rank; PeerFailedError: on the other ranks;
            CollectiveError: the agreement failed or timed out.
        """
        ...
