"""The worker: one thread keeping up to ``queue_depth`` pieces in flight on its own context.

Job: the loop READY -> submit -> IN FLIGHT -> complete -> DONE of the engine's state
diagram (:mod:`tiers.aio.engine`), short transfers resubmitted for the rest, and the
per-file O_DIRECT fallback (``_route``: aligned pieces to the O_DIRECT descriptor,
others, and pieces O_DIRECT refused with EINVAL, to the buffered one).

Invariants:

* Workers never die: an exception while submitting, reaping or completing one piece
  fails that piece's request only, and the loop goes on; a failed reap is retried (the
  kernel keeps the completions).
* A piece's buffer is in the kernel's hands from submit until its completion is reaped;
  its request is not finished before that, so the buffer is never freed or reused early.
"""

from __future__ import annotations

import collections
import errno
import logging
import threading
import time

from tiers.aio.contexts import _NativeContext, _ThreadContext
from tiers.aio.requests import Op, _failure, _io_error, _Piece
from tiers.config import DIRECT_ALIGNMENT
from tiers.errors import SwapEOFError

log = logging.getLogger("swapper.tiers.aio")

#: How often a worker with requests in flight wakes to look for new work (seconds).
_REAP_POLL_S = 0.02


class _Worker:
    """One thread that keeps up to ``depth`` pieces in flight on its own context."""

    def __init__(self, context: _NativeContext | _ThreadContext, depth: int, name: str) -> None:
        self._context = context
        self._depth = depth
        self._inbox: collections.deque[_Piece] = collections.deque()
        self._cv = threading.Condition()
        self._stopping = False
        #: The error of the last failed reap, until one works again (logged once).
        self._reap_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, pieces: list[_Piece]) -> None:
        with self._cv:
            self._inbox.extend(pieces)
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join()
        self._context.close()

    def _run(self) -> None:
        ready: collections.deque[_Piece] = collections.deque()
        inflight = 0
        while True:
            with self._cv:
                if not ready and not inflight:
                    while not self._inbox and not self._stopping:
                        self._cv.wait()
                    if not self._inbox:
                        return  # stopping, and nothing left anywhere
                if self._inbox:
                    ready.extend(self._inbox)
                    self._inbox.clear()
            try:
                inflight += self._submit(ready, self._depth - inflight)
                if inflight:
                    inflight -= self._reap(ready)
            except Exception:  # pragma: no cover - _submit and _reap handle their own
                # Last resort: a worker that died would strand every request it holds.
                log.exception("AIO worker %s: unexpected error; it goes on", self._thread.name)
                time.sleep(_REAP_POLL_S)

    def _submit(self, ready: collections.deque[_Piece], room: int) -> int:
        """Submit up to ``room`` ready pieces; returns how many went in flight.

        A piece the context refuses fails its request; the others stay ready.
        """
        batch: list[_Piece] = []
        while ready and len(batch) < room:
            piece = ready.popleft()
            if piece.request.error is not None:
                piece.request.finish_piece()  # its request failed: do not start more of it
                continue
            _route(piece)
            batch.append(piece)
        if not batch:
            return 0
        try:
            accepted = self._context.submit(batch)
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno == errno.EAGAIN:
                ready.extendleft(reversed(batch))  # kernel busy: retry after a reap
                time.sleep(_REAP_POLL_S / 10)  # nothing may be in flight to reap: back off
                return 0
            # The first piece was refused (bad fd, bad address...). Fail it, keep the rest.
            first = batch[0]
            if not isinstance(exc, OSError):
                log.error("submitting %s failed", first.request.future.describe(), exc_info=exc)
            what = f"submitting the {first.request.op.value}"
            first.request.finish_piece(_failure(first, exc, what))
            ready.extendleft(reversed(batch[1:]))
            return 0
        ready.extendleft(reversed(batch[accepted:]))
        return accepted

    def _reap(self, ready: collections.deque[_Piece]) -> int:
        """Wait a little for completions and handle them; returns how many arrived.

        A failed wait is logged (once until it works again) and retried: the kernel keeps
        the completions, and the buffers of pieces in flight must stay untouched until
        they arrive, so no request can be failed for it.
        """
        try:
            completions = self._context.reap(_REAP_POLL_S)
        except Exception as exc:
            if self._reap_error is None:
                log.error(
                    "AIO worker %s: reaping completions failed; retrying: %r",
                    self._thread.name,
                    exc,
                    exc_info=exc,
                )
            self._reap_error = exc
            time.sleep(_REAP_POLL_S)
            return 0
        if self._reap_error is not None:
            log.warning("AIO worker %s: reaping works again", self._thread.name)
            self._reap_error = None
        for piece, res in completions:
            try:
                self._complete(piece, res, ready)
            except Exception as exc:  # never let one request stop the others
                what = f"completing the {piece.request.op.value}"
                log.error("%s of %s failed", what, piece.request.future.describe(), exc_info=exc)
                piece.request.finish_piece(_failure(piece, exc, what))
        return len(completions)

    def _complete(
        self, piece: _Piece, res: int | BaseException, ready: collections.deque[_Piece]
    ) -> None:
        """Act on one completion: finish the piece, or put it back in ``ready`` to go on.

        Putting it back is the last thing done: if anything here raises, the piece has
        been neither finished nor requeued, and the caller fails it.
        """
        request = piece.request
        op = request.op.value
        if isinstance(res, BaseException):
            request.finish_piece(_failure(piece, res, op))
            return
        if res < 0:
            code = -res
            if code == errno.EINVAL and piece.direct:
                # Retried on the buffered descriptor; how that goes tells whether the file
                # or this request is the cause (see the module's docstring).
                piece.buffered_only = piece.einval_pending = True
                ready.appendleft(piece)
                return
            request.finish_piece(_io_error(piece, code, op))
            return
        if piece.direct and res > 0:
            request.file.direct_worked = True
        elif piece.einval_pending:
            piece.einval_pending = False
            # One reason for reads and writes alike: it is logged once per directory.
            request.file.direct_failed("EINVAL from aligned O_DIRECT I/O that works buffered")
        if res == 0 and piece.nbytes:
            if request.op is Op.READ:
                size = request.file.size()
                request.finish_piece(
                    SwapEOFError(
                        errno.EIO,
                        f"read past end of file: {piece.nbytes} bytes missing at offset "
                        f"{piece.offset} (file is {size} bytes)",
                        str(request.file.path),
                    )
                )
            else:
                request.finish_piece(_io_error(piece, errno.EIO, "write (no progress)"))
        elif res < piece.nbytes:
            # Short transfer: continue from where it stopped, never ignore the rest.
            piece.address += res
            piece.offset += res
            piece.nbytes -= res
            ready.appendleft(piece)
        else:
            request.finish_piece()


def _route(piece: _Piece) -> None:
    """Send a piece to the O_DIRECT descriptor when it is aligned, else the buffered one."""
    direct_fd = piece.request.file.direct_fd
    mask = DIRECT_ALIGNMENT - 1
    aligned = not ((piece.address | piece.offset | piece.nbytes) & mask)
    if direct_fd is not None and aligned and not piece.buffered_only:
        piece.fd, piece.direct = direct_fd, True
    else:
        piece.fd, piece.direct = piece.request.file.fd, False
