"""In-place writes to a sharded model's parameters outside swapper's hooks: found and
raised on every rank, never lost quietly.

Between uses a sharded parameter's ``.data`` is a 0-element placeholder (its full value
exists only while its module runs, gathered from every rank's shards), so a write such
as ``torch.nn.init.zeros_(param)``, ``param.zero_()`` under ``no_grad`` or
``param.data.normal_()`` lands on the placeholder and is lost. As on the one-process
path (:mod:`swapper.zero.local.weights`), such a write bumps a version counter: the
parameter's own, or, since the parameter is made a
:class:`~swapper.zero.local.weights.GuardedParameter` whose ``.data`` between uses is the
placeholder object itself, the placeholder's. :class:`WriteGuard` records both whenever
the parameter is pointed at its placeholder.

Where it is checked: at agreement points only, because a rank that raised alone would
leave the others waiting in the next collective until the timeout. :meth:`WriteGuard.check`
runs at the start of every forward of the wrapped model and before a state dict is
gathered: each rank compares the counters of its parameters, then every rank says
whether it found a write (:func:`~swapper.distributed.agree`, one all_gather of one byte
per rank). A rank that found one raises :class:`~swapper.zero.local.weights.OffloadedWriteError`
naming the parameters; the others :class:`~swapper.distributed.PeerFailedError` naming
that rank. Nothing else changed: the parameters keep the values the tiers hold, the
counters are recorded again (the error is raised once), and training may go on.

Not caught: a write while the module is gathered (inside its forward or backward,
through ``.data`` or on the parameter): it lands in the gathered buffer, which is freed
when the module is done, so it is lost too. Writes to parameters of an ``nn.Parameter``
subclass through ``.data`` (the class is left alone, as on the one-process path). To
write a sharded parameter, load it: ``load_sharded_state_dict`` (every rank alike).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from swapper.distributed import DistGroup, agree
from swapper.distributed.errors import PeerFailedError
from swapper.zero.local.weights import OffloadedWriteError, guard, unguard
from swapper.zero.sharded.state import ShardSlot

if TYPE_CHECKING:
    from swapper.zero.local.params import Slot

__all__ = ["WriteGuard"]


class WriteGuard:
    """The write detection of a sharded model's parameters (see the module docstring).

    Args:
        group: the ranks (the check is an agreement over them).
        slots: every parameter's record; each is pointed at its placeholder and guarded.
    """

    def __init__(self, group: DistGroup, slots: Sequence[ShardSlot]) -> None:
        self._group = group
        self._slots = list(slots)
        self._versions: dict[int, tuple[int, int]] = {}
        for slot in self._slots:
            # guard() reads and writes param, placeholder and placeholder_version only
            guard(cast("Slot", _Guarded(slot)))
            self.rest(slot)

    def rest(self, slot: ShardSlot) -> None:
        """Point the parameter at its placeholder and record both version counters."""
        slot.param.data = slot.placeholder
        self._versions[slot.index] = (slot.param._version, slot.placeholder._version)

    def written(self) -> list[ShardSlot]:
        """The parameters written since they were last pointed at their placeholder
        (those whose module is gathered now are skipped); their counters are recorded
        again."""
        found: list[ShardSlot] = []
        for slot in self._slots:
            if any(m.gathered is not None for m in slot.modules):
                continue
            now = (slot.param._version, slot.placeholder._version)
            if now != self._versions.get(slot.index, now):
                found.append(slot)
                self._versions[slot.index] = now
        return found

    def check(self, what: str) -> None:
        """Every rank checks its parameters, then all agree (call on every rank alike).

        Raises:
            OffloadedWriteError: this rank's parameters were written outside the hooks
                (named, with how to write them instead).
            PeerFailedError: another rank's were (that rank named).
            CollectiveError: the agreement failed or timed out.
        """
        found = self.written()
        try:
            agree(self._group, not found, f"{what}: checking for writes outside the hooks")
        except PeerFailedError:
            if found:
                raise OffloadedWriteError(_message(found, self._group.rank)) from None
            raise

    def close(self) -> None:
        """Give the parameters back their ``nn.Parameter`` class (idempotent)."""
        unguard(cast("list[Slot]", [_Guarded(s) for s in self._slots]))


class _Guarded:
    """What :func:`~swapper.zero.local.weights.guard` and ``unguard`` touch of a slot."""

    def __init__(self, slot: ShardSlot) -> None:
        self.param = slot.param
        self.placeholder = slot.placeholder
        self.placeholder_version = slot.placeholder._version


def _message(found: list[ShardSlot], rank: int) -> str:
    names = ", ".join(f"{s.name!r} (shape {list(s.shape)})" for s in found[:8])
    more = f" and {len(found) - 8} more" if len(found) > 8 else ""
    return (
        f"offload: parameter(s) {names}{more} were written in place on rank {rank} outside "
        "the forward/backward (torch.nn.init.*, param.zero_(), param.data.normal_() ...): "
        "with several ranks a parameter's full value exists only while its module runs, "
        "so the write landed on an empty placeholder and is lost (the parameters keep the "
        "values the tiers hold, on every rank). Initialise the model before "
        "swapper.offload(...), or load new values with load_sharded_state_dict on every "
        "rank"
    )
