"""Swap files: private, never through a symlink, space reserved before it is written.

A :class:`SwapFile` holds two descriptors on one file: a buffered one, always, and an
O_DIRECT one where the filesystem accepts it. The engine sends each piece of a request to
the direct descriptor when the piece's address, offset and length are aligned, and to the
buffered one otherwise, so callers never need to know the alignment rules. Linux keeps the
page cache coherent across the two: direct I/O writes back and invalidates cached pages
in its range first.

O_DIRECT is given up per file, never per directory or process: a file whose O_DIRECT open
fails with EINVAL (e.g. some FUSE or network mounts), or whose first O_DIRECT I/O fails
with EINVAL where the same request works buffered (the engine decides, see
:meth:`SwapFile.direct_failed`), uses its buffered descriptor only; every other file still
tries O_DIRECT. The reason is logged as a warning once per directory and reason.

Swap directories (:func:`make_private_dir`, :func:`check_private_dir`) must be private:
owned by this process's user and not writable by group or others, since whoever can
write there can replace a swap file and so the data read back. Directories created here
are 0700 whatever the umask, parents included.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
from pathlib import Path

from tiers.errors import SwapIOError, SwapNoSpaceError, UnsafeSwapDirError

log = logging.getLogger("swapper.tiers.files")

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)

_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)

#: (directory, reason) of every file that gave up O_DIRECT in this process: the warning is
#: logged once per pair, and :func:`direct_refused` reports it. It steers nothing.
_direct_refused: set[tuple[str, str]] = set()
_direct_refused_lock = threading.Lock()


def make_private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` and its missing parents, each mode 0700 whatever the umask; return it.

    An existing directory is used as it is if it is private (see
    :func:`check_private_dir`; 0755 is fine, the owner's choice), but a symlink or a
    non-directory at ``path`` is refused. Existing parents are not checked: a swap
    directory under ``/tmp`` is fine.

    Raises:
        UnsafeSwapDirError: ``path`` exists but is owned by another user or writable by
            group or others.
        SwapIOError: ``path`` is a symlink or not a directory, or cannot be created.
    """
    p = Path(path)
    missing = [d for d in (p, *p.parents) if not os.path.lexists(d)]
    for d in reversed(missing):  # outermost first
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            continue  # made meanwhile by someone else: checked like any existing one
        except OSError as exc:
            message = f"cannot create swap directory: {exc.strerror}"
            raise SwapIOError(exc.errno, message, str(p)) from exc
        _chmod_dir_0700(d, p)
    check_private_dir(p)
    return p


def _chmod_dir_0700(directory: Path, swap_dir: Path) -> None:
    """Set a directory just made to exactly 0700: the umask may have taken owner bits."""
    try:
        fd = os.open(directory, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)
    except OSError as exc:  # replaced by a symlink or a file under our feet
        message = f"cannot use swap directory: {directory} changed while being made"
        raise SwapIOError(exc.errno, message, str(swap_dir)) from exc
    try:
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def check_private_dir(path: str | os.PathLike[str]) -> None:
    """Refuse a swap directory that is not this process's own, private directory.

    Checks ``path`` itself (not its parents): it must be a directory (not a symlink to
    one), owned by this process's effective user, and not writable by group or others.

    Raises:
        SwapIOError: ``path`` cannot be examined (ENOENT...), is a symlink (ELOOP) or not
            a directory (ENOTDIR).
        UnsafeSwapDirError: owned by another user, or writable by group or others; the
            message names the directory, its owner and mode, and what to do.
    """
    p = Path(path)
    try:
        st = os.lstat(p)
    except OSError as exc:  # e.g. a parent is a regular file (ENOTDIR)
        message = f"cannot use swap directory: {exc.strerror}"
        raise SwapIOError(exc.errno, message, str(p)) from exc
    if stat.S_ISLNK(st.st_mode):
        raise SwapIOError(errno.ELOOP, "swap directory is a symbolic link; refusing it", str(p))
    if not stat.S_ISDIR(st.st_mode):
        raise SwapIOError(errno.ENOTDIR, "swap directory path is not a directory", str(p))
    mode = stat.S_IMODE(st.st_mode)
    me = os.geteuid()
    own_dir = "a new directory of your own (swapper creates it, and its missing parents, 0700)"
    if st.st_uid != me:
        raise UnsafeSwapDirError(
            f"swap directory {p} is owned by {_user_name(st.st_uid)} (uid {st.st_uid}, mode "
            f"{mode:04o}), not by this process's user {_user_name(me)} (uid {me}): its owner "
            f"could replace the swapped data. Give {own_dir}",
            str(p),
            st.st_uid,
            mode,
        )
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = " and ".join(
            w for w, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if mode & bit
        )
        if mode & stat.S_ISVTX:  # like /tmp: others cannot rename or delete what we make
            own_dir += f", e.g. {p / f'swapper-{_user_name(me)}'}"
        raise UnsafeSwapDirError(
            f"swap directory {p} (owner {_user_name(st.st_uid)}, mode {mode:04o}) is "
            f"writable by {who}: they could replace the swapped data. Run `chmod go-w {p}`, "
            f"or give {own_dir}",
            str(p),
            st.st_uid,
            mode,
        )


def _user_name(uid: int) -> str:
    try:
        import pwd  # POSIX only; imported here so the module loads elsewhere too

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def direct_refused(directory: str | os.PathLike[str]) -> bool:
    """Whether some file in ``directory`` gave up O_DIRECT earlier in this process.

    For reports only: other files there still try O_DIRECT.
    """
    directory = os.path.abspath(directory)
    with _direct_refused_lock:
        return any(d == directory for d, _ in _direct_refused)


def _note_direct_refused(path: Path, reason: str) -> None:
    """Log that ``path`` gave up O_DIRECT: a warning once per directory and reason."""
    key = (os.path.abspath(path.parent), reason)
    with _direct_refused_lock:
        first = key not in _direct_refused
        _direct_refused.add(key)
    log.log(
        logging.WARNING if first else logging.DEBUG,
        "O_DIRECT refused for %s (%s): buffered I/O for this file; other files still try "
        "O_DIRECT%s",
        path,
        reason,
        " (others in this directory refused for the same reason are logged at DEBUG)"
        if first
        else "",
    )


class SwapFile:
    """An open swap file. Use :meth:`open`; close with :meth:`close` or ``with``.

    Closing a file that requests are still using (see :meth:`begin_request`) closes its
    descriptors when the last of them ends: a descriptor number closed under a request
    could be reused by the next open and the request's remaining pieces would go to
    another file.

    Attributes:
        path: the file's path.
        fd: the buffered descriptor.
        direct_fd: the O_DIRECT descriptor, or None where direct I/O is off or refused.
        direct_worked: whether an O_DIRECT transfer on this file has succeeded (set by
            the engine; see :meth:`direct_failed`).
    """

    def __init__(self, path: Path, fd: int, direct_fd: int | None) -> None:
        self.path = path
        self.fd = fd
        self.direct_fd = direct_fd
        self.direct_worked = False
        self._reserved_nbytes = os.fstat(fd).st_size
        self._lock = threading.Lock()
        self._fds = [fd] + ([direct_fd] if direct_fd is not None else [])
        self._closed = False  # close() was called
        self._users = 0  # requests using the descriptors (begin_request .. end_request)

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
            if direct and _O_DIRECT:
                try:
                    direct_fd = _open(p, (flags & ~os.O_CREAT) | _O_DIRECT)
                except SwapIOError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    _note_direct_refused(p, "EINVAL at open")
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
        """Stop using O_DIRECT for this file (only); log ``reason`` the first time.

        Idempotent. Other files, in the same directory too, are not affected.
        """
        if self.direct_fd is None:
            return
        # The direct fd stays open until close(): pieces may still be in flight on it.
        self.direct_fd = None
        _note_direct_refused(self.path, reason)

    def direct_failed(self, reason: str) -> bool:
        """An aligned transfer failed with EINVAL on the O_DIRECT descriptor and then
        worked on the buffered one; returns whether this file gave up O_DIRECT.

        If no O_DIRECT transfer on this file has worked yet (``direct_worked``), the file
        cannot use O_DIRECT: it stops trying (:meth:`refuse_direct`). Otherwise the cause
        was that request, and the file keeps O_DIRECT for the others.
        """
        if self.direct_fd is None:
            return False
        if self.direct_worked:
            log.debug(
                "O_DIRECT refused one transfer on %s (%s), which went buffered; O_DIRECT "
                "stays on for this file's other transfers",
                self.path,
                reason,
            )
            return False
        self.refuse_direct(f"{reason}, before any O_DIRECT transfer on it worked")
        return True

    def size(self) -> int:
        """The file's size in bytes.

        Raises:
            SwapIOError: the file is closed (EBADF).
        """
        self._check_open()
        return os.fstat(self.fd).st_size

    def _check_open(self) -> None:
        # Only while requests hold it may a closed file's descriptors still be used.
        if self._closed and not self._users:
            raise SwapIOError(errno.EBADF, "the swap file is closed; open it again", str(self.path))

    def begin_request(self) -> None:
        """Note that a request will use the descriptors: they stay open until
        :meth:`end_request`, even if :meth:`close` is called meanwhile.

        Raises:
            SwapIOError: the file is closed (EBADF).
        """
        with self._lock:
            if self._closed:
                raise SwapIOError(
                    errno.EBADF, "the swap file is closed; open it again", str(self.path)
                )
            self._users += 1

    def end_request(self) -> None:
        """The request of a :meth:`begin_request` has ended (its I/O is no longer in flight).

        Closes the descriptors if :meth:`close` was called meanwhile and this was the
        last request. Raises OSError only from that close.
        """
        with self._lock:
            self._users -= 1
            close_now = self._closed and self._users == 0
        if close_now:
            self._close_fds()

    def reserve(self, end: int) -> None:
        """Make sure disk space is allocated for bytes ``[0, end)``.

        Uses ``posix_fallocate`` so that a full disk fails here, naming the file, and not
        later as a short write. Filesystems without fallocate support are let through.

        Raises:
            SwapNoSpaceError: the filesystem has no room; the file is left as it was.
            SwapIOError: fallocate failed otherwise.
        """
        with self._lock:
            if self._closed and not self._users:
                raise SwapIOError(
                    errno.EBADF, "the swap file is closed; open it again", str(self.path)
                )
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
        """Close both descriptors, now or, if requests still use them, when the last ends.

        Idempotent.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            close_now = self._users == 0
        if close_now:
            self._close_fds()

    def _close_fds(self) -> None:
        fds, self._fds = self._fds, []
        error: OSError | None = None
        for fd in fds:
            try:
                os.close(fd)
            except OSError as exc:  # close every one; report the first failure
                error = error or exc
        if error is not None:
            raise error

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


def read_lock_pid(fd: int) -> int | None:
    """The pid a store lock file's holder wrote in it (:mod:`tiers.nvme.lock`), or None."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def lock_holder(path: str | os.PathLike[str]) -> int | None:
    """Whether the store lock file at ``path`` is held, for a message that names who holds
    it before any work starts (a command-line tool refusing a store in use).

    Returns:
        None when nothing is there or nobody holds it; otherwise the holder's pid as it
        wrote it in the file, or ``0`` when the file names none (a holder between taking
        the lock and writing its pid).

    The test takes a shared lock for an instant and gives it back, so a store opening at
    that very instant may be refused once (naming this process); it never changes a byte.
    A path that is not a regular file counts as not held (opening the store says why).
    Here rather than in :mod:`tiers.nvme.lock` so that a command-line tool can ask before
    it imports torch.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = read_lock_pid(fd)
            return 0 if pid is None else pid
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
