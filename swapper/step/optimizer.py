# Size: ~700 lines: StreamedOptimizer's torch.optim surface (construction, the step's
# order, state dict, zero_grad, add_param_group, close) is one class; OffloadAdamW, its
# AdamW face (100 lines), stays beside it for the importers of swapper.step.optimizer.
"""``OffloadAdamW``: AdamW over 16-bit parameters with fp32 state streamed from the tiers.

The 16-bit parameters and their 16-bit gradients stay where they are (ordinary tensors);
the fp32 master weights and both moments live in a :class:`~swapper.manager.TierManager`
in sub-groups (see :mod:`swapper.step.layout`) and stream through memory during
:meth:`OffloadAdamW.step` (see :mod:`swapper.step.pipeline`). The fp32 gradient of a
sub-group is built from the retained 16-bit gradient into one reused fp32 buffer, right
before the fused AdamW kernel needs it: fp32 gradients never go to disk.

Memory besides the manager's budgets: one fp32 buffer of a sub-group's elements (4 B per
element of ``sub_group_numel``) per device the state is computed on, one fp32 scratch of
a sub-group's state (12 B per element) while the state is being set up, and, with
``accumulate_fp32=True``, 4 B per parameter element of host memory for the fp32
gradient accumulators.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from swapper.manager import ManagerConfig, TierManager
from swapper.step.config import DEFAULT_SUB_GROUP_NUMEL, StepConfig, check_hyper
from swapper.step.deferred import DeferredStepError, DeferredSteps
from swapper.step.flat_grads import FlatGrads
from swapper.step.layout import SubGroup
from swapper.step.params import check_params, fp32_accumulators
from swapper.step.pipeline import PipelineClosedError, StepPipeline, StepTraffic
from swapper.step.resume import ResumedState, adopt, resumed_of, unadopt
from swapper.step.rules.adamw import AdamWRule
from swapper.step.rules.base import UpdateRule
from swapper.step.scaler import DynamicLossScaler
from swapper.step.sources import (
    LocalParams,
    ParamSource,
    ResidentSource,
    SharedStep,
    TieredModel,
)
from swapper.step.state import (
    StateDictError,
    SubGroupStates,
    load_state,
    saved_state,
)
from swapper.step.update import SubGroupMath
from swapper.step.view import OptimizerState, StepCounters
from tiers import signals
from tiers.errors import SwapConfigError, SwapError

__all__ = [
    "DeferredStepError",
    "OffloadAdamW",
    "StateDictError",
    "StepPendingError",
    "StepReport",
    "StreamedOptimizer",
    "SubGroupStates",
]


class StepPendingError(SwapError, RuntimeError):
    """A step failed part-way and must be finished (call ``step()`` again) first."""


@dataclasses.dataclass(frozen=True)
class StepReport:
    """What one call of :meth:`OffloadAdamW.step` did.

    Attributes:
        step: the optimizer's step count after it.
        skipped: the step was skipped (inf/NaN gradients under a loss scaler).
        grad_norm: global L2 norm of the unscaled gradients (None when neither clipping
            nor a loss scaler asked for it).
        seconds: wall time of the call.
        stall_seconds: time spent waiting for state to arrive from NVMe.
        traffic: bytes read from and written to NVMe, by kind.
    """

    step: int
    skipped: bool
    grad_norm: float | None
    seconds: float
    stall_seconds: float
    traffic: StepTraffic


_Optimizer = TypeVar("_Optimizer", bound="StreamedOptimizer")


class StreamedOptimizer(SubGroupMath, torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` over 16-bit parameters whose fp32 master weights and
    state stream from the tiers in sub-groups, updated by an
    :class:`~swapper.step.rules.base.UpdateRule` (what it declares is what is stored).

    The public optimizers are its subclasses: :class:`OffloadAdamW` (the fused AdamW
    rule) and :class:`~swapper.step.offload_optimizer.OffloadOptimizer` (any ``torch.optim`` class).
    Arguments and errors: as :class:`OffloadAdamW`'s, with ``defaults`` the param
    groups' defaults and ``rule`` the update rule.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        rule: UpdateRule | None,
        tiers: TierManager | ManagerConfig | TieredModel,
        config: StepConfig | None = None,
        loss_scaler: DynamicLossScaler | None = None,
    ) -> None:
        if config is None:
            config = StepConfig()
        elif not isinstance(config, StepConfig):
            raise SwapConfigError(
                f"config={config!r} must be a StepConfig (e.g. StepConfig(sub_group_numel="
                "25_000_000))"
            )
        if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
            raise SwapConfigError(f"loss_scaler={loss_scaler!r} must be a DynamicLossScaler")
        super().__init__(params, defaults)
        self._source: ParamSource
        if isinstance(tiers, TieredModel):
            self._source = tiers.param_source()
            config = config.merged(tiers.step_config())
            if config.accumulate_fp32:
                raise SwapConfigError(
                    "accumulate_fp32 does not apply to an offloaded model: its 16-bit "
                    "gradients already accumulate in their retained buffers"
                )
        elif isinstance(tiers, (TierManager, ManagerConfig)):
            self._source = LocalParams()
        else:
            raise SwapConfigError(
                f"tiers={tiers!r} must be a TierManager, a ManagerConfig or an offloaded model"
            )
        config = config.merged(
            StepConfig(
                sub_group_numel=DEFAULT_SUB_GROUP_NUMEL,
                host_fraction=0.0,
                overlap=False,
                moments="fp32",
            )
        )
        sub_group_numel = config.sub_group_numel or DEFAULT_SUB_GROUP_NUMEL
        host_fraction = config.host_fraction or 0.0
        self.config = config
        check_params(self.param_groups, self._source)
        for group in self.param_groups:
            self._check_group(group)
            group.setdefault("step", 0)
        #: the update of a sub-group, and the state it declares
        self.rule = rule if rule is not None else self._make_rule()
        plan = self.rule.plan(self.numels(), sub_group_numel, config.moments or "fp32")
        self.sub_group_numel = sub_group_numel
        self.max_grad_norm = config.max_grad_norm
        self.loss_scaler = loss_scaler
        self.last_step: StepReport | None = None
        #: steps taken, a step that failed part-way, a load part-way, closed: shared with
        #: the step modules (deferred, state, resume) and the stored state's view
        self.counters = StepCounters()
        self._grad32: dict[torch.device, torch.Tensor] = {}
        self._flat = FlatGrads()  # the gradients converted once (a resident step)
        self._absent = {}
        self._owners_of, self._owners = None, {}  # (SubGroupMath._param_owners)
        self._accumulators: list[torch.Tensor] = []
        self._hooks: list[Any] = []
        # overlap (swapper.step.deferred): the running update's hyper-parameters and order
        self._deferred: DeferredSteps | None = None
        self._frozen_groups: list[dict[str, Any]] | None = None
        self._run_order: tuple[int, ...] | None = None
        self._owns_manager = isinstance(tiers, ManagerConfig)
        if isinstance(tiers, ManagerConfig):
            self.manager = TierManager(tiers)
        elif isinstance(tiers, TierManager):
            self.manager = tiers
        else:
            self.manager = tiers.manager
        pipeline: StepPipeline | None = None
        resumed: ResumedState | None = None
        try:
            self._check_manager(self.manager)
            pipeline = StepPipeline(
                self.manager,
                plan,
                name=config.name,
                host_fraction=host_fraction,
                readahead=config.readahead,
            )
            self._pipeline = pipeline
            self._check_budget()
            if config.accumulate_fp32:
                self._accumulators = fp32_accumulators(self.param_groups, self._hooks)
            resumed = resumed_of(tiers)
            if resumed is None:
                pipeline.initialize(self._initial_state)
            else:  # the state is in the manager already (swapper.offload(resume=...))
                adopt(self, pipeline, resumed)
            if config.overlap:
                self._deferred = DeferredSteps(self, pipeline, tiers, self._source)
        except BaseException:
            for hook in self._hooks:
                hook.remove()
            if pipeline is not None:
                if resumed is not None:  # the adopted state stays, for the next optimizer
                    unadopt(pipeline, resumed)
                pipeline.close()
            if self._owns_manager:
                self.manager.close(remove=True)
            raise
        self._constructed = True

    # -- the public surface --------------------------------------------------------------

    @property
    def stored_state(self) -> OptimizerState:
        """The door to the stored state, for checkpoints, exports and digests
        (:class:`~swapper.step.view.OptimizerState`)."""
        return OptimizerState(self, self._pipeline, self.counters, self._source, self._deferred)

    @property
    def step_count(self) -> int:
        """Steps taken (skipped ones not counted)."""
        return self.counters.step

    # The counters under the names the subclasses use (OffloadOptimizer, the bench's).
    @property
    def _step_count(self) -> int:
        return self.counters.step

    @_step_count.setter
    def _step_count(self, value: int) -> None:
        self.counters.step = value

    @property
    def _pending(self) -> int | None:
        return self.counters.pending

    @_pending.setter
    def _pending(self, value: int | None) -> None:
        self.counters.pending = value

    @property
    def _load_incomplete(self) -> bool:
        return self.counters.load_incomplete

    @_load_incomplete.setter
    def _load_incomplete(self, value: bool) -> None:
        self.counters.load_incomplete = value

    @property
    def _closed(self) -> bool:
        return self.counters.closed

    @property
    def overlap_waited_s(self) -> float:
        """Seconds the caller's thread has waited for overlapped updates so far (the
        forward's hooks waiting for a parameter's new values, a backward or ``step()``
        waiting for the update's end; ``StepConfig(overlap=True)``; 0 otherwise). The
        update's own fetch waits run beside the training and count as the manager's
        ``background_stall_s`` instead."""
        return self._deferred.waited_s if self._deferred is not None else 0.0

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW step over every sub-group (see :mod:`swapper.step.pipeline`).

        Returns:
            the closure's loss, if a closure was given.

        Raises:
            StepFailedError: an I/O error or timeout stopped the step part-way. The
                sub-groups done are kept; call ``step()`` again (same gradients) to finish
                the rest, which never applies the step twice to any sub-group.
            PeerFailedError: over a model sharded across ranks, another rank's step
                failed; this rank's step stays pending as well: call ``step()`` again on
                every rank.

        With overlap, the update's own errors surface later (:class:`DeferredStepError`
        naming the step, at the first call that needs it); ``step()`` then finishes the
        failed update and returns without starting a new step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Ctrl-C surfaces only where the step waits for I/O, or at its end: never between
        # a sub-group's update and its record, nor between the pipeline's end and the
        # step count. Cut at a wait, the step is pending: step() again finishes it.
        with signals.at_waits:
            if self._deferred is not None:
                self._deferred.step()
            else:
                self._step()
        return loss

    def _step(self) -> None:
        started = time.perf_counter()
        before = self._pipeline.counters()
        stall_before = self.manager.stats().stall_s
        target = self._step_count + 1
        source = self._source
        if self._pending is None:
            self.check_unconsumed()
        # (budgets that hold everything: params and grads fetched once, grads made fp32 once)
        with (
            (
                source.resident(self._all_params())
                if isinstance(source, ResidentSource)
                else contextlib.nullcontext(False)
            ) as resident,
            self._flat_grads(resident),
        ):
            grad_norm, found_inf = self.grad_norm()
            skipped = found_inf and self.loss_scaler is not None and self._pending is None
            if skipped and self.loss_scaler is not None:
                self.loss_scaler.update(True)
            else:
                factor = self.grad_factor(grad_norm)
                self.check_open()
                self._pending = target
                self._run_agreed(target, factor)
                self._pending = None
                self._step_count = target
                for group in self.param_groups:
                    group["step"] = target
                if self.loss_scaler is not None:
                    self.loss_scaler.update(False)
        norm = None if grad_norm is None else float(grad_norm)
        self.report_step(started, before, stall_before, norm, skipped=skipped)
        self.manager.check_write_budget()  # issue 29: warns once, or (strict) raises

    @contextlib.contextmanager
    def _flat_grads(self, resident: bool) -> Iterator[None]:
        """Within a resident step (see :mod:`swapper.step.flat_grads`), on the CPU,
        without fp32 accumulators: the gradients converted once, for the norm and the
        sub-groups."""
        if not resident or self._accumulators:
            yield
            return
        self._flat.fill(self.param_groups, self._source)
        try:
            yield
        finally:
            self._flat.clear()

    def report_step(
        self, started: float, before: Any, stall_before: float, norm: float | None, *, skipped: bool
    ) -> None:
        """Record what a step did as :attr:`last_step` (a :class:`StepReport`):
        ``started`` its ``time.perf_counter()`` at the start, ``before`` the pipeline's
        counters then, ``stall_before`` the manager's stall seconds then, ``norm`` the
        gradient norm (or None). Called by the step, and by the overlapped step at its
        start and its update's end."""
        self.last_step = StepReport(
            step=self._step_count,
            skipped=skipped,
            grad_norm=norm,
            seconds=time.perf_counter() - started,
            stall_seconds=self.manager.stats().stall_s - stall_before,
            traffic=self._pipeline.traffic_since(before),
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (and the fp32 accumulators). With an overlapped update
        running, the update drops them once it has read them (this returns at once).

        Raises:
            StepPendingError: a step failed part-way; finish it with ``step()`` first (its
                remaining sub-groups need these gradients).
        """
        if self._deferred is not None and self._deferred.defer_zero_grad():
            return  # the update (or, over ranks, its finishing) drops them once read
        if self._pending is not None:
            raise StepPendingError(
                f"step {self._pending} failed part-way; call step() again to finish it "
                "before zero_grad() (the sub-groups left need these gradients)"
            )
        self.zero_grad_now(set_to_none)

    def zero_grad_now(self, set_to_none: bool = True) -> None:
        """Clear the gradients (and the fp32 accumulators) now, without consulting an
        overlapped update or a pending step (:meth:`zero_grad` does; the overlapped
        update calls this once it has read them)."""
        if isinstance(self._source, LocalParams):
            super().zero_grad(set_to_none=set_to_none)
        else:
            self._source.zero_grad(self._all_params())
        for accumulator in self._accumulators:
            accumulator.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, streamed: ``"state"`` is a mapping from sub-group index
        to ``{"master", "exp_avg", "exp_avg_sq"}`` (fp32, the sub-group's elements) whose
        values are read from the tiers one at a time when looked up.

        It reflects the optimizer at this call; reading it after a later ``step()``
        raises :class:`StateDictError`. ``torch.save`` of it reads every sub-group (all in
        memory at once); :meth:`~swapper.step.OffloadAdamW.load_state_dict` of it, into
        another optimizer, streams.
        """
        self.wait_pending()
        return saved_state(self)

    def wait_pending(self) -> None:
        """Return once no overlapped update is running (``StepConfig(overlap=True)``;
        at once otherwise): the parameters and the state then reflect every step taken.

        Raises:
            DeferredStepError: the update of a step failed in the background (the step is
                named); call ``step()`` again to finish it.
        """
        if self._deferred is not None:
            self._deferred.wait()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` returned, one sub-group at a time; each is durable
        before the next is read.

        Everything but the tensors is checked before anything is written; a sub-group
        whose tensors are wrong stops the load there, and ``step()`` then refuses until
        a load succeeds (the state would be part old, part new).

        Raises:
            StateDictError: it is not such a state dict, or it is of other parameters
                (counts, element counts or sub-group size differ; the first difference is
                named), or a value in it is invalid (named).
            SwapIOError: writing a sub-group failed; ``step()`` refuses until a load succeeds.
        """
        if self._deferred is not None:
            self._deferred.forget_failed()  # the load replaces what it would finish
        load_state(self, state_dict)

    def close(self) -> None:
        """Forget the state (its NVMe copy is deleted), remove the hooks, and close the
        manager if the optimizer made it (its files are deleted). Idempotent."""
        if self.counters.closed:
            return
        if self._deferred is not None:
            self._deferred.close()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self._pipeline.close()
        if self._owns_manager:
            self.manager.close(remove=True)
        self.counters.closed = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group, as on ``torch.optim``: its missing hyper-parameters are the
        defaults; after construction its fp32 masters are read from its 16-bit
        parameters and its state laid out in new sub-groups after the others (written to
        the tiers before this returns). The parameters of the groups before it keep
        their sub-groups and state.

        Not after construction (refused, nothing changed): over a model sharded across
        ranks, with ``StepConfig(overlap=True)``, ``accumulate_fp32`` or compressed
        moments (each sizes what it holds from the groups at construction). A snapshot
        of the optimizer after it resumes into an optimizer constructed with every group.

        Raises:
            SwapConfigError: a parameter already in a group, not 16-bit or not contiguous,
                a hyper-parameter out of range (named), one of the cases above, or the
                host budget cannot hold the new sub-groups; nothing is changed.
            StepPendingError: a step failed part-way; finish it with ``step()`` first.
            and what :class:`TierManager` raises writing the new state (nothing kept).
        """
        if not getattr(self, "_constructed", False):
            self._append_group(param_group)
            return
        self._check_growable()
        groups = len(self.param_groups)
        rule = self.rule
        try:
            self._append_group(param_group)
            group = self.param_groups[-1]
            check_params(self.param_groups, self._source)
            self._check_group(group)
            group["step"] = self._step_count
            self.rule = self._grown_rule(rule)
            moments = self.config.moments or "fp32"
            plan = self.rule.plan(self.numels(), self.sub_group_numel, moments)
            old = self.sub_groups
            if tuple(plan[: len(old)]) != old:  # pragma: no cover - the plans go group by group
                raise SwapConfigError("the new param group would move the others' state")
            new = plan[len(old) :]
            self._check_budget(new)
            self._pipeline.extend(new, self._initial_state, self._step_count)
        except BaseException:
            del self.param_groups[groups:]
            self.rule = rule
            raise
        self._grad32.clear()  # (sized for the largest sub-group)

    def _append_group(self, param_group: dict[str, Any]) -> None:
        try:
            super().add_param_group(param_group)
        except ValueError as exc:  # e.g. a parameter in two groups
            raise SwapConfigError(f"param group {len(self.param_groups)}: {exc}") from None

    def _check_growable(self) -> None:
        """Refuse :meth:`add_param_group` after construction where it cannot work."""
        name = type(self).__name__
        self.check_open()
        self.wait_pending()
        if self._pending is not None:
            raise StepPendingError(
                f"step {self._pending} failed part-way; call step() again to finish it "
                "before add_param_group()"
            )
        why = None
        if isinstance(self._source, SharedStep):
            why = "over ranks every rank would have to add it in step (not supported yet)"
        elif self._deferred is not None:
            why = "StepConfig(overlap=True) maps parameters to sub-groups at construction"
        elif self._accumulators:
            why = "accumulate_fp32's accumulators and hooks are made at construction"
        elif self._pipeline.codec.compressed:
            why = "compressed moments keep their block scales in one tensor sized then"
        if why is not None:
            raise SwapConfigError(
                f"{name}.add_param_group after construction: {why}; pass every param "
                "group to the constructor"
            )

    def _grown_rule(self, rule: UpdateRule) -> UpdateRule:
        """The update rule once a param group was added (``self.param_groups`` has it):
        ``rule`` itself unless a subclass's rule depends on the groups."""
        return rule

    def check_open(self) -> None:
        """Raise unless a step may run.

        Raises:
            PipelineClosedError: the optimizer is closed.
            StateDictError: a ``load_state_dict()`` stopped part-way.
        """
        if self.counters.closed:
            raise PipelineClosedError("the optimizer is closed")
        if self.counters.load_incomplete:
            raise StateDictError(
                "a load_state_dict() stopped part-way: the state is partly old, partly "
                "loaded; load a state dict again before stepping"
            )

    def __enter__(self: _Optimizer) -> _Optimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- set-up ---------------------------------------------------------------------------

    def numels(self) -> list[list[int]]:
        """Per group, the element count of each parameter (from the source: an offloaded
        parameter's ``.data`` is a placeholder)."""
        return [[self._source.shape(p).numel() for p in g["params"]] for g in self.param_groups]

    def _check_budget(self, added: Sequence[SubGroup] = ()) -> None:
        """Check the host budget holds the kept state and one streamed sub-group (of the
        sub-groups and those ``added``, which are streamed)."""
        host = self.manager.config.host_nbytes
        if host is None or not (self.sub_groups or added):
            return
        pipeline = self._pipeline
        scales = pipeline.scales.charge  # int8: kept in memory for the optimizer's life
        kept = pipeline.kept_nbytes - scales
        streamed = (*self.sub_groups[pipeline.kept :], *added)
        largest = max((sg.state_nbytes for sg in streamed), default=0)
        if host < kept + scales + largest:
            raise SwapConfigError(
                f"host_nbytes={host} cannot hold the kept sub-groups' state ({kept} bytes, "
                f"host_fraction), the int8 block scales ({scales} bytes: 8 per 1024 "
                f"elements, in 4 KiB, kept in memory) and one streamed sub-group ({largest} "
                f"bytes of {self.config.moments} moments): lower sub_group_numel (now "
                f"{self.sub_group_numel}) or host_fraction, or raise the host budget to at "
                f"least {kept + scales + largest}"
            )

    def check_group(self, group: dict[str, Any]) -> None:
        """Check a param group's hyper-parameters (as the constructor does; a resume
        checks a snapshot's groups with it).

        Raises:
            SwapConfigError: a value out of range (named).
            KeyError: a hyper-parameter is missing.
        """
        self._check_group(group)

    def _check_group(self, group: dict[str, Any]) -> None:
        """Check a param group's hyper-parameters (the subclass's; raise SwapConfigError)."""

    def _check_manager(self, manager: TierManager) -> None:
        """Check the manager the state will live in, before anything is stored (a
        subclass's; raise SwapConfigError)."""

    def _make_rule(self) -> UpdateRule:
        """The update rule, when the constructor was given none: made once the param
        groups and their shapes are known, before anything is stored (a subclass's)."""
        raise SwapConfigError(f"{type(self).__name__} was given no update rule")

    def _initial_state(self, sg: SubGroup, state: torch.Tensor) -> None:
        master = state.view(-1)[: sg.padded_numel]
        for piece in sg.pieces:
            self._source.read_param(
                self._param(sg, piece.param_index),
                piece.param_offset,
                master[piece.offset : piece.offset + piece.numel],
            )
        self.rule.initial(sg, state, self.param_groups)


class OffloadAdamW(StreamedOptimizer):
    """AdamW (decoupled weight decay) over 16-bit parameters, state in the tiers.

    Use it like ``torch.optim.AdamW``: ``loss.backward()``, ``optimizer.step()``,
    ``optimizer.zero_grad()``. The update is PyTorch's fused AdamW kernel
    (``torch._fused_adamw_``, the one ``torch.optim.AdamW(fused=True)`` runs), applied to
    the fp32 master weights; the 16-bit parameters are then rounded from them. It runs
    where the state was fetched to: on the accelerator when the manager's placement puts
    ``optim_state`` there, else on the CPU.

    While the state streams from NVMe, :meth:`step` runs PyTorch's intra-op pool with one
    thread fewer than configured (``torch.set_num_threads``, restored after), leaving a
    core to the I/O threads.

    With ``StepConfig(overlap=True)`` (over an offloaded model), :meth:`step` returns
    once the global part is done and the sub-group updates run in the background while
    the next forward runs; what reads parameters or state waits for them first (see
    :mod:`swapper.step.deferred`; :meth:`wait_pending` waits explicitly).

    A parameter whose ``.grad`` is None at a step is stepped with a zero gradient (its
    moments decay, weight decay applies), as in ZeRO's flat partitions; ``torch.optim``
    would skip it; over an offloaded model a frozen one is left out instead (no state).

    Args:
        params: 16-bit (bf16 or fp16), contiguous tensors, or param groups (dicts), as for
            any ``torch.optim`` optimizer; ``(name, tensor)`` pairs name them in errors.
        lr, betas, eps, weight_decay: AdamW's hyper-parameters (per group; lr schedulers
            work as usual).
        tiers: the :class:`TierManager` to keep the state in (shared, not closed by
            :meth:`close`), or a :class:`ManagerConfig` for one of its own, or a model
            wrapped by :func:`swapper.offload` (its parameters live in its manager, which
            then holds the state too).
        config: sub-group size, host fraction, clipping, fp32 accumulation, read-ahead
            and key prefix (see :class:`~swapper.step.StepConfig`); fields left ``None``
            come from the offloaded model's ``OffloadConfig.step``, else the defaults.
        loss_scaler: for fp16: the scaler whose scale the gradients carry; a step with
            inf/NaN gradients is skipped and leaves all state and parameters untouched.
            A live object the training loop shares (its state is saved by
            :meth:`state_dict`), so an argument, not a setting of ``config``.

    Raises:
        SwapConfigError: a hyper-parameter or setting is out of range (named), a parameter
            is not a 16-bit contiguous tensor (named by group, index, name and shape) or
            appears twice.
        and what :class:`TierManager` raises while the state is set up (nothing is kept).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        tiers: TierManager | ManagerConfig | TieredModel,
        config: StepConfig | None = None,
        loss_scaler: DynamicLossScaler | None = None,
    ) -> None:
        check_hyper(lr, betas, eps, weight_decay)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        super().__init__(
            params,
            defaults,
            rule=AdamWRule(),
            tiers=tiers,
            config=config,
            loss_scaler=loss_scaler,
        )

    def _check_group(self, group: dict[str, Any]) -> None:
        check_hyper(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def _check_growable(self) -> None:
        super()._check_growable()
        if self._step_count:
            raise SwapConfigError(
                "OffloadAdamW.add_param_group after a step: its bias correction counts "
                f"the optimizer's steps ({self._step_count}), not each parameter's as "
                "torch.optim.AdamW does, so the new group would start at that step; add "
                "it before the first step, or use OffloadOptimizer(torch.optim.AdamW, ...)"
            )
