"""Overlapped steps (``StepConfig(overlap=True)``): the sub-group updates of a step run in
the background while the next forward runs, and the forward waits only for the updates of
the parameters it fetches.

``OffloadAdamW.step()`` does at once what must be global, exactly as the ordinary step:
the gradient norm (clipping), the fp16 overflow check and the skip decision, the step
count, the loss scaler's update, and a copy of every param group's hyper-parameters (an
lr scheduler stepping right after ``step()`` changes the next step, not this one). Then
it starts one thread that drives the usual pipeline (:mod:`swapper.step.pipeline`) over
the sub-groups in the *forward order* of their parameters (the order in which the
model's hooks first asked for them; sub-groups of parameters not seen yet last, by
index), and returns. Each sub-group's update reads only its own state and gradients, so
the order changes no result: the run is bit-identical to the ordinary step. The model
records its manager's eviction order over one whole overlapped cycle (see
:meth:`~swapper.zero.model.readahead.FetchPlan.overlapped`; :meth:`step` tells it where a step
starts), so that the order holds the update's fetches as they interleave with the forward.

The model's hooks call the :class:`DeferredSteps` gate (:data:`~swapper.step.sources.ParamGate`)
before they fetch a parameter: it returns once every sub-group holding part of that
parameter has published its new 16-bit values (so the fetch reads the new ones). A
backward waits for the whole update before its first module's backward (its gradients
are about to change), also when it fetches nothing (holds carried over from the
forward). Reading the
model's weights outside the hooks (``state_dict``, ``iter_state_dict``, ``unwrap``, leaving
the ``offload`` block) waits for the parameter's sub-groups; ``close()`` of the model or of
the optimizer, ``model.zero_grad()``, the optimizer's ``state_dict``, ``load_state_dict``,
``wait_pending`` and the next ``step()``, and ``save_snapshot``/``final_digest``/the DCP
export wait for the whole update. ``optimizer.zero_grad()`` does not wait: the retained
gradients are dropped by the update itself once it has read them (before any backward
can add to them).

States of one overlapped step (one at a time)::

    step() ── RUNNING (thread) ──ok──▶ (none)      gate and waits return
                 │ an error (I/O, timeout, anything the update raised)
                 ▼
               FAILED ── step() again: the pipeline finishes it in the caller's thread
                 │        (sub-groups done stay done: nothing is applied twice)
                 └─ gate / waits / zero_grad raise DeferredStepError naming the step,
                    until then (a gate only for a parameter the failure left stale)

Interrupts: Ctrl-C reaches the main thread only; a wait for the update is a wait point,
cut there nothing has been taken (a hook has not yet counted its fetch), and the update
goes on in its thread, its bookkeeping exact (:mod:`swapper.step.pipeline`). A failed or
cut update leaves ``optimizer.counters.pending`` at its step, which every reader of the state
refuses until ``step()`` finishes it, as after a failed ordinary step.

Cost and who waits: ``step()`` asks for the state of the first streamed sub-group of the
order before it computes the gradient norm (the next forward's first module waits for that
sub-group's update, and its read would otherwise start only with the thread). The update
runs with one intra-op thread (``UPDATE_THREADS``), the forward keeping the cores. Its fetch
waits are the manager's ``background_stall_s`` (:func:`swapper.manager.background_work`);
the training thread's waits for it (the gate, a backward, ``step()``) are summed in
:attr:`DeferredSteps.waited_s` (``OffloadAdamW.overlap_waited_s``).

Over a model sharded across ranks the same thread steps this rank's shards; the model
gates its gathers and agrees the update's end over the ranks in the caller's thread (the
update's thread issues no collective): :mod:`swapper.zero.sharded.overlap`.

Requirement on budgets: while the forward holds a module's parameters, the update of a
later sub-group must find room in the host budget for its state and one parameter or
gradient (as the ordinary step does with nothing held). Where parameters are used in the
host tier, a budget that cannot hold both is refused when the optimizer is made
(``SwapConfigError`` naming both needs: :func:`swapper.zero.local.placing.check_overlap_room`;
it made the update time out before), and a forward keeps its holds for the backward only
when every parameter fits beside the update.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from swapper.manager import background_work
from swapper.step.pipeline import StepFailedError, StepPipeline
from swapper.step.sources import AgreedModel, GatedModel, ParamSource, SharedStep
from swapper.step.view import StepOwner
from tiers import signals
from tiers.errors import SwapConfigError

__all__ = ["DeferredStepError", "DeferredSteps"]

log = logging.getLogger(__name__)

#: Intra-op threads of the update's thread (see ``DeferredSteps._work``).
UPDATE_THREADS = 1


class DeferredStepError(StepFailedError):
    """An overlapped step's update failed in the background: call ``optimizer.step()``
    again to finish it (its gradients are kept; nothing is applied twice).

    Attributes:
        step: the step the update belongs to; ``undone``: sub-groups not durable at it.
    """


@dataclasses.dataclass(eq=False)
class _Job:
    """One overlapped step's update."""

    step: int
    factor: float
    groups: list[dict[str, Any]]  # hyper-parameters as they were at step()
    order: tuple[int, ...]
    started: float
    counters: dict[Any, int]
    stall_before: float
    grad_norm: float | None
    published: set[int] = dataclasses.field(default_factory=set)
    ended: bool = False
    error: BaseException | None = None
    zero_grad: bool = False  # a zero_grad() waits for the update's end


class DeferredSteps:
    """The overlapped steps of one optimizer over one model (``OffloadAdamW`` makes it
    when ``config.overlap`` is set, and installs :meth:`gate` in the model).

    Over a model sharded across ranks (its step a :class:`SharedStep`), the model agrees
    the updates over the ranks (:class:`~swapper.step.sources.AgreedModel`,
    :mod:`swapper.zero.sharded.overlap`): ``step()`` starts with that agreement, and a failed
    update does not refuse ``zero_grad()`` (the ranks learn of it at the next agreement;
    ``step()`` then finishes it and drops the gradients).

    Raises:
        SwapConfigError: the optimizer's ``tiers`` is not a model with hooks that call a
            gate (plain tensors have none to wait in), or its step is shared with other
            ranks and the model does not agree the updates, or the model has a gate
            already.
    """

    def __init__(
        self, optimizer: StepOwner, pipeline: StepPipeline, model: object, source: ParamSource
    ) -> None:
        self._agreed: AgreedModel | None = None
        if isinstance(source, SharedStep):
            if not isinstance(model, AgreedModel):
                raise SwapConfigError(
                    "StepConfig(overlap=True) over parameters shared with other ranks needs "
                    "tiers=<a model wrapped by swapper.offload with a process group>: its "
                    "updates are agreed over the ranks (use overlap=False)"
                )
            self._agreed = model
        if not isinstance(model, GatedModel):
            raise SwapConfigError(
                "StepConfig(overlap=True) needs tiers=<a model wrapped by swapper.offload>: "
                "its hooks wait for the pending update of a parameter before fetching it; "
                "plain tensors have no hooks (use overlap=False)"
            )
        self._optimizer = optimizer
        self._pipeline = pipeline  # the optimizer's, handed over (its state's stream)
        self._model: GatedModel = model
        self._cond = threading.Condition(threading.Lock())
        self._job: _Job | None = None  # running, or failed; None once a job succeeded
        self._thread: threading.Thread | None = None
        self._worker: int | None = None  # the thread id of the running update
        #: id(param) → the sub-groups holding part of it
        self._sub_groups_of: dict[int, tuple[int, ...]] = {}
        params_of: list[list[int]] = []
        for sg in optimizer.sub_groups:
            params = optimizer.param_groups[sg.group_index]["params"]
            ids = [id(params[piece.param_index]) for piece in sg.pieces]
            params_of.append(ids)
            for pid in ids:
                self._sub_groups_of[pid] = (*self._sub_groups_of.get(pid, ()), sg.index)
        self._params_of = params_of
        #: id(param) → position of its first fetch through the gate (the forward order)
        self._first_use: dict[int, int] = {}
        #: seconds callers waited for an update (the gate, ``step()``, the waits): the
        #: training's thread's share of the overlap (see ``OffloadAdamW.overlap_waited_s``)
        self.waited_s = 0.0
        model.set_param_gate(self.gate, update_nbytes=self._update_nbytes(source))

    # -- the model's side -------------------------------------------------------------------

    def gate(self, param: torch.Tensor | None) -> None:
        """Called by the model's hooks (:data:`~swapper.step.sources.ParamGate`).

        Raises:
            DeferredStepError: the update this waited for failed.
        """
        if self._worker is not None and threading.get_ident() == self._worker:
            return  # the update's own reads and writes (never a hook's; defensive)
        if param is not None:
            pid = id(param)
            if pid not in self._first_use and pid in self._sub_groups_of:
                self._first_use[pid] = len(self._first_use)
        job = self._job
        if job is None:
            return
        if param is None or torch._C._current_graph_task_id() != -1:
            # everything; inside a backward: its gradients are about to change
            self._raise_failed(self._wait(lambda j: j.ended))
            return
        needed = self._sub_groups_of.get(id(param))
        if not needed:
            return
        done = self._wait(lambda j: j.ended or j.published.issuperset(needed))
        if done is not None and not done.published.issuperset(needed):
            self._raise_failed(done)

    # -- the optimizer's side ---------------------------------------------------------------

    def step(self) -> None:
        """``OffloadAdamW.step()`` with overlap (module docstring): finish a failed update
        (and return), or do the global part now and start the update.

        Raises:
            StepFailedError: finishing a failed update failed again (it stays pending).
            and what the ordinary step raises before it runs a sub-group.
        """
        optimizer = self._optimizer
        job = self._wait(lambda j: j.ended)
        failed = job if job is not None and job.error is not None else None
        if self._agreed is not None:
            # every rank, in the caller's thread: the update's end agreed (a rank's failed
            # one finished here first); any rank finished one: no new step anywhere
            finish = None if failed is None else functools.partial(self._finish_failed, failed)
            if self._agreed.agree_update(finish):
                return
        elif failed is not None:
            self._finish_failed(failed)
            return
        started = time.perf_counter()
        counters = self._pipeline.counters()
        stall_before = optimizer.manager.stats().stall_s
        order = self._order()
        # The next forward's first module waits for the first sub-group of this order:
        # its state's read starts now, beside the gradient norm below, instead of when
        # the update's thread asks for it (at 100M parameters that read was most of the
        # forward's wait at the gate). A hint: dropped when there is no room.
        optimizer.check_open()
        optimizer.check_unconsumed()
        self._read_first(order)
        grad_norm, found_inf = optimizer.grad_norm()
        norm = None if grad_norm is None else float(grad_norm)
        scaler = optimizer.loss_scaler
        if found_inf and scaler is not None:
            scaler.update(True)
            optimizer.report_step(started, counters, stall_before, norm, skipped=True)
            return
        factor = optimizer.grad_factor(grad_norm)
        optimizer.check_open()
        # here, not in the update's thread: a failed pass's holds are the forward's state
        self._model.release_stale_holds()
        # Before anything changes: over ranks it waits for the gathers started ahead (a
        # Ctrl-C or a failed gather may cut it). After the counters moved and the job was
        # set, that left a job no thread would ever end: every later wait hung.
        self._model.step_started()
        target = optimizer.step_count + 1
        groups = [
            {k: v for k, v in group.items() if k not in ("params", "param_names")}
            for group in optimizer.param_groups
        ]
        job = _Job(target, factor, groups, order, started, counters, stall_before, norm)
        # The counters move now (what reads them next sees this step taken); the state
        # follows in the thread, and every reader of the state waits for it.
        optimizer.counters.step = target
        for group in optimizer.param_groups:
            group["step"] = target
        if scaler is not None:
            scaler.update(False)
        optimizer.report_step(started, counters, stall_before, norm, skipped=False)
        with self._cond:
            self._job = job
        thread = threading.Thread(
            target=self._work, args=(job,), name=f"swapper-step-{target}", daemon=False
        )
        self._thread = thread
        thread.start()

    def defer_zero_grad(self) -> bool:
        """``optimizer.zero_grad()``: True when an update is running, which then drops the
        retained gradients when it has read them, or (over ranks) failed, whose finishing
        by ``step()`` drops them; False otherwise (drop them now; in one process a failed
        update's step is pending, which ``zero_grad()`` refuses)."""
        with self._cond:
            job = self._job
            if job is None or (job.ended and self._agreed is None):
                return False
            job.zero_grad = True
            return True

    def wait(self, *, raise_failure: bool = True) -> None:
        """Return once no update is running.

        Raises:
            DeferredStepError: the update failed (only with ``raise_failure``).
        """
        job = self._wait(lambda j: j.ended)
        if raise_failure:
            self._raise_failed(job)

    def forget_failed(self) -> None:
        """A load of the whole state replaced what a failed update would finish."""
        self.wait(raise_failure=False)
        with self._cond:
            self._job = None

    def close(self) -> None:
        """Wait for the running update (its failure stays logged), remove the gate."""
        self.wait(raise_failure=False)
        if self._thread is not None:
            self._thread.join()  # (it has ended its job: only its return is left)
        self._model.set_param_gate(None)

    def published(self, index: int) -> None:
        """Called by the optimizer once sub-group ``index`` wrote its new 16-bit params."""
        with self._cond:
            job = self._job
            if job is not None:
                job.published.add(index)
                self._cond.notify_all()

    # -- inside ------------------------------------------------------------------------------

    def _update_nbytes(self, source: ParamSource) -> int:
        """The host memory the update holds at once (bytes): the sub-groups kept in
        memory and the int8 block scales, one streamed sub-group's state, and one
        parameter or gradient (fetched whole to read or write its piece, one at a
        time)."""
        optimizer = self._optimizer
        kept = self._pipeline.kept
        groups = optimizer.sub_groups
        largest_param = max(
            (
                source.shape(p).numel() * source.dtype(p).itemsize
                for group in optimizer.param_groups
                for p in group["params"]
            ),
            default=0,
        )
        return (
            self._pipeline.kept_nbytes  # (the kept sub-groups and the int8 scales)
            + max((sg.state_nbytes for sg in groups[kept:]), default=0)
            + largest_param
        )

    def _read_first(self, order: tuple[int, ...]) -> None:
        """Read ahead the state of the first streamed sub-group of ``order``."""
        pipeline = self._pipeline
        if not pipeline.streams:
            return
        first = next((index for index in order if not pipeline.holds(index)), None)
        if first is not None:
            pipeline.manager.prefetch([pipeline.key(first)])

    def _order(self) -> tuple[int, ...]:
        first = self._first_use
        late = len(first)

        def key(index: int) -> tuple[int, int]:
            return (min((first.get(p, late) for p in self._params_of[index]), default=late), index)

        return tuple(sorted(range(len(self._params_of)), key=key))

    def _wait(self, done: Callable[[_Job], bool]) -> _Job | None:
        """Wait (a wait point: Ctrl-C may cut it, nothing is taken) until there is no job
        or ``done(job)``; returns the job then (None: none). The time waited is added to
        :attr:`waited_s`."""
        started: float | None = None
        with self._cond:
            try:
                while True:
                    job = self._job
                    if job is None or done(job):
                        return job
                    if started is None:
                        started = time.perf_counter()
                    signals.wait_cond(self._cond, None, "step.overlap")
            finally:
                if started is not None:
                    self.waited_s += time.perf_counter() - started

    def _raise_failed(self, job: _Job | None) -> None:
        if job is None or job.error is None:
            return
        cause = job.error
        undone = tuple(
            sg.index
            for sg in self._optimizer.sub_groups
            if self._pipeline.progress[sg.index].durable < job.step
        )
        raise DeferredStepError(
            f"the overlapped update of step {job.step} failed in the background "
            f"({len(undone)} sub-group(s) not durable, first {list(undone[:8])}): {cause!r}. "
            "Call optimizer.step() again to finish it (same gradients; nothing is applied "
            "twice)",
            step=job.step,
            undone=undone,
        ) from cause

    def _complete(self, job: _Job) -> None:
        """The update, in whichever thread calls it; then the zero_grad() it was asked
        for; then the job's end, recorded. Raises what failed (recorded first)."""
        optimizer = self._optimizer
        try:
            optimizer.run_update(job.step, job.factor, groups=job.groups, order=job.order)
            while True:
                with self._cond:  # checked and ended in one go: no zero_grad() missed
                    if not job.zero_grad:
                        self._report(job)
                        self._end(job, None)
                        break
                    job.zero_grad = False
                try:
                    optimizer.zero_grad_now()
                except BaseException:
                    job.zero_grad = True  # asked for still: done after the retry
                    raise
        except BaseException as exc:
            with self._cond:
                self._end(job, exc)
            raise

    def _work(self, job: _Job) -> None:
        self._worker = threading.get_ident()
        # One intra-op thread here: the forward beside it is the critical path and already
        # has a kernel on every core; a second pool of spinning workers over the same
        # cores stalls the forward's kernels. (This thread's pool only: OpenMP's count is
        # per calling thread, checked with torch 2.13. Torch also keeps it as the default
        # of threads it has not seen yet: one that starts its first kernel while an update
        # runs gets one thread; restored at the end for those after.)
        threads = torch.get_num_threads()
        if threads > 1:
            torch.set_num_threads(UPDATE_THREADS)
        try:
            # (grad mode is per thread: step()'s does not reach here); its fetch waits are
            # background stall: the training's thread waits only at the gate (waited_s)
            with torch.no_grad(), background_work():
                self._complete(job)
        except BaseException as exc:  # kept, raised where the update is needed
            log.warning("the overlapped update of step %d failed: %r", job.step, exc)
        finally:
            if threads > 1:
                torch.set_num_threads(threads)

    def _finish_failed(self, job: _Job) -> None:
        with self._cond:
            job.ended, job.error = False, None
        self._complete(job)

    def _report(self, job: _Job) -> None:
        self._optimizer.report_step(
            job.started, job.counters, job.stall_before, job.grad_norm, skipped=False
        )

    def _end(self, job: _Job, error: BaseException | None) -> None:
        """Record the job's end (``self._cond`` held)."""
        optimizer = self._optimizer
        job.ended, job.error = True, error
        if error is None:
            optimizer.counters.pending = None
            self._job = None
        else:
            optimizer.counters.pending = job.step
        self._worker = None
        self._cond.notify_all()
