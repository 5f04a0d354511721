"""DCP's file-system writer on swapper's AIO engine, without copying the tensors: each
item's bytes go from the tier memory they live in straight to the disk (O_DIRECT, many
requests in flight), at a file offset chosen to match their address.

Why: the disk this was measured on takes O_DIRECT writes at 5–6 GB/s, faster than one
core copies memory, so every pass the CPU makes over the bytes (a staging copy,
``torch.save``'s CRC-32, a copy into write blocks) costs more than the write. Here the
CPU reads each byte once (its XXH3 checksum, at ~25 GB/s) and copies only the 16-bit
weights (one copy into a staging slot, as the tiers give no stable view of them).

The format stays DCP's own, so a plain ``torch.distributed.checkpoint.load`` (its
``FileSystemReader``) reads it: every tensor item is a complete ``torch.save`` archive
at the ``(offset, length)`` the metadata gives. The archive's small records are
``torch.save``'s own (written once per dtype and shape under
``torch.serialization.skip_data``, :func:`swapper.zero.checkpoint.dcp_templates.template`); the
tensor record's bytes are the tensor's. As with ``skip_data`` (and
``torch.serialization.set_crc32_options(False)``), its CRC-32 field is 0: ``torch.load``
does not check it, and zip tools warn. The integrity check that replaces it: an XXH3-64
digest of each item's bytes (archive, or pickled bytes for the non-tensor entries), in a
sidecar file per data file (``<file>.xxh3.json``, :data:`SIDECAR_SUFFIX`), which
swapper's import checks (:class:`~swapper.zero.checkpoint.dcp_planners.CheckedReader`) and plain
DCP ignores.

Layout of an item whose tensor is large (:data:`DIRECT_MIN_NBYTES`): it starts where its
data's file offset has the same phase modulo 4 KiB as the data's address (a gap of at
most 4 KiB of zeros before it, outside every item), so the data's aligned body is one
O_DIRECT request from the tier memory itself. Everything else (archive records, the
body's unaligned head and tail, small items, gaps) is collected in a buffer and written
through the buffered descriptor: no page is written both ways. The file's space is
reserved once (one ``posix_fallocate``) and trimmed at the end.

Buffers with I/O in flight are never reused: a staging slot is taken again only after
its write completed; a tier view
(:class:`~swapper.zero.checkpoint.dcp_planners.StreamingSavePlanner`'s lease) stays valid
until :meth:`AioStorageWriter.drain`, which its owner calls before it lets the memory go
(the export's sub-group cache does).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemWriter,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from swapper.zero.checkpoint.dcp_templates import Template as _Template
from swapper.zero.checkpoint.dcp_templates import template as _template
from tiers.aio import AioEngine, IOFuture
from tiers.buffers import HostBuffer, allocate
from tiers.config import DIRECT_ALIGNMENT, AioConfig

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import WriteItem

_log = logging.getLogger(__name__)

__all__ = [
    "DIRECT_MIN_NBYTES",
    "IN_FLIGHT_NBYTES",
    "SIDECAR_SUFFIX",
    "AioStorageWriter",
    "item_digest",
]

#: A tensor's bytes at least this long go straight from its memory (O_DIRECT); shorter
#: ones are copied into the buffered writes (a 4 KiB gap each would cost more).
DIRECT_MIN_NBYTES = 256 << 10
#: Bytes of direct writes in flight at most (the disk wants many requests queued).
IN_FLIGHT_NBYTES = 512 << 20
#: Staging slots for items that are copied (a sharded model's 16-bit weights): each
#: reused once its write completed.
STAGING_SLOTS = 4
#: Items whose tier memory is held for their write (a parameter fetched), in flight at
#: most: what the tiers must fit besides what they already hold.
HELD_LEASES = 16
#: The checksum file of data file ``F`` is ``F + SIDECAR_SUFFIX``.
SIDECAR_SUFFIX = ".xxh3.json"
_ALGORITHM = "xxh3_64"
_AIO = AioConfig(block_size=8 << 20, queue_depth=32)  # (swapper-bench disk's defaults)


def item_digest(data: Any) -> str:
    """The XXH3-64 digest (hex) of a buffer, as the sidecar stores it."""
    return xxhash.xxh3_64_hexdigest(data)


# -- the writer ----------------------------------------------------------------------


class _File:
    """One data file being written: buffered bytes collected for one contiguous region,
    direct requests in flight with what to release when each completed."""

    def __init__(self, engine: AioEngine, path: Path, reserve: int) -> None:
        self.engine = engine
        self.file = engine.open(path, create=True)
        os.ftruncate(self.file.fd, 0)  # an export replaces what was there
        self.file.reserve(reserve)  # the space once, not per request
        self.end = 0  # bytes placed (the file's length at the end)
        self.pending = bytearray()  # buffered bytes for [pending_at, end)
        self.pending_at = 0
        # (future, bytes, staging slot's release, tier memory's release)
        self.flight: collections.deque[
            tuple[IOFuture, int, Callable[[], None] | None, _Once | None]
        ] = collections.deque()
        self.flight_nbytes = 0
        self.held = 0  # requests in flight holding tier memory
        self.deferred: list[_Once] = []  # after_writes calls (run by drain at the latest)

    def put(self, data: Any) -> None:
        """Buffered bytes at the end."""
        view = memoryview(data).cast("B")
        self.pending += view
        self.end += len(view)

    def skip_to(self, at: int) -> None:
        """Zeros up to ``at`` (a gap between items)."""
        self.pending += bytes(at - self.end)
        self.end = at

    def flush(self) -> None:
        if self.pending:
            os.pwrite(self.file.fd, self.pending, self.pending_at)
        self.pending = bytearray()
        self.pending_at = self.end

    def direct(
        self,
        body: torch.Tensor,
        release: Callable[[], None] | None,
        free: Callable[[], None] | None,
    ) -> None:
        """``body`` (aligned address and length) written at the end, from its memory;
        ``release`` called by :meth:`wait_one` (this thread), ``free`` (tier memory) as
        soon as the request completed, by whichever thread completes it: this thread
        may be waiting for that memory in a fetch meanwhile."""
        self.flush()  # (the region before it: it may share no page with the body)
        nbytes = body.numel()
        while self.flight and self.flight_nbytes + nbytes > IN_FLIGHT_NBYTES:
            self.wait_one()
        future = self.engine.pwrite(body, self.file, self.end, nbytes)
        once = _Once(free) if free is not None else None
        self.flight.append((future, nbytes, release, once))
        if once is not None:
            future.add_done_callback(once)
        self.flight_nbytes += nbytes
        self.held += free is not None
        self.end += nbytes
        self.pending_at = self.end

    def after_writes(self, call: Callable[[], None]) -> None:
        """``call()`` once every request in flight now completed (at once if none is),
        from whichever thread completes the last, or :meth:`drain`, whichever is first."""
        futures = [f for f, *_ in self.flight if not f.done()]
        if not futures:
            call()
            return
        left = [len(futures)]
        lock = threading.Lock()
        once = _Once(call)
        self.deferred.append(once)

        def one(_: Any) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                once()

        for future in futures:
            future.add_done_callback(one)

    def wait_one(self) -> None:
        future, nbytes, release, once = self.flight.popleft()
        self.flight_nbytes -= nbytes
        self.held -= once is not None
        try:
            future.result()  # raises the write's SwapIOError
        finally:
            if release is not None:
                release()
            if once is not None:  # (its callback may not have run yet: done here then)
                once()

    def drain(self) -> None:
        """Every direct request completed, and whatever waited for them released."""
        error: BaseException | None = None
        while self.flight:
            try:
                self.wait_one()
            except BaseException as exc:  # every request waited on before raising
                error = error or exc
        deferred, self.deferred = self.deferred, []
        for once in deferred:
            once()
        if error is not None:
            raise error

    def finish(self, sync: bool) -> None:
        self.drain()
        self.flush()
        os.ftruncate(self.file.fd, self.end)  # the reservation's unused tail
        if sync:
            os.fsync(self.file.fd)

    def close(self) -> None:
        with contextlib.suppress(BaseException):
            self.drain()
        self.file.close()


class _Staging:
    """Page-aligned slots for the items that are copied; a slot is reused only after the
    write of what it held completed."""

    def __init__(self, slot_nbytes: int) -> None:
        self.slot_nbytes = slot_nbytes
        self._buffers: list[HostBuffer] = []
        self._free: list[int] = []

    def take(self, file: _File | None, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        nbytes = numel * dtype.itemsize
        if nbytes > self.slot_nbytes:
            raise ValueError(f"{nbytes} bytes do not fit a {self.slot_nbytes}-byte slot")
        while not self._free and len(self._buffers) >= STAGING_SLOTS and file is not None:
            file.wait_one()  # the oldest write, which frees a slot sooner or later
        if not self._free:
            # plain pages: prefaulting huge ones costs more than the few faults here
            self._buffers.append(allocate(self.slot_nbytes, huge=False))
            self._free.append(len(self._buffers) - 1)
        slot = self._free.pop()
        return self._buffers[slot].tensor[:nbytes].view(dtype), slot

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    def close(self) -> None:
        for buffer in self._buffers:
            buffer.close()
        self._buffers.clear()
        self._free.clear()


class AioStorageWriter(FileSystemWriter):
    """``FileSystemWriter`` (one file per rank, torch's plans, metadata and names) whose
    ``write_data`` writes the items as the module docstring says. Tensor items come from
    ``planner.lease(item, stage)`` when the planner has it (a flat tensor, and what to
    call once it is written; ``stage(numel, dtype)`` gives a staging slot to copy into),
    else from ``planner.resolve_data``. Call :meth:`close` after the save."""

    def __init__(self, path: str | os.PathLike[str], *, sync_files: bool = True) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=sync_files, thread_count=1)
        self._engine: AioEngine | None = None
        self._file: _File | None = None
        self._staging: _Staging | None = None

    def after_writes(self, call: Callable[[], None]) -> None:
        """``call()`` once the writes in flight now completed (at once if there are
        none), perhaps from the engine's thread: how a lease's owner lets its memory go
        (the export's sub-group cache), without waiting for them here."""
        if self._file is None:
            call()
        else:
            self._file.after_writes(call)

    def close(self) -> None:
        """Close the engine (requests in flight end), then free the staging slots."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix: _StoragePrefix = plan.storage_data
        name = f"{prefix.prefix}0{DEFAULT_SUFFIX}"
        path = Path(self.path) / name
        blobs = [
            (item, cast(io.BytesIO, planner.resolve_data(item)).getbuffer())
            for item in plan.items
            if item.type == WriteItemType.BYTE_IO
        ]
        tensors = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
        shapes = [(_dtype(item), tuple(_sizes(item))) for item in tensors]
        bound = sum(len(b) for _, b in blobs)
        bound += sum(_template(*s).length + DIRECT_ALIGNMENT for s in shapes)
        if self._engine is None:
            self._engine = AioEngine(_AIO)
        file = self._file = _File(self._engine, path, max(bound, 1))
        results: list[WriteResult] = []
        digests: dict[str, str] = {}

        def record(item: WriteItem, at: int, length: int, digest: str) -> None:
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(name, at, length)))  # fmt: skip
            digests[str(at)] = digest

        for item, blob in blobs:
            at = file.end
            file.put(blob)
            record(item, at, len(blob), item_digest(blob))
        largest = max((_template(*s).nbytes for s in shapes), default=0)
        if self._staging is None:
            self._staging = _Staging(largest)
        staging = self._staging
        lease = getattr(planner, "lease", None)
        for item, shape in zip(tensors, shapes, strict=True):
            template = _template(*shape)
            release: Callable[[], None] | None = None
            while file.held >= HELD_LEASES:
                file.wait_one()  # (the oldest request first: it holds the oldest)
            if lease is not None:

                def stage(numel: int, dtype: torch.dtype) -> torch.Tensor:
                    nonlocal release
                    out, slot = staging.take(file, numel, dtype)
                    release = functools.partial(staging.give_back, slot)
                    return out

                data, done = lease(item, stage)
            else:
                data, done = cast(torch.Tensor, planner.resolve_data(item)).contiguous(), None
            raw = data.view(-1).view(torch.uint8)
            if raw.numel() != template.nbytes:
                raise RuntimeError(
                    f"export: {item.index.fqn} gave {raw.numel()} bytes, its box holds "
                    f"{template.nbytes} (a source of the wrong size: a bug)"
                )
            hasher = xxhash.xxh3_64(template.prefix)
            # (hashed after a direct request is submitted: the disk writes meanwhile;
            # the memory stays until the request completed, which is waited for later)
            direct = self._write_tensor(file, template, raw, release, done)
            hasher.update(raw.numpy().data)
            hasher.update(template.suffix)
            if not direct:
                for call in (release, done):
                    if call is not None:
                        call()
            record(item, file.end - template.length, template.length, hasher.hexdigest())
        file.finish(self.sync_files)
        sidecar = path.with_name(name + SIDECAR_SUFFIX)
        text = json.dumps({"algorithm": _ALGORITHM, "items": digests}, sort_keys=True)
        with open(sidecar, "w") as f:
            f.write(text)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        file.close()
        self._file = None
        # nothing in flight: the engine closes meanwhile (io_destroy waits out an RCU
        # grace period, ~20-40 ms measured), while DCP writes the metadata
        engine, self._engine = self._engine, None
        threading.Thread(target=engine.close, name="swapper-dcp-engine-close", daemon=True).start()
        done_future: Future[list[WriteResult]] = Future()
        done_future.set_result(results)
        return done_future

    @staticmethod
    def _write_tensor(
        file: _File,
        template: _Template,
        raw: torch.Tensor,
        release: Callable[[], None] | None,
        free: Callable[[], None] | None,
    ) -> bool:
        """The archive of ``raw`` at the end of ``file``: True, its aligned body directly
        from ``raw``'s memory (large), ``release`` and ``free`` called when that request
        completed (:meth:`_File.direct`); False: copied, both the caller's to call."""
        nbytes = raw.numel()
        if nbytes < DIRECT_MIN_NBYTES:
            file.put(template.prefix)
            file.put(raw.numpy())
            file.put(template.suffix)
            return False
        # the data's file offset gets the phase of its address: its body goes direct
        address = raw.data_ptr()
        start = file.end + (address - file.end - len(template.prefix)) % DIRECT_ALIGNMENT
        file.skip_to(start)
        file.put(template.prefix)
        head = -address % DIRECT_ALIGNMENT
        body = (nbytes - head) // DIRECT_ALIGNMENT * DIRECT_ALIGNMENT
        file.put(raw[:head].numpy())
        file.direct(raw[head : head + body], release, free)
        file.put(raw[head + body :].numpy())
        file.put(template.suffix)
        return True


class _Once:
    """A release run once, by whichever comes first: the request's completion (a future's
    done-callback, in the engine's thread) or the writer waiting for it; a failure is
    logged (the completing thread has no one to raise it to)."""

    def __init__(self, call: Callable[[], None]) -> None:
        self._call: Callable[[], None] | None = call
        self._lock = threading.Lock()

    def __call__(self, _: Any = None) -> None:
        with self._lock:
            call, self._call = self._call, None
        if call is None:
            return
        try:
            call()
        except Exception:
            _log.exception("export: releasing tier memory after a write failed")


def _dtype(item: WriteItem) -> torch.dtype:
    if item.tensor_data is None:
        raise RuntimeError(f"{item.index.fqn}: a tensor item without tensor data")
    return item.tensor_data.properties.dtype


def _sizes(item: WriteItem) -> torch.Size:
    if item.tensor_data is None:
        raise RuntimeError(f"{item.index.fqn}: a tensor item without tensor data")
    return item.tensor_data.chunk.sizes
