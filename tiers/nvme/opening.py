"""The files of a store before it exists in memory: made new, or found and checked.

Job: what the :class:`~tiers.nvme.store.NvmeStore` constructor and :meth:`open` do on
disk. :func:`create` makes a store's files (lock first, manifest last: a manifest means a
whole store). :func:`reopen` takes the lock, turns the files a store (or a crash) left into
the durable state and the open data files, checking everything against everything else,
or refuses with a typed error naming the file and the field; a journal with anything in it
is then compacted into a new manifest. On failure both undo what they made (files, lock
files, directories) and release the lock.

Invariants of a reopened state:

- the state is the manifest's tensors with the journal's valid records applied in order
  (a journal of an older generation than the manifest is already in it and is ignored; a
  newer one is refused); a torn tail is dropped and logged;
- every extent lies inside its data file and no two overlap (the free lists are rebuilt
  from them), so nothing durable can be handed out again;
- every data file is a regular file opened without following a symlink;
- every retained snapshot file is read and checked (:mod:`tiers.nvme.snapshots`), its
  extents inside the data files and each either one the durable state (or an earlier
  snapshot) names for the same tensor, or overlapping nothing; its extents are allocated
  in the free lists too. A snapshot that fails a check is listed as damaged (logged,
  ignored, its file left for ``drop_snapshot``): it never stops the store from opening.
  A snapshot file that cannot be read at all (an I/O error: EIO, EACCES...) proves
  nothing of its bytes: the open fails with a SwapIOError naming it instead.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from tiers.aio.engine import AioEngine
from tiers.errors import SwapIOError
from tiers.files import SwapFile, make_private_dir
from tiers.nvme.housekeeping import create_exclusive, existing_store_error
from tiers.nvme.journal import (
    Journal,
    JournalContents,
    decode_changes,
    log_dropped,
    parse_journal,
)
from tiers.nvme.lock import StoreLock
from tiers.nvme.manifest import ManifestSpec, encode_manifest, parse_manifest
from tiers.nvme.metafiles import (
    StoreFiles,
    io_error_of,
    read_metadata,
    remove_orphans,
    replace_file,
)
from tiers.nvme.placement import Placement
from tiers.nvme.records import (
    Extent,
    ManifestError,
    OverlappingExtentsError,
    StoredTensor,
    check_distinct,
)
from tiers.nvme.snapshots import SnapshotDamagedError, SnapshotFile, parse_snapshot

__all__ = ["LoadedSnapshot", "Opened", "create", "reopen"]

log = logging.getLogger("swapper.tiers.nvme")


@dataclass
class LoadedSnapshot:
    """A retained snapshot found at open: its file's contents, path and size."""

    content: SnapshotFile
    path: Path
    file_nbytes: int


@dataclass
class Opened:
    """A store's files, open and locked, and the durable state they hold."""

    files: StoreFiles
    lock: StoreLock
    data: list[SwapFile]
    created_dirs: list[Path]
    journal: Journal
    placement: Placement
    checksum: bool
    tensors: list[StoredTensor]
    snapshots: list[LoadedSnapshot]
    damaged: dict[str, tuple[Path, str]]


@dataclass
class _Recovered:
    """The durable state found at open, and what it took to find it."""

    spec: ManifestSpec
    journal: JournalContents
    tensors: dict[str, StoredTensor]
    files: list[SwapFile]
    placement: Placement
    snapshots: list[LoadedSnapshot]
    damaged: dict[str, tuple[Path, str]]

    @property
    def needs_compaction(self) -> bool:
        """Whether the journal holds anything (records, a torn tail, an old generation)."""
        j = self.journal
        return bool(j.payloads) or j.dropped_nbytes > 0 or j.generation != self.spec.generation


def _remove_hint(files: StoreFiles) -> str:
    return (
        f"tiers.nvme.remove_store({[str(d) for d in files.dirs]!r}, name={files.name!r}) "
        "deletes this store's files (and nothing else)"
    )


def _check_existing_dirs(paths: list[Path], name: str) -> None:
    """Every swap directory exists and is a directory, not a symlink (open creates none).

    Raises:
        ManifestError: a directory is missing (no store there).
        SwapIOError: a path is a symlink or not a directory.
    """
    for path in paths:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise ManifestError(
                f"no store named {name!r} to reopen: swap directory {path} does not exist"
            ) from None
        except OSError as exc:
            raise SwapIOError(
                exc.errno, f"cannot use swap directory: {exc.strerror}", str(path)
            ) from exc
        if stat.S_ISLNK(st.st_mode):
            raise SwapIOError(
                errno.ELOOP, "swap directory is a symbolic link; refusing it", str(path)
            )
        if not stat.S_ISDIR(st.st_mode):
            raise SwapIOError(errno.ENOTDIR, "swap directory path is not a directory", str(path))


def _recover(files: StoreFiles, engine: AioEngine) -> _Recovered:
    """Read and check the store's durable state; the caller holds the store's lock.

    Raises:
        ManifestError: no manifest or journal, or one that is refused (see
            :mod:`tiers.nvme.manifest` and :mod:`tiers.nvme.journal`), a data file
            missing, an extent outside its file.
        OverlappingExtentsError: two extents share bytes (a ManifestError naming both keys).
        SwapIOError: a data file is not a regular file, or cannot be opened.
    """
    paths = list(files.dirs)
    remove_orphans(files)
    try:
        manifest = read_metadata(files.manifest, "manifest")
    except FileNotFoundError:
        present = [p for p in (files.data(i) for i in range(len(paths))) if os.path.lexists(p)]
        left = f" ({', '.join(map(str, present))} are left from it)" if present else ""
        raise ManifestError(
            f"no manifest at {files.manifest}: no store named {files.name!r} to reopen{left}. "
            f"If a crash while creating it left files, {_remove_hint(files)}"
        ) from None
    spec = parse_manifest(manifest, files.manifest, paths, files.name)
    try:
        raw = read_metadata(files.journal, "journal")
    except FileNotFoundError:
        raise ManifestError(
            f"the journal {files.journal} is missing, so writes acknowledged since the last "
            f"save cannot be recovered; {_remove_hint(files)}"
        ) from None
    journal = parse_journal(raw, files.journal)
    tensors = dict(spec.tensors)
    if journal.generation > spec.generation:
        raise ManifestError(
            f"the journal {files.journal} is of generation {journal.generation}, newer than "
            f"the manifest's {spec.generation}: the manifest was replaced by an older one"
        )
    if journal.generation == spec.generation:
        for i, payload in enumerate(journal.payloads):
            for key, stored in decode_changes(
                payload,
                f"journal {files.journal} record {i + 1}",
                n_dirs=len(paths),
                stripe_nbytes=spec.stripe_nbytes,
                checksum=spec.checksum,
            ):
                if stored is None:
                    tensors.pop(key, None)
                else:
                    tensors[key] = stored
        log_dropped(files.journal, journal)
    opened: list[SwapFile] = []
    try:
        for i in range(len(paths)):
            data_path = files.data(i)
            try:
                opened.append(engine.open(data_path))
            except FileNotFoundError:
                raise ManifestError(
                    f"data file {data_path} of the store in manifest {files.manifest} is "
                    f"missing; {_remove_hint(files)}"
                ) from None
        for stored in tensors.values():
            for e in stored.extents:
                size = opened[e.dir_index].size()
                if e.offset + e.nbytes > size:
                    raise ManifestError(
                        f"manifest {files.manifest}: tensors[{stored.key!r}] needs bytes up to "
                        f"{e.offset + e.nbytes} of {files.data(e.dir_index)}, which has only "
                        f"{size}: the data file was truncated"
                    )
        replayed = journal.generation == spec.generation and bool(journal.payloads)
        _check_disjoint(files, tensors, replayed)
        owners = {e: t for t in tensors.values() for e in t.extents}
        try:
            placement = Placement.rebuild(len(paths), spec.stripe_nbytes, list(owners))
        except ValueError as exc:
            raise ManifestError(f"manifest {files.manifest}: extents overlap: {exc}") from None
        snapshots, damaged = _load_snapshots(files, spec, [f.size() for f in opened], owners)
        if snapshots:
            placement = Placement.rebuild(len(paths), spec.stripe_nbytes, list(owners))
    except BaseException:
        for f in opened:
            f.close()
        raise
    return _Recovered(spec, journal, tensors, opened, placement, snapshots, damaged)


def _check_disjoint(files: StoreFiles, tensors: dict[str, StoredTensor], replayed: bool) -> None:
    """No two extents of the durable state share a byte of a data file (as allocated:
    each rounded up to 4 KiB). Checked on its own, before the free lists are rebuilt,
    because those key extents by value: two tensors naming one identical extent
    (checksum and all) would pass as one, and the second would read the first's bytes.

    Raises:
        OverlappingExtentsError: naming both keys, the data file and the shared range.
    """
    by_dir: dict[int, list[tuple[int, int, str]]] = {}
    for stored in tensors.values():
        for e in stored.extents:
            by_dir.setdefault(e.dir_index, []).append(
                (e.offset, e.offset + e.allocated_nbytes, stored.key)
            )
    where = f"manifest {files.manifest}"
    if replayed:
        where += f" with the records of journal {files.journal} applied"
    for dir_index, ranges in sorted(by_dir.items()):
        ranges.sort()
        reach, holder = 0, ""  # the furthest end seen so far, and whose extent it is
        for offset, end, key in ranges:
            if offset < reach:
                shared = min(end, reach) - offset
                path = files.data(dir_index)
                whose = (
                    f"tensors[{key!r}] names bytes [{offset}, {offset + shared}) twice"
                    if key == holder
                    else f"tensors[{holder!r}] and tensors[{key!r}] both claim bytes "
                    f"[{offset}, {offset + shared})"
                )
                raise OverlappingExtentsError(
                    f"{where}: extents overlap: {whose} of data file {path}: a read of one would "
                    "return the other's bytes, so the store is not opened. Restore the manifest "
                    f"and journal from a backup, or {_remove_hint(files)}",
                    keys=(holder, key),
                    path=path,
                    offset=offset,
                    nbytes=shared,
                )
            if end > reach:
                reach, holder = end, key


def _load_snapshots(
    files: StoreFiles, spec: ManifestSpec, sizes: list[int], owners: dict[Extent, StoredTensor]
) -> tuple[list[LoadedSnapshot], dict[str, tuple[Path, str]]]:
    """Read and check every snapshot file, oldest first; ``owners`` (extent → tensor of
    the durable state) gains the extents of those accepted. See the module docstring."""
    found: list[LoadedSnapshot] = []
    damaged: dict[str, tuple[Path, str]] = {}
    for name, path in files.snapshots():
        try:
            data = read_metadata(path, "snapshot file")
            content = parse_snapshot(
                data,
                path,
                store=files.name,
                name=name,
                dirs=list(files.dirs),
                stripe_nbytes=spec.stripe_nbytes,
                checksum=spec.checksum,
            )
        except FileNotFoundError:
            continue
        except ManifestError as exc:  # SnapshotDamagedError is one
            cause = io_error_of(exc)
            if cause is not None:
                # Not read (EIO, EAGAIN, EACCES...): that proves nothing of its bytes, and
                # listed as damaged it would let a resume roll back past it.
                raise SwapIOError(
                    cause.errno,
                    f"cannot read snapshot file {name!r}: {cause.strerror} (an I/O error, "
                    "not proof of damage: the store is not opened; retry once the disk "
                    "reads again)",
                    str(path),
                ) from cause
            damaged[name] = (path, str(exc))
            continue
        found.append(LoadedSnapshot(content, path, len(data)))
    found.sort(key=lambda s: (s.content.seq, s.content.name))
    accepted = []
    for snapshot in found:
        try:
            _check_snapshot_extents(snapshot, files, spec, sizes, owners)
        except SnapshotDamagedError as exc:
            damaged[snapshot.content.name] = (snapshot.path, str(exc))
            continue
        accepted.append(snapshot)
    for name, (_, why) in sorted(damaged.items()):
        log.warning("store %r: snapshot %r is damaged and ignored: %s", files.name, name, why)
    return accepted, damaged


def _check_snapshot_extents(
    snapshot: LoadedSnapshot,
    files: StoreFiles,
    spec: ManifestSpec,
    sizes: list[int],
    owners: dict[Extent, StoredTensor],
) -> None:
    """Add the snapshot's extents to ``owners`` if they fit (else nothing changes).

    Raises:
        SnapshotDamagedError: an extent is outside its data file, is another tensor's, or
            overlaps an extent already named.
    """
    where = f"snapshot file {snapshot.path}"
    new: dict[Extent, StoredTensor] = {}
    for stored in snapshot.content.tensors.values():
        for e in stored.extents:
            if e.offset + e.nbytes > sizes[e.dir_index]:
                raise SnapshotDamagedError(
                    f"{where}: tensors[{stored.key!r}] needs bytes up to {e.offset + e.nbytes} "
                    f"of {files.data(e.dir_index)}, which has only {sizes[e.dir_index]}"
                )
            owner = owners.get(e) or new.get(e)
            if owner is not None and owner != stored:
                raise SnapshotDamagedError(
                    f"{where}: tensors[{stored.key!r}] names an extent of key {owner.key!r}"
                )
            if owner is None:
                new[e] = stored
    if new:
        try:
            Placement.rebuild(len(files.dirs), spec.stripe_nbytes, [*owners, *new])
        except ValueError as exc:
            raise SnapshotDamagedError(f"{where}: its extents overlap others: {exc}") from None
    owners.update(new)


def create(files: StoreFiles, engine: AioEngine, *, stripe_nbytes: int, checksum: bool) -> Opened:
    """Make the directories (0700) and a new, empty store's files.

    Raises:
        StoreLockedError: another open store holds a directory.
        StoreExistsError: a store of that name is already there (the message says what
            to call).
        SwapConfigError: two directories are the same.
        SwapIOError: a directory or file cannot be created.
    """
    paths = list(files.dirs)
    created_dirs: list[Path] = []
    made: list[Path] = []
    data: list[SwapFile] = []
    lock: StoreLock | None = None
    journal: Journal | None = None
    try:
        for path in paths:
            if not os.path.lexists(path):
                created_dirs.append(path)
            make_private_dir(path)
        check_distinct(paths)
        lock = StoreLock.acquire(files)
        data_paths = [files.data(i) for i in range(len(paths))]
        snapshot_paths = [p for _, p in files.snapshots()]  # left by a removed store: refuse
        for path in [*data_paths, files.manifest, files.journal, *snapshot_paths]:
            if os.path.lexists(path):
                raise existing_store_error(files, path)
        remove_orphans(files)
        for path in data_paths:
            create_exclusive(files, path)
            made.append(path)
            data.append(engine.open(path))
        journal = Journal.create(files.journal, 0)
        made.append(files.journal)
        manifest = encode_manifest(
            name=files.name,
            dirs=paths,
            stripe_nbytes=stripe_nbytes,
            checksum=checksum,
            generation=0,
            tensors=[],
        )
        replace_file(files.manifest, manifest, "manifest")  # last: the store is whole
    except BaseException:
        if journal is not None:
            journal.close()
        for f in data:
            f.close()
        for path in made:
            with contextlib.suppress(OSError):
                path.unlink()
        if lock is not None:
            lock.release(remove_created=True)
        for path in reversed(created_dirs):
            with contextlib.suppress(OSError):
                path.rmdir()
        raise
    placement = Placement(len(paths), stripe_nbytes)
    return Opened(files, lock, data, created_dirs, journal, placement, checksum, [], [], {})


def reopen(files: StoreFiles, engine: AioEngine) -> Opened:
    """Lock, read and check a store's files, and compact its journal if it holds anything.

    Raises:
        StoreLockedError: another open store holds a directory.
        ManifestError: no store there, or its manifest, journal or data files are refused
            (see :func:`_recover`).
        SwapIOError: a path is a symlink or not a directory, a data file is not a regular
            file, or the compacted manifest cannot be written.
    """
    paths = list(files.dirs)
    _check_existing_dirs(paths, files.name)
    check_distinct(paths)
    lock = StoreLock.acquire(files)
    try:
        found = _recover(files, engine)
        try:
            spec = found.spec
            generation = spec.generation
            if found.needs_compaction:
                generation += 1
                manifest = encode_manifest(
                    name=files.name,
                    dirs=paths,
                    stripe_nbytes=spec.stripe_nbytes,
                    checksum=spec.checksum,
                    generation=generation,
                    tensors=found.tensors.values(),
                )
                replace_file(files.manifest, manifest, "manifest")
            journal = Journal.create(files.journal, generation)
        except BaseException:
            for f in found.files:
                f.close()
            raise
    except BaseException:
        lock.release(remove_created=True)
        raise
    tensors = list(found.tensors.values())
    return Opened(
        files,
        lock,
        found.files,
        [],
        journal,
        found.placement,
        spec.checksum,
        tensors,
        found.snapshots,
        found.damaged,
    )
