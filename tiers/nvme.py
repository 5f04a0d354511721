"""The NVMe store: tensors kept as extents of data files in one or more swap directories.

Each swap directory holds one data file (``<name>.bin``); a tensor's bytes live in one or
more :class:`Extent` s of those files, found by a stable string key. Tensors larger than
``stripe_nbytes`` are cut into stripe-size chunks placed round-robin over the directories,
so that two drives add their bandwidth; smaller ones go to the directory with the fewest
bytes allocated. Every chunk of a request is issued to the engine at once.

Allocation is a first-fit free list per file, in 4 KiB units (so every extent starts
O_DIRECT-aligned), with holes coalesced on free; a file grows at its end when no hole
fits. Space is reserved with ``fallocate`` before any byte is written, so a full disk
fails the ``write`` call at once with :class:`~tiers.errors.SwapNoSpaceError`.

Writes never overwrite a key's current bytes: a write goes to newly allocated extents
and the key switches to them only when every piece has completed (copy on write). A failed
write therefore leaves the previous version readable, and a read in flight always sees one
whole version. The price is room for a second copy of the tensors being written.

Life of one version of a key::

    write(key, t): validate, allocate extents, reserve file space ──ENOSPC──▶ extents
      │                                                  freed, SwapNoSpaceError raised
      ▼
    WRITING: all pieces issued at once; content hash computed on the caller's thread meanwhile
      │
      ├─ a piece failed ──────────────────────▶ DISCARDED: extents freed, the key keeps its
      │                                           old version; the future raises SwapIOError
      ├─ superseded (a write issued later has ▶ DISCARDED, the future succeeds
      │  committed, or the key was deleted)
      ▼
    CURRENT: info/read/verify use it; a read pins it while in flight
      │ a newer write commits, or delete(key)
      ▼
    RETIRED ── not pinned by reads in flight nor by the saved manifest ──▶ FREED
                                                 (its extents back to the free list)

The saved manifest pins the versions it names until the next :meth:`NvmeStore.save_manifest`,
so that reopening after a crash finds exactly the bytes the manifest describes even when
the keys were rewritten since.

Checksums: the XXH3-64 hash (``xxhash``, ~17 GB/s on one core here against 2.3 GB/s for
``zlib.crc32``, which capped evictions below disk speed) of the tensor's bytes, on the
calling thread, while the pieces
are being written. It runs at about 2 GB/s on one core (zlib 1.2.13, measured on the
development machine), i.e. ~0.5 s per GiB: slower than a fast NVMe drive, so on write-heavy
paths the checksum can be what ``write`` waits for. zlib releases the GIL for it, so other
threads keep running. Turn it off with ``NvmeStore(..., checksum=False)``.

Buffers: the engine uses O_DIRECT only for 4 KiB-aligned memory; tensors from torch's CPU
allocator usually are not, and their bytes then go through the page cache. Stage through
page-aligned buffers (:mod:`tiers.buffers`) for the fast path.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import itertools
import json
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import xxhash

from tiers.aio.engine import AioEngine, IOFuture, Op
from tiers.config import DIRECT_ALIGNMENT
from tiers.errors import SwapConfigError, SwapError, SwapIOError
from tiers.extents import RangeAllocator, pad
from tiers.files import SwapFile, make_private_dir
from tiers.units import format_size

__all__ = [
    "MANIFEST_VERSION",
    "ChecksumError",
    "DirUsage",
    "Extent",
    "ManifestError",
    "NvmeStore",
    "StoreClosedError",
    "StoreExistsError",
    "StoreFuture",
    "StoreKeyError",
    "StoredTensor",
]

#: Version of the manifest's JSON layout; :meth:`NvmeStore.open` refuses others.
MANIFEST_VERSION = 2  # 2: checksums are XXH3-64 (1 was zlib.crc32)


def content_hash(tensor: torch.Tensor) -> int:
    """XXH3-64 of a contiguous CPU tensor's bytes (the GIL is released while hashing)."""
    return xxhash.xxh3_64_intdigest(tensor.view(torch.uint8).numpy() if tensor.numel() else b"")


_MANIFEST_FORMAT = "swapper-nvme-store"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


# -- errors -------------------------------------------------------------------------------


class StoreClosedError(SwapError, RuntimeError):
    """The store is closed or closing; no new requests are accepted."""


class StoreKeyError(SwapError, KeyError):
    """No tensor is stored under the key."""

    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument; a message reads better plainly.
        return str(self.args[0]) if self.args else ""


class StoreExistsError(SwapError, FileExistsError):
    """A new store would overwrite the files of an existing one; reopen it or delete it."""


class ManifestError(SwapError, ValueError):
    """The manifest is missing, unreadable, of another version, or does not match."""


class ChecksumError(SwapError):
    """The bytes read back do not have the checksum recorded when they were written.

    Attributes:
        key: the tensor's key.
        expected: the XXH3-64 hash recorded at write time.
        actual: the XXH3-64 hash of the bytes read now.
    """

    def __init__(self, message: str, *, key: str, expected: int, actual: int) -> None:
        super().__init__(message)
        self.key = key
        self.expected = expected
        self.actual = actual


# -- public records -----------------------------------------------------------------------


@dataclass(frozen=True)
class Extent:
    """``nbytes`` consecutive bytes of a tensor at byte ``offset`` of directory
    ``dir_index``'s data file. ``offset`` is 4 KiB-aligned; the space allocated for the
    extent is ``nbytes`` rounded up to 4 KiB."""

    dir_index: int
    offset: int
    nbytes: int

    @property
    def allocated_nbytes(self) -> int:
        """Bytes of file space the extent occupies (``nbytes`` padded to 4 KiB)."""
        return pad(self.nbytes)


@dataclass(frozen=True)
class StoredTensor:
    """What the store knows of one tensor: its extents are in tensor byte order.

    ``checksum`` is the XXH3-64 hash of its bytes, or None when written with checksums off.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    extents: tuple[Extent, ...]
    checksum: int | None


@dataclass(frozen=True)
class DirUsage:
    """Space in one swap directory's data file, in bytes.

    ``allocated_nbytes``: held by extents (padded to 4 KiB), including retired versions not
    yet freed; ``end_nbytes``: the end of the last allocation (holes below it are free);
    ``file_nbytes``: the data file's size on disk (space reserved, never shrunk).
    """

    path: Path
    allocated_nbytes: int
    end_nbytes: int
    file_nbytes: int


# -- futures ------------------------------------------------------------------------------


class StoreFuture(concurrent.futures.Future):
    """The outcome of one ``write`` or ``read`` of a key: ``result()`` is its byte count.

    Covers every piece of the request across directories (and, for writes, the checksum).
    ``result()`` raises the first error to occur: a :class:`~tiers.errors.SwapIOError` (or
    subclass) whose message names the key and whose ``filename`` is the data file. By the
    time the future completes the store's metadata is updated: after a successful write,
    :meth:`NvmeStore.info` describes the new version. A request cannot be cancelled.
    """

    def __init__(self, op: Op, key: str, nbytes: int) -> None:
        super().__init__()
        self.op = op
        self.key = key
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._parts = 0  # completions expected: pieces, plus the checksum for writes
        self._issued = 0  # pieces handed to the engine so far
        self._left = 0
        self._error: BaseException | None = None
        self._finish: Callable[[BaseException | None], None] | None = None

    def describe(self) -> str:
        return f"{self.op.value} of key={self.key!r} ({self.nbytes} bytes)"

    def cancel(self) -> bool:
        """Always False: bytes already handed to the kernel cannot be called back."""
        return False

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<StoreFuture {self.describe()} ({state})>"

    # The store drives these; they are not for callers.

    def _begin(self, parts: int, finish: Callable[[BaseException | None], None]) -> None:
        """Expect ``parts`` completions, then call ``finish(first_error)`` and resolve."""
        self._parts = self._left = parts
        self._finish = finish
        if parts == 0:
            self._complete()

    def _attach(self, piece: IOFuture) -> None:
        self._issued += 1
        piece.add_done_callback(self._piece_done)

    def _piece_done(self, piece: IOFuture) -> None:
        self._part_done(piece.exception())

    def _part_done(self, error: BaseException | None) -> None:
        with self._lock:
            if error is not None and self._error is None:
                self._error = _name_key(error, self.op, self.key)
            self._left -= 1
            last = self._left == 0
        if last:
            self._complete()

    def _complete(self) -> None:
        error = self._error
        try:
            if self._finish is not None:
                self._finish(error)
        except BaseException as exc:  # a bookkeeping bug must still resolve the future
            error = error or exc
        if error is not None:
            self.set_exception(error)
        else:
            self.set_result(self.nbytes)


def _name_key(error: BaseException, op: Op, key: str) -> BaseException:
    """The engine's error, re-raised with the key in its message (the path stays)."""
    if not isinstance(error, OSError):
        # Not an I/O error (EngineClosedError, a bad buffer...): keep its type, add the key.
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(f"while doing the {op.value} of key={key!r}")
        return error
    cls = type(error) if isinstance(error, SwapIOError) else SwapIOError
    code = error.errno if error.errno is not None else errno.EIO
    what = error.strerror or str(error)
    wrapped = cls(code, f"{op.value} of key={key!r} failed: {what}", error.filename)
    wrapped.__cause__ = error
    return wrapped


# -- internal state -----------------------------------------------------------------------


@dataclass(eq=False)
class _Version:
    """One written version of a key (compared by identity).

    ``pins``: reads in flight plus one while the saved manifest names it; the extents are
    freed when the version is retired and unpinned.
    """

    stored: StoredTensor
    seq: int
    checksum: int | None = None
    pins: int = 0
    retired: bool = False


@dataclass(eq=False)
class _Key:
    """A key's current version and its writes in flight.

    ``seq`` is the sequence number of the last commit or delete: a write issued earlier
    than that completes as superseded and is discarded.
    """

    current: _Version | None = None
    seq: int = -1
    writing: int = 0


@dataclass(eq=False)
class _StoreDir:
    """One swap directory: its data file and that file's allocator."""

    path: Path
    data_path: Path
    file: SwapFile
    allocator: RangeAllocator
    created_dir: bool


# -- the store ----------------------------------------------------------------------------


class NvmeStore:
    """Tensors by key in data files over one or more swap directories.

    Thread-safe: reads and writes of any keys may run concurrently from any threads; see
    the module docstring for how concurrent writes of one key resolve (the one issued last
    wins). Close with :meth:`close` or use as a context manager.

    Args:
        dirs: the swap directories (created 0700 if missing). The data files go there.
        engine: the engine that does the I/O; the caller closes it after the store.
        stripe_nbytes: tensors larger than this are striped over the directories in chunks
            of this many bytes; a positive multiple of 4 KiB.
        checksum: record an XXH3-64 hash of every tensor written (see the module docstring).
        name: the files' base name: ``<name>.bin`` in each directory, ``<name>.json`` (the
            manifest) in ``dirs[0]``. Give each store sharing a directory its own name.

    Raises:
        SwapConfigError: no directories, a directory named twice, a bad stripe size or name.
        StoreExistsError: a data file or manifest of that name already exists (reopen the
            store with :meth:`open`, or delete the files).
        SwapIOError: a directory or file cannot be created.
    """

    def __init__(
        self,
        dirs: Sequence[str | os.PathLike[str]],
        engine: AioEngine,
        *,
        stripe_nbytes: int = 16 << 20,
        checksum: bool = True,
        name: str = "swapper-store",
    ) -> None:
        paths = _check_dirs(dirs)
        if (
            not isinstance(stripe_nbytes, int)
            or stripe_nbytes <= 0
            or stripe_nbytes % DIRECT_ALIGNMENT
        ):
            raise SwapConfigError(
                f"stripe_nbytes={stripe_nbytes} must be a positive multiple of "
                f"{DIRECT_ALIGNMENT} bytes (e.g. 16MiB)"
            )
        _check_name(name)
        self._setup(engine, name=name, stripe_nbytes=stripe_nbytes, checksum=checksum)
        created: list[_StoreDir] = []
        created_dirs: list[Path] = []
        try:
            for path in paths:
                if not os.path.lexists(path):
                    created_dirs.append(path)
                make_private_dir(path)
            _check_distinct(paths)
            for path in [*(p / f"{name}.bin" for p in paths), paths[0] / f"{name}.json"]:
                if os.path.lexists(path):
                    raise StoreExistsError(
                        errno.EEXIST,
                        "a store's file is already there; reopen it with NvmeStore.open() "
                        "or delete it",
                        str(path),
                    )
            for path in paths:
                data_path = path / f"{name}.bin"
                _create_exclusive(data_path)
                try:
                    swap_file = engine.open(data_path)
                except BaseException:
                    data_path.unlink()
                    raise
                created.append(
                    _StoreDir(path, data_path, swap_file, RangeAllocator(), path in created_dirs)
                )
        except BaseException:
            for d in created:
                d.file.close()
                d.data_path.unlink(missing_ok=True)
            for path in reversed(created_dirs):
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise
        self._dirs = created

    def _setup(self, engine: AioEngine, *, name: str, stripe_nbytes: int, checksum: bool) -> None:
        """State shared by the constructor and :meth:`open` (no I/O)."""
        self._engine = engine
        self._name = name
        self._stripe = stripe_nbytes
        self._checksum = checksum
        self._dirs: list[_StoreDir] = []
        self._keys: dict[str, _Key] = {}
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._ops = 0  # requests whose futures have not completed
        self._saved: list[_Version] = []  # the versions the manifest on disk names
        self._save_lock = threading.Lock()
        self._closing = False
        self._closed = False
        self._removed = False

    # -- properties -------------------------------------------------------------------

    @property
    def dirs(self) -> list[Path]:
        """The swap directories, absolute, in order."""
        return [d.path for d in self._dirs]

    @property
    def stripe_nbytes(self) -> int:
        return self._stripe

    @property
    def checksum(self) -> bool:
        """Whether writes record a content hash (XXH3-64)."""
        return self._checksum

    @property
    def name(self) -> str:
        return self._name

    @property
    def manifest_path(self) -> Path:
        return self._dirs[0].path / f"{self._name}.json"

    def dir_usage(self) -> list[DirUsage]:
        """Space used in each directory's data file."""
        with self._lock:
            return [
                DirUsage(
                    d.data_path,
                    d.allocator.used_nbytes,
                    d.allocator.end_nbytes,
                    0 if self._closed else d.file.size(),
                )
                for d in self._dirs
            ]

    # -- queries ----------------------------------------------------------------------

    def info(self, key: str) -> StoredTensor:
        """What is stored under ``key`` (its current version).

        Raises:
            StoreKeyError: nothing is stored under ``key``.
        """
        with self._lock:
            return self._current(key, "info").stored

    def keys(self) -> list[str]:
        """The keys with a stored tensor, oldest first (a deleted key rewritten is new)."""
        with self._lock:
            return [k for k, entry in self._keys.items() if entry.current is not None]

    def __iter__(self) -> Iterator[str]:
        """Iterate over a snapshot of :meth:`keys`."""
        return iter(self.keys())

    def __contains__(self, key: object) -> bool:
        with self._lock:
            entry = self._keys.get(key) if isinstance(key, str) else None
            return entry is not None and entry.current is not None

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for entry in self._keys.values() if entry.current is not None)

    # -- I/O --------------------------------------------------------------------------

    def write(self, key: str, tensor: torch.Tensor) -> StoreFuture:
        """Store ``tensor``'s bytes, dtype and shape under ``key``; returns at once.

        The bytes go to newly allocated extents; the key switches to them only when the
        write completes, so the previous version stays readable until then, and for good
        if the write fails. ``tensor`` must not be changed before the future completes.

        Raises (at once):
            TypeError: ``key`` is not a non-empty str, ``tensor`` is not a CPU tensor, or
                its dtype cannot be viewed as bytes.
            ValueError: ``tensor`` is not contiguous.
            SwapNoSpaceError: no room for it on disk; the message names the key, and the
                store and the key's old version are unchanged.
            StoreClosedError: the store is closed.
        The future raises :class:`~tiers.errors.SwapIOError` naming the key and the file
        when a piece fails; the key then keeps its old version.
        """
        _check_key(key)
        data = _byte_view(tensor, key, Op.WRITE)
        nbytes = data.numel()
        with self._lock:
            self._check_open()
            extents = self._place(nbytes)
            entry = self._keys.setdefault(key, _Key())
            entry.writing += 1
            self._ops += 1
            seq = next(self._seq)
        stored = StoredTensor(key, tensor.dtype, tuple(tensor.shape), nbytes, extents, None)
        version = _Version(stored, seq)
        future = StoreFuture(Op.WRITE, key, nbytes)
        future._begin(
            len(extents) + (1 if self._checksum else 0),
            lambda error: self._finish_write(version, error),
        )
        try:
            self._reserve_space(extents)
            self._issue(future, Op.WRITE, data, extents)
        except BaseException as exc:
            self._abort(future, exc)
        if self._checksum:
            # After the pieces are issued, so that the crc overlaps the I/O.
            try:
                version.checksum = content_hash(data)
            except BaseException as exc:  # e.g. KeyboardInterrupt: still settle the write
                future._part_done(exc)
                raise
            future._part_done(None)
        return future

    def read(self, key: str, out: torch.Tensor) -> StoreFuture:
        """Read ``key``'s bytes into ``out``; returns at once.

        ``out`` must be a contiguous CPU tensor of exactly the stored byte count; its
        dtype and shape may differ (a uint8 staging buffer of the right size will do), the
        bytes are copied as they are. The version read stays allocated until the future
        completes, even if the key is rewritten or deleted meanwhile.

        Raises (at once):
            StoreKeyError: nothing is stored under ``key``.
            TypeError, ValueError: ``out`` is not a contiguous CPU tensor, or its byte
                count differs; the message names the key and both dtypes and shapes.
            StoreClosedError: the store is closed.
        The future raises :class:`~tiers.errors.SwapIOError` naming the key and the file.
        """
        return self._read(key, out)[0]

    def verify(self, key: str) -> bool:
        """Read ``key`` back and compare its checksum; True when it matches.

        Returns False when no checksum was recorded (written with ``checksum=False``).

        Raises:
            ChecksumError: the bytes on disk differ from those written.
            StoreKeyError: nothing is stored under ``key``.
            SwapIOError: the read failed.
        """
        with self._lock:
            nbytes = self._current(key, "verify").stored.nbytes
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        future, stored = self._read(key, buffer)
        future.result()
        if stored.checksum is None:
            return False
        actual = content_hash(buffer)
        if actual != stored.checksum:
            where = ", ".join(
                f"{self._dirs[e.dir_index].data_path}@{e.offset}+{e.nbytes}" for e in stored.extents
            )
            raise ChecksumError(
                f"key={key!r}: XXH3-64 hash of the {stored.nbytes} bytes read back is "
                f"{actual:#018x}, {stored.checksum:#018x} was written ({where})",
                key=key,
                expected=stored.checksum,
                actual=actual,
            )
        return True

    def delete(self, key: str) -> None:
        """Forget ``key``; its extents return to the free list once no read in flight or
        saved manifest uses them. A write of ``key`` in flight is discarded when it ends.

        Raises:
            StoreKeyError: nothing is stored under ``key``.
            StoreClosedError: the store is closed.
        """
        with self._lock:
            self._check_open()
            entry = self._keys.get(key)
            version = self._current(key, "delete")
            entry.current = None
            entry.seq = next(self._seq)
            self._retire(version)
            if entry.writing == 0:
                del self._keys[key]

    # -- manifest ---------------------------------------------------------------------

    def save_manifest(self) -> None:
        """Write the manifest of every key's current version to ``dirs[0]``, atomically.

        The data files are fsynced first, so the manifest never names bytes that a crash
        could lose. Writes in flight are not in it. The manifest goes to a temporary file
        in the same directory, which is fsynced, renamed over the old manifest with
        ``os.replace`` and the directory fsynced: a crash at any point leaves either the
        old or the new manifest, whole. Until the next save, the versions named stay
        allocated even if their keys are rewritten or deleted (see the module docstring).

        Raises:
            SwapIOError: a file could not be written or synced; the old manifest is intact
                and the temporary file removed.
            StoreClosedError: the store is closed.
        """
        with self._save_lock:
            with self._lock:
                self._check_open()
                snapshot = [e.current for e in self._keys.values() if e.current is not None]
                for version in snapshot:
                    version.pins += 1  # nothing named here may be reused before it is on disk
                self._ops += 1  # keeps close() from closing the files under us
            try:
                document = self._manifest_document(snapshot)
                for d in self._dirs:
                    _fsync(d.file.fd, d.data_path)
                _write_atomically(self.manifest_path, json.dumps(document, indent=1) + "\n")
            except BaseException:
                with self._lock:
                    self._unpin(snapshot)
                    self._op_done()
                raise
            with self._lock:
                old, self._saved = self._saved, snapshot
                self._unpin(old)
                self._op_done()

    @classmethod
    def open(
        cls,
        dirs: Sequence[str | os.PathLike[str]],
        engine: AioEngine,
        *,
        name: str = "swapper-store",
    ) -> NvmeStore:
        """Reopen the store whose manifest ``<name>.json`` is in ``dirs[0]``.

        Stripe size and checksum setting come from the manifest; the free lists are
        rebuilt from the extents it names.

        Raises:
            ManifestError: no manifest, or it is unreadable, of another version, names other
                directories than ``dirs`` (same order), or describes extents that do not
                fit the data files.
            SwapConfigError: ``dirs`` or ``name`` are not usable.
            SwapIOError: a data file cannot be opened.
        """
        paths = _check_dirs(dirs)
        _check_name(name)
        manifest_path = paths[0] / f"{name}.json"
        try:
            document = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise ManifestError(f"no manifest at {manifest_path}: nothing to reopen") from None
        except (OSError, ValueError) as exc:
            raise ManifestError(f"cannot read the manifest {manifest_path}: {exc}") from exc
        store = cls.__new__(cls)
        try:
            spec = _parse_manifest(document, manifest_path, paths)
            store._setup(
                engine, name=name, stripe_nbytes=spec.stripe_nbytes, checksum=spec.checksum
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ManifestError):
                raise
            raise ManifestError(f"manifest {manifest_path} is malformed: {exc!r}") from exc
        opened: list[_StoreDir] = []
        try:
            for i, path in enumerate(paths):
                data_path = path / f"{name}.bin"
                try:
                    swap_file = engine.open(data_path)
                except FileNotFoundError:
                    raise ManifestError(
                        f"data file {data_path} named by manifest {manifest_path} is missing"
                    ) from None
                opened.append(_StoreDir(path, data_path, swap_file, RangeAllocator(), False))
                used = [
                    (e.offset, e.allocated_nbytes)
                    for t in spec.tensors
                    for e in t.extents
                    if e.dir_index == i
                ]
                try:
                    opened[i].allocator = RangeAllocator.rebuild(used)
                except ValueError as exc:
                    raise ManifestError(f"manifest {manifest_path}: {data_path}: {exc}") from None
                size = swap_file.size()
                for t in spec.tensors:
                    for e in t.extents:
                        if e.dir_index == i and e.offset + e.nbytes > size:
                            raise ManifestError(
                                f"manifest {manifest_path}: key={t.key!r} needs bytes up to "
                                f"{e.offset + e.nbytes} of {data_path}, which has only {size}"
                            )
        except BaseException:
            for d in opened:
                d.file.close()
            raise
        store._dirs = opened
        # Everything reopened is named by the manifest on disk: pinned until the next save.
        for t in spec.tensors:
            version = _Version(t, next(store._seq), t.checksum, pins=1)
            store._keys[t.key] = _Key(current=version, seq=version.seq)
            store._saved.append(version)
        return store

    # -- lifecycle --------------------------------------------------------------------

    def close(self, *, remove: bool = False) -> None:
        """Wait for the requests in flight, then close the data files. Idempotent.

        The data files and manifest stay on disk unless ``remove``: then this store's files
        (its data files and manifest) are deleted, and the directories the constructor
        created are removed if nothing else is in them. Nothing else is ever deleted.
        """
        with self._lock:
            self._closing = True
            while self._ops:
                self._idle.wait()
            was_closed, self._closed = self._closed, True
        if not was_closed:
            for d in self._dirs:
                d.file.close()
        if remove and not self._removed:
            self._removed = True
            if self._dirs:
                self.manifest_path.unlink(missing_ok=True)
            for d in self._dirs:
                d.data_path.unlink(missing_ok=True)
            for d in reversed(self._dirs):
                if d.created_dir:
                    with contextlib.suppress(OSError):  # not empty: someone else's files
                        d.path.rmdir()

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} tensors"
        return (
            f"<NvmeStore {self._name!r} dirs={[str(p) for p in self.dirs]} "
            f"stripe={format_size(self._stripe)} ({state})>"
        )

    # -- internals --------------------------------------------------------------------

    def _check_open(self) -> None:
        """Lock held."""
        if self._closing:
            raise StoreClosedError(f"store {self._name!r} is closed; no new requests are accepted")

    def _current(self, key: str, what: str) -> _Version:
        """Lock held. The key's current version, or StoreKeyError."""
        entry = self._keys.get(key) if isinstance(key, str) else None
        if entry is None or entry.current is None:
            raise StoreKeyError(f"{what}: no tensor stored under key={key!r}")
        return entry.current

    def _place(self, nbytes: int) -> tuple[Extent, ...]:
        """Lock held. Allocate the extents for ``nbytes`` bytes, in tensor order."""
        if nbytes == 0:
            return ()
        n_dirs = len(self._dirs)
        first = min(range(n_dirs), key=lambda i: self._dirs[i].allocator.used_nbytes)
        if n_dirs == 1 or nbytes <= self._stripe:
            offset = self._dirs[first].allocator.allocate(pad(nbytes))
            return (Extent(first, offset, nbytes),)
        # One region per directory holds all of its chunks back to back, so each drive
        # reads and writes its share sequentially.
        chunks = [
            ((first + i) % n_dirs, min(self._stripe, nbytes - start))
            for i, start in enumerate(range(0, nbytes, self._stripe))
        ]
        region = [0] * n_dirs
        for dir_index, size in chunks:
            region[dir_index] += pad(size)
        cursor = [
            self._dirs[i].allocator.allocate(region[i]) if region[i] else 0 for i in range(n_dirs)
        ]
        extents = []
        for dir_index, size in chunks:
            extents.append(Extent(dir_index, cursor[dir_index], size))
            cursor[dir_index] += pad(size)
        return tuple(extents)

    def _free(self, extents: tuple[Extent, ...]) -> None:
        """Lock held."""
        for e in extents:
            self._dirs[e.dir_index].allocator.free(e.offset, e.allocated_nbytes)

    def _retire(self, version: _Version) -> None:
        """Lock held. The version is no longer current; free it once nothing pins it."""
        version.retired = True
        if version.pins == 0:
            self._free(version.stored.extents)

    def _unpin(self, versions: list[_Version]) -> None:
        """Lock held."""
        for version in versions:
            version.pins -= 1
            if version.retired and version.pins == 0:
                self._free(version.stored.extents)

    def _op_done(self) -> None:
        """Lock held."""
        self._ops -= 1
        if self._ops == 0:
            self._idle.notify_all()

    def _reserve_space(self, extents: tuple[Extent, ...]) -> None:
        """Allocate disk space up to the padded end of every extent, per file.

        Raises:
            SwapNoSpaceError: a filesystem is full (the file keeps what it had).
        """
        ends: dict[int, int] = {}
        for e in extents:
            ends[e.dir_index] = max(ends.get(e.dir_index, 0), e.offset + e.allocated_nbytes)
        for dir_index, end in sorted(ends.items()):
            self._dirs[dir_index].file.reserve(end)

    def _issue(
        self, future: StoreFuture, op: Op, data: torch.Tensor, extents: tuple[Extent, ...]
    ) -> None:
        """Hand every extent's piece of ``data`` (a flat uint8 view) to the engine at once."""
        submit = self._engine.pwrite if op is Op.WRITE else self._engine.pread
        start = 0
        for e in extents:
            piece = data[start : start + e.nbytes]
            future._attach(submit(piece, self._dirs[e.dir_index].file, e.offset))
            start += e.nbytes

    def _abort(self, future: StoreFuture, error: BaseException) -> NoReturn:
        """Issuing failed part-way: settle the parts never issued, wait for those that
        were (the kernel may still be using the buffer and the extents), then raise the
        error with the key named. The future's finish step has undone the request."""
        for _ in range(future._parts - future._issued):
            future._part_done(error)
        raised = future.exception()  # waits for the pieces in flight
        raise raised if raised is not None else error

    def _finish_write(self, version: _Version, error: BaseException | None) -> None:
        """Runs once when every part of a write is done (any thread; lock not held)."""
        key = version.stored.key
        with self._lock:
            entry = self._keys[key]
            entry.writing -= 1
            if error is None and version.seq > entry.seq:
                version.stored = dataclasses.replace(version.stored, checksum=version.checksum)
                old, entry.current, entry.seq = entry.current, version, version.seq
                if old is not None:
                    self._retire(old)  # only now: until here the old bytes were the key's
            else:
                self._free(version.stored.extents)  # failed, or superseded by later news
            if entry.current is None and entry.writing == 0:
                del self._keys[key]
            self._op_done()

    def _read(self, key: str, out: torch.Tensor) -> tuple[StoreFuture, StoredTensor]:
        _check_key(key)
        with self._lock:
            self._check_open()
            version = self._current(key, "read")
            stored = version.stored
            data = _byte_view(out, key, Op.READ)
            if data.numel() != stored.nbytes:
                raise ValueError(
                    f"read of key={key!r}: out is {out.dtype} {tuple(out.shape)} "
                    f"({data.numel()} bytes) but the stored tensor is {stored.dtype} "
                    f"{stored.shape} ({stored.nbytes} bytes)"
                )
            version.pins += 1
            self._ops += 1
        future = StoreFuture(Op.READ, key, stored.nbytes)
        future._begin(len(stored.extents), lambda error: self._finish_read(version))
        try:
            self._issue(future, Op.READ, data, stored.extents)
        except BaseException as exc:
            self._abort(future, exc)
        return future, stored

    def _finish_read(self, version: _Version) -> None:
        with self._lock:
            self._unpin([version])
            self._op_done()

    def _manifest_document(self, versions: list[_Version]) -> dict[str, Any]:
        return {
            "format": _MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "name": self._name,
            "dirs": [str(d.path) for d in self._dirs],
            "stripe_nbytes": self._stripe,
            "checksum": self._checksum,
            "alignment": DIRECT_ALIGNMENT,
            "tensors": {v.stored.key: _stored_to_json(v.stored) for v in versions},
        }


# -- helpers ------------------------------------------------------------------------------


def _check_key(key: object) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"key must be a non-empty str, got {key!r}")


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise SwapConfigError(
            f"name={name!r} must be a file name of letters, digits, '_', '.', '-' "
            "(not starting with '.' or '-')"
        )


def _check_dirs(dirs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    if isinstance(dirs, (str, os.PathLike)):
        raise SwapConfigError("dirs must be a list of directories, not a single path")
    paths = [Path(os.path.abspath(os.fspath(d))) for d in dirs]
    if not paths:
        raise SwapConfigError("dirs is empty: give at least one swap directory")
    if len(set(paths)) != len(paths):
        raise SwapConfigError(f"dirs names a directory twice: {[str(p) for p in paths]}")
    return paths


def _check_distinct(paths: list[Path]) -> None:
    """Two names for one directory (a symlink, a bind mount) would hand one file twice."""
    seen: dict[tuple[int, int], Path] = {}
    for path in paths:
        st = os.stat(path)
        other = seen.setdefault((st.st_dev, st.st_ino), path)
        if other != path:
            raise SwapConfigError(f"swap directories {other} and {path} are the same directory")


def _create_exclusive(path: Path) -> None:
    """Create an empty 0600 file, failing if anything is at ``path`` (never truncating)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise StoreExistsError(
            errno.EEXIST, "a store's file is already there; reopen it or delete it", str(path)
        ) from None
    except OSError as exc:
        raise SwapIOError(exc.errno, f"cannot create data file: {exc.strerror}", str(path)) from exc
    os.close(fd)


def _byte_view(tensor: object, key: str, op: Op) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor's bytes (no copy)."""
    what = f"{op.value} of key={key!r}"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise TypeError(
            f"{what}: tensor is on {tensor.device}; the store moves host memory only: "
            "stage it through a contiguous CPU tensor (tiers.buffers) first"
        )
    if tensor.layout != torch.strided:
        raise TypeError(f"{what}: tensor has layout {tensor.layout}; only dense tensors")
    if not tensor.is_contiguous():
        raise ValueError(
            f"{what}: tensor of shape {tuple(tensor.shape)} with strides {tensor.stride()} "
            "is not contiguous; pass tensor.contiguous()"
        )
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError(f"{what}: tensor has a lazy conj/neg bit; pass tensor.resolve_conj()")
    try:
        return tensor.detach().reshape(-1).view(torch.uint8)
    except RuntimeError as exc:
        raise TypeError(f"{what}: dtype {tensor.dtype} cannot be viewed as bytes: {exc}") from exc


def _fsync(fd: int, path: Path) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        raise SwapIOError(exc.errno, f"fsync failed: {exc.strerror}", str(path)) from exc


def _write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text`` so that a crash leaves old or new."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            raise SwapIOError(
                exc.errno or errno.EIO,
                f"cannot write the manifest: {exc.strerror or exc}",
                str(path),
            ) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        _fsync(dir_fd, path.parent)  # the rename itself is durable only once the dir is
    finally:
        os.close(dir_fd)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"unknown dtype {name!r}")
    return dtype


def _stored_to_json(stored: StoredTensor) -> dict[str, Any]:
    return {
        "dtype": _dtype_name(stored.dtype),
        "shape": list(stored.shape),
        "nbytes": stored.nbytes,
        "extents": [
            {"dir": e.dir_index, "offset": e.offset, "nbytes": e.nbytes} for e in stored.extents
        ],
        "checksum": stored.checksum,
    }


@dataclass(frozen=True)
class _ManifestSpec:
    stripe_nbytes: int
    checksum: bool
    tensors: list[StoredTensor]


def _parse_manifest(document: Any, manifest_path: Path, paths: list[Path]) -> _ManifestSpec:
    """Check and decode a manifest (KeyError/TypeError/ValueError for malformed ones).

    Raises:
        ManifestError: another format or version, other directories, or bad extents.
    """
    if not isinstance(document, dict) or document.get("format") != _MANIFEST_FORMAT:
        raise ManifestError(f"{manifest_path} is not a swapper NVMe store manifest")
    if document.get("version") != MANIFEST_VERSION:
        raise ManifestError(
            f"{manifest_path} has manifest version {document.get('version')!r}; this swapper "
            f"reads version {MANIFEST_VERSION}"
        )
    recorded = [str(p) for p in document["dirs"]]
    given = [str(p) for p in paths]
    if recorded != given:
        raise ManifestError(
            f"manifest {manifest_path} was written for directories {recorded}, but {given} "
            "were given: pass the same directories in the same order"
        )
    stripe = document["stripe_nbytes"]
    if not isinstance(stripe, int) or stripe <= 0 or stripe % DIRECT_ALIGNMENT:
        raise ManifestError(f"manifest {manifest_path}: bad stripe_nbytes {stripe!r}")
    tensors = []
    for key, item in document["tensors"].items():
        dtype = _parse_dtype(item["dtype"])
        shape = tuple(int(s) for s in item["shape"])
        nbytes = int(item["nbytes"])
        extents = tuple(
            Extent(int(e["dir"]), int(e["offset"]), int(e["nbytes"])) for e in item["extents"]
        )
        checksum = item["checksum"]
        numel = 1
        for s in shape:
            numel *= s
        problems = []
        if min(shape, default=0) < 0 or numel * dtype.itemsize != nbytes:
            problems.append(f"{nbytes} bytes do not match {dtype} {shape}")
        if sum(e.nbytes for e in extents) != nbytes:
            problems.append("its extents do not add up to its size")
        for e in extents:
            if (
                not 0 <= e.dir_index < len(paths)
                or e.offset % DIRECT_ALIGNMENT
                or e.offset < 0
                or e.nbytes <= 0
            ):
                problems.append(f"bad extent {e}")
        if checksum is not None and not isinstance(checksum, int):
            problems.append(f"bad checksum {checksum!r}")
        if problems:
            raise ManifestError(f"manifest {manifest_path}: key={key!r}: " + "; ".join(problems))
        tensors.append(StoredTensor(key, dtype, shape, nbytes, extents, checksum))
    return _ManifestSpec(stripe, bool(document["checksum"]), tensors)
