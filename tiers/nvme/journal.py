"""The journal: the store's changes since its manifest, appended and synced in groups.

Job: the file ``<name>.journal`` in ``dirs[0]``. The store appends one record per committed
write ("put": the key's new version) or delete; :meth:`Journal.append` writes a group of
records with one ``pwrite`` and makes them durable with one ``fdatasync``. Replayed over
the manifest at open; reset (replaced by an empty journal of the next generation) once a
manifest holding everything in it is durable.

File layout (little-endian)::

    header, 32 bytes:  b"SWPRJNL1" | generation u64 | 0 u64 | XXH3-64 of the first 24 bytes
    records, then zeros to the end of the file (preallocated space)
    record:            length u32 | seq u64 | digest u64 | payload (length bytes)
                       digest = XXH3-64(generation u64 | seq u64 | payload)
                       seq = 1, 2, 3 ... within a generation
    payload (JSON):    {"op": "put", "key": k, "tensor": <as in the manifest>}
                       {"op": "delete", "key": k}
                       {"op": "switch", "put": {k: <tensor>, ...}, "delete": [k, ...]}
                       (a snapshot restored: all of its changes in one record, so a
                       crash replays all of them or none)

Invariants:

- The header is written with the file, atomically (:func:`replace_file`): a crash cannot
  tear it, so a bad header is refused (:class:`ManifestError`), never guessed at.
- A record counts only if its length fits the file, its ``seq`` is the next one and its
  digest matches (the digest covers the generation, so bytes of an older journal never
  pass). Replay stops at the first record that fails: that is a torn tail, what a crash in
  the middle of appending a group leaves, and no write of that group had been acknowledged
  (acknowledgement waits for the ``fdatasync``). The bytes after it are dropped (logged,
  unless they are all zeros: the preallocated space).
- A record whose digest matches but whose payload does not decode was not torn by a crash:
  refused with :class:`ManifestError`.
- After a failed append the journal's end is unknown: the store stops writing (see
  :class:`~tiers.nvme.store.NvmeStore`) rather than append after bytes replay would drop.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from tiers.errors import SwapIOError
from tiers.nvme.manifest import loads_strict, tensor_from_json, tensor_to_json
from tiers.nvme.metafiles import count_written, replace_file, write_all
from tiers.nvme.records import ManifestError, StoredTensor

__all__ = [
    "Journal",
    "JournalContents",
    "decode_changes",
    "decode_payload",
    "encode_delete",
    "encode_put",
    "encode_switch",
]

log = logging.getLogger("swapper.tiers.nvme")

MAGIC = b"SWPRJNL1"
_HEADER = struct.Struct("<8sQQQ")
_RECORD = struct.Struct("<IQQ")
HEADER_NBYTES = _HEADER.size
#: The longest record payload replay accepts (a longer length field is a torn tail).
MAX_RECORD_NBYTES = 256 << 20
#: Bytes of zeros a new journal is created with (and grown by, doubling): appending then
#: overwrites allocated blocks, so the append's fdatasync flushes the bytes without a
#: metadata commit for the file's growth.
PREALLOCATED_NBYTES = 64 << 10


def _header(generation: int) -> bytes:
    head = struct.pack("<8sQQ", MAGIC, generation, 0)
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def _digest(generation: int, seq: int, payload: bytes) -> int:
    h = xxhash.xxh3_64(struct.pack("<QQ", generation, seq))
    h.update(payload)
    return h.intdigest()


def encode_put(stored: StoredTensor) -> bytes:
    document = {"op": "put", "key": stored.key, "tensor": tensor_to_json(stored)}
    return json.dumps(document, separators=(",", ":")).encode()


def encode_delete(key: str) -> bytes:
    return json.dumps({"op": "delete", "key": key}, separators=(",", ":")).encode()


def encode_switch(puts: list[StoredTensor], deletes: list[str]) -> bytes:
    document = {
        "op": "switch",
        "put": {t.key: tensor_to_json(t) for t in puts},
        "delete": deletes,
    }
    return json.dumps(document, separators=(",", ":")).encode()


def decode_changes(
    payload: bytes, where: str, *, n_dirs: int, stripe_nbytes: int, checksum: bool
) -> list[tuple[str, StoredTensor | None]]:
    """The changes of any record, in the order to apply them (a switch's deletes first).

    Raises:
        ManifestError: the payload is not a record of this layout (naming ``where``).
    """
    document = loads_strict(payload, where)
    if not (isinstance(document, dict) and document.get("op") == "switch"):
        return [
            decode_payload(
                payload, where, n_dirs=n_dirs, stripe_nbytes=stripe_nbytes, checksum=checksum
            )
        ]
    if document.keys() != {"op", "put", "delete"}:
        raise ManifestError(f"{where}: a switch record with fields {sorted(document)}")
    puts, deletes = document["put"], document["delete"]
    if not isinstance(puts, dict) or not isinstance(deletes, list):
        raise ManifestError(f"{where}: a switch record's put/delete are not an object/a list")
    changes: list[tuple[str, StoredTensor | None]] = []
    for key in deletes:
        if not isinstance(key, str) or not key or key in puts:
            raise ManifestError(f"{where}.delete: bad key {key!r}")
        changes.append((key, None))
    for key, item in puts.items():
        stored = tensor_from_json(
            key, item, where, n_dirs=n_dirs, stripe_nbytes=stripe_nbytes, checksum=checksum
        )
        changes.append((key, stored))
    return changes


def decode_payload(
    payload: bytes, where: str, *, n_dirs: int, stripe_nbytes: int, checksum: bool
) -> tuple[str, StoredTensor | None]:
    """``(key, stored)`` of a put record, ``(key, None)`` of a delete.

    Raises:
        ManifestError: the payload is not a record of this layout (naming ``where``).
    """
    document = loads_strict(payload, where)
    if not isinstance(document, dict):
        raise ManifestError(f"{where}: expected an object, got {type(document).__name__}")
    op, key = document.get("op"), document.get("key")
    if not isinstance(key, str) or not key:
        raise ManifestError(f"{where}.key: expected a non-empty string, got {key!r}")
    if op == "delete" and document.keys() == {"op", "key"}:
        return key, None
    if op == "put" and document.keys() == {"op", "key", "tensor"}:
        stored = tensor_from_json(
            key,
            document["tensor"],
            where,
            n_dirs=n_dirs,
            stripe_nbytes=stripe_nbytes,
            checksum=checksum,
        )
        return key, stored
    raise ManifestError(f"{where}: not a put or delete record: fields {sorted(document)}")


@dataclass(frozen=True)
class JournalContents:
    """What replay found: the valid records' payloads, where they end, and what was not."""

    generation: int
    payloads: list[bytes]
    end: int  #: offset just past the last valid record
    dropped_nbytes: int  #: bytes after it (a torn tail), ignored


def parse_journal(data: bytes, path: Path) -> JournalContents:
    """Split a journal's bytes into records (see the module docstring for the rules).

    Raises:
        ManifestError: the header is missing or damaged.
    """
    if len(data) < HEADER_NBYTES:
        raise ManifestError(
            f"journal {path} is {len(data)} bytes, shorter than its {HEADER_NBYTES}-byte header"
        )
    magic, generation, _, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ManifestError(f"journal {path} does not start with {MAGIC!r}: not a swapper journal")
    if digest != xxhash.xxh3_64_intdigest(data[:24]):
        raise ManifestError(f"journal {path}: its header's checksum does not match")
    payloads = []
    offset = HEADER_NBYTES
    seq = 1
    # Zeros after the last record are the preallocated space, not a torn tail.
    while len(data) - offset >= _RECORD.size:
        length, record_seq, record_digest = _RECORD.unpack_from(data, offset)
        start = offset + _RECORD.size
        if length > MAX_RECORD_NBYTES or start + length > len(data) or record_seq != seq:
            break
        payload = data[start : start + length]
        if _digest(generation, seq, payload) != record_digest:
            break
        payloads.append(payload)
        offset = start + length
        seq += 1
    rest = len(data) - offset
    dropped = 0 if data.count(0, offset) == rest else rest
    return JournalContents(generation, payloads, offset, dropped)


class Journal:
    """An open journal, appended to by one thread (the store's committer) at a time."""

    def __init__(
        self, path: Path, fd: int, generation: int, *, end: int, next_seq: int, allocated: int
    ) -> None:
        self.path = path
        self._fd = fd
        self.generation = generation
        self.end = end  #: just past the last record
        self.next_seq = next_seq
        self._allocated = allocated  # the file's size: zeros from end on

    @classmethod
    def create(cls, path: Path, generation: int) -> Journal:
        """Replace ``path`` by an empty journal of ``generation`` (atomically, durably).

        Raises:
            SwapIOError: it cannot be written; ``path`` is as it was.
        """
        data = _header(generation).ljust(PREALLOCATED_NBYTES, b"\0")
        fd = replace_file(path, data, "journal", keep_open=True)
        if fd is None:  # pragma: no cover - keep_open always returns one
            raise SwapIOError(errno.EIO, "journal was not kept open", str(path))
        return cls(path, fd, generation, end=HEADER_NBYTES, next_seq=1, allocated=len(data))

    def append(self, payloads: list[bytes]) -> None:
        """Append the records and ``fdatasync``: durable when this returns.

        Raises:
            SwapIOError: naming the journal; what reached the file is unknown.
        """
        parts = []
        seq = self.next_seq
        for payload in payloads:
            parts.append(_RECORD.pack(len(payload), seq, _digest(self.generation, seq, payload)))
            parts.append(payload)
            seq += 1
        data = b"".join(parts)
        try:
            end = self.end + len(data)
            if end > self._allocated:  # grow by zeros first: the file's size changes rarely
                grown = max(2 * self._allocated, end)
                write_all(self._fd, bytes(grown - self._allocated), self._allocated)
                count_written(self.path, grown - self._allocated)
                self._allocated = grown
            write_all(self._fd, data, self.end)
            count_written(self.path, len(data))
            os.fdatasync(self._fd)
        except OSError as exc:
            raise SwapIOError(
                exc.errno or errno.EIO,
                f"cannot append to the journal: {exc.strerror or exc}",
                str(self.path),
            ) from exc
        self.end += len(data)
        self.next_seq = seq

    def reset(self, generation: int) -> None:
        """Replace the file by an empty journal of ``generation``; the old one is closed.

        Raises:
            SwapIOError: the new journal cannot be written; this one stays as it was.
        """
        fresh = Journal.create(self.path, generation)
        os.close(self._fd)
        self._fd, self.generation = fresh._fd, generation
        self.end, self.next_seq, self._allocated = fresh.end, fresh.next_seq, fresh._allocated

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def log_dropped(path: Path, contents: JournalContents) -> None:
    if contents.dropped_nbytes:
        log.warning(
            "journal %s: dropped a torn tail of %d bytes after %d valid record(s) "
            "(a crash while appending; none of those writes had been acknowledged)",
            path,
            contents.dropped_nbytes,
            len(contents.payloads),
        )
