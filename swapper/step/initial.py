"""The optimizer's initial state, written to NVMe at the disk's write rate (issue 23).

Creating an optimizer over a model larger than memory writes its whole state (fp32
master weights and zeroed moments, 12 B per parameter) once. One sub-group at a time,
made in one scratch and registered with a write waited for, that ran at a fraction of the
disk: the scratch was ordinary ``torch.empty`` memory (not page-aligned, so the engine's
writes went through the page cache), and each write's durability (one group commit, two
``fdatasync``) was waited for before the next sub-group was made. At 400 M parameters on
the 2-core VM the creation wrote 4.97 GB in 12.2 s, 9.9 s of it waiting for writes.

Here each sub-group's state is made in one of a few page-aligned slots and handed to
:meth:`TierManager.register_behind`: the write is issued from the slot itself, its
checksums recorded as it is issued, and the next sub-group is made while it is in flight.
A slot is made again once its previous write no longer reads it (the future's
``released``: every piece of the write has ended), not once that write is durable: the
flush (one group commit: the data files' and the journal's ``fdatasync``) of one
sub-group's write runs while the next is made in its slot, and several keys settling
together share one group commit. Waiting for durability before refilling a slot left the
disk idle for each flush (400 M parameters, two slots: each of 22 writes of 192 MB then
waited ~67 ms for its flush before its slot was made again). Every key's durability is
still waited for, in order, by :meth:`InitialWriter.put` (those done by then) and
:meth:`InitialWriter.finish` (all). The slots are blocks of the manager's host tier
(:meth:`TierManager.reserve_room`: 4 KiB-aligned arena memory, already faulted in, and
charged to the host budget, so the creation's memory stays within the budgets); where
there is no host tier, or a slot can never fit its budget, they are mapped with
:func:`tiers.buffers.allocate` instead.

States of one slot, and of the key written from it::

    FREE ──fill (zero, master from the 16-bit parameters, encode)──▶ FILLED
      ▲                                                                │ register_behind
      │ released (the write's pieces ended)                            ▼
      └──────────────────────────────────────────────────────────── IN FLIGHT

    key: SETTLING ──group commit durable──▶ settled (checked by put / finish, in order)
              └──── write or flush failed──▶ the error is raised by a later put() or
                                             finish(); the manager dropped the key

Data and crashes: a slot whose write still reads it is never given back nor refilled: if
the writer stops waiting (a failure elsewhere, a timeout, an interrupt), the slot goes
back to the host tier only from its write's ``released``. A failed flush never re-reads
the slot (the key is dropped), so refilling it before the flush loses nothing. A crash at
any instant leaves the store as a crash during any write does: each key's write becomes
part of the durable state only with its group commit, and a store opened after a crash
during an optimizer's creation is a store the caller never finished making
(``swapper.offload`` opens only stores whose snapshot committed).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import math
from collections.abc import Callable

import torch

from swapper.manager import Kind, ManagerTimeout, Tier, TierManager
from swapper.step.compress import MomentCodec
from swapper.step.layout import SubGroup
from tiers import buffers
from tiers.budget import BudgetExceededError
from tiers.signals import wait_future

__all__ = ["InitialWriter", "writes_in_flight"]

#: At most this many bytes of slots, and at most a quarter of the host budget.
SLOTS_NBYTES = 640 << 20
#: Slots: one filling while the others' writes are in flight. Four kept the disk busy at
#: 400 M parameters (sub-groups of 96 MB) on the 2-core VM; two is the least that overlaps.
MAX_SLOTS = 4


def writes_in_flight(slot_nbytes: int, host_nbytes: int | None = None) -> int:
    """How many slots of ``slot_nbytes`` to use: :data:`MAX_SLOTS`, fewer where they would
    pass :data:`SLOTS_NBYTES` or a quarter of ``host_nbytes`` (the host budget, None:
    unlimited), at least 2."""
    cap = SLOTS_NBYTES if host_nbytes is None else min(SLOTS_NBYTES, host_nbytes // 4)
    return max(2, min(MAX_SLOTS, cap // max(1, slot_nbytes)))


@dataclasses.dataclass
class _Slot:
    memory: torch.Tensor  # uint8, page-aligned
    release: Callable[[], None]  # gives the memory back (once its write has ended)
    #: done once no write reads the slot any more (``BehindFuture.released``); None:
    #: nothing was written from it since it was last free
    busy: concurrent.futures.Future[None] | None = None
    key: str = ""


class InitialWriter:
    """Registers sub-groups' initial state under keys, ``depth`` writes in flight.

    Args:
        manager: where the state goes (its ``register_behind``).
        codec: the stored form of the state (fp32, or compressed moments).
        sub_groups: the plan; sizes the slots (the largest sub-group).
        fp32_shape: a sub-group's state in fp32, as ``fill`` sees it (the update rule's
            rows; three with compressed moments).
        timeout_s: the longest wait for one slot's write to end.

    Raises:
        MemoryError: the slots cannot be mapped.
    """

    def __init__(
        self,
        manager: TierManager,
        codec: MomentCodec,
        sub_groups: tuple[SubGroup, ...],
        fp32_shape: Callable[[SubGroup], tuple[int, ...]],
        *,
        timeout_s: float,
    ) -> None:
        self.manager = manager
        self.codec = codec
        self.timeout_s = timeout_s
        self._shape = fp32_shape
        largest = max((math.prod(fp32_shape(sg)) for sg in sub_groups), default=0)
        #: the fp32 state of one sub-group before it is encoded (compressed moments only)
        self._fp32: torch.Tensor | None = None
        if codec.compressed:
            self._fp32 = torch.empty(largest, dtype=torch.float32)
            slot_nbytes = max((sg.state_nbytes for sg in sub_groups), default=0)
        else:
            slot_nbytes = 4 * largest
        host = manager.config.host_nbytes
        self.depth = writes_in_flight(slot_nbytes, host)
        count = min(self.depth, len(sub_groups))
        # From the host tier only where the slots leave half its budget to the rest (a
        # budget of one sub-group, the least the optimizer accepts, could never hold two
        # slots: the second would wait for room the first holds).
        in_host = host is None or count * slot_nbytes <= host // 2
        self._slots: list[_Slot] = []
        self._queue: collections.deque[_Slot] = collections.deque()
        self._failed: set[str] = set()  # keys whose writes failed (gone from the manager)
        #: keys registered and not yet seen settled, in order, with their futures
        self._settling: collections.deque[tuple[str, concurrent.futures.Future[None]]] = (
            collections.deque()
        )
        try:
            for _ in range(count):
                self._slots.append(self._slot(slot_nbytes, in_host))
        except BaseException:
            self.close()
            raise
        self._queue.extend(self._slots)

    def _slot(self, nbytes: int, in_host: bool) -> _Slot:
        """A block of the host tier (charged to its budget), else mapped memory."""
        if in_host:
            try:
                block = self.manager.reserve_room(
                    Tier.HOST, nbytes, what="a slot of the initial optimizer state"
                )
            except (ValueError, BudgetExceededError):  # no host tier, or it never fits
                pass
            else:
                return _Slot(block.tensor, block.release)
        memory = buffers.allocate(nbytes, lock=False, pin=False)
        return _Slot(memory.tensor, memory.close)

    def put(self, key: str, sg: SubGroup, fill: Callable[[SubGroup, torch.Tensor], None]) -> None:
        """Make ``sg``'s state in a free slot (``fill(sg, buffer)`` into a zeroed fp32
        buffer of ``fp32_shape(sg)``), then register it under ``key`` with its write in
        flight. On return the key is registered (settling). The slot is the one whose
        last write has ended soonest; the keys already settled are checked first.

        Raises:
            SwapIOError: an earlier sub-group's write or flush failed (named; its key is
                gone).
            ManagerTimeout: an earlier write did not end within ``timeout_s``.
            what ``fill`` and :meth:`TierManager.register_behind` raise (the key is then
            not registered).
        """
        slot = self._queue[0]
        self._free(slot)
        self._check_settled(wait=False)
        self._queue.rotate(-1)
        shape = self._shape(sg)
        numel = math.prod(shape)
        if self._fp32 is None:
            state = slot.memory[: 4 * numel].view(torch.float32).view(shape)
            state.zero_()
            fill(sg, state)
            stored = state
        else:
            state = self._fp32[:numel].view(shape)
            state.zero_()
            fill(sg, state)
            stored = self.codec.stored_form(sg, state, slot.memory)
        behind = self.manager.register_behind(key, stored, Kind.OPTIM_STATE)
        slot.busy, slot.key = behind.released, key
        self._settling.append((key, behind))

    def finish(self) -> None:
        """Wait for every write in flight and every key's durability; all keys are then
        settled.

        Raises:
            SwapIOError, ManagerTimeout: as :meth:`put` (the first failure, in order).
        """
        for slot in self._slots:
            self._free(slot)
        self._check_settled(wait=True)

    def _free(self, slot: _Slot) -> None:
        """Wait until no write reads ``slot``."""
        busy = slot.busy
        if busy is None:
            return
        if not wait_future(busy, self.timeout_s, "step.initialize"):
            raise ManagerTimeout(
                f"the initial optimizer state {slot.key!r}: its write to NVMe did not end "
                f"within {self.timeout_s} s (ManagerConfig.timeout_s); check the swap disk"
            )
        slot.busy = None

    def _check_settled(self, *, wait: bool) -> None:
        """Take the settled keys off the front of the list, in order (``wait``: all of
        them, waiting for each); raise the first one's failure."""
        while self._settling:
            key, future = self._settling[0]
            if not future.done():
                if not wait:
                    return
                if not wait_future(future, self.timeout_s, "step.initialize"):
                    raise ManagerTimeout(
                        f"the initial optimizer state {key!r}: its write to NVMe was not "
                        f"durable within {self.timeout_s} s (ManagerConfig.timeout_s); "
                        "check the swap disk"
                    )
            self._settling.popleft()
            if future.exception() is not None:
                self._failed.add(key)  # the manager dropped the key
                future.result()  # raises the write's error (named by the manager)

    def drain(self) -> set[str]:
        """After a failure: wait (up to ``timeout_s`` in all; not a wait point, so an
        interrupt waits) for the writes in flight. Returns the keys whose writes failed
        (the manager dropped them); a write still running is left to its completion."""
        busy = [slot.busy for slot in self._slots if slot.busy is not None]
        pending = [future for _, future in self._settling]
        concurrent.futures.wait(busy + pending, timeout=self.timeout_s)
        failed = set(self._failed)
        for key, future in self._settling:
            if future.done() and future.exception() is not None:
                failed.add(key)
        for slot in self._slots:
            if slot.busy is not None and slot.busy.done():
                slot.busy = None
        return failed

    def close(self) -> None:
        """Give the slots back; one whose write still runs goes back from the write's
        completion (its memory is never reused under the I/O). Idempotent."""
        for slot in self._slots:
            busy = slot.busy
            if busy is not None and not busy.done():
                busy.add_done_callback(lambda _done, release=slot.release: release())
            else:
                slot.release()
        self._slots.clear()
        self._queue.clear()
        self._settling.clear()
        self._fp32 = None
