"""What the NVMe store records about a tensor, the store's errors, and the checks of names.

Job: the value types every other module of :mod:`tiers.nvme` passes around, with no I/O.

Invariants:

- An :class:`Extent` starts 4 KiB-aligned (O_DIRECT) and holds at most ``stripe_nbytes``
  bytes of one tensor: it is the unit of placement, of I/O requests and of checksums.
- A :class:`StoredTensor`'s extents are in tensor byte order and add up to ``nbytes``,
  which is ``numel * itemsize`` of its dtype and shape.
- ``Extent.checksum`` is the XXH3-64 digest of the extent's bytes as written, or None when
  the store records no checksums (``checksum=False``); within one store it is all or none.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from tiers.errors import SwapConfigError, SwapCorruptionError, SwapError
from tiers.extents import pad

__all__ = [
    "DTYPES",
    "MANIFEST_VERSION",
    "MAX_METADATA_NBYTES",
    "ChecksumError",
    "DirUsage",
    "Extent",
    "ManifestError",
    "OverlappingExtentsError",
    "StoreClosedError",
    "StoreExistsError",
    "StoreKeyError",
    "StoreWrites",
    "StoredTensor",
    "byte_view",
    "check_dirs",
    "check_key",
    "check_name",
    "content_hash",
]

#: Version of the manifest's JSON layout; :meth:`NvmeStore.open` refuses others.
#: 3: one XXH3-64 checksum per extent, a generation for the journal, a lock file.
#: 2: one XXH3-64 checksum per tensor (refused: remove such a store with remove_store).
#: 1: zlib.crc32 per tensor.
MANIFEST_VERSION = 3

#: The largest manifest or journal file :meth:`NvmeStore.open` reads, in bytes. A store of
#: a million tensors has a manifest of about 200 MB; anything larger is refused unread.
MAX_METADATA_NBYTES = 1 << 30

#: Largest byte offset or length a manifest may name (the kernel's loff_t is signed 64-bit).
MAX_FILE_NBYTES = (1 << 62) - 1

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _known_dtypes() -> dict[str, torch.dtype]:
    names = [
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex32",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
    ]
    out = {}
    for name in names:
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):  # the newer ones exist in newer torch only
            out[name] = dtype
    return out


#: The dtypes a store records, by the name it writes (``str(dtype)`` without ``torch.``).
DTYPES: dict[str, torch.dtype] = _known_dtypes()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def content_hash(tensor: torch.Tensor) -> int:
    """XXH3-64 of a contiguous CPU tensor's bytes (the GIL is released while hashing)."""
    if not tensor.numel():
        return xxhash.xxh3_64_intdigest(b"")
    data = tensor.reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_intdigest(data)  # pyright: ignore[reportArgumentType]


# -- errors -------------------------------------------------------------------------------


class StoreClosedError(SwapError, RuntimeError):
    """The store is closed or closing; no new requests are accepted."""


class StoreKeyError(SwapError, KeyError):
    """No tensor is stored under the key."""

    def __str__(self) -> str:
        # KeyError's str() is the repr of its argument; a message reads better plainly.
        return str(self.args[0]) if self.args else ""


class StoreExistsError(SwapError, FileExistsError):
    """A new store would overwrite the files of an existing one; the message names the
    calls that reopen it (:meth:`NvmeStore.open`) or delete it (:func:`remove_store`)."""


class ManifestError(SwapError, ValueError):
    """The manifest or journal is missing, unreadable, of another version, malformed, or
    does not match the directories and files; the message names the file and the field."""


class OverlappingExtentsError(ManifestError):
    """Two tensors of a store's durable state (its manifest with the journal replayed)
    claim the same bytes of a data file: reading one would return the other's bytes, so
    the store is refused at open. ``keys``: the two keys (equal when one tensor names
    the bytes twice); ``path``: the data file; ``offset``, ``nbytes``: the shared range."""

    def __init__(
        self, message: str, *, keys: tuple[str, str], path: Path, offset: int, nbytes: int
    ) -> None:
        super().__init__(message)
        self.keys = keys
        self.path = path
        self.offset = offset
        self.nbytes = nbytes


#: The name this error had before reads were verified; the same class.
ChecksumError = SwapCorruptionError


# -- records ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Extent:
    """``nbytes`` consecutive bytes of a tensor at byte ``offset`` of directory
    ``dir_index``'s data file. ``offset`` is 4 KiB-aligned; the space allocated for the
    extent is ``nbytes`` rounded up to 4 KiB (the padding is never read).

    ``checksum``: XXH3-64 of the extent's bytes as written, or None (checksums off).
    """

    dir_index: int
    offset: int
    nbytes: int
    checksum: int | None = None

    @property
    def allocated_nbytes(self) -> int:
        """Bytes of file space the extent occupies (``nbytes`` padded to 4 KiB)."""
        return pad(self.nbytes)


@dataclass(frozen=True)
class StoredTensor:
    """What the store knows of one tensor: its extents are in tensor byte order, each
    with the checksum of its bytes (see :class:`Extent`)."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    extents: tuple[Extent, ...]


@dataclass(frozen=True)
class DirUsage:
    """Space in one swap directory's data file, in bytes.

    ``allocated_nbytes``: held by extents (padded to 4 KiB), including retired versions not
    yet freed; ``end_nbytes``: the end of the last allocation (holes below it are free);
    ``file_nbytes``: the data file's size on disk (space reserved, never shrunk).
    """

    path: Path
    allocated_nbytes: int
    end_nbytes: int
    file_nbytes: int


@dataclass(frozen=True)
class StoreWrites:
    """Bytes a store has written to its files since it was opened (its creation, or the
    journal's compaction at open, not counted): what the disk is asked to take.

    ``data_nbytes``: tensor bytes of writes that completed (each ``write``'s byte count);
    ``journal_nbytes``, ``manifest_nbytes``, ``snapshot_nbytes``: the metadata files (the
    journal's records and the zeros it grows by, each manifest saved, each snapshot
    file); ``metadata_nbytes``: their sum; ``total_nbytes``: everything.
    """

    data_nbytes: int
    journal_nbytes: int
    manifest_nbytes: int
    snapshot_nbytes: int

    @property
    def metadata_nbytes(self) -> int:
        return self.journal_nbytes + self.manifest_nbytes + self.snapshot_nbytes

    @property
    def total_nbytes(self) -> int:
        return self.data_nbytes + self.metadata_nbytes


# -- checks of arguments ------------------------------------------------------------------


def check_key(key: object) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"key must be a non-empty str, got {key!r}")


def check_name(name: object) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise SwapConfigError(
            f"name={name!r} must be a file name of letters, digits, '_', '.', '-' "
            "(not starting with '.' or '-')"
        )


def check_dirs(dirs: object) -> list[Path]:
    """The swap directories as absolute paths (not resolved: a symlink is refused later)."""
    if isinstance(dirs, (str, os.PathLike)):
        raise SwapConfigError("dirs must be a list of directories, not a single path")
    try:
        paths = [Path(os.path.abspath(os.fspath(d))) for d in dirs]  # type: ignore[attr-defined]
    except TypeError as exc:
        raise SwapConfigError(f"dirs must be a list of directory paths: {exc}") from None
    if not paths:
        raise SwapConfigError("dirs is empty: give at least one swap directory")
    if len(set(paths)) != len(paths):
        raise SwapConfigError(f"dirs names a directory twice: {[str(p) for p in paths]}")
    return paths


def check_distinct(paths: list[Path]) -> None:
    """Two names for one directory (a symlink, a bind mount) would hand one file twice."""
    seen: dict[tuple[int, int], Path] = {}
    for path in paths:
        st = os.stat(path)
        other = seen.setdefault((st.st_dev, st.st_ino), path)
        if other != path:
            raise SwapConfigError(f"swap directories {other} and {path} are the same directory")


def byte_view(tensor: object, key: str, op: str) -> torch.Tensor:
    """A flat uint8 view of a contiguous CPU tensor's bytes (no copy); ``op`` names the
    request ("write", "read") in messages.

    Raises:
        TypeError: not a dense CPU tensor, or its dtype cannot be viewed as bytes.
        ValueError: not contiguous, or with a lazy conj/neg bit.
    """
    what = f"{op} of key={key!r}"
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise TypeError(
            f"{what}: tensor is on {tensor.device}; the store moves host memory only: "
            "stage it through a contiguous CPU tensor (tiers.buffers) first"
        )
    if tensor.layout != torch.strided:
        raise TypeError(f"{what}: tensor has layout {tensor.layout}; only dense tensors")
    if not tensor.is_contiguous():
        raise ValueError(
            f"{what}: tensor of shape {tuple(tensor.shape)} with strides {tensor.stride()} "
            "is not contiguous; pass tensor.contiguous()"
        )
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError(f"{what}: tensor has a lazy conj/neg bit; pass tensor.resolve_conj()")
    try:
        return tensor.detach().reshape(-1).view(torch.uint8)
    except RuntimeError as exc:
        raise TypeError(f"{what}: dtype {tensor.dtype} cannot be viewed as bytes: {exc}") from exc
