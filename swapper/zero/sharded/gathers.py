"""The gathers of a :class:`~swapper.zero.sharded.model.ShardedModel`, its
:class:`~swapper.zero.model.lifecycle.FetchStrategy`: each module's parameters gathered
from every rank's shards into one buffer, held while the module runs, released, and
started ahead along the recorded order.

Job: a gather's life, and nothing of hooks or autograd (those are
:mod:`swapper.zero.sharded.model`'s, which calls :meth:`Gathers.acquire` and
:meth:`Gathers.release` from its hooks; the lifecycle calls :meth:`Gathers.release` for a
failed pass's holds)::

    start ──► pending (state.pending: read-ahead) ──► acquire: wait ──► gathered
      │              │                                   │ (users > 0)      │
      │              └─ drain / settle_all ◄─────────────┘ wait raised      ▼
      │                 (settled, then freed)                           release
      └───────────────────────────────────────────────────────────► (freed, users 0)

Invariant: a gather's buffers (blocks of the device budget,
:class:`~swapper.zero.sharded.gather_budget.GatherBudget`) are freed only once its collective is
done with them: after a wait that returned, or after
:meth:`~swapper.distributed.PendingFetch.settle` when a wait raised (a failed group
raises at once, the collective still unwaited). A gather cut by an interrupt stays in
``state.pending`` (with its buffers) until :meth:`Gathers.settle_all` (close) settles it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import torch

from swapper.distributed import DistGroup, ModuleLayout, PendingFetch
from swapper.zero.model.core import ModelCore
from swapper.zero.sharded.gather_budget import GatherBudget, gather_need
from swapper.zero.sharded.state import ModuleState, ShardSlot
from tiers import signals

if TYPE_CHECKING:
    from swapper.zero.config.distributed import DistributedConfig
    from swapper.zero.sharded.overlap import ShardOverlap
    from swapper.zero.sharded.writes import WriteGuard

__all__ = ["Gathers"]

log = logging.getLogger("swapper.zero.sharded.model")  # (the messages keep their logger)


class Gathers:
    """Holds of modules, gathered by collective (module docstring): the N-rank fetch
    strategy. Made by the model's constructor, which hands over what it uses: the core
    (lock, manager, use tier), the group and its settings, the records, each module's
    state, the gathers' device budget, the write guard and the overlapped optimizer's
    gate. The gather order (recorded over the first step, then followed by read-ahead)
    is its own."""

    def __init__(
        self,
        core: ModelCore[ShardSlot, tuple[torch.nn.Module, list[ModuleState]]],
        group: DistGroup,
        dist: DistributedConfig,
        device: torch.device,
        by_index: list[ShardSlot],
        states: dict[torch.nn.Module, ModuleState],
        budget: GatherBudget,
        writes: WriteGuard,
        overlap: ShardOverlap,
    ) -> None:
        self.core = core
        self.group = group
        self._dist = dist
        self._device = device
        self._by_index = by_index
        self._states = states
        self._budget = budget
        self._writes = writes
        self._overlap = overlap
        #: the gather order recorded over the first step (None until then)
        self.order: list[ModuleState] | None = None
        #: the first step's gathers, in order (None once recorded)
        self.recording: list[ModuleState] | None = []
        self._position: dict[ModuleState, list[int]] = {}
        self._cursor = -1

    def backward_ended(self) -> None:
        """The first backward's end: the gathers recorded so far become the order that
        read-ahead follows from now on."""
        if self.recording is not None and self.recording:
            self.order, self.recording = self.recording, None
            for i, state in enumerate(self.order):
                self._position.setdefault(state, []).append(i)
            log.info("offload: recorded a gather order of %d modules", len(self.order))

    def drain(self) -> None:
        """Wait for every gather started ahead of use and drop it (the collectives were
        issued on every rank, so waiting pairs them; the buffers are freed only once the
        backend is done writing them).

        Raises:
            CollectiveError: a gather failed or timed out; it is settled
                (:meth:`~swapper.distributed.PendingFetch.settle`, at most the group's
                timeout) before its buffers are freed, the gathers after it are left for
                the next drain() or close().
        """
        for state in self._states.values():
            pending = state.pending
            if pending is None:
                continue
            try:
                pending.wait()
            except Exception:
                # A wait that raised left the collective unwaited (a failed group raises
                # at once): the backend may still write into the buffers.
                self._settle_and_free(state, pending)
                raise
            # an interrupt (BaseException) keeps it and its buffers: the collective may be
            # in flight; close() settles it
            state.pending = None
            self._budget.release(pending)

    def _settle_and_free(self, state: ModuleState, pending: PendingFetch) -> None:
        """Free the buffers of a gather whose wait raised, once the backend is done with
        them. ``state.pending`` holds it until then: an interrupt in the settle leaves it
        for close() (never freed with the collective in flight)."""
        state.pending = pending
        pending.settle()
        state.pending = None
        self._budget.release(pending)

    def settle_all(self) -> None:
        """For close: every gather started ahead of use waited for, whatever the group's
        state (a broken group fails a wait at once, its collective still unwaited), then
        its buffers freed; a failure is dropped (nothing is left to pair with). An
        interrupt keeps the gathers not yet settled (and their buffers) for the next
        close()."""
        for state in self._states.values():
            pending = state.pending
            if pending is None:
                continue
            # (not in PendingFetch.wait: a signal held by acquire's section is delivered
            # there; acquire keeps an interrupted gather in state.pending, for here)
            signals.wait_point("gather")  # a Ctrl-C here keeps it in flight, for close()
            with contextlib.suppress(Exception):
                pending.wait()
            pending.settle()  # never free a buffer the backend may still write
            state.pending = None
            self._budget.release(pending)

    def start(self, layout: ModuleLayout, slots: list[ShardSlot], what: str) -> PendingFetch:
        """Start the gather of ``slots`` (their layout): with an overlapped optimizer, once
        the update published this rank's shards of them (:mod:`swapper.zero.sharded.overlap`);
        this rank's shards are read from
        the tiers, copied into the collective's buffer (charged to the device budget
        until :meth:`release`: :class:`~swapper.zero.sharded.gather_budget.GatherBudget`), and
        released.

        Raises:
            BudgetTimeout: no device room for the buffers within the manager's timeout.
            CollectiveError: the collective failed to start.
        """
        shards: dict[int, torch.Tensor] = {}
        held: list[str] = []
        pieces = layout.rank_pieces(self.group.rank)
        # an overlapped update's new values of this rank's shards first (blocks; never
        # skips the gather: the other ranks issue it)
        self._overlap.before_gather(self._by_index[piece.index].param for piece in pieces)
        try:
            for piece in pieces:
                slot = self._by_index[piece.index]
                tensor = self.core.manager.fetch(slot.key, self.core.use_tier)
                held.append(slot.key)
                shards[piece.index] = tensor.view(-1).to(self._device)
            return self._budget.start(layout, shards, slots[0].dtype, what)
        finally:
            for key in held:
                self.core.manager.release(key, modified=False)

    def end(self, pending: PendingFetch) -> None:
        """A gather from :meth:`start` is no longer used: its buffers' device
        bytes go back to the budget (the memory itself once no view is left)."""
        self._budget.release(pending)

    def acquire(self, state: ModuleState) -> None:
        """Count a user of the module, gathering it for the first (the gather started
        ahead, or one started now), then start the next gathers along the order. Cut (an
        error, Ctrl-C), nothing is counted or held; a gather cut mid-collective stays in
        ``state.pending`` for :meth:`settle_all`.

        Raises:
            CollectiveError: the gather failed or timed out (settled, then freed).
            BudgetTimeout: no device room for the buffers.
        """
        with signals.at_waits:
            with self.core.lock:
                state.users += 1
                if state.users > 1:
                    return
            try:
                pending, state.pending = state.pending, None
                if pending is None:
                    pending = self.start(state.layout, state.slots, f"module {state.name!r}")
                pending.wait()
            except BaseException as exc:
                with self.core.lock:
                    state.users -= 1
                if pending is not None:
                    if isinstance(exc, Exception) or pending.done:
                        self._settle_and_free(state, pending)
                    else:  # interrupted mid-collective: close() settles it, then frees
                        state.pending = pending
                raise
            self._budget.waited(pending)  # the staging buffer: its copy is done
            with self.core.lock:
                state.gathered = pending
                for slot in state.slots:
                    slot.param.data = state.view(slot)
            try:
                self._note_fetch(state)
            except BaseException:
                # A read-ahead that raised (a Ctrl-C at the overlapped update's gate or a
                # fetch's wait, no device room, a collective): the caller records no hold
                # of this module, so give it back here. Kept, it stayed gathered for
                # good, and every later forward used that buffer, stale after a step.
                self.release(state)
                raise

    def release(self, state: ModuleState) -> None:
        """Give back one hold of the module; after the last, its buffer is charged no
        more and each parameter points at another module's gathered view of it, or at
        its placeholder."""
        with signals.held, self.core.lock:
            state.users -= 1
            if state.users > 0:
                return
            self._budget.release(state.gathered)  # charged no more: nothing reads it now
            state.gathered = None  # the buffer is freed once no view is left
            for slot in state.slots:
                self._point(slot)

    def _point(self, slot: ShardSlot) -> None:
        """``.data`` of a parameter: a view of a module's gathered buffer that holds it
        (a tied parameter may be held by another), else the empty placeholder."""
        for other in slot.modules:
            if other.gathered is not None:
                slot.param.data = other.view(slot)
                return
        self._writes.rest(slot)

    def _note_fetch(self, state: ModuleState) -> None:
        """Record the gather order (first step), or start the next gathers along it."""
        if self.recording is not None:
            self.recording.append(state)
            return
        order = self.order
        positions = self._position.get(state)
        if not order or not positions:
            return
        after = [i for i in positions if i > self._cursor]
        self._cursor = after[0] if after else positions[0]
        # Not past the end of the step: the optimizer changes the parameters after it.
        world, method = self.group.world_size, self._dist.fetch_collective
        for nxt in order[self._cursor + 1 : self._cursor + 1 + self._dist.fetch_ahead]:
            if nxt.pending is None and nxt.gathered is None:
                if not self._budget.may_start_ahead(gather_need(nxt.layout, world, method, False)):
                    break  # fewer ahead: the gather needed next must always find room
                nxt.pending = self.start(nxt.layout, nxt.slots, f"module {nxt.name!r}")
