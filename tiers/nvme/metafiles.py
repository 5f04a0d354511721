"""The store's files by name, read defensively and replaced atomically.

Job: name every file a store owns in its directories; read a metadata file (manifest,
journal) without trusting what is at its path; write one so that a crash leaves either the
old or the new file, whole; find the temporary files a crash left behind.

Files of a store named ``<name>`` (nothing else is ever created or deleted):

- ``<name>.bin`` in every swap directory: the data file, tensors' bytes in extents;
- ``<name>.lock`` in every swap directory: the advisory lock, holding the holder's pid;
- ``<name>.json`` in ``dirs[0]``: the manifest (the durable state at its generation);
- ``<name>.journal`` in ``dirs[0]``: the records of the changes since the manifest;
- ``<name>.identity`` in ``dirs[0]``: whose store it is (rank, world size), written by the
  layer above (:mod:`swapper.distributed.identity`); never read here, deleted with the store;
- ``<name>.<snapshot>.snap`` in ``dirs[0]``: a retained snapshot (:mod:`tiers.nvme.snapshots`);
  a snapshot name has no '.', so the files of a store named ``a.b`` are never a's;
- ``.<name>.json.<8 chars>.tmp`` / ``.<name>.journal.<8 chars>.tmp`` /
  ``.<name>.<snapshot>.snap.<8 chars>.tmp`` in ``dirs[0]``: a manifest, journal or
  snapshot being written; left behind only by a crash mid-write.

Invariants:

- A metadata file is read only if it is a regular file (``O_NOFOLLOW | O_NONBLOCK``, then
  ``fstat``: a symlink, FIFO, device or directory is refused without blocking) of at most
  :data:`~tiers.nvme.records.MAX_METADATA_NBYTES`; every refusal is a
  :class:`~tiers.nvme.records.ManifestError` naming the file.
- :func:`replace_file` creates its temporary file with ``O_EXCL | O_NOFOLLOW`` mode 0600,
  fsyncs it, renames it over the target and fsyncs the directory; on any error the
  temporary file is removed and the target is untouched.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from tiers.errors import SwapIOError
from tiers.nvme.records import MAX_METADATA_NBYTES, ManifestError

__all__ = [
    "StoreFiles",
    "count_written",
    "read_metadata",
    "remove_orphans",
    "replace_file",
    "written_nbytes",
]

# Bytes written to each metadata file (journal, manifest) by this process, keyed by the
# file's final path, and to all of a store's snapshot files under one key
# (StoreFiles.snapshots_account): the store's write accounting (NvmeStore.written). A path
# is one store's (its lock), so a store reads its own files' counts. One key per kind of
# file, not per snapshot name: a long run that names every snapshot anew must not grow this
# table (nor the time to read it) by a key per snapshot.
_written_lock = threading.Lock()
_written: dict[Path, int] = {}


def count_written(path: Path, nbytes: int) -> None:
    """Count ``nbytes`` written to metadata file ``path`` (temporary files count as the
    file they replace)."""
    with _written_lock:
        _written[path] = _written.get(path, 0) + nbytes


def written_nbytes(paths: list[Path]) -> int:
    """Bytes counted for the metadata files ``paths``."""
    with _written_lock:
        return sum(_written.get(p, 0) for p in paths)


_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


@dataclass(frozen=True)
class StoreFiles:
    """The paths of one store's files (see the module docstring)."""

    dirs: tuple[Path, ...]
    name: str

    def data(self, dir_index: int) -> Path:
        return self.dirs[dir_index] / f"{self.name}.bin"

    def lock(self, dir_index: int) -> Path:
        return self.dirs[dir_index] / f"{self.name}.lock"

    @property
    def manifest(self) -> Path:
        return self.dirs[0] / f"{self.name}.json"

    @property
    def journal(self) -> Path:
        return self.dirs[0] / f"{self.name}.journal"

    @property
    def identity(self) -> Path:
        """The record a layer above keeps beside the store (the rank and world size that
        own it, :mod:`swapper.distributed.identity`): tiers never reads it, but it is one of
        the store's files, so :func:`~tiers.nvme.remove_store` deletes it."""
        return self.dirs[0] / f"{self.name}.identity"

    def snapshots_account(self) -> Path:
        """The key all of this store's snapshot files are counted under
        (:func:`count_written`): a name no file has."""
        return self.dirs[0] / f"{self.name}.*.snap"

    def snapshot(self, snapshot: str) -> Path:
        """The file of the retained snapshot named ``snapshot`` (a name without '.')."""
        return self.dirs[0] / f"{self.name}.{snapshot}.snap"

    def snapshots(self) -> list[tuple[str, Path]]:
        """``(snapshot name, path)`` of every snapshot file in ``dirs[0]``, by name."""
        pattern = re.compile(rf"^{re.escape(self.name)}\.([A-Za-z0-9_][A-Za-z0-9_-]*)\.snap$")
        found = [(m.group(1), self.dirs[0] / n) for n in self._names() if (m := pattern.match(n))]
        return sorted(found)

    def orphans(self) -> list[Path]:
        """Temporary manifests, journals and snapshots in ``dirs[0]`` (only a crash
        leaves them)."""
        pattern = re.compile(
            rf"^\.{re.escape(self.name)}\.(json|journal|identity|[A-Za-z0-9_][A-Za-z0-9_-]*\.snap)"
            rf"\.[A-Za-z0-9_]{{8}}\.tmp$"
        )
        return sorted(self.dirs[0] / n for n in self._names() if pattern.match(n))

    def _names(self) -> list[str]:
        try:
            return os.listdir(self.dirs[0])
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise SwapIOError(exc.errno, f"cannot list: {exc.strerror}", str(self.dirs[0])) from exc


def _kind(mode: int) -> str:
    for test, what in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def io_error_of(exc: BaseException) -> OSError | None:
    """The OSError behind a :func:`read_metadata` refusal when the file could not be read
    at all (EIO, EAGAIN, EACCES...): that proves nothing of its bytes, so a caller must not
    take the file for damaged. None for a refusal of what the file is (a symbolic link,
    too large, not a regular file) or of what it says."""
    cause = exc.__cause__
    if isinstance(cause, OSError) and cause.errno != errno.ELOOP:
        return cause
    return None


def read_metadata(path: Path, what: str, *, limit: int = MAX_METADATA_NBYTES) -> bytes:
    """The bytes of the regular file at ``path``, refusing anything else.

    Raises:
        FileNotFoundError: nothing is at ``path`` (the caller says what that means).
        ManifestError: ``path`` is a symlink, FIFO, device, directory or socket, larger
            than ``limit`` bytes, or cannot be read; the message names it and ``what``.
    """
    try:
        st = os.lstat(path)  # first, so that a device node is never even opened
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ManifestError(f"cannot read the {what} {path}: {exc.strerror}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise ManifestError(f"the {what} {path} is {_kind(st.st_mode)}; refusing to read it")
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ManifestError(
                f"the {what} {path} is a symbolic link; refusing to follow it"
            ) from exc
        raise ManifestError(f"cannot open the {what} {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)  # what was opened, which may differ from what lstat saw
        if not stat.S_ISREG(st.st_mode):
            raise ManifestError(f"the {what} {path} is {_kind(st.st_mode)}; refusing to read it")
        if st.st_size > limit:
            raise ManifestError(
                f"the {what} {path} is {st.st_size} bytes, more than the {limit} bytes a "
                f"{what} may have (MAX_METADATA_NBYTES): it is not one this store wrote"
            )
        chunks = []
        total = 0
        while True:
            chunk = os.read(fd, min(16 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # it grew after fstat
                raise ManifestError(f"the {what} {path} grew past {limit} bytes while read")
        return b"".join(chunks)
    except OSError as exc:
        raise ManifestError(f"cannot read the {what} {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in ``path`` durable.

    Raises:
        SwapIOError: the directory cannot be opened or synced.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise SwapIOError(exc.errno, f"cannot sync directory: {exc.strerror}", str(path)) from exc


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """``pwrite`` every byte of ``data`` at ``offset`` (a short write continues)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.EIO, "write made no progress")
        view = view[n:]
        offset += n


def replace_file(
    path: Path, data: bytes, what: str, *, keep_open: bool = False, account: Path | None = None
) -> int | None:
    """Replace ``path`` by a 0600 file holding ``data``, atomically and durably.

    With ``keep_open`` the new file's descriptor (open for writing) is returned, else None.
    The bytes are counted as written to ``account`` (default ``path``; see
    :func:`count_written`).

    Raises:
        SwapIOError: a step failed; the temporary file is gone, and ``path`` is as it was
            unless only the final directory fsync failed (then the new file is in place
            but its rename may not survive a power cut).
    """
    tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"
    fd = -1
    try:
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o600
            )
            write_all(fd, data, 0)
            count_written(path if account is None else account, len(data))
            os.fsync(fd)
            os.replace(tmp, path)
        except OSError as exc:
            raise SwapIOError(
                exc.errno or errno.EIO,
                f"cannot write the {what}: {exc.strerror or exc}",
                str(path),
            ) from exc
        fsync_dir(path.parent)  # the rename is durable only once the directory is
    except BaseException:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass  # renamed already, or never made
        except OSError:
            pass  # left for remove_orphans at the next open
        raise
    if keep_open:
        return fd
    os.close(fd)
    return None


def remove_orphans(files: StoreFiles) -> list[Path]:
    """Delete the temporary files a crash mid-save left; the caller holds the store's lock.

    Raises:
        SwapIOError: one cannot be deleted.
    """
    removed = []
    for path in files.orphans():
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise SwapIOError(
                exc.errno, f"cannot remove a temporary file: {exc.strerror}", str(path)
            ) from exc
        removed.append(path)
    return removed
