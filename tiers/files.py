"""Swap files: private, never through a symlink, space reserved before it is written.

A :class:`SwapFile` holds two descriptors on one file: a buffered one, always, and an
O_DIRECT one where the filesystem accepts it. The engine sends each piece of a request to
the direct descriptor when the piece's address, offset and length are aligned, and to the
buffered one otherwise, so callers never need to know the alignment rules. Linux keeps the
page cache coherent across the two: direct I/O writes back and invalidates cached pages
in its range first.

Where a filesystem refuses O_DIRECT (EINVAL at open, e.g. some FUSE or network mounts),
the directory is remembered and every later file there is opened buffered, with one
warning per directory.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from pathlib import Path

from tiers.errors import SwapIOError, SwapNoSpaceError

log = logging.getLogger("swapper.tiers.files")

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

_direct_refused: set[str] = set()
_direct_refused_lock = threading.Lock()


def make_private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and parents) with the leaf as mode 0700; return it.

    An existing directory is used as it is (its mode is the owner's choice), but a
    symlink or a non-directory at ``path`` is refused.

    Raises:
        SwapIOError: ``path`` is a symlink or not a directory, or cannot be created.
    """
    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        message = f"cannot create swap directory: {exc.strerror}"
        raise SwapIOError(exc.errno, message, str(p)) from exc
    try:
        st = os.lstat(p)
    except OSError as exc:  # e.g. a parent is a regular file (ENOTDIR)
        message = f"cannot use swap directory: {exc.strerror}"
        raise SwapIOError(exc.errno, message, str(p)) from exc
    if stat.S_ISLNK(st.st_mode):
        raise SwapIOError(errno.ELOOP, "swap directory is a symbolic link; refusing it", str(p))
    if not stat.S_ISDIR(st.st_mode):
        raise SwapIOError(errno.ENOTDIR, "swap directory path is not a directory", str(p))
    return p


def direct_refused(directory: str | os.PathLike[str]) -> bool:
    """Whether O_DIRECT was refused for files in ``directory`` earlier in this process."""
    return os.path.abspath(directory) in _direct_refused


def _remember_direct_refused(directory: str, reason: str) -> None:
    with _direct_refused_lock:
        if directory in _direct_refused:
            return
        _direct_refused.add(directory)
    log.warning(
        "O_DIRECT refused in %s (%s): using buffered I/O for files there", directory, reason
    )


class SwapFile:
    """An open swap file. Use :meth:`open`; close with :meth:`close` or ``with``.

    Attributes:
        path: the file's path.
        fd: the buffered descriptor.
        direct_fd: the O_DIRECT descriptor, or None where direct I/O is off or refused.
    """

    def __init__(self, path: Path, fd: int, direct_fd: int | None) -> None:
        self.path = path
        self.fd = fd
        self.direct_fd = direct_fd
        self._reserved_nbytes = os.fstat(fd).st_size
        self._lock = threading.Lock()
        self._fds = [fd] + ([direct_fd] if direct_fd is not None else [])
        self._closed = False

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        create: bool = False,
        direct: bool = True,
        readonly: bool = False,
    ) -> SwapFile:
        """Open ``path`` for reading and writing; with ``create``, make it 0600 if missing.

        With ``readonly`` the file is opened for reading only (so files on read-only
        mounts can be read); :meth:`reserve` and writes then fail with EBADF.

        Raises:
            FileNotFoundError: the file (without ``create``) or its directory is missing.
            SwapIOError: the path is a symlink (ELOOP), or open fails otherwise (errno and
                filename set).
        """
        p = Path(path)
        access = os.O_RDONLY if readonly else os.O_RDWR
        flags = access | _O_NOFOLLOW | _O_CLOEXEC | (os.O_CREAT if create else 0)
        fd = _open(p, flags)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SwapIOError(errno.EINVAL, "swap file path is not a regular file", str(p))
            direct_fd = None
            parent = os.path.abspath(p.parent)
            if direct and _O_DIRECT and parent not in _direct_refused:
                try:
                    direct_fd = _open(p, (flags & ~os.O_CREAT) | _O_DIRECT)
                except SwapIOError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    _remember_direct_refused(parent, "EINVAL at open")
            if direct_fd is not None:
                a, b = os.fstat(fd), os.fstat(direct_fd)
                if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                    os.close(direct_fd)
                    raise SwapIOError(errno.ESTALE, "swap file was replaced while opening", str(p))
        except BaseException:
            os.close(fd)
            raise
        return cls(p, fd, direct_fd)

    def refuse_direct(self, reason: str) -> None:
        """Stop using O_DIRECT for this file and its directory (I/O returned EINVAL)."""
        _remember_direct_refused(os.path.abspath(self.path.parent), reason)
        # The direct fd stays open until close(): pieces may still be in flight on it.
        self.direct_fd = None

    def size(self) -> int:
        """The file's size in bytes."""
        return os.fstat(self.fd).st_size

    def reserve(self, end: int) -> None:
        """Make sure disk space is allocated for bytes ``[0, end)``.

        Uses ``posix_fallocate`` so that a full disk fails here, naming the file, and not
        later as a short write. Filesystems without fallocate support are let through.

        Raises:
            SwapNoSpaceError: the filesystem has no room; the file is left as it was.
            SwapIOError: fallocate failed otherwise.
        """
        with self._lock:
            if end <= self._reserved_nbytes:
                return
            start = self._reserved_nbytes
            old_size = os.fstat(self.fd).st_size
            try:
                os.posix_fallocate(self.fd, start, end - start)
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    # No fallocate on this filesystem (e.g. some network mounts): writes
                    # still report ENOSPC themselves, just later.
                    self._reserved_nbytes = end
                    return
                if os.fstat(self.fd).st_size != old_size:
                    os.ftruncate(self.fd, old_size)  # give back a partial allocation
                if exc.errno == errno.ENOSPC:
                    raise SwapNoSpaceError(
                        errno.ENOSPC,
                        f"no space left to reserve {end - start} bytes at offset {start} "
                        f"(file would be {end} bytes)",
                        str(self.path),
                    ) from exc
                message = f"posix_fallocate: {exc.strerror}"
                raise SwapIOError(exc.errno, message, str(self.path)) from exc
            self._reserved_nbytes = end

    def close(self) -> None:
        """Close both descriptors. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for fd in self._fds:
            os.close(fd)

    def __enter__(self) -> SwapFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SwapFile({str(self.path)!r}, direct={self.direct_fd is not None})"


def _open(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags, 0o600)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SwapIOError(
                errno.ELOOP, "swap file path is a symbolic link; refusing to follow it", str(path)
            ) from exc
        raise SwapIOError(exc.errno, exc.strerror, str(path)) from exc
