"""The store lock: one open store per set of files, across processes and within one.

Job: hold an exclusive ``flock`` on ``<name>.lock`` in every swap directory of a store for
as long as the store is open, so that no second store (another process, or this one) reads
or writes its files meanwhile; say who holds it when refused.

``flock`` (not ``fcntl``/``lockf`` record locks) because its locks belong to the open file
description: two opens in one process conflict, and closing some other descriptor of the
file does not drop the lock. The kernel drops it when the holder's descriptor is closed,
including when the process dies (SIGKILL too): a crashed store is never locked for good.
It is advisory: it keeps out stores (and :func:`~tiers.nvme.remove_store`), not other
programs. The descriptor is close-on-exec; a child made by ``fork`` shares the lock.

Invariants:

- The lock is taken (in directory order) before any other file of the store is read or
  written, and released only after the store's last file is closed.
- The lock file is never unlinked while someone else may hold it: only by its holder
  (:meth:`StoreLock.release` with ``remove``), and a taker checks, once it holds the lock,
  that the path still names the file it locked (else someone removed it: it retries).
- The lock file holds the holder's pid (text), for the error message only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat

from tiers.errors import StoreLockedError, SwapIOError
from tiers.files import lock_holder, read_lock_pid
from tiers.nvme.metafiles import StoreFiles

__all__ = ["StoreLock", "lock_holder"]  # (lock_holder: tiers.files, torch-free)

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_RETRIES = 20


class StoreLock:
    """The held locks of one store; take with :meth:`acquire`, give back with :meth:`release`."""

    def __init__(self, files: StoreFiles) -> None:
        self.files = files
        self._fds: list[int] = []
        self._created: list[bool] = []

    @classmethod
    def acquire(cls, files: StoreFiles) -> StoreLock:
        """Lock every directory of ``files``, creating the lock files (0600) where missing.

        Raises:
            StoreLockedError: a directory's lock is held (by a live process, perhaps this
                one); names the directory and the holder's pid. Nothing stays locked.
            SwapIOError: a lock file cannot be created or locked, or something other than
                a regular file is at its path.
        """
        lock = cls(files)
        try:
            for i in range(len(files.dirs)):
                lock._take(i)
        except BaseException:
            lock.release(remove_created=True)
            raise
        return lock

    def _take(self, dir_index: int) -> None:
        path = self.files.lock(dir_index)
        for _ in range(_RETRIES):
            created = True
            flags = os.O_RDWR | _O_NOFOLLOW | _O_CLOEXEC | _O_NONBLOCK
            try:
                try:
                    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
                except FileExistsError:
                    created = False
                    try:
                        fd = os.open(path, flags)
                    except FileNotFoundError:
                        continue  # removed between the two opens: try again
            except OSError as exc:
                what = "is a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
                raise SwapIOError(
                    exc.errno, f"cannot open the store's lock file: {what}", str(path)
                ) from exc
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise SwapIOError(
                        errno.EINVAL, "the store's lock file is not a regular file", str(path)
                    )
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pid = read_lock_pid(fd)
                    mine = " (this process)" if pid == os.getpid() else ""
                    who = f"pid {pid}{mine}" if pid is not None else "a process of unknown pid"
                    raise StoreLockedError(
                        f"swap directory {self.files.dirs[dir_index]} is in use: store "
                        f"{self.files.name!r} is open in {who} (lock {path}). Close that "
                        "store first; the lock is released when its process exits",
                        directory=str(self.files.dirs[dir_index]),
                        pid=pid,
                    ) from None
                except OSError as exc:
                    raise SwapIOError(exc.errno, f"cannot lock: {exc.strerror}", str(path)) from exc
                try:
                    now = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    now = None
                if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    os.close(fd)  # its holder removed it as we locked it: take the new one
                    continue
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except BaseException:
                if fd not in self._fds:
                    os.close(fd)
                raise
            self._fds.append(fd)
            self._created.append(created)
            return
        raise SwapIOError(errno.EAGAIN, "the store's lock file keeps being replaced", str(path))

    @property
    def held(self) -> bool:
        return bool(self._fds)

    @property
    def created(self) -> list[bool]:
        """Per directory locked, whether this lock created the lock file."""
        return list(self._created)

    def release(self, *, remove: bool = False, remove_created: bool = False) -> None:
        """Unlock every directory (idempotent). With ``remove`` the lock files are deleted
        first (while still held); with ``remove_created`` only those this lock created."""
        for i, fd in reversed(list(enumerate(self._fds))):
            if remove or (remove_created and self._created[i]):
                # Already gone, or a read-only directory: a stale lock file is harmless.
                with contextlib.suppress(OSError):
                    os.unlink(self.files.lock(i))
            os.close(fd)
        self._fds.clear()
        self._created.clear()

    def __repr__(self) -> str:
        return f"<StoreLock {self.files.name!r} dirs={[str(d) for d in self.files.dirs]}>"
