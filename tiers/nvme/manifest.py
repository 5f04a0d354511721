"""The manifest: the store's durable state at one generation, as strict JSON.

Job: encode a set of :class:`~tiers.nvme.records.StoredTensor` (and the store's settings)
as the manifest document and decode one back, trusting nothing in it; the journal's
records reuse the tensor encoding (:func:`tensor_to_json`, :func:`tensor_from_json`).

Layout (``version`` 3)::

    {"format": "swapper-nvme-store", "version": 3, "name": "<name>",
     "dirs": ["/abs/dir0", ...], "stripe_nbytes": 16777216, "checksum": true,
     "alignment": 4096, "generation": 7,
     "tensors": {"<key>": {"dtype": "bfloat16", "shape": [300, 257], "nbytes": 154200,
                           "extents": [{"dir": 0, "offset": 0, "nbytes": 154200,
                                        "xxh3": 1234567890123456789}]}}}

Decoding is strict; each refusal is a :class:`~tiers.nvme.records.ManifestError` naming
the file and the field (e.g. ``tensors['w'].shape[0]``), never a raw Python exception:

- UTF-8 JSON nested at most :data:`MAX_NESTING` deep (checked before parsing, so a deeply
  nested file never reaches the recursive parser), no duplicate keys in an object, no
  NaN/Infinity, no integer literal longer than 40 digits;
- every field present and no unknown one (a newer layout bumps ``version``); integers are
  ``int`` (not bool, float or string) within bounds; shapes non-negative and matching
  ``nbytes``; dtypes from :data:`~tiers.nvme.records.DTYPES`;
- extents in tensor order adding up to ``nbytes``, 4 KiB-aligned, 1 to ``stripe_nbytes``
  bytes each, in a named directory, with a checksum exactly when the store records them.
  That extents lie inside the data files and do not overlap (no two keys, nor one key
  twice, share a byte: :class:`~tiers.nvme.records.OverlappingExtentsError` names both
  keys) is checked by the store once the journal is replayed (the files' sizes and the
  journal's records are needed).

Versions other than 3 are refused with a message naming :func:`~tiers.nvme.remove_store`:
a version-2 manifest holds one checksum per tensor, which cannot verify a chunk.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiers.config import DIRECT_ALIGNMENT
from tiers.nvme.records import (
    DTYPES,
    MANIFEST_VERSION,
    MAX_FILE_NBYTES,
    Extent,
    ManifestError,
    StoredTensor,
    dtype_name,
)

__all__ = [
    "MAX_NESTING",
    "ManifestSpec",
    "encode_manifest",
    "loads_strict",
    "parse_manifest",
    "tensor_from_json",
    "tensor_to_json",
]

FORMAT = "swapper-nvme-store"
#: Deepest nesting of JSON arrays and objects accepted (the layout needs 5).
MAX_NESTING = 16
_MAX_NDIM = 64
_MAX_INT_DIGITS = 40
_TOP_FIELDS = frozenset(
    {"format", "version", "name", "dirs", "stripe_nbytes", "checksum", "alignment"}
    | {"generation", "tensors"}
)
_TENSOR_FIELDS = frozenset({"dtype", "shape", "nbytes", "extents"})
_EXTENT_FIELDS = frozenset({"dir", "offset", "nbytes", "xxh3"})
# A JSON string, so that brackets inside strings are not counted as nesting.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


@dataclass(frozen=True)
class ManifestSpec:
    """A decoded manifest: the settings and the tensors, by key in file order."""

    generation: int
    stripe_nbytes: int
    checksum: bool
    tensors: dict[str, StoredTensor]


# -- encoding -----------------------------------------------------------------------------


def tensor_to_json(stored: StoredTensor) -> dict[str, Any]:
    return {
        "dtype": dtype_name(stored.dtype),
        "shape": list(stored.shape),
        "nbytes": stored.nbytes,
        "extents": [
            {"dir": e.dir_index, "offset": e.offset, "nbytes": e.nbytes, "xxh3": e.checksum}
            for e in stored.extents
        ],
    }


def encode_manifest(
    *,
    name: str,
    dirs: Iterable[Path],
    stripe_nbytes: int,
    checksum: bool,
    generation: int,
    tensors: Iterable[StoredTensor],
) -> bytes:
    document = {
        "format": FORMAT,
        "version": MANIFEST_VERSION,
        "name": name,
        "dirs": [str(d) for d in dirs],
        "stripe_nbytes": stripe_nbytes,
        "checksum": checksum,
        "alignment": DIRECT_ALIGNMENT,
        "generation": generation,
        "tensors": {t.key: tensor_to_json(t) for t in tensors},
    }
    return (json.dumps(document, indent=1) + "\n").encode()


# -- strict JSON --------------------------------------------------------------------------


def _nesting(data: bytes) -> int:
    """Deepest nesting of arrays/objects in ``data`` (strings skipped), in C-speed passes."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    depth, deepest = 0, 0
    view = np.frombuffer(brackets, dtype=np.uint8)
    for start in range(0, len(view), 1 << 24):
        steps = np.cumsum(_DEPTH_STEP[view[start : start + (1 << 24)]], dtype=np.int64) + depth
        if len(steps):
            deepest = max(deepest, int(steps.max()))
            depth = int(steps[-1])
    return deepest


def loads_strict(data: bytes, where: str) -> Any:
    """Parse ``data`` as strict JSON (see the module docstring).

    Raises:
        ManifestError: naming ``where`` and what is wrong.
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(
            f"{where} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    depth = _nesting(data)
    if depth > MAX_NESTING:
        raise ManifestError(
            f"{where} nests arrays/objects {depth} deep, more than the {MAX_NESTING} allowed"
        )

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                raise ManifestError(f"{where}: key {key!r} appears twice in one object")
            out[key] = value
        return out

    def constant(name: str) -> Any:
        raise ManifestError(f"{where}: {name} is not a number a manifest may hold")

    def integer(literal: str) -> int:
        if len(literal) > _MAX_INT_DIGITS:
            raise ManifestError(f"{where}: integer {literal[:20]}... has {len(literal)} digits")
        return int(literal)

    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant, parse_int=integer)
    except ManifestError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ManifestError(f"{where} is not valid JSON: {exc}") from None


# -- strict schema ------------------------------------------------------------------------


def _int(value: object, where: str, *, lo: int = 0, hi: int = MAX_FILE_NBYTES) -> int:
    if type(value) is not int:  # bool is an int subclass: refused too
        raise ManifestError(f"{where}: expected an integer, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise ManifestError(f"{where}: {value} is outside [{lo}, {hi}]")
    return value


def _dict(value: object, where: str, fields: frozenset[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ManifestError(f"{where}: expected an object, got {type(value).__name__}")
    missing = sorted(fields - value.keys())
    unknown = sorted(value.keys() - fields)
    if missing:
        raise ManifestError(f"{where}: field {missing[0]!r} is missing")
    if unknown:
        raise ManifestError(f"{where}: unknown field {unknown[0]!r}")
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ManifestError(f"{where}: expected a list, got {type(value).__name__}")
    return value


def tensor_from_json(
    key: object, item: object, where: str, *, n_dirs: int, stripe_nbytes: int, checksum: bool
) -> StoredTensor:
    """Decode one tensor's entry, checking it on its own (see the module docstring).

    Raises:
        ManifestError: naming ``where``, the key and the field.
    """
    if not isinstance(key, str) or not key:
        raise ManifestError(f"{where}: a tensor's key must be a non-empty string, got {key!r}")
    at = f"{where}: tensors[{key!r}]"
    fields = _dict(item, at, _TENSOR_FIELDS)
    name = fields["dtype"]
    if not isinstance(name, str) or name not in DTYPES:
        raise ManifestError(f"{at}.dtype: unknown dtype {name!r}")
    dtype = DTYPES[name]
    shape_list = _list(fields["shape"], f"{at}.shape")
    if len(shape_list) > _MAX_NDIM:
        raise ManifestError(f"{at}.shape: {len(shape_list)} dimensions, more than {_MAX_NDIM}")
    shape = tuple(_int(s, f"{at}.shape[{i}]") for i, s in enumerate(shape_list))
    nbytes = _int(fields["nbytes"], f"{at}.nbytes")
    numel = 1
    for s in shape:
        numel *= s
    if numel * dtype.itemsize != nbytes:
        raise ManifestError(
            f"{at}.nbytes: {nbytes} bytes do not match {name} {list(shape)} "
            f"({numel * dtype.itemsize} bytes)"
        )
    extents = []
    total = 0
    for i, raw in enumerate(_list(fields["extents"], f"{at}.extents")):
        e_at = f"{at}.extents[{i}]"
        e = _dict(raw, e_at, _EXTENT_FIELDS)
        dir_index = _int(e["dir"], f"{e_at}.dir", hi=n_dirs - 1)
        offset = _int(e["offset"], f"{e_at}.offset")
        if offset % DIRECT_ALIGNMENT:
            raise ManifestError(f"{e_at}.offset: {offset} is not a multiple of {DIRECT_ALIGNMENT}")
        e_nbytes = _int(e["nbytes"], f"{e_at}.nbytes", lo=1, hi=stripe_nbytes)
        if offset + e_nbytes > MAX_FILE_NBYTES:
            raise ManifestError(f"{e_at}: ends past the largest file offset")
        digest = e["xxh3"]
        if checksum:
            digest = _int(digest, f"{e_at}.xxh3", hi=(1 << 64) - 1)
        elif digest is not None:
            raise ManifestError(f"{e_at}.xxh3: the store records no checksums, got {digest!r}")
        extents.append(Extent(dir_index, offset, e_nbytes, digest))
        total += e_nbytes
    if total != nbytes:
        raise ManifestError(f"{at}.extents: they hold {total} bytes, not nbytes={nbytes}")
    return StoredTensor(key, dtype, shape, nbytes, tuple(extents))


def parse_manifest(data: bytes, path: Path, dirs: list[Path], name: str) -> ManifestSpec:
    """Decode and check the manifest read from ``path`` for a store of ``dirs``, ``name``.

    Raises:
        ManifestError: see the module docstring; the message names ``path`` and the field.
    """
    where = f"manifest {path}"
    document = loads_strict(data, where)
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ManifestError(f"{path} is not a swapper NVMe store manifest (no format {FORMAT!r})")
    version = document.get("version")
    if type(version) is not int or version != MANIFEST_VERSION:
        raise ManifestError(
            f"{where} has layout version {version!r}; this swapper reads version "
            f"{MANIFEST_VERSION} only. A store of another version cannot be reopened: delete "
            f"it with tiers.nvme.remove_store({[str(d) for d in dirs]!r}, name={name!r})"
        )
    top = _dict(document, where, _TOP_FIELDS)
    if top["name"] != name:
        raise ManifestError(f"{where}.name: written for store {top['name']!r}, not {name!r}")
    recorded = _list(top["dirs"], f"{where}.dirs")
    given = [str(p) for p in dirs]
    if recorded != given:
        raise ManifestError(
            f"{where}.dirs: written for directories {recorded}, but {given} were given: "
            "pass the same directories in the same order"
        )
    stripe = _int(top["stripe_nbytes"], f"{where}.stripe_nbytes", lo=DIRECT_ALIGNMENT)
    if stripe % DIRECT_ALIGNMENT:
        raise ManifestError(f"{where}.stripe_nbytes: {stripe} is not a multiple of 4096")
    if top["alignment"] != DIRECT_ALIGNMENT or type(top["alignment"]) is not int:
        raise ManifestError(f"{where}.alignment: {top['alignment']!r}, expected {DIRECT_ALIGNMENT}")
    checksum = top["checksum"]
    if not isinstance(checksum, bool):
        raise ManifestError(f"{where}.checksum: expected true or false, got {checksum!r}")
    generation = _int(top["generation"], f"{where}.generation", hi=(1 << 63) - 1)
    entries = top["tensors"]
    if not isinstance(entries, dict):
        raise ManifestError(f"{where}.tensors: expected an object, got {type(entries).__name__}")
    tensors = {
        key: tensor_from_json(
            key, item, where, n_dirs=len(dirs), stripe_nbytes=stripe, checksum=checksum
        )
        for key, item in entries.items()
    }
    return ManifestSpec(generation, stripe, checksum, tensors)
