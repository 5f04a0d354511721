"""The future of one store request, made of many parts, and the check of a read's parts.

Job: :class:`StoreFuture` counts the parts of a ``write`` or ``read`` (one engine request
per extent, plus the checksums), keeps the first error, and once the last part is in runs
the store's finish step, which resolves the future — at once (reads, failed writes), or
later (a write is resolved by the committer once its record is durable).
:class:`ReadCheck` makes a read's part done only once its bytes match their digest.

Invariants: the finish step runs exactly once, after every part has reported (so no buffer
or extent is still in use by the kernel); the future is resolved exactly once, with the
first error of any part or of the finish step, or with the request's byte count.
:attr:`StoreFuture.released` is done from that same moment, before the finish step: a
write's source may be reused from then on while its durability is still being made (the
bytes are the kernel's; a failed flush fails the future, it never re-reads the source).
"""

from __future__ import annotations

import concurrent.futures
import errno
import threading
from collections.abc import Callable

import torch
import xxhash

from tiers.aio.engine import IOFuture, Op
from tiers.errors import IOTimeoutError, SwapCorruptionError, SwapIOError
from tiers.nvme.records import Extent

__all__ = ["ReadCheck", "StoreFuture", "digest", "name_key"]


class StoreFuture(concurrent.futures.Future):
    """The outcome of one ``write`` or ``read`` of a key: ``result()`` is its byte count.

    Covers every piece of the request across directories, the checksums, and for writes
    the journal record. ``result()`` raises the first error to occur: a
    :class:`~tiers.errors.SwapIOError` (or subclass) whose message names the key and whose
    ``filename`` is the data file, or for a read a
    :class:`~tiers.errors.SwapCorruptionError`. When a write's future succeeds the new
    version is durable (a crash or power cut after that finds it, or a later one) and
    :meth:`NvmeStore.info` describes it. A request cannot be cancelled.
    """

    def __init__(self, op: Op, key: str, nbytes: int) -> None:
        super().__init__()
        self.op = op
        self.key = key
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._parts = 0  # completions expected
        self._issued = 0  # engine requests handed out so far
        self._left = 0
        self._error: BaseException | None = None
        self._finish: Callable[[BaseException | None], None] | None = None
        self._resolved = False
        # The engine requests, so that a waiter that gives up can name the one stuck.
        self._pieces: list[IOFuture] = []
        #: Done (with None, whatever the outcome) once every part has ended: no request
        #: of this one reads or writes the caller's buffer any more. For a write that is
        #: before it is durable (the future itself waits for the flush).
        self.released: concurrent.futures.Future[None] = concurrent.futures.Future()

    def describe(self) -> str:
        return f"{self.op.value} of key={self.key!r} ({self.nbytes} bytes)"

    def cancel(self) -> bool:
        """Always False: bytes already handed to the kernel cannot be called back."""
        return False

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<StoreFuture {self.describe()} ({state})>"

    def stuck(self) -> IOFuture | None:
        """The first engine request of this one still in flight (None: all are done)."""
        return next((p for p in self._pieces if not p.done()), None)

    def timed_out(
        self,
        waited_s: float,
        setting: str,
        *,
        cls: type[IOTimeoutError] = IOTimeoutError,
        then: str = "The request stays in flight (its buffer is kept until it ends)",
    ) -> IOTimeoutError:
        """The error a waiter raises when this request has not completed after
        ``waited_s`` seconds (``setting``: the timeout it waited, named in the message),
        of type ``cls``; ``then``: what happens to the request, said in the message. It
        names the file and offset of the first piece still in flight."""
        piece = self.stuck()
        if piece is None:
            where = "every piece is done; it waits for the flush that makes it durable"
            path = offset = nbytes = None
        else:
            where = f"stuck: the {piece.describe()} has not completed"
            path, offset, nbytes = piece.path, piece.offset, piece.nbytes
        return cls(
            f"{self.describe()} did not complete within {waited_s:.3g} s ({setting}); "
            f"{where}. {then}. "
            f"Check the swap disk (dmesg, the device's health), or raise {setting}",
            op=self.op.value,
            key=self.key,
            waited_s=waited_s,
            path=path,
            offset=offset,
            nbytes=nbytes,
        )

    # The producer side (as concurrent.futures' set_result): the store's core drives
    # these, in this order: expect, attach per engine request (or part_done per part
    # that never reached the engine), complete when there are no parts, resolve from
    # the finish step. Not for callers, who wait on the future.

    @property
    def parts(self) -> int:
        """Completions expected (:meth:`expect`)."""
        return self._parts

    @property
    def issued(self) -> int:
        """Engine requests attached so far (:meth:`attach`)."""
        return self._issued

    def expect(self, parts: int, finish: Callable[[BaseException | None], None]) -> None:
        """Expect ``parts`` completions, then call ``finish(first_error)``, which resolves
        the future (now or later) with :meth:`resolve`. With no parts, the caller calls
        :meth:`complete` itself (outside any lock ``finish`` takes)."""
        self._parts = self._left = parts
        self._finish = finish

    def attach(
        self,
        piece: IOFuture,
        then: Callable[[concurrent.futures.Future], None] | None = None,
    ) -> None:
        """Count ``piece`` as one part: done when it is, or when ``then(piece)`` (which
        must call :meth:`part_done` once) says so."""
        self._issued += 1
        self._pieces.append(piece)
        piece.add_done_callback(then if then is not None else self._piece_done)

    def _piece_done(self, piece: concurrent.futures.Future) -> None:
        self.part_done(piece.exception())

    def part_done(self, error: BaseException | None) -> None:
        """One part ended (``error``: its failure, or None); the last one completes."""
        with self._lock:
            if error is not None and self._error is None:
                self._error = name_key(error, self.op, self.key)
            self._left -= 1
            last = self._left == 0
        if last:
            self.complete()

    def complete(self) -> None:
        """Every part ended: ``finish(first_error)``, or resolve at once without one."""
        # Every part is in: no piece is in flight. Drop them, since a done engine future
        # keeps its callbacks (a read's ReadCheck, and through it the slice of the
        # destination it hashed): a finished request kept by its owner (the manager keeps
        # each tensor's latest one) would otherwise keep that memory mapped after the tier
        # gave it back.
        self._pieces = []
        error = self._error
        if not self.released.done():
            self.released.set_result(None)
        try:
            if self._finish is None:
                self.resolve(error)
            else:
                self._finish(error)
        except BaseException as exc:  # a bookkeeping bug must still resolve the future
            self.resolve(error or exc)

    def resolve(self, error: BaseException | None) -> None:
        """Settle the future, once: ``error``, or the request's byte count."""
        with self._lock:
            if self._resolved:
                return
            self._resolved = True
        if error is not None:
            self.set_exception(error)
        else:
            self.set_result(self.nbytes)


def name_key(error: BaseException, op: Op, key: str) -> BaseException:
    """The engine's error, re-raised with the key in its message (the path stays)."""
    if not isinstance(error, OSError):
        # Not an I/O error (corruption, EngineClosedError, a bad buffer...): keep its type;
        # add the key where the message does not have it.
        add_note = getattr(error, "add_note", None)  # Python >= 3.11
        if f"key={key!r}" not in str(error) and add_note is not None:
            add_note(f"while doing the {op.value} of key={key!r}")
        return error
    cls = type(error) if isinstance(error, SwapIOError) else SwapIOError
    code = error.errno if error.errno is not None else errno.EIO
    what = error.strerror or str(error)
    if f"key={key!r}" in what:
        return error
    wrapped = cls(code, f"{op.value} of key={key!r} failed: {what}", error.filename)
    wrapped.__cause__ = error
    return wrapped


def digest(data: torch.Tensor) -> int:
    """XXH3-64 of a flat uint8 CPU tensor's bytes (the GIL is released while hashing)."""
    if not data.numel():
        return xxhash.xxh3_64_intdigest(b"")
    return xxhash.xxh3_64_intdigest(data.numpy())  # pyright: ignore[reportArgumentType]


class ReadCheck:
    """A read piece's done-callback: hash the extent's bytes (``out``'s slice it was read
    into) on a verifier thread, then report the part; a mismatch as
    :class:`~tiers.errors.SwapCorruptionError` naming key, file, offset and both digests."""

    def __init__(
        self,
        future: StoreFuture,
        extent: Extent,
        piece: torch.Tensor,
        path: str,
        submit: Callable[[Callable[[], None]], object],
    ) -> None:
        self.future, self.extent, self.path = future, extent, path
        self.piece: torch.Tensor | None = piece
        self._submit = submit

    def __call__(self, io: concurrent.futures.Future) -> None:
        error = io.exception()
        if error is not None:
            self.piece = None
            self.future.part_done(error)
            return
        try:
            self._submit(self._check)
        except BaseException as exc:  # e.g. interpreter shutdown: never leave the part open
            self.future.part_done(exc)

    def _check(self) -> None:
        piece, self.piece = self.piece, None  # (hashed once; held no longer than that)
        try:
            if piece is None:
                raise RuntimeError(f"read of key={self.future.key!r}: a piece checked twice")
            actual = digest(piece)
            e, key = self.extent, self.future.key
            expected = e.checksum if e.checksum is not None else 0
            if actual == expected:
                self.future.part_done(None)
                return
            error = SwapCorruptionError(
                f"read of key={key!r}: bytes {e.offset}..{e.offset + e.nbytes} of {self.path} "
                f"hash to XXH3-64 {actual:#018x} but {expected:#018x} was recorded when they "
                "were written: the file was changed or damaged on disk. The key stays "
                "stored; delete it and write it again from another copy",
                key=key,
                path=self.path,
                offset=e.offset,
                nbytes=e.nbytes,
                expected=expected,
                actual=actual,
            )
            self.future.part_done(error)
        except BaseException as exc:
            self.future.part_done(exc)
