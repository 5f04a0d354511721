"""Each rank's NVMe files in their own directory, and a record of whose they are.

Job: name the per-rank swap directories (:func:`rank_dirs`: ``<nvme dir>/rank{r}of{N}``
for every configured NVMe directory, so ranks sharing a disk never share a file), and
refuse to open a rank's store as another rank or under another world size
(:func:`claim_store_identity`), before the store itself is opened.

The record is ``<store name>.identity`` in the first per-rank directory, beside the
store's ``<name>.lock`` (a small JSON file, mode 0600, written atomically with
:func:`tiers.nvme.metafiles.replace_file`)::

    {"format": 1, "store_name": "...", "rank": r, "world_size": N}

It is written before the store is first opened and never changed. It is a separate file
rather than a manifest field so that the store (``tiers.nvme``) stays rank-blind, as the
design asks: "the manager knows nothing of ranks beyond its store's identity".

Refused (:class:`~swapper.distributed.errors.StoreIdentityError`, nothing written):

- the identity file names another rank or world size (a rank opening another's files,
  e.g. a wrong ``nvme_dirs`` or a rank renumbering);
- the directory holds the store's files but no identity file (made by something else);
- the configured directory itself holds a store of that name made by one process
  (:func:`refuse_other_layout`, a :class:`~swapper.distributed.errors.StoreLayoutError`;
  the one-process path makes the converse check before it opens its store);
- another ``rank*of{M}`` directory with ``M != N`` beside it holds a store of that name:
  the world size changed under an existing store. The message names the directory,
  both world sizes and the ways on: run at the old world size (its snapshots resume
  there), reshard through the portable form (``export_dcp`` there, ``import_dcp`` here
  over a fresh directory), or start afresh (another directory or ``store_name``, or
  remove the old store).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from swapper.distributed.errors import StoreIdentityError, StoreLayoutError
from tiers.errors import SwapConfigError, SwapIOError
from tiers.files import lock_holder, make_private_dir
from tiers.nvme.metafiles import StoreFiles, read_metadata, replace_file
from tiers.nvme.records import ManifestError

__all__ = [
    "IDENTITY_FORMAT",
    "claim_store_identity",
    "delete_advice",
    "identity_path",
    "rank_dirs",
    "refuse_other_layout",
]

IDENTITY_FORMAT = 1
_RANK_DIR = re.compile(r"^rank(\d+)of(\d+)$")
#: Files whose presence means a store of that name lives in a directory.
_STORE_SUFFIXES = (".bin", ".json", ".journal", ".identity")
#: The same for a store of one process (no identity record; ``.lock`` alone may be stale).
_ONE_PROCESS_SUFFIXES = (".bin", ".json", ".journal")


def _check_rank(rank: int, world_size: int) -> None:
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise SwapConfigError(f"{name}={value!r} must be an int")
    if world_size < 1 or not 0 <= rank < world_size:
        raise SwapConfigError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")


def rank_dirs(
    nvme_dirs: Sequence[str | os.PathLike[str]], rank: int, world_size: int, *, create: bool = True
) -> tuple[Path, ...]:
    """``<d>/rank{rank}of{world_size}`` for every ``d`` in ``nvme_dirs``, in order.

    With ``create`` each is made (0700, see :func:`tiers.files.make_private_dir`).

    Raises:
        SwapConfigError: a bad rank / world size.
        UnsafeSwapDirError, SwapIOError: as :func:`~tiers.files.make_private_dir`.
    """
    _check_rank(rank, world_size)
    out = tuple(Path(d) / f"rank{rank}of{world_size}" for d in nvme_dirs)
    if create:
        for d in out:
            make_private_dir(d)
    return out


def identity_path(dirs: Sequence[Path], store_name: str) -> Path:
    """Where a store's identity record lives: ``dirs[0] / f"{store_name}.identity"``
    (:attr:`tiers.nvme.metafiles.StoreFiles.identity`, which ``remove_store`` deletes)."""
    return StoreFiles(tuple(Path(d) for d in dirs), store_name).identity


def _has_store(directory: Path, store_name: str) -> bool:
    return any((directory / f"{store_name}{s}").exists() for s in _STORE_SUFFIXES)


def _read(path: Path) -> tuple[int, int, str] | None:
    try:
        raw = read_metadata(path, "store identity", limit=4096)
    except FileNotFoundError:
        return None
    except ManifestError as exc:
        raise StoreIdentityError(
            f"{path}: unreadable store identity ({exc}); remove the store or fix the file",
            path=str(path), expected=(-1, -1), found=None,
        ) from exc  # fmt: skip
    try:
        data = json.loads(raw)
        return int(data["rank"]), int(data["world_size"]), str(data["store_name"])
    except (ValueError, KeyError, TypeError) as exc:
        raise StoreIdentityError(
            f"{path}: not a store identity record ({exc}); remove the store or fix the file",
            path=str(path), expected=(-1, -1), found=None,
        ) from exc  # fmt: skip


def _rank_store_dirs(base: Path, store_name: str, world_size: int) -> list[Path]:
    """The ``rank*of{world_size}`` directories under ``base`` holding store ``store_name``."""
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    return [
        base / n
        for n in names
        if (m := _RANK_DIR.match(n)) and int(m.group(2)) == world_size
        and _has_store(base / n, store_name)
    ]  # fmt: skip


def delete_advice(base: Path, store_name: str, world_size: int | None) -> str:
    """How to delete store ``store_name`` of ``world_size`` ranks (None: one process) left
    in ``base``: the shell command first (every path, quoted as a shell needs), then the
    exact library call, which also removes the identity records and lock files."""
    if world_size is None:
        paths = [str(base / f"{store_name}.*")]
        call = f"tiers.nvme.remove_store([{str(base)!r}], name={store_name!r})"
    else:
        found = _rank_store_dirs(base, store_name, world_size)
        paths = [shlex.quote(str(d)) for d in found] or [f"{base}/rank*of{world_size}"]
        call = (
            f"tiers.nvme.remove_store([d], name={store_name!r}) for each d in "
            f"{base}/rank*of{world_size}"
        )
    return f"rm -r {' '.join(paths)} (from Python: {call})"


def _world_size_changed(base: Path, rank_dir: str, store_name: str, world_size: int) -> str:
    """The message for a store of another world size found in ``base / rank_dir``: the
    directory, both world sizes, and the three ways on."""
    stored = int(_RANK_DIR.match(rank_dir).group(2))  # type: ignore[union-attr]  # matched
    return (
        f"NVMe directory {base} holds store {store_name!r} made by a run of world size "
        f"{stored} ({base / rank_dir}, ...), but this run has world size {world_size}; a "
        "store cannot change its world size. Either (1) run at world size "
        f"{stored} (offload(..., resume=True) continues from its newest committed "
        f"snapshot); or (2) reshard: at world size {stored}, resume and "
        "swapper.zero.export_dcp(wrapped, DIR, optimizer), then here, over a fresh "
        "directory, swapper.zero.import_dcp(wrapped, DIR, optimizer); or (3) start "
        "afresh: another nvme_dirs or store_name, or, if nothing in it is needed, delete "
        f"it: {delete_advice(base, store_name, stored)}"
    )


def _layout(world_size: int | None) -> str:
    if world_size is None:
        return "one process"
    return f"{world_size} rank{'s' if world_size > 1 else ''}"


def refuse_other_layout(
    nvme_dirs: Sequence[str | os.PathLike[str]],
    store_name: str,
    world_size: int | None,
    *,
    rank: int = 0,
) -> None:
    """Refuse to open store ``store_name`` as ``world_size`` ranks (None: one process, its
    files straight in each directory) where the other layout has it, open or on disk
    (``rank``: this process's, for the error's ``expected``).

    One process keeps ``<d>/<store>.*``; rank r of N keeps ``<d>/rank{r}of{N}/<store>.*``.
    Their locks are different files, so without this check both would run in one
    directory unawares. Files on disk are the test (an open store has written its
    manifest, or a rank its identity record, before it is used), so a store left by a
    stopped run is refused as one still open is. (Two runs starting at the same instant
    may both pass: each checks before it creates its files.)

    Raises:
        StoreLayoutError: naming the directory, both layouts and the ways on.
        SwapIOError: a directory cannot be listed.
    """
    for base in map(Path, nvme_dirs):
        try:
            names = sorted(os.listdir(base))
        except (FileNotFoundError, NotADirectoryError):
            continue  # (no store of either layout; opening the store names what is wrong)
        except OSError as exc:
            raise SwapIOError(exc.errno, f"cannot list: {exc.strerror}", str(base)) from exc
        found: tuple[Path, int, int | None] | None = None
        if world_size is not None:
            hits = [base / f"{store_name}{s}" for s in _ONE_PROCESS_SUFFIXES]
            present = [p for p in hits if p.exists()]
            if present:
                found = (present[0], 0, None)
        else:
            for name in names:
                m = _RANK_DIR.match(name)
                if m and _has_store(base / name, store_name):
                    found = (base / name, int(m.group(1)), int(m.group(2)))
                    break
        if found is None:
            continue
        path, their_rank, theirs = found
        raise StoreLayoutError(
            _layout_message(base, store_name, path, theirs, world_size),
            directory=str(base), path=str(path), wanted=_layout(world_size),
            existing=_layout(theirs), expected=(rank, world_size or 1),
            found=(their_rank, theirs or 1),
        )  # fmt: skip


def _layout_message(
    base: Path, store: str, path: Path, theirs: int | None, mine: int | None
) -> str:
    where = f"{base}/{store}.*" if theirs is None else f"{base}/rank*of{theirs}/{store}.*"
    return (
        f"NVMe directory {base} holds store {store!r} in the layout of "
        f"{_layout(theirs)} ({where}; found {path}), {_in_use(path, store)}, but this "
        f"run opens it as {_layout(mine)}; two layouts of one store in one directory would "
        "be two processes sharing it unawares. Either (1) if nothing in it is needed, "
        f"delete it: {delete_advice(base, store, theirs)}; or (2) give this run another "
        "nvme_dirs or store_name (a script's swap-directory flag); or (3) "
        f"continue the other run as it was ({_layout(theirs)}; offload(..., resume=True) "
        "continues from its newest snapshot); or (4) move its state over through the "
        "portable form (swapper.zero.export_dcp there, swapper.zero.import_dcp here)"
    )


def _in_use(path: Path, store: str) -> str:
    """``open in process N`` when a live process holds the store's lock, else ``left on
    disk by an earlier run``."""
    lock = (path if path.is_dir() else path.parent) / f"{store}.lock"
    pid = lock_holder(lock)
    if pid is None:
        return "left on disk by an earlier run"
    return f"open in process {pid}" if pid else "open in another process"


def claim_store_identity(
    nvme_dirs: Sequence[str | os.PathLike[str]], store_name: str, rank: int, world_size: int
) -> tuple[Path, ...]:
    """Make and check rank ``rank``'s directories for store ``store_name``; return them.

    ``nvme_dirs`` are the configured (shared) directories; the result is
    :func:`rank_dirs`'s, to hand to the store as its ``nvme_dirs``. The first call writes
    the identity record; later calls check it.

    Raises:
        StoreIdentityError: the directories belong to another rank or world size, or hold
            the store's files without an identity (see the module docstring).
        StoreLayoutError: a store of that name made by one process is in a directory.
        SwapConfigError: a bad rank, world size or store name; no NVMe directory.
        UnsafeSwapDirError, SwapIOError: a directory cannot be made or is unsafe, or the
            record cannot be written.
    """
    if not nvme_dirs:
        raise SwapConfigError("claim_store_identity: no nvme_dirs given")
    if not store_name or "/" in store_name or store_name.startswith("."):
        raise SwapConfigError(f"store_name={store_name!r} must be a plain file name")
    _check_rank(rank, world_size)
    expected = (rank, world_size)
    refuse_other_layout(nvme_dirs, store_name, world_size, rank=rank)
    for base in nvme_dirs:
        base = Path(base)
        try:
            names = sorted(os.listdir(base))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for name in names:
            m = _RANK_DIR.match(name)
            if m and int(m.group(2)) != world_size and _has_store(base / name, store_name):
                raise StoreIdentityError(
                    _world_size_changed(base, name, store_name, world_size),
                    path=str(base / name), expected=expected,
                    found=(int(m.group(1)), int(m.group(2))),
                )  # fmt: skip
    dirs = rank_dirs(nvme_dirs, rank, world_size)
    path = identity_path(dirs, store_name)
    found = _read(path)
    if found is not None:
        if found != (rank, world_size, store_name):
            raise StoreIdentityError(
                f"{path}: this store belongs to rank {found[0]} of {found[1]} (store "
                f"{found[2]!r}), not rank {rank} of {world_size}: check nvme_dirs and the "
                "rank each process gets",
                path=str(path), expected=expected, found=(found[0], found[1]),
            )  # fmt: skip
        return dirs
    for d in dirs:
        if _has_store(d, store_name):
            raise StoreIdentityError(
                f"{d} holds store {store_name!r} files but no identity record {path.name}: "
                "they were not made by this rank; remove them or choose another store_name",
                path=str(d), expected=expected, found=None,
            )  # fmt: skip
    record = {"format": IDENTITY_FORMAT, "store_name": store_name, "rank": rank,
              "world_size": world_size}  # fmt: skip
    replace_file(path, json.dumps(record).encode(), "store identity")
    return dirs
