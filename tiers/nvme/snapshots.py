"""Snapshot files: a retained snapshot's versions and metadata, as strict, digested JSON.

Job: encode what :meth:`~tiers.nvme.store.NvmeStore.snapshot` records and decode it back
at open, trusting nothing; the snapshot's errors and :class:`SnapshotInfo`. No locking and
no store state: the store's snapshot methods (:mod:`tiers.nvme.snapshotting`) use these.

A snapshot is a manifest switch, not a copy: it names the extents of the versions that
were current when it was taken, and while its file exists those extents are pinned (never
freed, never handed out again; see :mod:`tiers.nvme.versions`), so later writes of the same
keys go to new extents (copy-on-write).

File ``<name>.<snapshot>.snap`` in ``dirs[0]`` (see :mod:`tiers.nvme.metafiles`), written
by :func:`~tiers.nvme.metafiles.replace_file` (temporary file, fsync, rename, directory
fsync)::

    {"format": "swapper-nvme-snapshot", "version": 1, "store": "<name>",
     "snapshot": "<snapshot>", "seq": 3, "created": 1764000000.25,
     "dirs": [...], "stripe_nbytes": 16777216, "checksum": true,
     "extra": {"kind": "json" | "bytes" | "none", "data": "<JSON text | base64 | ''>"},
     "tensors": {"<key>": <as in the manifest>}}
    #xxh3=<16 hex digits: XXH3-64 of every byte before this line>

The trailer's digest catches a flipped byte that would still parse. ``extra`` is kept as
text so its nesting does not count against the document's (it is parsed strictly on its
own). Decoding refusals are :class:`SnapshotDamagedError` naming the file and the field.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from tiers.errors import SwapConfigError, SwapError
from tiers.nvme.manifest import loads_strict, tensor_from_json, tensor_to_json
from tiers.nvme.records import ManifestError, StoredTensor

__all__ = [
    "MAX_EXTRA_NBYTES",
    "MAX_SNAPSHOT_NAME",
    "SnapshotDamagedError",
    "SnapshotError",
    "SnapshotExistsError",
    "SnapshotFile",
    "SnapshotInfo",
    "SnapshotNotFoundError",
    "check_snapshot_name",
    "encode_extra",
    "encode_snapshot",
    "parse_snapshot",
]

FORMAT = "swapper-nvme-snapshot"
VERSION = 1
#: Longest snapshot name, in characters.
MAX_SNAPSHOT_NAME = 64
#: Largest ``extra`` a snapshot records, in bytes of its encoding (JSON text or base64).
MAX_EXTRA_NBYTES = 16 << 20

_NAME = re.compile(rf"^[A-Za-z0-9_][A-Za-z0-9_-]{{0,{MAX_SNAPSHOT_NAME - 1}}}$")
_TRAILER = re.compile(rb"\n#xxh3=([0-9a-f]{16})\n\Z")
_TOP_FIELDS = frozenset(
    {"format", "version", "store", "snapshot", "seq", "created", "dirs", "stripe_nbytes"}
    | {"checksum", "extra", "tensors"}
)
_EXTRA_KINDS = frozenset({"json", "bytes", "none"})


class SnapshotError(SwapError):
    """Base class of the snapshot errors."""


class SnapshotExistsError(SnapshotError, ValueError):
    """A snapshot of that name exists (or a damaged file of that name is in the way)."""


class SnapshotNotFoundError(SnapshotError, KeyError):
    """No snapshot of that name, or the snapshot does not name the key."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SnapshotDamagedError(SnapshotError, ManifestError):
    """A snapshot file is unreadable, corrupt or not this store's; the message names it."""


def check_snapshot_name(name: object, store: str) -> str:
    """``name`` if it is a usable snapshot name.

    Raises:
        SwapConfigError: not a str of 1 to 64 letters, digits, '_' or '-' (not starting
            with '-'); the message names the store.
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise SwapConfigError(
            f"store {store!r}: snapshot name {name!r} must be 1 to {MAX_SNAPSHOT_NAME} "
            "letters, digits, '_' or '-' (not starting with '-'), e.g. 'step-1000'"
        )
    return name


@dataclass(frozen=True)
class SnapshotInfo:
    """One retained snapshot.

    ``seq``: larger than that of every snapshot existing when it was taken. ``created``:
    seconds since the epoch. ``nbytes``: tensor bytes it names. ``exclusive_nbytes``:
    bytes of the data files (padded to 4 KiB, as in ``dir_usage``) that only it holds,
    what dropping it would free now. ``file_nbytes``: bytes of its file (all that taking
    it wrote). ``extra``: the caller's metadata, as given.
    """

    name: str
    seq: int
    created: float
    keys: tuple[str, ...]
    nbytes: int
    exclusive_nbytes: int
    file_nbytes: int
    path: Path
    extra: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class SnapshotFile:
    """A decoded snapshot file."""

    name: str
    seq: int
    created: float
    extra: Any
    tensors: dict[str, StoredTensor]


def encode_extra(extra: object, store: str, name: str) -> dict[str, str]:
    """``extra`` as the file records it.

    Raises:
        TypeError: not a Mapping with str keys, bytes, or None, or not exactly JSON-able
            (a tuple, a NaN, a non-str key would not read back as given).
        ValueError: larger than :data:`MAX_EXTRA_NBYTES` encoded, or nested too deep.
    """
    at = f"snapshot {name!r} of store {store!r}: extra"
    if extra is None:
        return {"kind": "none", "data": ""}
    if isinstance(extra, (bytes, bytearray, memoryview)):
        data = base64.b64encode(bytes(extra)).decode("ascii")
        kind = "bytes"
    elif isinstance(extra, Mapping):
        value = dict(extra)
        try:
            data = json.dumps(value, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{at} is not JSON-able: {exc}") from None
        if len(data) > MAX_EXTRA_NBYTES:
            raise ValueError(f"{at} is {len(data)} bytes as JSON, more than {MAX_EXTRA_NBYTES}")
        try:
            same = loads_strict(data.encode(), at) == value
        except ManifestError as exc:
            raise ValueError(str(exc)) from None
        if not same:
            raise TypeError(
                f"{at} would not read back as given (tuples, non-str keys or other "
                "non-JSON types): pass lists, dicts with str keys, str, int, float, bool, None"
            )
        kind = "json"
    else:
        raise TypeError(f"{at} must be a Mapping, bytes or None, got {type(extra).__name__}")
    if len(data) > MAX_EXTRA_NBYTES:
        raise ValueError(f"{at} is {len(data)} bytes encoded, more than {MAX_EXTRA_NBYTES}")
    return {"kind": kind, "data": data}


def encode_snapshot(
    *,
    store: str,
    name: str,
    seq: int,
    created: float,
    dirs: list[Path],
    stripe_nbytes: int,
    checksum: bool,
    extra: dict[str, str],
    tensors: list[StoredTensor],
) -> bytes:
    document = {
        "format": FORMAT,
        "version": VERSION,
        "store": store,
        "snapshot": name,
        "seq": seq,
        "created": created,
        "dirs": [str(d) for d in dirs],
        "stripe_nbytes": stripe_nbytes,
        "checksum": checksum,
        "extra": extra,
        "tensors": {t.key: tensor_to_json(t) for t in tensors},
    }
    body = json.dumps(document, indent=1).encode()
    return body + b"\n#xxh3=%016x\n" % xxhash.xxh3_64_intdigest(body)


def _decode_extra(raw: object, where: str) -> Any:
    if not isinstance(raw, dict) or raw.keys() != {"kind", "data"}:
        raise SnapshotDamagedError(f"{where}.extra: expected an object with kind and data")
    kind, data = raw["kind"], raw["data"]
    if kind not in _EXTRA_KINDS or not isinstance(data, str):
        raise SnapshotDamagedError(f"{where}.extra: unknown kind {kind!r} or data not a string")
    if len(data) > MAX_EXTRA_NBYTES:
        raise SnapshotDamagedError(f"{where}.extra: larger than {MAX_EXTRA_NBYTES} bytes")
    if kind == "none":
        if data:
            raise SnapshotDamagedError(f"{where}.extra: kind 'none' with data")
        return None
    if kind == "bytes":
        try:
            return base64.b64decode(data.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise SnapshotDamagedError(f"{where}.extra: data is not base64") from None
    try:
        value = loads_strict(data.encode(), f"{where}.extra")
    except ManifestError as exc:
        raise SnapshotDamagedError(str(exc)) from None
    if not isinstance(value, dict):
        raise SnapshotDamagedError(f"{where}.extra: JSON data is not an object")
    return value


def parse_snapshot(
    data: bytes,
    path: Path,
    *,
    store: str,
    name: str,
    dirs: list[Path],
    stripe_nbytes: int,
    checksum: bool,
) -> SnapshotFile:
    """Decode and check a snapshot file of ``store`` (its own checks only: whether its
    extents fit the data files and the other snapshots is the opener's to check).

    Raises:
        SnapshotDamagedError: naming ``path`` and what is wrong.
    """
    where = f"snapshot file {path}"
    match = _TRAILER.search(data[-32:])
    if match is None:
        raise SnapshotDamagedError(f"{where} has no digest trailer: truncated or not a snapshot")
    body = data[: len(data) - len(match.group(0))]
    if int(match.group(1), 16) != xxhash.xxh3_64_intdigest(body):
        raise SnapshotDamagedError(f"{where}: its digest does not match its bytes (corrupted)")
    try:
        document = loads_strict(body, where)
    except ManifestError as exc:
        raise SnapshotDamagedError(str(exc)) from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise SnapshotDamagedError(f"{where} is not a swapper snapshot (no format {FORMAT!r})")
    missing = sorted(_TOP_FIELDS - document.keys())
    unknown = sorted(document.keys() - _TOP_FIELDS)
    if missing or unknown:
        what = f"field {missing[0]!r} is missing" if missing else f"unknown field {unknown[0]!r}"
        raise SnapshotDamagedError(f"{where}: {what}")
    if document["version"] != VERSION or type(document["version"]) is not int:
        raise SnapshotDamagedError(
            f"{where}: layout version {document['version']!r}; this swapper reads {VERSION}"
        )
    expected = {
        "store": store,
        "snapshot": name,
        "dirs": [str(d) for d in dirs],
        "stripe_nbytes": stripe_nbytes,
        "checksum": checksum,
    }
    for key, value in expected.items():
        if document[key] != value or type(document[key]) is not type(value):
            raise SnapshotDamagedError(
                f"{where}.{key}: {document[key]!r}, but this store's is {value!r}"
            )
    seq = document["seq"]
    if type(seq) is not int or not 0 <= seq < 1 << 63:
        raise SnapshotDamagedError(f"{where}.seq: {seq!r} is not a non-negative integer")
    created = document["created"]
    if type(created) not in (int, float) or not math.isfinite(created) or created < 0:
        raise SnapshotDamagedError(f"{where}.created: {created!r} is not a time")
    extra = _decode_extra(document["extra"], where)
    entries = document["tensors"]
    if not isinstance(entries, dict):
        raise SnapshotDamagedError(f"{where}.tensors: expected an object")
    try:
        tensors = {
            key: tensor_from_json(
                key, item, where, n_dirs=len(dirs), stripe_nbytes=stripe_nbytes, checksum=checksum
            )
            for key, item in entries.items()
        }
    except ManifestError as exc:
        raise SnapshotDamagedError(str(exc)) from None
    return SnapshotFile(name, seq, float(created), extra, tensors)
