"""The store's table of keys and versions, and the rules for when extents may be reused.

Job: which version of each key is current (what reads see), which one the durable state
(manifest + synced journal) names, and when a version's extents go back to the free lists.
No I/O and no locking: the store calls every method under its lock.

A version's ``pins`` count what may still use its extents:

- each read in flight of it: +1 until the read completes;
- the durable state: +1 from when its put record is queued (the record may become durable
  at any moment from then on) until a durable record of the same key supersedes it (a
  later put, or a delete);
- each retained snapshot naming it (:mod:`tiers.nvme.snapshotting`): +1 from when the
  snapshot captures it until the snapshot's file is durably removed. Snapshots share the
  version object with the key's current or durable version when they name the same
  extents, so its extents are freed once, when the last holder lets go.

A version is freed (its extents returned) when it is retired (no longer current) and has
no pins. Hence the invariant crash safety rests on: extents the durable state names are
never handed out again until a durable record supersedes them, whatever is current in
memory. A write that never commits (failed, or superseded before it finished) was never
named by anything and is freed at once.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tiers.nvme.placement import Placement
from tiers.nvme.records import StoredTensor, StoreKeyError

__all__ = ["Outcome", "Version", "VersionTable"]


@dataclass(eq=False)
class Version:
    """One written version of a key (compared by identity); see the module docstring."""

    stored: StoredTensor
    seq: int
    pins: int = 0
    retired: bool = False


@dataclass(eq=False)
class _Key:
    """A key's current version and its writes in flight. ``seq``: of the last commit or
    delete; a write issued before that completes as superseded."""

    current: Version | None = None
    seq: int = -1
    writing: int = 0


class Outcome(enum.Enum):
    COMMITTED = "committed"  #: now current; its put record must be queued
    SUPERSEDED = "superseded"  #: a later write or a delete won; freed
    FAILED = "failed"  #: freed; the key keeps what it had


class VersionTable:
    """Keys → versions over one :class:`~tiers.nvme.placement.Placement`."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        self._keys: dict[str, _Key] = {}
        self._durable: dict[str, Version] = {}
        self._seq = itertools.count()

    def load(
        self, tensors: Iterable[StoredTensor], snapshots: Iterable[Iterable[StoredTensor]] = ()
    ) -> list[dict[str, Version]]:
        """Start from the durable state found at open (each version pinned by it) and the
        retained snapshots' tensors (each version pinned once per snapshot naming it; the
        opener has checked that equal extents mean equal tensors). Returns each
        snapshot's versions by key."""
        by_extents: dict[tuple, Version] = {}
        for stored in tensors:
            version = Version(stored, next(self._seq), pins=1)
            self._keys[stored.key] = _Key(current=version, seq=version.seq)
            self._durable[stored.key] = version
            if stored.extents:
                by_extents[stored.extents] = version
        held = []
        for snapshot in snapshots:
            versions = {}
            for stored in snapshot:
                version = by_extents.get(stored.extents) if stored.extents else None
                if version is None:
                    version = Version(stored, next(self._seq), retired=True)
                    if stored.extents:
                        by_extents[stored.extents] = version
                version.pins += 1
                versions[stored.key] = version
            held.append(versions)
        return held

    # -- queries ------------------------------------------------------------------------

    def current(self, key: object, what: str) -> Version:
        """The key's current version.

        Raises:
            StoreKeyError: nothing is stored under ``key`` (named with ``what``).
        """
        entry = self._keys.get(key) if isinstance(key, str) else None
        if entry is None or entry.current is None:
            raise StoreKeyError(f"{what}: no tensor stored under key={key!r}")
        return entry.current

    def has(self, key: object) -> bool:
        entry = self._keys.get(key) if isinstance(key, str) else None
        return entry is not None and entry.current is not None

    def keys(self) -> list[str]:
        return [k for k, entry in self._keys.items() if entry.current is not None]

    def currents(self) -> dict[str, Version]:
        """Every key's current version."""
        return {k: e.current for k, e in self._keys.items() if e.current is not None}

    def durable(self) -> list[StoredTensor]:
        """What the durable state names, in manifest order."""
        return [v.stored for v in self._durable.values()]

    # -- writes -------------------------------------------------------------------------

    def start_write(
        self, key: str, dtype: torch.dtype, shape: tuple[int, ...], nbytes: int
    ) -> Version:
        """A new version with freshly allocated extents (no checksums yet)."""
        extents = self.placement.place(nbytes)
        self._keys.setdefault(key, _Key()).writing += 1
        return Version(StoredTensor(key, dtype, shape, nbytes, extents), next(self._seq))

    def finish_write(self, version: Version, stored: StoredTensor, *, ok: bool) -> Outcome:
        """Settle a write whose every part is done; ``stored`` has the extents' checksums.

        COMMITTED: ``version`` is current and pinned for the durable state; the old current
        version is retired (its own durable pin keeps it until the record is applied).
        """
        entry = self._keys[stored.key]
        entry.writing -= 1
        if not ok or version.seq <= entry.seq:
            self.placement.free(version.stored.extents)
            if entry.current is None and entry.writing == 0:
                del self._keys[stored.key]
            return Outcome.FAILED if not ok else Outcome.SUPERSEDED
        version.stored = stored
        old, entry.current, entry.seq = entry.current, version, version.seq
        version.pins += 1
        if old is not None:
            self.retire(old)
        return Outcome.COMMITTED

    def delete(self, key: str) -> None:
        """The key has no current version any more; its delete record must be queued.

        Raises:
            StoreKeyError: nothing is stored under ``key``.
        """
        version = self.current(key, "delete")
        entry = self._keys[key]
        entry.current = None
        entry.seq = next(self._seq)
        self.retire(version)
        if entry.writing == 0:
            del self._keys[key]

    def restore(self, versions: dict[str, Version]) -> list[tuple[str, Version | None]]:
        """Make ``versions`` (pinned by a snapshot, so never freed) the current versions
        of their keys and delete every other key; writes in flight of any key complete as
        superseded. Returns the changes whose one record must be queued (as for
        :meth:`finish_write` and :meth:`delete`)."""
        changes: list[tuple[str, Version | None]] = []
        for key, entry in list(self._keys.items()):
            if key in versions:
                continue
            if entry.current is not None:
                self.delete(key)
                changes.append((key, None))
            else:
                entry.seq = next(self._seq)
        for key, version in versions.items():
            entry = self._keys.setdefault(key, _Key())
            entry.seq = next(self._seq)
            if entry.current is version:
                continue
            old, entry.current = entry.current, version
            version.retired = False
            version.pins += 1  # the durable state's, as for a committed write
            if old is not None:
                self.retire(old)
            changes.append((key, version))
        return changes

    # -- pins ---------------------------------------------------------------------------

    def pin(self, version: Version) -> None:
        version.pins += 1

    def unpin(self, version: Version) -> None:
        version.pins -= 1
        if version.retired and version.pins == 0:
            self.placement.free(version.stored.extents)

    def retire(self, version: Version) -> None:
        version.retired = True
        if version.pins == 0:
            self.placement.free(version.stored.extents)

    def apply_durable(self, changes: Iterable[tuple[str, Version | None]]) -> None:
        """These records (a put's version, or None for a delete) are durable, in order."""
        for key, version in changes:
            old = self._durable.pop(key, None) if version is None else self._durable.get(key)
            if version is not None:
                self._durable[key] = version
            if old is not None and old is not version:
                self.unpin(old)
