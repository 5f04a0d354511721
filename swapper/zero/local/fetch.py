"""The one-process :class:`~swapper.zero.model.lifecycle.FetchStrategy`: a hold is of one
parameter (a :class:`~swapper.zero.local.params.Slot`), fetched from the tiers by
``TierManager.fetch`` for its first user and given back by ``release`` after its last.

The lifecycle (``ModelLifecycle``) and the one-process hooks
(:mod:`swapper.zero.local.offload_hooks`) call :meth:`TierFetch.acquire` and
:meth:`TierFetch.release`; the N-rank strategy is
:class:`~swapper.zero.sharded.gathers.Gathers` (a hold of a module, gathered by
collective).

Invariants: a slot's ``users`` counts its holds; its ``param.data`` is the fetched block
exactly while ``users > 0`` (or while persistent: :mod:`swapper.zero.local.persist`, where
the block stays and only the count moves); the counter and ``.data`` change together
under the core's lock, in a signal-held section, so an interrupt leaves a hold counted
and held, or neither.
"""

from __future__ import annotations

from swapper.zero.local.params import LocalCore, Slot
from swapper.zero.local.weights import check_unwritten
from tiers import signals

__all__ = ["TierFetch"]


class TierFetch:
    """Holds of single parameters, fetched from and released to the tiers (module
    docstring). ``core``: the model's, whose lock, manager, gate, persistence and read-ahead
    plan it uses."""

    def __init__(self, core: LocalCore) -> None:
        self.core = core

    def acquire(self, slot: Slot) -> None:
        """Count a user of the slot, fetching it for the first. Cut (Ctrl-C at a wait of
        the fetch, an error), nothing is counted or held; a signal arriving after the fetch
        waits for the caller's section, which records the hold first.

        Raises:
            OffloadedWriteError: the placeholder was written since the last release.
            DeferredStepError: an overlapped update of the parameter failed (its gate).
            and what ``TierManager.fetch`` raises (nothing is counted then).
        """
        core = self.core
        with signals.at_waits:
            if core.param_gate is not None:
                core.param_gate(slot.param)  # an overlapped step's update of it first
            with core.lock:
                slot.users += 1
                if slot.users > 1:
                    return
                if core.persist.active:  # fetched already (swapper.zero.local.persist)
                    core.holds.held_nbytes += slot.nbytes
                    return
            try:
                check_unwritten(slot)  # a write to the placeholder: raised, not lost quietly
                tensor = core.manager.fetch(slot.key, core.use_tier)
            except BaseException:
                with core.lock:
                    slot.users -= 1
                raise
            with core.lock:
                slot.param.data = tensor
                slot.version = slot.param._version
                core.holds.held_nbytes += slot.nbytes
            core.plan.fetched(slot.key)

    def release(self, slot: Slot) -> None:
        """Give back one hold of the slot; after the last, the parameter is its empty
        placeholder again and the manager's block is released (as modified when an
        in-place write landed in it while fetched)."""
        core = self.core
        with signals.held:  # uncounted and released, or neither
            with core.lock:
                slot.users -= 1
                if slot.users > 0:
                    return
                if core.persist.active:  # stays fetched (swapper.zero.local.persist)
                    core.holds.held_nbytes -= slot.nbytes
                    return
                # an in-place write while fetched landed in the tiers' bytes: keep it
                modified = slot.param._version != slot.version
                slot.param.data = slot.placeholder
                slot.version = slot.param._version
                core.holds.held_nbytes -= slot.nbytes
            core.manager.release(slot.key, modified=modified)
