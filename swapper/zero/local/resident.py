"""Fast paths of :class:`~swapper.zero.local.offload.OffloadedModel`'s hooks for budgets that
hold every parameter (issue 14): what the general paths do, with fewer lock holds, signal
sections and manager calls, taken only when nothing has to move. Each returns False when
it does not apply, and the hook then runs its general path, unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from swapper.zero.local.params import LocalCore, Slot
from swapper.zero.local.weights import check_unwritten

__all__ = ["acquire_resident"]


def acquire_resident(core: LocalCore, slots: Sequence[Slot]) -> bool:
    """A module's forward pre-hook, when its use tier holds every parameter
    (``core.keep_held``), no overlapped update gates the parameters, none of ``slots`` has a
    user and all are in the use tier now: all fetched in one manager call
    (:meth:`~swapper.manager.TierManager.fetch_resident_all`), each counted as one user,
    its ``.data`` set. False, with nothing fetched or counted, otherwise.

    Called in the hook's ``signals.at_waits`` section, on the thread running the forward
    (the only one that takes holds while no overlapped update runs).

    Raises:
        OffloadedWriteError: as ``TierFetch.acquire``
            (:func:`~swapper.zero.local.weights.check_unwritten`), before anything is fetched.
    """
    if core.param_gate is not None or not core.keep_held:
        return False
    for slot in slots:
        if slot.users:
            return False
    for slot in slots:
        check_unwritten(slot)  # a write to the placeholder: raised, not lost quietly
    tensors = core.manager.fetch_resident_all([slot.key for slot in slots], core.use_tier)
    if tensors is None:
        return False
    holds = core.holds
    with core.lock:
        for slot, tensor in zip(slots, tensors, strict=True):
            slot.users += 1
            slot.param.data = tensor
            slot.version = slot.param._version
            holds.held_nbytes += slot.nbytes
    plan = core.plan
    for slot in slots:
        plan.fetched(slot.key)
    return True
