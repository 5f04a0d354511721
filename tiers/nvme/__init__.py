"""The NVMe tier: tensors by key in swap files, verified, locked and crash-true.

Modules, each with one job (read its header for the invariants it keeps):

- :mod:`~tiers.nvme.store`: :class:`NvmeStore`, the public face, and the life of a version;
- :mod:`~tiers.nvme.core`: the requests in flight under it, and the glue to the committer;
- :mod:`~tiers.nvme.versions`: keys → versions, and when extents may be reused;
- :mod:`~tiers.nvme.placement`: extent allocation and striping over the directories;
- :mod:`~tiers.nvme.manifest`: the manifest's format and its strict decoding;
- :mod:`~tiers.nvme.journal`: the journal of changes since the manifest;
- :mod:`~tiers.nvme.snapshotting`: retained snapshots (copy-on-write), the store's API;
- :mod:`~tiers.nvme.snapshots`: the snapshot file format, :class:`SnapshotInfo`, errors;
- :mod:`~tiers.nvme.committer`: group commit, the thread that makes changes durable;
- :mod:`~tiers.nvme.opening`: the files at creation and at open (checks, journal replay);
- :mod:`~tiers.nvme.lock`: the ``flock`` that keeps a store's files to one open store;
- :mod:`~tiers.nvme.metafiles`: the store's files by name, defensive reads, atomic writes;
- :mod:`~tiers.nvme.housekeeping`: creating files safely, :func:`remove_store`;
- :mod:`~tiers.nvme.futures`: :class:`StoreFuture`;
- :mod:`~tiers.nvme.records`: the value types, errors and argument checks.
"""

from tiers.errors import StoreLockedError, SwapCorruptionError
from tiers.nvme.futures import StoreFuture
from tiers.nvme.housekeeping import remove_store
from tiers.nvme.records import (
    MANIFEST_VERSION,
    MAX_METADATA_NBYTES,
    ChecksumError,
    DirUsage,
    Extent,
    ManifestError,
    OverlappingExtentsError,
    StoreClosedError,
    StoredTensor,
    StoreExistsError,
    StoreKeyError,
    StoreWrites,
    content_hash,
)
from tiers.nvme.snapshots import (
    SnapshotDamagedError,
    SnapshotError,
    SnapshotExistsError,
    SnapshotInfo,
    SnapshotNotFoundError,
)
from tiers.nvme.store import NvmeStore

__all__ = [
    "MANIFEST_VERSION",
    "MAX_METADATA_NBYTES",
    "ChecksumError",
    "DirUsage",
    "Extent",
    "ManifestError",
    "NvmeStore",
    "OverlappingExtentsError",
    "SnapshotDamagedError",
    "SnapshotError",
    "SnapshotExistsError",
    "SnapshotInfo",
    "SnapshotNotFoundError",
    "StoreClosedError",
    "StoreExistsError",
    "StoreFuture",
    "StoreKeyError",
    "StoreLockedError",
    "StoreWrites",
    "StoredTensor",
    "SwapCorruptionError",
    "content_hash",
    "remove_store",
]
