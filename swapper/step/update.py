"""One step's arithmetic for :class:`~swapper.step.optimizer.OffloadAdamW`: the global
gradient norm, the factor the fp32 gradients are multiplied by, each sub-group's fp32
gradient built from the retained 16-bit one, the fused AdamW update and the rounding of
the new masters into the 16-bit parameters.

Why a mixin: ``OffloadAdamW`` is torch's ``Optimizer`` surface (construction, state dict,
``zero_grad``, closing) and the order of a step; what is computed per sub-group is a job of
its own, and the overlapped step (:mod:`swapper.step.deferred`) calls the same methods from
its thread. The attributes it reads are set by ``OffloadAdamW.__init__`` (declared below).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from swapper.step.clip import clip_coefficient, grad_norm32, total_norm
from swapper.step.deferred import DeferredSteps
from swapper.step.flat_grads import FlatGrads
from swapper.step.layout import SubGroup
from swapper.step.pipeline import StepPipeline
from swapper.step.rules.base import UpdateRule
from swapper.step.scaler import DynamicLossScaler
from swapper.step.sources import AheadSource, ConsumingSource, ParamSource, SharedStep

__all__ = ["SubGroupMath"]


class SubGroupMath:
    """The per-step arithmetic of ``OffloadAdamW`` (module docstring)."""

    param_groups: list[dict[str, Any]]
    max_grad_norm: float | None
    loss_scaler: DynamicLossScaler | None
    _source: ParamSource
    _pipeline: StepPipeline
    _accumulators: list[torch.Tensor]
    _flat: FlatGrads
    _grad32: dict[torch.device, torch.Tensor]
    _frozen_groups: list[dict[str, Any]] | None
    _deferred: DeferredSteps | None
    _run_order: tuple[int, ...] | None
    #: sub-group index → positions of its pieces without a gradient, from :meth:`_grad`
    #: to the rule's update (one update per sub-group at a time, on one thread)
    _absent: dict[int, frozenset[int]]
    #: for :meth:`_drop_consumed`: the sub-groups these owners were counted from, and
    #: (param group, parameter index) → the indices of the sub-groups holding its pieces
    _owners_of: tuple[SubGroup, ...] | None
    _owners: dict[tuple[int, int], tuple[int, ...]]
    rule: UpdateRule

    @property
    def sub_groups(self) -> tuple[SubGroup, ...]:
        """The sub-groups the state is cut into."""
        return self._pipeline.sub_groups

    def _all_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def _param(self, sg: SubGroup, param_index: int) -> torch.Tensor:
        return self.param_groups[sg.group_index]["params"][param_index]

    def grad_norm(self) -> tuple[torch.Tensor | None, bool]:
        """(unscaled global L2 norm as a 0-dim fp32 tensor, found inf/NaN), when clipping
        or scaling needs it; computed as ``clip_grad_norm_`` does (see
        :mod:`swapper.step.clip`)."""
        if self.max_grad_norm is None and self.loss_scaler is None:
            return None, False
        if self._accumulators:
            # per parameter, as the reference's fp32 .grad tensors would be
            norms = [
                n
                for group, acc in zip(self.param_groups, self._accumulators, strict=True)
                for n in grad_norm32(acc.split([p.numel() for p in group["params"]]))
            ]
        elif self._flat.filled:
            norms = self._flat.norms
        else:
            norms = self._source.grad_norms(self._all_params())
        if not norms:
            return torch.tensor(0.0), False
        total = total_norm(norms)  # one host sync below for the whole norm
        if not math.isfinite(float(total)):
            return total, True
        if self.loss_scaler is not None:
            # the scale is a power of two: dividing the norm is exact, and equals the
            # norm of the unscaled gradients that GradScaler.unscale_ would give
            total = total / self.loss_scaler.loss_scale
        return total, False

    def grad_factor(self, grad_norm: torch.Tensor | None) -> float:
        """What the fp32 gradients are multiplied by: 1/scale, times the clip coefficient
        (computed in fp32 as ``clip_grad_norm_`` does; the returned float is that fp32
        value exactly, so multiplying an fp32 tensor by it rounds as torch does)."""
        factor = 1.0
        if self.loss_scaler is not None:
            factor = 1.0 / self.loss_scaler.loss_scale
        if self.max_grad_norm is not None and grad_norm is not None:
            factor *= float(clip_coefficient(grad_norm, self.max_grad_norm))
        return factor

    def _run_agreed(self, target: int, factor: float) -> None:
        """:meth:`_run`; over a sharded model, then an agreement of every rank: a rank's
        failure raises on every rank, and every rank keeps the step pending (done
        sub-groups kept), so ``step()`` again on every rank finishes it everywhere."""
        source = self._source
        if not isinstance(source, SharedStep):
            self._run(target, factor)
            return
        try:
            self._run(target, factor)
        except BaseException:
            with contextlib.suppress(Exception):  # (it raises: this rank said it failed)
                source.agree_step(False)
            raise
        source.agree_step(True)

    def _run(self, target: int, factor: float) -> None:
        threads = torch.get_num_threads()
        try:
            if (
                self._pipeline.streams
                and threads > 1
                and self._pipeline.codec.moments != "int8"
                and self.rule.elementwise  # (a reduction's bits depend on the threads)
            ):
                # The kernel runs while reads and writes are in flight, and O_DIRECT
                # submission and completion take CPU too: on a small machine a kernel on
                # every core starves them, and the step stops overlapping (measured in
                # docs/benchmarks.md). So the step leaves one core to the I/O threads.
                # Not with 8-bit moments: their encoding and decoding, not the I/O (half
                # the bytes), bound the step, and every core is faster (2 cores: 0.71
                # against 0.85 s a step at 50M, docs/benchmarks.md, 2026-11-26).
                torch.set_num_threads(threads - 1)
            self._run_pipeline(target, factor)
        finally:
            torch.set_num_threads(threads)

    def run_update(
        self,
        step: int,
        factor: float,
        *,
        groups: list[dict[str, Any]] | None = None,
        order: tuple[int, ...] | None = None,
    ) -> None:
        """Every sub-group's update of step ``step`` (the overlapped step's, in its
        thread): with ``groups``' hyper-parameters (as they were at ``step()``; default:
        the live param groups) in ``order`` (sub-group indices; default: by index), the
        fp32 gradients multiplied by ``factor``.

        Raises:
            StepFailedError: an I/O error or timeout stopped it part-way (the sub-groups
                done stay done).
        """
        self._frozen_groups = groups
        self._run_order = order
        try:
            self._run_pipeline(step, factor)
        finally:
            self._frozen_groups = None
            self._run_order = None

    def _run_pipeline(self, target: int, factor: float) -> None:
        """Every sub-group through the pipeline; a subclass may fetch more per sub-group
        (``swapper.bench.legacy_step`` fetches the fp32 gradient it wrote)."""
        self._pipeline.run(
            target,
            lambda sg, state, extras: self._update(sg, state, extras, target, factor),
            self._publish,
            order=self._run_order,
            ahead=self._ahead if isinstance(self._source, AheadSource) else None,
        )

    def _ahead(self, sg: SubGroup) -> None:
        """Read ahead the gradients ``sg``'s update reads, and the parameters its publish
        writes in part (a parameter it writes whole is placed without reading its old
        bytes: :meth:`~swapper.manager.TierManager.assign`)."""
        source = self._source
        if isinstance(source, AheadSource):
            params = [self._param(sg, piece.param_index) for piece in sg.pieces]
            partial = [
                param
                for piece, param in zip(sg.pieces, params, strict=True)
                if piece.numel != source.shape(param).numel()
            ]
            source.read_ahead(params, partial)

    def _grad_buffer(self, device: torch.device, numel: int) -> torch.Tensor:
        buffer = self._grad32.get(device)
        if buffer is None:
            largest = max(sg.numel for sg in self.sub_groups)
            buffer = torch.empty(largest, dtype=torch.float32, device=device)
            self._grad32[device] = buffer
        return buffer[:numel]

    def _build_grad(self, sg: SubGroup, out: torch.Tensor, factor: float) -> frozenset[int]:
        """The fp32 gradient of ``sg`` from the retained 16-bit gradients, into ``out``
        (zeros where a parameter has none); returns the positions in ``sg.pieces`` of the
        pieces whose parameter has no gradient."""
        absent: set[int] = set()
        if self._accumulators:
            accumulator = self._accumulators[sg.group_index]
            out.copy_(accumulator[sg.flat_offset : sg.flat_offset + sg.numel])
        else:
            for position, piece in enumerate(sg.pieces):
                window = out[piece.offset : piece.offset + piece.numel]
                param = self._param(sg, piece.param_index)
                if not self._source.read_grad(param, piece.param_offset, window):
                    window.zero_()
                    absent.add(position)
        if factor != 1.0:
            out.mul_(factor)
        return frozenset(absent)

    def _update(
        self,
        sg: SubGroup,
        state: torch.Tensor,
        extras: list[torch.Tensor],
        step: int,
        factor: float,
    ) -> None:
        group = (self._frozen_groups or self.param_groups)[sg.group_index]
        grad = self._grad(sg, state, extras, factor)
        absent = self._absent.pop(sg.index, frozenset())
        self.rule.update(sg, state, grad, group, step, self._pipeline.codec, absent=absent)

    def _grad(
        self, sg: SubGroup, state: torch.Tensor, extras: list[torch.Tensor], factor: float
    ) -> torch.Tensor:
        """The fp32 gradient of ``sg``, built from the retained 16-bit one into a reused
        buffer on the state's device (``extras``: what :meth:`_run_pipeline` fetched)."""
        grad = self._flat.grad(sg, state.device)
        if grad is not None:  # converted once for the step: a view, scaled in place
            if factor != 1.0:
                grad.mul_(factor)
            self._absent[sg.index] = self._flat.absent(sg)
            return grad
        grad = self._grad_buffer(state.device, sg.numel)
        self._absent[sg.index] = self._build_grad(sg, grad, factor)
        return grad

    def _publish(self, sg: SubGroup, state: torch.Tensor) -> None:
        """Round the new master weights into the 16-bit parameters."""
        master = self._pipeline.codec.master(sg, state)
        for piece in sg.pieces:
            self._source.write_param(
                self._param(sg, piece.param_index),
                piece.param_offset,
                master[piece.offset : piece.offset + piece.numel],
            )
        if self._deferred is not None:
            self._deferred.published(sg.index)
        self._drop_consumed(sg)

    def _drop_consumed(self, sg: SubGroup) -> None:
        """Tell a :class:`~swapper.step.sources.ConsumingSource` which parameters' gradients
        the step has now read whole: those all of whose sub-groups have been computed at
        this step and recorded so (a failed step's rerun never computes them again; the
        sub-groups may run in any order, so a parameter is judged by all its sub-groups,
        not by its last piece). Nothing with fp32 accumulators (the update reads those, and
        the 16-bit gradients are the next micro-step's to add into)."""
        source = self._source
        if self._accumulators or not isinstance(source, ConsumingSource):
            return
        progress = self._pipeline.progress
        step = progress[sg.index].applied  # (this step's: publish follows the compute)
        owners = self._param_owners()
        done = [
            self._param(sg, piece.param_index)
            for piece in sg.pieces
            if all(
                progress[index].applied >= step
                for index in owners[(sg.group_index, piece.param_index)]
            )
        ]
        if done:
            source.consumed(done)

    def check_unconsumed(self) -> None:
        """Before a new step (not a failed step's rerun): raises what the source raises
        when a gradient is gone since the last step read it (see
        :class:`~swapper.step.sources.ConsumingSource`), before the step changes anything
        (raised part-way, the step would be left pending, and ``zero_grad`` refused)."""
        source = self._source
        if isinstance(source, ConsumingSource):
            source.check_unconsumed(self._all_params())

    def _param_owners(self) -> dict[tuple[int, int], tuple[int, ...]]:
        """(param group, parameter index) → the sub-groups holding its pieces; counted
        again when the sub-groups change (a param group added)."""
        sub_groups = self.sub_groups
        if self._owners_of is not sub_groups:
            owners: dict[tuple[int, int], list[int]] = {}
            for sg in sub_groups:
                for piece in sg.pieces:
                    owners.setdefault((sg.group_index, piece.param_index), []).append(sg.index)
            self._owners = {key: tuple(value) for key, value in owners.items()}
            self._owners_of = sub_groups
        return self._owners
