"""The commit record of a snapshot taken over several ranks.

Job: the one file that says a multi-rank training snapshot is complete, written by rank
0 after every rank's part is durable, and read back at resume trusting nothing.

A snapshot over N ranks is N store snapshots (each rank's ``<dir>/rank{r}of{N}/<store>.
<name>.snap``, :mod:`swapper.manager.snapshot`), its *parts*, plus this record in rank
0's configured NVMe directory (the parent of the rank directories)::

    <dir>/<store>.<name>.commit

    {"format": "swapper-snapshot-commit", "version": 1, "store": "<store>",
     "snapshot": "<name>", "seq": 7, "step": 12, "world_size": 2, "created": 1764.0,
     "parts": [{"rank": 0, "path": "rank0of2/<store>.<name>.snap",
                "digest": "sha256:<64 hex>", "nbytes": 5123}, ...]}
    #sha256=<64 hex digits: SHA-256 of every byte before this line>

``part`` (present only when it differs from ``snapshot``) is the store snapshot name the
parts were taken under: a snapshot saved again under its name takes its new parts under
a fresh name (``<name>--g<k>``, :func:`part_name`) so that the old parts, which the old
record names, stay whole until the new record has replaced it.
``digest`` is the SHA-256 of the part's file (its metadata: the extents, checksums and
training fields it names; the tensors' bytes are covered by the store's own checksums).
``seq`` orders the snapshots (larger: newer). The record is written with
:func:`tiers.nvme.metafiles.replace_file` (temporary file, fsync, rename, directory
fsync), so it exists whole or not at all. A snapshot without a record, or whose record
names a part that is missing, damaged or other than the one it digested, is never chosen
for resume (:mod:`swapper.zero.checkpoint.shard_resume`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from tiers.errors import SwapConfigError, SwapIOError
from tiers.nvme.manifest import loads_strict
from tiers.nvme.metafiles import (
    StoreFiles,
    fsync_dir,
    io_error_of,
    read_metadata,
    replace_file,
)
from tiers.nvme.records import ManifestError
from tiers.nvme.snapshots import SnapshotDamagedError

__all__ = [
    "COMMIT_FORMAT",
    "CommitRecord",
    "CommitRecordError",
    "RankPart",
    "WorldSizeMismatchError",
    "commit_path",
    "encode_commit",
    "parse_commit",
    "part_digest",
    "part_name",
    "read_commits",
    "refuse_other_world_size",
    "remove_commit",
    "remove_orphan_commits",
    "reshard_advice",
    "write_commit",
]

COMMIT_FORMAT = "swapper-snapshot-commit"
COMMIT_VERSION = 1
#: Largest commit record read, in bytes (a line per rank: far below this).
MAX_COMMIT_NBYTES = 4 << 20
_TRAILER = re.compile(rb"\n#sha256=([0-9a-f]{64})\n\Z")
_FIELDS = frozenset(
    {"format", "version", "store", "snapshot", "seq", "step", "world_size", "created", "parts"}
)
_OPTIONAL_FIELDS = frozenset({"part"})
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,63}$")
_PART_FIELDS = frozenset({"rank", "path", "digest", "nbytes"})
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


class CommitRecordError(SnapshotDamagedError):
    """A commit record is torn, corrupt or not this store's, or names a part that is
    missing or damaged; the message names the file and what is wrong."""


class WorldSizeMismatchError(SwapConfigError):
    """A snapshot was taken at another world size than this run's.

    Attributes: ``path`` (the commit record or snapshot file), ``found`` (its world
    size), ``expected`` (this run's).
    """

    def __init__(self, message: str, *, path: str, found: int, expected: int) -> None:
        super().__init__(message)
        self.path = path
        self.found = found
        self.expected = expected


def refuse_other_world_size(nvme_dirs: Sequence[str | os.PathLike[str]], store: str) -> None:
    """One process resuming where several ranks left commit records, and no snapshot of
    one process's is there: the run changed its world size.

    Raises:
        WorldSizeMismatchError: naming the newest record (and what to do: reshard).
        SwapIOError: the directory cannot be listed.
    """
    if not nvme_dirs:
        return  # (the caller says what is wrong)
    base = Path(nvme_dirs[0])
    records, _ = read_commits(base, store)
    if records and not StoreFiles((base,), store).snapshots():
        newest = records[0]
        raise WorldSizeMismatchError(
            f"commit record {newest.path}: snapshot {newest.name!r}: "
            + reshard_advice(newest.world_size, 1),
            path=str(newest.path),
            found=newest.world_size,
            expected=1,
        )


def reshard_advice(found: int, expected: int) -> str:
    """What to do when a snapshot of ``found`` ranks meets a run of ``expected``."""
    return (
        f"it was taken by {found} rank(s), this run has {expected}: resume at world size "
        f"{found}, or reshard through the portable form (swapper.zero.export_dcp there, "
        f"swapper.zero.import_dcp here); a store snapshot cannot change its world size"
    )


@dataclasses.dataclass(frozen=True)
class RankPart:
    """One rank's part of a committed snapshot.

    Attributes:
        rank: the rank that wrote it.
        path: its file, relative to the configured NVMe directory (``rank{r}of{N}/...``).
        digest: ``"sha256:<hex>"`` of the file's bytes.
        nbytes: the file's size in bytes.
    """

    rank: int
    path: str
    digest: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class CommitRecord:
    """A decoded commit record (``path``: its file)."""

    name: str
    seq: int
    step: int
    world_size: int
    created: float
    parts: tuple[RankPart, ...]
    path: Path
    #: the store snapshot name of the parts (``name`` unless saved again under it)
    part: str = ""

    def __post_init__(self) -> None:
        if not self.part:
            object.__setattr__(self, "part", self.name)


def commit_path(base: Path, store: str, name: str) -> Path:
    """Where snapshot ``name``'s commit record of store ``store`` lives in ``base``."""
    return Path(base) / f"{store}.{name}.commit"


def part_digest(data: bytes) -> str:
    """``"sha256:<hex>"`` of a part file's bytes."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def part_name(name: str, taken: Collection[str]) -> str:
    """The store snapshot name for the parts of snapshot ``name``: ``name`` itself, or
    the first ``<name>--g<k>`` (``name`` shortened to keep 64 characters) not in
    ``taken`` (the part names of every existing record, and the names of damaged ones):
    the parts of a snapshot being replaced are never overwritten before its new record
    is durable."""
    k = 0
    candidate = name
    while candidate in taken:
        k += 1
        suffix = f"--g{k}"
        candidate = name[: 64 - len(suffix)] + suffix
    return candidate


def encode_commit(
    *, store: str, name: str, seq: int, step: int, world_size: int, created: float,
    parts: list[RankPart], part: str | None = None,
) -> bytes:  # fmt: skip
    """The record's bytes (see the module docstring); ``part``: the parts' store
    snapshot name, when not ``name``."""
    document: dict[str, Any] = {
        "format": COMMIT_FORMAT,
        "version": COMMIT_VERSION,
        "store": store,
        "snapshot": name,
        "seq": seq,
        "step": step,
        "world_size": world_size,
        "created": created,
        "parts": [dataclasses.asdict(p) for p in parts],
    }
    if part is not None and part != name:  # (else the format of records before it)
        document["part"] = part
    body = json.dumps(document, indent=1).encode()
    return body + b"\n#sha256=%s\n" % hashlib.sha256(body).hexdigest().encode()


def write_commit(base: Path, record_bytes: bytes, store: str, name: str) -> Path:
    """Write a commit record atomically and durably; return its path.

    Raises:
        SwapIOError: it could not be written (nothing is left in its place, unless only
            the final directory fsync failed).
    """
    path = commit_path(base, store, name)
    replace_file(path, record_bytes, "snapshot commit record")
    return path


def remove_orphan_commits(base: Path, store: str) -> list[Path]:
    """Delete the temporary files of commit records whose write a crash cut off (never
    renamed in: no snapshot ever named them). Returns what was deleted.

    Raises:
        SwapIOError: ``base`` cannot be listed, or a file cannot be deleted.
    """
    pattern = re.compile(
        rf"^\.{re.escape(store)}\.[A-Za-z0-9_][A-Za-z0-9_-]*\.commit\.[A-Za-z0-9_]{{8}}\.tmp$"
    )
    try:
        names = os.listdir(base)
    except OSError as exc:
        raise SwapIOError(exc.errno, f"cannot list: {exc.strerror}", str(base)) from exc
    removed: list[Path] = []
    for file_name in sorted(n for n in names if pattern.match(n)):
        path = Path(base) / file_name
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise SwapIOError(exc.errno, f"cannot delete: {exc.strerror}", str(path)) from exc
        removed.append(path)
    return removed


def remove_commit(path: Path) -> None:
    """Delete a commit record durably (first, before its parts: the snapshot then no
    longer exists for resume). A missing one is not an error.

    Raises:
        SwapIOError: it could not be deleted, or the deletion not synced.
    """
    try:
        path.unlink()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SwapIOError(exc.errno, f"cannot delete: {exc.strerror}", str(path)) from exc
    fsync_dir(path.parent)


def _int(document: dict[str, Any], key: str, where: str, low: int = 0) -> int:
    value = document[key]
    if type(value) is not int or not low <= value < 1 << 63:
        raise CommitRecordError(f"{where}.{key}: {value!r} is not an integer >= {low}")
    return value


def parse_commit(data: bytes, path: Path, *, store: str, name: str) -> CommitRecord:
    """Decode and check a commit record of snapshot ``name`` of store ``store``.

    Raises:
        CommitRecordError: naming ``path`` and what is wrong (truncated, corrupted, a
            field missing or of the wrong type, another store's or snapshot's, parts not
            one per rank in order).
    """
    where = f"commit record {path}"
    match = _TRAILER.search(data[-80:])
    if match is None:
        raise CommitRecordError(f"{where} has no digest trailer: truncated or not a record")
    body = data[: len(data) - len(match.group(0))]
    if match.group(1).decode() != hashlib.sha256(body).hexdigest():
        raise CommitRecordError(f"{where}: its digest does not match its bytes (corrupted)")
    try:
        document = loads_strict(body, where)
    except ManifestError as exc:
        raise CommitRecordError(str(exc)) from None
    if not isinstance(document, dict) or document.get("format") != COMMIT_FORMAT:
        raise CommitRecordError(f"{where} is not a commit record (no format {COMMIT_FORMAT!r})")
    if not _FIELDS <= document.keys() <= _FIELDS | _OPTIONAL_FIELDS:
        odd = sorted((document.keys() ^ _FIELDS) - _OPTIONAL_FIELDS)
        raise CommitRecordError(f"{where}: field {odd[0]!r} is missing or unknown")
    if document["version"] != COMMIT_VERSION or type(document["version"]) is not int:
        raise CommitRecordError(
            f"{where}: version {document['version']!r}; this swapper reads {COMMIT_VERSION}"
        )
    for key, value in (("store", store), ("snapshot", name)):
        if document[key] != value:
            raise CommitRecordError(f"{where}.{key}: {document[key]!r}, expected {value!r}")
    part = document.get("part", name)
    if not isinstance(part, str) or not _NAME.match(part):
        raise CommitRecordError(f"{where}.part: {part!r} is not a snapshot name")
    seq, step = _int(document, "seq", where), _int(document, "step", where)
    world = _int(document, "world_size", where, low=1)
    created = document["created"]
    if type(created) not in (int, float) or not math.isfinite(created) or created < 0:
        raise CommitRecordError(f"{where}.created: {created!r} is not a time")
    raw_parts = document["parts"]
    if not isinstance(raw_parts, list) or len(raw_parts) != world:
        raise CommitRecordError(f"{where}.parts: expected a list of {world} parts (one a rank)")
    parts: list[RankPart] = []
    for r, raw in enumerate(raw_parts):
        at = f"{where}.parts[{r}]"
        if not isinstance(raw, dict) or raw.keys() != _PART_FIELDS:
            raise CommitRecordError(f"{at}: expected an object with {sorted(_PART_FIELDS)}")
        if _int(raw, "rank", at) != r:
            raise CommitRecordError(f"{at}.rank: {raw['rank']!r}, expected {r}")
        rel = raw["path"]
        if not isinstance(rel, str) or rel.startswith("/") or ".." in Path(rel).parts:
            raise CommitRecordError(f"{at}.path: {rel!r} is not a path inside the store's dir")
        if not isinstance(raw["digest"], str) or not _DIGEST.match(raw["digest"]):
            raise CommitRecordError(f"{at}.digest: {raw['digest']!r} is not 'sha256:<hex>'")
        parts.append(RankPart(r, rel, raw["digest"], _int(raw, "nbytes", at)))
    return CommitRecord(name, seq, step, world, float(created), tuple(parts), path, part)


def read_commits(base: Path, store: str) -> tuple[list[CommitRecord], dict[str, str]]:
    """The commit records of store ``store`` in ``base``: those that decode, newest
    (largest ``seq``) first, and the damaged ones by snapshot name (what is wrong).

    Raises:
        SwapIOError: ``base`` cannot be listed, or a record cannot be read (EIO...: not
            listed as damaged, which would let a resume pass over it).
    """
    pattern = re.compile(rf"^{re.escape(store)}\.([A-Za-z0-9_][A-Za-z0-9_-]*)\.commit$")
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return [], {}
    except OSError as exc:
        raise SwapIOError(exc.errno, f"cannot list: {exc.strerror}", str(base)) from exc
    records: list[CommitRecord] = []
    damaged: dict[str, str] = {}
    for file_name in names:
        m = pattern.match(file_name)
        if m is None:
            continue
        path = Path(base) / file_name
        try:
            data = read_metadata(path, "snapshot commit record", limit=MAX_COMMIT_NBYTES)
            records.append(parse_commit(data, path, store=store, name=m.group(1)))
        except FileNotFoundError:
            continue  # removed meanwhile
        except (CommitRecordError, ManifestError) as exc:
            cause = io_error_of(exc)
            if cause is not None:  # not read: no proof of damage, never passed over
                raise SwapIOError(
                    cause.errno,
                    f"cannot read commit record {m.group(1)!r}: {cause.strerror} (an I/O "
                    "error, not proof of damage; retry once the disk reads again)",
                    str(path),
                ) from cause
            damaged[m.group(1)] = str(exc)
    records.sort(key=lambda r: r.seq, reverse=True)
    return records, damaged
