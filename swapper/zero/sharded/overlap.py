"""Overlapped optimizer steps (``StepConfig(overlap=True)``, :mod:`swapper.step.deferred`)
over a :class:`~swapper.zero.sharded.model.ShardedModel`: the gate in the gathers, and the
agreements that keep the ranks' collectives paired.

What the gate guards. A gather reads this rank's shard of each parameter it holds a piece
of (:meth:`~swapper.zero.sharded.gathers.Gathers.start`); each rank's optimizer
steps only its own shards. So before a rank contributes its local shard to a gather
(one started by the forward, by read-ahead, or by a reader of the weights), the gate
waits for the sub-groups *of this rank* holding that shard to publish their new 16-bit
values: every rank waits for its own update, none for another's, and every gather reads
the new values. A rank never skips nor reorders a gather while it waits (the
collectives are paired by the order they are issued in): it blocks on the gate. Gathers
in flight when ``step()`` starts the update read the old shards: ``step()`` waits for
and drops them in the caller's thread (:meth:`ShardOverlap.step_started`), before the
update's thread starts; the update's own writes then skip
:meth:`~swapper.zero.sharded.model.ShardedModel.before_param_write`'s drain (a collective
wait from another thread, beside the forward's gathers).

No collective in the update's thread. The update (the pipeline over this rank's
sub-groups) issues none; what is global (the gradient norm, the fp16 overflow flag, the
skip decision) is reduced in ``step()`` before the update starts, as without overlap.
The ordinary step's end agreement (:meth:`~swapper.zero.sharded.state.ShardedParams.agree_step`)
is replaced by agreements in the caller's thread, at points every rank reaches in the
same order (one all_gather of one byte per rank each,
:func:`~swapper.distributed.gather_codes`), from ``step()`` starting an update until
one of them finds it done on every rank ("open"; every rank opens and closes it at the
same agreement, so every rank knows alike whether the next point agrees):

- the end of each forward (``ShardedModel.forward``, outermost): "my gathers read new
  shards only". Does not close (the update may still run).
- the wait for the whole update: before the first module's backward (its gradients are
  about to change), ``model.zero_grad()``, the model's state dicts, a snapshot, an
  export, a load:
  "my update ended well". Closes when every rank's did.
- ``optimizer.step()`` (:meth:`ShardOverlap.agree_update`): the same, after this rank
  finished a failed update in the caller's thread; ``step()`` returns then on every rank
  when any rank finished one (no new step starts: its gradients were the failed step's).

A failed update on one rank (an I/O error, a timeout): its gate raises
:class:`~swapper.step.deferred.DeferredStepError` for a parameter the failure left stale.
The gather cannot be skipped (the other ranks issue it): this rank contributes its old
shard, records the error, and the forward's end agreement raises it on this rank and
:class:`~swapper.distributed.PeerFailedError` on the others, before the forward returns
anything computed from it (every rank within one forward; the gathers hold no state, and
those started ahead are dropped by the next ``step()``). ``optimizer.zero_grad()`` does
not raise there: the retained gradients are dropped once the update is finished. Then
``optimizer.step()`` on every rank finishes it (sub-groups done stay done: nothing is
applied twice) and starts no new step.

Cost: a gather started ahead waits at the gate too, so the forward runs at most
``fetch_ahead`` modules behind the update (skipping read-ahead instead would depend on
each rank's timing and break the pairing); and one or two agreements per step (the
first forward's end, the backward's start), one byte per rank each.

Budget: where parameters are used in the host tier, a gather holds this rank's shards
of one module there at once, beside the update's state and parameter: refused when the
host budget cannot hold both (:meth:`ShardOverlap.install`, itself an agreement: the
ranks' shards differ, so one rank may be short alone).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from swapper.distributed import DistGroup, agree, gather_codes
from swapper.distributed.groups import peer_failed
from swapper.manager import in_background_work
from swapper.step.deferred import DeferredStepError
from swapper.step.sources import ParamGate
from tiers.errors import SwapConfigError
from tiers.units import format_size

if TYPE_CHECKING:
    from swapper.zero.sharded.state import ModuleState, ShardSlot

__all__ = ["ShardOverlap"]

#: What a rank says at an agreement point (one byte).
#: CLOSED: ok, and this rank's optimizer is closed (its gate removed): when every rank
#: says so the update is closed without further agreements
OK, FAILED, FINISHED, CLOSED = 0, 1, 2, 3
#: what to do about a failed update once the optimizer that ran it is closed
_CLOSED_HINT = (
    "the overlapped optimizer was closed with that update unfinished, so the weights "
    "are not what training made on every rank: load a snapshot (or the state before)"
)


class ShardOverlap:
    """The overlapped optimizer's gate in one rank's sharded model, and the agreements
    over its ranks (module docstring). Used from the caller's thread only.

    Args:
        group: the model's ranks.
        drain: the model's ``drain`` (waits for and drops the gathers started ahead).
        states: every module's gather record.
        slots: every parameter's record, by plan index.
        host_nbytes: the host budget where parameters are used in the host tier
            (bytes; None: no limit, or used elsewhere).
    """

    def __init__(
        self,
        group: DistGroup,
        drain: Callable[[], None],
        states: Iterable[ModuleState],
        slots: list[ShardSlot],
        host_nbytes: int | None,
    ) -> None:
        self._group = group
        self._drain = drain
        self._states = states
        self._slots = slots
        self._host_nbytes = host_nbytes
        self.gate: ParamGate | None = None
        #: an update started and not yet agreed done on every rank (the same on every rank)
        self.open = False
        #: a gather read a shard that this rank's failed update left old
        self._stale: DeferredStepError | None = None

    def install(self, gate: ParamGate | None, update_nbytes: int) -> None:
        """Install an overlapped optimizer's gate (None: remove it). Refused when the
        update cannot find its host room while a gather holds this rank's shards of a
        module there (parameters used in the host tier).

        Args:
            gate: the optimizer's :data:`~swapper.step.sources.ParamGate`, or None.
            update_nbytes: what the update holds in the host tier at once (bytes).

        Installing is an agreement (every rank makes the optimizer alike): the ranks'
        shards differ, so one rank's budget may refuse alone, and a rank that went on
        alone would issue gathers no other rank pairs.

        Raises:
            SwapConfigError: another optimizer's gate is installed (one overlapped
                optimizer per model), or the budget cannot hold both (both needs named),
                on the rank where it is so;
            PeerFailedError: on the other ranks;
            CollectiveError: the agreement failed or timed out.
        """
        if gate is None:
            old, self.gate = self.gate, None
            if old is not None and self.open:
                try:  # the optimizer has waited for its update: did it fail here?
                    old(None)
                except DeferredStepError as exc:  # kept: the next forward raises it
                    self._stale = self._stale or exc
            return
        error: SwapConfigError | None = None
        try:
            if self.gate is not None:
                raise SwapConfigError("offload: one overlapped optimizer per model (a gate is set)")
            if self._host_nbytes is not None:
                self._check_room(self._states, self._slots, self._host_nbytes, update_nbytes)
        except SwapConfigError as exc:
            error = exc
        try:
            agree(self._group, error is None, "StepConfig(overlap=True): installing the gate")
        except BaseException:
            if error is not None:
                raise error from None
            raise
        self.gate = gate

    def _check_room(
        self,
        states: Iterable[ModuleState],
        slots: list[ShardSlot],
        host_nbytes: int,
        update_nbytes: int,
    ) -> None:
        rank = self._group.rank
        held, name = 0, ""
        for state in states:
            nbytes = sum(
                slots[piece.index].local_numel * slots[piece.index].dtype.itemsize
                for piece in state.layout.rank_pieces(rank)
            )
            if nbytes > held:
                held, name = nbytes, state.name
        need = held + update_nbytes
        if need > host_nbytes:
            raise SwapConfigError(
                f"StepConfig(overlap=True): a gather holds up to {held} bytes of rank "
                f"{rank}'s shards in the host tier (module {name!r}) while the overlapped "
                f"update holds up to {update_nbytes} bytes there (its sub-group's state in "
                f"flight, the sub-groups kept in memory, one shard or gradient); "
                f"host_nbytes={host_nbytes} cannot hold both ({need} bytes, "
                f"{format_size(need)}): raise host_nbytes to at least {need}, lower "
                "sub_group_numel, or use overlap=False"
            )

    def before_gather(self, params: Iterable[torch.Tensor]) -> None:
        """Before this rank reads its shards of ``params`` for a gather: wait for their
        sub-groups' new values. A failed update's stale shard is read all the same (the
        other ranks issue the gather) and the failure kept for the forward's end."""
        gate = self.gate
        if gate is None:
            return
        for param in params:
            try:
                gate(param)
            except DeferredStepError as exc:
                if self._stale is None:
                    self._stale = exc

    def step_started(self) -> None:
        """``step()`` starts an update (every rank alike), in the caller's thread before
        the update's: the gathers started ahead read the old shards, dropped here.

        Raises:
            CollectiveError: waiting for a gather started ahead failed.
        """
        self._drain()
        self._stale = None
        self.open = True

    def in_update(self) -> bool:
        """Whether the calling thread is an overlapped update's (a gate is installed and
        the thread runs the update: :func:`~swapper.manager.in_background_work`): its
        shard writes skip the drain (a collective wait, the caller's thread's to do). Any
        other write (a load of a state dict from whatever thread, a failed update
        finished by ``step()``) drains the gathers started ahead first, as without
        overlap: they hold the old shards."""
        return self.gate is not None and in_background_work()

    def forward_ended(self) -> None:
        """The end of an outermost forward while an update is open: every rank says
        whether its gathers read new shards only.

        Raises:
            DeferredStepError: this rank's update failed and a gather read a stale shard.
            PeerFailedError: another rank's did.
            CollectiveError: the agreement failed or timed out.
        """
        if not self.open:
            return
        stale = self._stale
        if stale is not None and self.gate is None and _CLOSED_HINT not in str(stale):
            cause = str(stale).split(". Call optimizer.step()")[0]  # (it cannot any more)
            stale = self._stale = DeferredStepError(
                f"{cause}; {_CLOSED_HINT}", step=stale.step, undone=stale.undone
            )
        code = FAILED if stale is not None else (CLOSED if self.gate is None else OK)
        codes = self._agree(code, stale, "the forward beside an update")
        if all(c == CLOSED for c in codes):  # the same codes on every rank: closed alike
            self.open = False

    def settle(self, what: str) -> None:
        """Wait for the whole update; while one is open, every rank says whether its
        ended well, and it is closed when every rank's did. Call on every rank alike.

        Raises:
            DeferredStepError: this rank's update failed.
            PeerFailedError: another rank's did.
            CollectiveError: the agreement failed or timed out.
        """
        gate = self.gate
        if gate is None:
            return
        error: DeferredStepError | None = None
        try:
            gate(None)
        except DeferredStepError as exc:
            error = exc
        if not self.open:
            if error is not None:
                raise error
            return
        self._agree(FAILED if error is not None else OK, error, what)
        self.open = False

    def agree_update(self, finish: Callable[[], None] | None) -> bool:
        """At the start of ``optimizer.step()`` on every rank, after this rank's update
        ended (``finish``: finishes it in this thread when it failed, else None). Returns
        True when some rank finished a failed update now: ``step()`` then returns on
        every rank without starting a new step.

        Raises:
            what ``finish`` raised, on its rank (the step stays pending everywhere);
            PeerFailedError: on the other ranks.
            CollectiveError: the agreement failed or timed out.
        """
        if not self.open and finish is None:
            return False  # (a failed update keeps it open: every rank agreed it failed)
        self._drain()  # gathers started ahead may hold stale shards; the finish writes
        code, error = OK, None
        if finish is not None:
            try:
                finish()
                code = FINISHED
            except BaseException as exc:  # told to the others, then raised here
                code, error = FAILED, exc
        codes = self._agree(code, error, "the overlapped optimizer step")
        self.open = False
        self._stale = None
        return FINISHED in codes

    def _agree(self, code: int, error: BaseException | None, what: str) -> list[int]:
        codes = gather_codes(self._group, code, what)
        failed = tuple(r for r, c in enumerate(codes) if c == FAILED)
        if not failed:
            return codes
        if error is not None:
            raise error
        group = self._group
        todo = (
            "Call optimizer.step() on every rank to finish it"
            if self.gate is not None
            else _CLOSED_HINT[0].upper() + _CLOSED_HINT[1:]
        )
        raise peer_failed(
            group,
            what,
            failed,
            f"{what}: the overlapped optimizer update of rank(s) {list(failed)} of "
            f"{group.world_size} failed, so rank {group.rank} stops too; the failing "
            f"rank's own error says why. {todo}",
        )
