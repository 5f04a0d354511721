"""Kernel contexts, one per worker: native Linux AIO (libaio or the raw syscalls) or threads.

Job: move pieces to and from the kernel. ``submit()`` takes a batch and says how many it
accepted, from the first; it raises only when it accepted none. ``reap()`` returns
``(piece, res)`` with ``res`` the byte count, ``-errno``, or the exception that failed
the piece.

Invariants:

* A piece handed to ``submit()`` and accepted is reported by ``reap()`` exactly once, so
  its buffer is known to be out of the kernel's hands before its request ends.
* Nothing here completes a future or knows about requests beyond the piece: that is the
  worker's job (:mod:`tiers.aio.worker`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue

from tiers.aio._native import IOCB_CMD_PREAD, IOCB_CMD_PWRITE, _Provider, ffi
from tiers.aio.requests import Op, _Piece

log = logging.getLogger("swapper.tiers.aio")

#: Threads per worker of the thread backend, whatever the queue depth.
_MAX_POOL_THREADS = 64


# ----------------------------------------------------------------------------------------
# Kernel contexts: one per worker. submit() takes a batch and says how many it accepted,
# from the first; it raises only when it accepted none. reap() returns (piece, res) with
# res the byte count, -errno, or the exception that failed the piece.

_Completion = tuple[_Piece, int | BaseException]


class _NativeContext:
    """A kernel AIO context with ``depth`` iocb slots, reused for every piece."""

    def __init__(self, provider: _Provider, depth: int, *, single_submit: bool) -> None:
        self._provider = provider
        self._depth = depth
        self._single_submit = single_submit
        self._ctx = provider.setup(depth)
        self._iocbs = ffi.new("struct iocb[]", depth)  # zeroed: key, rw_flags, flags stay 0
        self._ptrs = ffi.new("struct iocb *[]", depth)
        self._events = ffi.new("struct io_event[]", depth)
        self._free = list(range(depth))
        self._slots: list[_Piece | None] = [None] * depth

    def submit(self, pieces: list[_Piece]) -> int:
        used: list[int] = []
        n = 0
        try:
            for piece in pieces:
                slot = self._free.pop()
                used.append(slot)
                self._slots[slot] = piece
                cb = self._iocbs[slot]
                cb.aio_data = slot
                op = IOCB_CMD_PREAD if piece.request.op is Op.READ else IOCB_CMD_PWRITE
                cb.aio_lio_opcode = op
                cb.aio_fildes = piece.fd
                cb.aio_buf = piece.address
                cb.aio_nbytes = piece.nbytes
                cb.aio_offset = piece.offset  # OverflowError past int64: checked at submit
                self._ptrs[n] = self._iocbs + slot
                n += 1
        except Exception:
            if n == 0:
                self._release(used)
                raise
            # A piece that cannot be put in an iocb: submit those before it; next round
            # it comes first and fails alone.
        try:
            accepted = self._submit_iocbs(n)
        except BaseException:
            self._release(used)
            raise
        self._release(used[accepted:])
        return accepted

    def _submit_iocbs(self, n: int) -> int:
        """Submit ``self._ptrs[:n]``; returns how many the kernel took.

        Raises:
            OSError: the kernel refused the first one (or anything the provider raised
                for it: a provider that raises has accepted nothing in that call).
        """
        if not self._single_submit:
            return self._provider.submit(self._ctx, n, self._ptrs)
        for i in range(n):  # one per call: nothing for the block layer to plug and merge
            try:
                self._provider.submit(self._ctx, 1, self._ptrs + i)
            except Exception:
                if i == 0:
                    raise
                return i
        return n

    def _release(self, slots: list[int]) -> None:
        for slot in slots:
            self._slots[slot] = None
            self._free.append(slot)

    def reap(self, timeout_s: float) -> list[_Completion]:
        n = self._provider.getevents(self._ctx, 1, self._depth, self._events, timeout_s)
        done: list[_Completion] = []
        for i in range(n):
            event = self._events[i]
            slot = int(event.data)
            piece = self._slots[slot] if 0 <= slot < self._depth else None
            if piece is None:  # not ours: nothing to complete, and no slot to free
                log.error("AIO event for unknown iocb slot %d ignored (res=%d)", slot, event.res)
                continue
            self._slots[slot] = None
            self._free.append(slot)
            done.append((piece, int(event.res)))
        return done

    def close(self) -> None:
        self._provider.destroy(self._ctx)


class _ThreadContext:
    """The portable backend: blocking ``os.preadv``/``os.pwritev`` on a thread pool."""

    def __init__(self, depth: int, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=min(depth, _MAX_POOL_THREADS), thread_name_prefix=name
        )
        self._done: queue.SimpleQueue[_Completion] = queue.SimpleQueue()

    def submit(self, pieces: list[_Piece]) -> int:
        for i, piece in enumerate(pieces):
            try:
                self._pool.submit(self._run, piece)
            except Exception:
                if i == 0:
                    raise
                return i
        return len(pieces)

    def _run(self, piece: _Piece) -> None:
        res: int | BaseException
        try:
            view = ffi.buffer(ffi.cast("char *", piece.address), piece.nbytes)
            if piece.request.op is Op.READ:
                res = os.preadv(piece.fd, [view], piece.offset)
            else:
                res = os.pwritev(piece.fd, [view], piece.offset)
        except OSError as exc:
            res = -exc.errno if exc.errno else exc
        except BaseException as exc:  # whatever it is, the piece must come back failed
            res = exc
        self._done.put((piece, res))

    def reap(self, timeout_s: float) -> list[_Completion]:
        try:
            done = [self._done.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def close(self) -> None:
        self._pool.shutdown(wait=True)
