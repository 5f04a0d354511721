# Size: ~700 lines: the sub-group state machine, its bookkeeping (and extension: a param
# group added late) and the whole-sub-group read/write (fp32 in and out, stored through
# compress.MomentCodec) stay one class.
"""The step pipeline: optimizer state streamed through memory, one sub-group at a time.

Each sub-group's state (fp32 master weights, ``exp_avg``, ``exp_avg_sq``; see
:mod:`swapper.step.layout`) is one tensor in the :class:`~swapper.manager.TierManager`,
of kind ``optim_state``. A step walks the sub-groups in order; while sub-group k computes,
the read-ahead of k+1 (up to ``readahead`` sub-groups) is in flight and k-1 is being
written behind. What bounds the sub-groups in flight is the manager's host budget: a
read-ahead takes room only when the budget has it, and a fetch waits for a write to end.

States of one sub-group during step t (``applied`` and ``durable`` are the step numbers
its state reflects in memory and on NVMe)::

                 prefetch (k-1 computing)            fetch (k's turn)
    ON_NVME ─────────────────────────────> READING ───────────────────> FETCHED
       ^                                                                   │ compute: fp32 grad
       │                                                                   │ from grad16, AdamW
       │ write durable                                                     v
    WRITING <─────────────── release(modified), evict ─────────────── APPLIED (applied=t)
       │                      (k+1 computes meanwhile)                  publish: 16-bit
       │ write failed                                                   params from master
       v
    DIRTY (applied=t, durable<t; memory holds it) ──── next step(): evict again, no compute

(``published`` records that the 16-bit parameters were written from the new master
weights; a sub-group applied but not published is published again, without computing.)

Sub-groups kept in host memory (``host_fraction``) stay FETCHED for the optimizer's life:
they compute in place and are never written during a step; memory counts as durable for
them (and for every sub-group when the manager has no NVMe tier).

With int8 moments the block scales of every sub-group are one more entry, kept FETCHED
the same way for the optimizer's life (:class:`~swapper.step.scales.HeldScales`): a step
updates them in place and never moves them; the sub-groups' NVMe traffic is the master
weights and the codes alone.

A step succeeds only when every streamed sub-group it touched is durable. When it fails
part-way (an I/O error, a timeout), the sub-groups done stay done: the next run of the
same step skips their compute (it never applies a step twice), rewrites those not yet
durable, and computes the rest.

Interrupts and exceptions. A step runs in a :mod:`tiers.signals` section: Ctrl-C is
delivered only where the step waits (the manager's waits inside a fetch or a prefetch,
and ``step.write``, the wait for a sub-group's write-behind) or when it ends; compute and
publish run with it held back entirely. The edges of a sub-group:

* cut while FETCHED is being fetched (READING): the manager undoes the fetch; nothing is
  held, ``applied`` unchanged: the next run fetches and computes it;
* cut while another sub-group is fetched (extra keys, read-ahead) with this one FETCHED:
  released unmodified (``finally``): the next run computes it;
* compute raising (an error; Ctrl-C is held until ``published`` is recorded): released
  unmodified, ``applied`` unchanged;
* cut at ``step.write``: the writes go on in the background; those not yet recorded
  durable are found clean (or written again) by the next run, never computed again.

Every fetch is recorded in the same section step as the fetch itself, so the release in
``finally`` never misses one, nor releases one twice.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager

import torch

from swapper.manager import Kind, Tier, TierManager
from swapper.step import window
from swapper.step.compress import MomentCodec
from swapper.step.initial import InitialWriter
from swapper.step.layout import SubGroup
from swapper.step.scales import HeldScales
from swapper.step.window import Room
from tiers import signals
from tiers.errors import SwapConfigError, SwapError
from tiers.signals import wait_future

__all__ = [
    "PipelineClosedError",
    "Progress",
    "StepFailedError",
    "StepPipeline",
    "StepTraffic",
    "interrupts_deferred",
]

log = logging.getLogger(__name__)

#: compute(sub_group, state, extra) → None; runs on the caller's thread with the state
#: fetched (``extra``: the tensors of the extra keys, fetched too).
Compute = Callable[[SubGroup, torch.Tensor, list[torch.Tensor]], None]


class StepFailedError(SwapError, RuntimeError):
    """A step could not finish; what was done is kept (see :attr:`undone`).

    Attributes:
        step: the step number that failed.
        undone: indices of sub-groups not yet durable at this step.
    """

    def __init__(self, message: str, *, step: int, undone: Sequence[int]) -> None:
        super().__init__(message)
        self.step = step
        self.undone = tuple(undone)


class PipelineClosedError(SwapError, RuntimeError):
    """The optimizer (and its state) is closed."""


@dataclasses.dataclass
class Progress:
    """How far one sub-group got: the step its state reflects (``applied``), the step
    its 16-bit parameters reflect (``published``) and the step its NVMe copy reflects
    (``durable``; for a sub-group kept in memory, memory counts as durable)."""

    applied: int = 0
    published: int = 0
    durable: int = 0


#: Failures a repeated step() can get past: I/O errors and timeouts.
_RETRYABLE = (SwapError, OSError, TimeoutError, concurrent.futures.TimeoutError)


def interrupts_deferred() -> AbstractContextManager[None]:
    """Hold SIGINT (and SIGTERM, SIGHUP) back until the block ends, then deliver it
    (main thread only; elsewhere signals never arrive anyway): :data:`tiers.signals.held`.
    Python raises KeyboardInterrupt at the first bytecode after a C call returns: inside a
    step that could be between updating a sub-group's state and recording that it was
    updated."""
    return signals.held


@dataclasses.dataclass(frozen=True)
class StepTraffic:
    """Bytes that crossed the disk during one step, by kind.

    Attributes:
        read_nbytes: kind → bytes read from NVMe.
        written_nbytes: kind → bytes written to NVMe.
    """

    read_nbytes: dict[Kind, int]
    written_nbytes: dict[Kind, int]

    @property
    def total_read_nbytes(self) -> int:
        """All bytes read, every kind."""
        return sum(self.read_nbytes.values())

    @property
    def total_written_nbytes(self) -> int:
        """All bytes written, every kind."""
        return sum(self.written_nbytes.values())


class StepPipeline:
    """Streams the state of ``sub_groups`` through ``manager`` and runs a step over it.

    Args:
        manager: where the state lives; it is not closed by :meth:`close`.
        sub_groups: the plan (see :func:`~swapper.step.layout.plan_sub_groups`).
        name: prefix of the manager keys, ``<name>/state/<index>``; unique per manager.
        host_fraction: the first ``round(host_fraction * len(sub_groups))`` sub-groups are
            kept in memory (fetched once, never written during a step).
        readahead: how many sub-groups to read ahead: an int, ``"auto"`` (sized at the
            start of every step from the host budget left beside the other keys, see
            :mod:`swapper.step.window`), or ``None``: as many as the host budget holds
            besides the kept ones, the one computing and the one being written; at least
            1 when it holds two, 0 when it holds only one.

    Raises:
        SwapConfigError: ``host_fraction`` not in [0, 1], a bad ``readahead``, mixed moments.
    """

    def __init__(
        self,
        manager: TierManager,
        sub_groups: Sequence[SubGroup],
        *,
        name: str,
        host_fraction: float = 0.0,
        readahead: int | str | None = None,
    ) -> None:
        if not isinstance(host_fraction, (int, float)) or not 0.0 <= host_fraction <= 1.0:
            raise SwapConfigError(f"host_fraction={host_fraction!r} must be between 0 and 1")
        window.check_readahead(readahead)
        self.manager = manager
        self.sub_groups = tuple(sub_groups)
        self.codec = MomentCodec.of(self.sub_groups)  #: the stored form (moments)
        self.scales = HeldScales(manager, self.codec, self.sub_groups, name)  #: int8's
        self.name = name
        self.kept = round(host_fraction * len(self.sub_groups))
        #: "auto": :attr:`readahead` is set again at the start of each step
        self.auto = readahead == window.AUTO
        #: sub-groups read ahead (this step's, under "auto")
        self.readahead = readahead if isinstance(readahead, int) else self._default_readahead()
        self._readahead_default = readahead is None  # (sized again by extend())
        self.room: Room | None = None  #: what "auto" decided from, last step
        self.streams = manager.config.nvme_dirs != ()
        #: per sub-group: how far it got (see the module docstring)
        self.progress = tuple(Progress() for _ in self.sub_groups)
        self._held: dict[int, torch.Tensor] = {}
        self._registered = 0
        self._closed = False

    # -- set-up ---------------------------------------------------------------------------

    def key(self, index: int) -> str:
        """The manager key of sub-group ``index``'s state."""
        return f"{self.name}/state/{index}"

    @property
    def kept_nbytes(self) -> int:
        """Bytes of memory budget taken for the optimizer's life: the kept sub-groups'
        state and the int8 block scales (:attr:`HeldScales.charge`)."""
        kept = sum(sg.state_nbytes for sg in self.sub_groups[: self.kept])
        return kept + self.scales.charge

    def held_states(self) -> dict[int, torch.Tensor]:
        """The sub-groups kept in memory for the optimizer's life: index → stored state
        (a new dict; the tensors are the kept ones, not copies)."""
        return dict(self._held)

    def holds(self, index: int) -> bool:
        """Whether sub-group ``index`` is kept in memory for the optimizer's life."""
        return index in self._held

    def initialize(self, fill: Callable[[SubGroup, torch.Tensor], None]) -> None:
        """Register every sub-group's state; ``fill(sub_group, buffer)`` writes it into a
        zeroed fp32 buffer of the state's shape (reused: one sub-group in memory at a time
        besides what the manager keeps).

        With int8 moments the block scales are encoded into one local tensor, registered
        once every sub-group is, and held (:class:`HeldScales`).

        Raises:
            what :meth:`TierManager.register` raises; the sub-groups registered so far are
            unregistered again.
        """
        # (A signal waits for a wait point or the end: what is registered or fetched is
        # always recorded, so that the undo below finds it.) Several sub-groups' writes
        # are in flight at once (swapper.step.initial: the disk's write rate).
        with signals.at_waits:
            gone: set[str] = set()
            try:
                scales = self.scales.fresh()  # int8: encoding fills it
                self._write_initial(self.sub_groups, fill, gone)
                self.scales.register(scales)
                del scales
                self.scales.hold()
                for sg in self.sub_groups[: self.kept]:
                    self._held[sg.index] = self.manager.fetch(self.key(sg.index))
            except BaseException:
                self._unregister(gone)
                raise

    def _write_initial(
        self,
        sub_groups: Sequence[SubGroup],
        fill: Callable[[SubGroup, torch.Tensor], None],
        gone: set[str],
    ) -> None:
        """Register ``sub_groups``' states, made by ``fill`` (:class:`InitialWriter`),
        counting each in ``_registered``. On an error, the keys whose writes failed (the
        manager dropped them) are added to ``gone`` before it is raised."""
        writer = InitialWriter(
            self.manager,
            self.codec,
            tuple(sub_groups),
            self._fp32_shape,
            timeout_s=self.manager.config.timeout_s,
        )
        try:
            for sg in sub_groups:
                writer.put(self.key(sg.index), sg, fill)
                self._registered += 1
            writer.finish()
        except BaseException:
            gone |= writer.drain()
            raise
        finally:
            writer.close()

    def extend(
        self,
        sub_groups: Sequence[SubGroup],
        fill: Callable[[SubGroup, torch.Tensor], None],
        step: int,
    ) -> None:
        """Add ``sub_groups`` (numbered on from the last one: a param group added after
        construction) and register their state as :meth:`initialize` does; they count as
        at ``step``. They are streamed (``host_fraction`` counted the sub-groups made at
        construction).

        Raises:
            SwapConfigError: ``sub_groups`` do not continue the numbering, or other
                moments than the others'.
            what :meth:`TierManager.register` raises; the new sub-groups registered so
            far are unregistered again and the pipeline is as before.
        """
        self._check_open()
        new = tuple(sub_groups)
        if [sg.index for sg in new] != list(
            range(len(self.sub_groups), len(self.sub_groups) + len(new))
        ) or any(sg.moments != self.codec.moments for sg in new):
            raise SwapConfigError(
                f"optimizer state {self.name!r}: added sub-groups must continue the "
                f"numbering from {len(self.sub_groups)} with {self.codec.moments} moments"
            )
        before = (self.sub_groups, self.progress, self.readahead)
        gone: set[str] = set()
        with signals.at_waits:
            try:
                self.sub_groups = self.sub_groups + new
                self.progress = self.progress + tuple(Progress(step, step, step) for _ in new)
                if self._readahead_default:
                    self.readahead = self._default_readahead()
                self._write_initial(new, fill, gone)
            except BaseException:
                self._unregister_to(len(before[0]), gone)
                self.sub_groups, self.progress, self.readahead = before
                raise

    def _fp32_shape(self, sg: SubGroup) -> tuple[int, ...]:
        """The shape of ``sg``'s state in fp32 (what ``fill`` and the rule see)."""
        return (3, sg.padded_numel) if self.codec.compressed else sg.state_shape

    def _fp32_numel(self, sg: SubGroup) -> int:
        return 3 * sg.padded_numel if self.codec.compressed else sg.state_numel

    def _default_readahead(self) -> int:
        streamed = self.sub_groups[self.kept :]
        if not streamed:
            return 0
        return window.budget_readahead(
            self.manager.config.host_nbytes,
            self.kept_nbytes,
            max(sg.state_nbytes for sg in streamed),
        )

    def _size_window(self) -> None:
        streamed = self.sub_groups[self.kept :]
        self.room = window.auto_readahead(
            self.manager,
            {self.key(sg.index) for sg in self.sub_groups} | {self.scales.key},
            kept_nbytes=self.kept_nbytes,
            largest_nbytes=max((sg.state_nbytes for sg in streamed), default=1),
            streamed=len(streamed),
        )
        self.readahead = self.room.readahead

    # -- one step -------------------------------------------------------------------------

    def run(
        self,
        step: int,
        compute: Compute,
        publish: Callable[[SubGroup, torch.Tensor], None],
        *,
        extra_keys: Callable[[SubGroup], list[str]] | None = None,
        timeout_s: float | None = None,
        order: Sequence[int] | None = None,
        ahead: Callable[[SubGroup], None] | None = None,
    ) -> None:
        """Bring every sub-group to step ``step``, in ``order`` (a permutation of the
        sub-group indices; ``None``: by index). The order changes no result: each
        sub-group's update reads only its own state and gradients. ``ahead(sg)`` is
        called for each sub-group as its state is read ahead (to read ahead what its
        compute and publish will read besides: gradients, parameters).

        For each sub-group not yet at ``step``: fetch its state (read ahead), ``compute``
        on it (which updates the state in place), ``publish`` the result (the 16-bit
        params), then write the state behind. A repeated call after a failure skips what
        is done: a sub-group already computed is only published and written again if
        those failed. Ctrl-C is held back while a sub-group computes and publishes, so an
        interrupt never leaves one computed but not marked so.

        Raises:
            StepFailedError: some sub-groups could not be read or written (an I/O error or
                a timeout, chained); what was done is kept, and calling again with the same
                ``step`` finishes the rest.
            Anything else ``compute`` or ``publish`` raise, as it is (after the writes in
            flight have ended; the bookkeeping stays exact).
        """
        self._check_open()
        # Signals surface only where the step waits (a fetch, a write), where the
        # bookkeeping below is exact, or when it ends; never between a fetch and the
        # record of it, nor between a compute and its mark.
        with signals.at_waits:
            self._run(step, compute, publish, extra_keys, timeout_s, order, ahead)

    def _run(
        self,
        step: int,
        compute: Compute,
        publish: Callable[[SubGroup, torch.Tensor], None],
        extra_keys: Callable[[SubGroup], list[str]] | None,
        timeout_s: float | None,
        order: Sequence[int] | None,
        ahead: Callable[[SubGroup], None] | None = None,
    ) -> None:
        extra = extra_keys or (lambda sg: [])
        if self.auto:  # budgets and the parameters' share change between steps
            self._size_window()
        walk = self.sub_groups if order is None else [self.sub_groups[i] for i in order]
        todo = [sg for sg in walk if self.progress[sg.index].durable < step]
        compute_todo = [sg for sg in todo if self.progress[sg.index].applied < step]
        position = {sg.index: i for i, sg in enumerate(compute_todo)}
        writes: dict[int, concurrent.futures.Future[None]] = {}
        error: BaseException | None = None
        try:
            for sg in todo:
                index = sg.index
                progress = self.progress[index]
                computing = progress.applied < step
                if computing:

                    def read_ahead(sg: SubGroup = sg) -> None:
                        # One short of the window before k computes: the farthest one is
                        # asked for once k's eviction is queued (below), see _read_ahead.
                        depth = min(self.readahead, max(1, self.readahead - 1))
                        self._read_ahead(compute_todo, position[sg.index] + 1, extra, depth, ahead)

                    self._compute_one(sg, compute, publish, extra(sg), step, timeout_s, read_ahead)
                elif progress.published < step:
                    self._publish_again(sg, publish, step, timeout_s)
                if index in self._held or not self.streams:
                    progress.durable = step
                else:
                    writes[index] = self.manager.evict(self.key(index), Tier.NVME)
                if computing:
                    self._read_ahead(
                        compute_todo, position[index] + 1, extra, self.readahead, ahead
                    )
        except BaseException as exc:  # raised below, once the writes have ended
            error = exc
        finally:
            failed = self._wait_writes(writes, step)
        if error is not None and not isinstance(error, _RETRYABLE):
            raise error
        if error is None and not failed:
            return
        undone = [sg.index for sg in self.sub_groups if self.progress[sg.index].durable < step]
        cause = error or next(iter(failed.values()))
        what = (
            f"step {step} did not finish: {len(undone)} of {len(self.sub_groups)} "
            f"sub-group(s) not durable at step {step} (first: {undone[:8]}); "
            f"{len(self.sub_groups) - len(undone)} done and kept. Call step() again with "
            f"the same gradients to finish it. Cause: {cause}"
        )
        raise StepFailedError(what, step=step, undone=undone) from cause

    def _read_ahead(
        self,
        order: list[SubGroup],
        start: int,
        extra: Callable[[SubGroup], list[str]],
        depth: int,
        ahead: Callable[[SubGroup], None] | None = None,
    ) -> None:
        """Ask the manager to read ahead ``order[start : start + depth]`` (keys already
        asked for are skipped by the manager), and ``ahead`` for each, state first.

        Why the window's far end waits for the eviction of the sub-group before it: the
        manager runs read-aheads and evictions on the same few mover threads, in the
        order asked, and a read-ahead with no room waits on its thread for room that only
        that eviction frees. Asked before it (k+1..k+r, then evict k), the read-aheads held
        both of the default two threads while evict k sat queued behind them, until
        something else woke them: 0.4-1.0 s between asking to evict a sub-group and its
        write starting, at 64M parameters on the 2-core VM (tools/step_trace.py
        --timeline; with 4 mover threads 17-50 ms).
        """
        keys: list[str] = []
        for sg in order[start : start + depth]:
            if sg.index not in self._held:
                keys.append(self.key(sg.index))
            keys.extend(extra(sg))
        if keys:
            self.manager.prefetch(keys)
        if ahead is not None:
            for sg in order[start : start + depth]:
                ahead(sg)

    def _compute_one(
        self,
        sg: SubGroup,
        compute: Compute,
        publish: Callable[[SubGroup, torch.Tensor], None],
        extra_keys: list[str],
        step: int,
        timeout_s: float | None,
        read_ahead: Callable[[], None],
    ) -> None:
        index = sg.index
        progress = self.progress[index]
        held = self._held.get(index)
        fetched: list[str] = []
        computed = False
        try:
            if held is None:
                state = self.manager.fetch(self.key(index), timeout_s=timeout_s)
                fetched.append(self.key(index))
            else:
                state = held
            # Issued once k is in: a read-ahead racing k's own fetch could take k's room
            # and be evicted again before use.
            read_ahead()
            extras = []
            for key in extra_keys:
                extras.append(self.manager.fetch(key, timeout_s=timeout_s))
                fetched.append(key)
            with signals.held:
                compute(sg, state, extras)
                computed = True
                # From here the state holds step `step`: it must never be computed again.
                progress.applied = step
                publish(sg, state)
                progress.published = step
        finally:
            state_key = self.key(index)
            for key in fetched:
                self.manager.release(key, modified=computed and key == state_key)

    def _publish_again(
        self,
        sg: SubGroup,
        publish: Callable[[SubGroup, torch.Tensor], None],
        step: int,
        timeout_s: float | None,
    ) -> None:
        """Publish a sub-group computed by an earlier, failed call (the state is not
        changed, so this is safe to repeat)."""
        held = self._held.get(sg.index)
        if held is not None:
            publish(sg, held)
        else:
            key = self.key(sg.index)
            state = self.manager.fetch(key, timeout_s=timeout_s)
            try:
                publish(sg, state)
            finally:
                self.manager.release(key, modified=False)
        self.progress[sg.index].published = step

    def _wait_writes(
        self, writes: dict[int, concurrent.futures.Future[None]], step: int
    ) -> dict[int, BaseException]:
        failed: dict[int, BaseException] = {}
        for index, future in writes.items():
            # Cut here, the writes go on; the sub-groups not marked durable are written
            # again (or found clean) by the next run of the step.
            wait_future(future, None, "step.write")
            exc = future.exception()
            if exc is not None:  # collected; run() raises
                log.warning("sub-group %d: write-behind at step %d failed: %s", index, step, exc)
                failed[index] = exc
            else:
                self.progress[index].durable = step
        return failed

    # -- reading and writing whole sub-groups (state_dict, load_state_dict) ----------------

    def read(self, index: int) -> torch.Tensor:
        """A copy of sub-group ``index``'s state, fp32 ``(3, padded_numel)``, decoded."""
        self._check_open()
        sg = self.sub_groups[index]
        held = self._held.get(index)
        if held is not None:
            return self.codec.decode(sg, held)
        key = self.key(index)
        with signals.at_waits:  # no signal between the fetch and the try
            state = self.manager.fetch(key)
            try:
                return self.codec.decode(sg, state)
            finally:
                self.manager.release(key, modified=False)

    def write(self, index: int, fill: Callable[[torch.Tensor], None], step: int) -> None:
        """Overwrite sub-group ``index``'s state with ``fill(state)`` (fp32, see
        :meth:`MomentCodec.fill`), mark it at ``step``, make it durable, then return."""
        self._check_open()
        with signals.at_waits:  # no signal between the fetch and the try
            held = self._held.get(index)
            if held is not None:
                self.codec.fill(self.sub_groups[index], fill, held)
            else:
                key = self.key(index)
                state = self.manager.fetch(key)
                try:
                    self.codec.fill(self.sub_groups[index], fill, state)
                finally:
                    self.manager.release(key, modified=True)
                if self.streams:
                    future = self.manager.evict(key, Tier.NVME)
                    wait_future(future, None, "step.write")
                    future.result()
            progress = self.progress[index]
            progress.applied = progress.published = progress.durable = step

    def iter_states(self) -> Iterator[tuple[SubGroup, torch.Tensor]]:
        """Each sub-group with a copy of its state, one at a time."""
        for sg in self.sub_groups:
            yield sg, self.read(sg.index)

    @contextlib.contextmanager
    def kept_released(self) -> Iterator[None]:
        """Inside the block, the sub-groups kept in memory and the int8 block scales are
        released (as modified: a step changed them in place), so that a manager snapshot
        writes and names them like any other; they are fetched again at the end, all of them
        whatever happened inside.

        Raises (at the end): the first re-fetch's error, once every other was tried.
        """
        manager = self.manager
        released: list[int] = []
        scales = False
        with signals.at_waits:
            try:
                for index in list(self._held):
                    manager.release(self.key(index), modified=True)
                    del self._held[index]
                    released.append(index)
                if self.scales.held:
                    self.scales.release(modified=True)
                    scales = True
                yield
            finally:
                # Signals held: a Ctrl-C that came during the block is delivered at the first
                # wait point, which would be the first re-fetch, and the others would stay
                # released (streamed from then on). It comes once all are back.
                error: BaseException | None = None
                with signals.held:
                    for index in released:
                        try:
                            self._held[index] = manager.fetch(self.key(index))
                        except Exception as exc:  # the others are still fetched
                            error = error or exc
                    if scales:
                        try:
                            self.scales.hold()
                        except Exception as exc:  # (a step then refuses: no scales bound)
                            error = error or exc
                if error is not None:
                    raise error

    # -- end ------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the kept sub-groups and forget every sub-group's state (their NVMe
        copies are deleted). Idempotent; if it raises, calling it again finishes."""
        if self._closed:
            return
        self._unregister()
        self._closed = True

    def _unregister(self, gone: set[str] | frozenset[str] = frozenset()) -> None:
        """Forget the state; ``gone``: keys the manager dropped already (a failed write
        of :meth:`initialize`)."""
        with signals.at_waits:  # each undo and its record go together
            for index in list(self._held):
                self.manager.release(self.key(index), modified=True)
                del self._held[index]
            self.scales.unregister()
            self._unregister_to(0, gone)

    def _unregister_to(self, count: int, gone: set[str] | frozenset[str]) -> None:
        """Unregister the sub-groups registered after the first ``count``, last first."""
        while self._registered > count:
            key = self.key(self.sub_groups[self._registered - 1].index)
            if key not in gone:
                self.manager.unregister(key)
            self._registered -= 1

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineClosedError(f"the optimizer state {self.name!r} is closed")
        # (int8: held again if a snapshot's re-fetch of them failed; else nothing)
        with signals.at_waits:
            self.scales.hold()

    def traffic_since(self, before: dict[tuple[Kind, Tier, Tier], int]) -> StepTraffic:
        """Bytes moved between NVMe and memory since ``before`` (a
        :meth:`counters` snapshot), by kind."""
        now = self.counters()
        read: dict[Kind, int] = {}
        written: dict[Kind, int] = {}
        for (kind, src, dst), nbytes in now.items():
            delta = nbytes - before.get((kind, src, dst), 0)
            if not delta:
                continue
            if src is Tier.NVME:
                read[kind] = read.get(kind, 0) + delta
            elif dst is Tier.NVME:
                written[kind] = written.get(kind, 0) + delta
        return StepTraffic(read, written)

    def counters(self) -> dict[tuple[Kind, Tier, Tier], int]:
        """The manager's bytes moved by (kind, source, destination), now."""
        return dict(self.manager.stats().kind_nbytes)
