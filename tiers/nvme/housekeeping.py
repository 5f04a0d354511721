"""Creating a store's files without clobbering anything, and deleting a store for good.

Job: the file-level steps around a store's life that are not reading or writing tensors:
create a data file only where nothing is, say exactly what to call when a store is already
there, and :func:`remove_store`, the one documented way to delete a store a crash (or
anything else) left behind.

Invariants: nothing outside the store's own files (see :mod:`tiers.nvme.metafiles`) is
ever created or deleted here; deleting happens only while holding the store's lock, so a
store open in a live process is never deleted under it.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence
from pathlib import Path

from tiers.errors import SwapIOError
from tiers.nvme.lock import StoreLock
from tiers.nvme.metafiles import StoreFiles, fsync_dir
from tiers.nvme.records import StoreExistsError, check_dirs, check_name

__all__ = ["create_exclusive", "existing_store_error", "remove_store"]

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _dirs_arg(files: StoreFiles) -> str:
    return repr([str(d) for d in files.dirs])


def existing_store_error(files: StoreFiles, found: Path) -> StoreExistsError:
    """The error for a new store where ``found``, a file of a store of that name, is."""
    remove = f"tiers.nvme.remove_store({_dirs_arg(files)}, name={files.name!r})"
    if os.path.lexists(files.manifest):
        hint = (
            f"reopen it with NvmeStore.open({_dirs_arg(files)}, engine, name={files.name!r}), "
            f"or delete it with {remove}"
        )
    else:  # no manifest: a crash while it was being created; it cannot be reopened
        hint = f"it has no manifest, so it cannot be reopened: delete it with {remove}"
    return StoreExistsError(
        errno.EEXIST, f"a store named {files.name!r} is already there: {hint}", str(found)
    )


def create_exclusive(files: StoreFiles, path: Path) -> None:
    """Create an empty 0600 file, failing if anything is at ``path`` (never truncating).

    Raises:
        StoreExistsError: something is at ``path``.
        SwapIOError: it cannot be created.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise existing_store_error(files, path) from None
    except OSError as exc:
        raise SwapIOError(exc.errno, f"cannot create data file: {exc.strerror}", str(path)) from exc
    os.close(fd)


def remove_store(
    dirs: Sequence[str | os.PathLike[str]],
    *,
    name: str = "swapper-store",
    keep_snapshots: bool = False,
) -> list[Path]:
    """Delete the store named ``name`` in ``dirs``: every file a store of that name keeps
    there (data files, manifest, journal, snapshot files, lock files, the identity record
    of a rank's store and the temporary files of an interrupted save); nothing else.

    For a store that cannot be reopened (a crash while it was being created, a damaged
    or foreign manifest) as well as for one that can. Directories are kept. Directories
    that do not exist are skipped; files already gone are fine.

    Args:
        dirs: the store's swap directories, in the order it was made with (for a rank's
            store, its ``<dir>/rank{r}of{N}`` directories).
        name: the store's name (``offload`` and ``swapper-pressure`` use
            ``"swapper-offload"``, :class:`~tiers.nvme.NvmeStore` ``"swapper-store"``).
        keep_snapshots: keep the retained snapshots and what they need to be reopened
            (data files, manifest, journal, identity record); delete only the lock files
            and the temporary files of an interrupted save.

    Returns:
        The paths deleted.

    Raises:
        StoreLockedError: the store is open (in a live process, perhaps this one); nothing
            is deleted. The message names the holder's pid.
        SwapConfigError: ``dirs`` or ``name`` are not usable.
        SwapIOError: a file cannot be deleted (e.g. a directory is in its place).
    """
    paths = check_dirs(dirs)
    check_name(name)
    files = StoreFiles(tuple(paths), name)
    present = [i for i, p in enumerate(paths) if os.path.isdir(p) and not os.path.islink(p)]
    if not present:
        return []
    lock = StoreLock.acquire(StoreFiles(tuple(paths[i] for i in present), name))
    removed: list[Path] = []
    try:
        targets = [] if keep_snapshots else [files.data(i) for i in present]
        if 0 in present:
            if not keep_snapshots:
                snapshots = [path for _, path in files.snapshots()]
                # The identity last but one, the manifest last: a removal cut part-way
                # leaves files that still say whose store they were.
                targets += [*snapshots, files.journal, files.identity, files.manifest]
            targets += files.orphans()
        for path in targets:
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise SwapIOError(
                    exc.errno, f"cannot delete the store's file: {exc.strerror}", str(path)
                ) from exc
            removed.append(path)
        removed += [
            files.lock(i) for i, made in zip(present, lock.created, strict=True) if not made
        ]
        lock.release(remove=True)
        for i in present:
            fsync_dir(paths[i])
    finally:
        lock.release()
    return removed
