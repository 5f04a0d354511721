"""What the tier manager measures: bytes moved per tier pair, speed, stalls, read-ahead."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from swapper.manager.config import Kind, Tier
from tiers.units import format_size

__all__ = [
    "METADATA_KINDS",
    "ManagerStats",
    "StatsRecorder",
    "TierStats",
    "TransferStats",
    "background_work",
    "in_background_work",
]

#: The store's own files in :meth:`ManagerStats.nvme_written`, beside the tensor kinds.
METADATA_KINDS = ("journal", "manifest", "snapshot")

#: Per thread: whether its fetches' waits count as background stall (``background_work``).
_thread = threading.local()


@contextlib.contextmanager
def background_work() -> Iterator[None]:
    """Within the block, the calling thread's fetch waits are *background* stall: work
    that runs beside the training's own thread (an overlapped optimizer step,
    :mod:`swapper.step.deferred`), whose waits delay no forward or backward by
    themselves. They still count in ``stall_s`` (every fetch's wait, as always) and are
    also summed in ``background_stall_s``, so that ``stall_s - background_stall_s`` is the
    time the training's thread waited. Nests."""
    before = getattr(_thread, "background", False)
    _thread.background = True
    try:
        yield
    finally:
        _thread.background = before


def in_background_work() -> bool:
    """Whether the calling thread is inside :func:`background_work` (an overlapped
    optimizer's update thread)."""
    return bool(getattr(_thread, "background", False))


@dataclass(frozen=True)
class TransferStats:
    """Transfers from one tier to another.

    Attributes:
        nbytes: bytes moved by transfers that succeeded.
        count: transfers that succeeded.
        busy_s: seconds of wall time during which at least one such transfer was running
            (concurrent transfers count once, so ``gbps`` is the achieved throughput).
    """

    nbytes: int = 0
    count: int = 0
    busy_s: float = 0.0

    @property
    def gbps(self) -> float:
        """Achieved throughput in GB/s (10^9 bytes per second) while busy; 0 when idle."""
        return self.nbytes / self.busy_s / 1e9 if self.busy_s > 0 else 0.0

    @property
    def gib_per_s(self) -> float:
        """The same in GiB/s (2^30 bytes per second): the unit the summary line and the
        command-line tools print, beside sizes in KiB/MiB/GiB."""
        return self.nbytes / self.busy_s / 2**30 if self.busy_s > 0 else 0.0


@dataclass(frozen=True)
class TierStats:
    """Bytes of one tier: its budget's limit (None: unlimited), bytes held now, and the
    most held at once (None where not tracked: NVMe)."""

    limit_nbytes: int | None
    used_nbytes: int
    peak_nbytes: int | None


@dataclass(frozen=True)
class ManagerStats:
    """A snapshot of :meth:`~swapper.manager.TierManager.stats`.

    Attributes:
        transfers: (source tier, destination tier) → transfers; device↔NVMe transfers go
            through host memory and count as two hops.
        tiers: bytes per tier.
        stall_s: seconds ``fetch`` calls spent waiting for bytes that were not there yet.
        fetches: ``fetch`` calls that returned a tensor.
        prefetch_hits: fetches that found the tensor in the tier, or on its way there.
        prefetch_misses: fetches that had to start the transfer themselves.
        prefetch_dropped: read-ahead requests given up (window full, no room without
            evicting something needed sooner, or failed).
        prefetch_wasted: tensors read ahead and evicted again before any fetch.
        write_errors: writes to NVMe that failed.
        kind_nbytes: (kind, source tier, destination tier) → bytes moved by transfers
            that succeeded, split by what the tensors are (the same bytes as
            ``transfers``).
        background_stall_s: the part of ``stall_s`` waited by threads doing background
            work (:func:`background_work`: an overlapped optimizer step's update).
        metadata_written: the store's own metadata written since it opened, in bytes:
            ``"journal"``, ``"manifest"``, ``"snapshot"`` (snapshot files); see
            :meth:`nvme_written`.
    """

    transfers: Mapping[tuple[Tier, Tier], TransferStats]
    tiers: Mapping[Tier, TierStats]
    stall_s: float
    fetches: int
    prefetch_hits: int
    prefetch_misses: int
    prefetch_dropped: int
    prefetch_wasted: int
    write_errors: int
    kind_nbytes: Mapping[tuple[Kind, Tier, Tier], int] = field(
        default_factory=lambda: MappingProxyType({})
    )
    background_stall_s: float = 0.0
    metadata_written: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def nvme_written(self) -> dict[str, int]:
        """Bytes written to NVMe by kind: each tensor kind's value (``"param16"``,
        ``"grad16"``, ``"optim_state"``, ``"grad32"``: bytes of the writes that completed)
        and the store's metadata (``"journal"``, ``"manifest"``, ``"snapshot"``); every
        key present, zeros included. Their sum is :attr:`nvme_written_nbytes`."""
        out = {kind.value: 0 for kind in Kind}
        for (kind, _, dst), nbytes in self.kind_nbytes.items():
            if dst is Tier.NVME:
                out[kind.value] += nbytes
        for name in METADATA_KINDS:
            out[name] = self.metadata_written.get(name, 0)
        return out

    @property
    def nvme_written_nbytes(self) -> int:
        """Every byte written to NVMe: tensors of every kind and the store's metadata."""
        return sum(self.nvme_written().values())

    @property
    def foreground_stall_s(self) -> float:
        """Seconds fetches waited outside background work (``stall_s`` less
        ``background_stall_s``): the waits of the training's own thread."""
        return self.stall_s - self.background_stall_s

    def moved_nbytes(self, kind: Kind, src: Tier, dst: Tier) -> int:
        """Bytes of tensors of ``kind`` moved from ``src`` to ``dst`` (0 when none)."""
        return self.kind_nbytes.get((kind, src, dst), 0)

    def moved(self, src: Tier, dst: Tier) -> TransferStats:
        """Transfers from ``src`` to ``dst`` (zeros when there were none)."""
        return self.transfers.get((src, dst), TransferStats())

    def summary(self) -> str:
        """One line for logs, sizes as :func:`tiers.units.format_size` writes them:
        ``fetches 12, hits 10, misses 2, stall 0.010 s, host->nvme 21 MiB at 0.11 GiB/s,
        host peak 4 MiB``."""
        moved = " ".join(
            f"{s.value}->{d.value} {format_size(t.nbytes)} at {t.gib_per_s:.2f} GiB/s,"
            for (s, d), t in sorted(self.transfers.items(), key=lambda kv: kv[0])
            if t.count
        )
        peaks = " ".join(
            f"{tier.value} peak {format_size(t.peak_nbytes)},"
            for tier, t in self.tiers.items()
            if t.peak_nbytes is not None
        )
        return (
            f"fetches {self.fetches}, hits {self.prefetch_hits}, misses "
            f"{self.prefetch_misses}, stall {self.stall_s:.3f} s, {moved or 'nothing moved,'} "
            f"{peaks}"
        ).rstrip(", ")


@dataclass
class _Meter:
    nbytes: int = 0
    count: int = 0
    busy_s: float = 0.0
    active: int = 0
    since: float = 0.0


@dataclass
class StatsRecorder:
    """Thread-safe counters behind :class:`ManagerStats` (its own lock: cheap to update
    from I/O completion callbacks)."""

    _lock: threading.Lock = field(default_factory=threading.Lock)
    _meters: dict[tuple[Tier, Tier], _Meter] = field(default_factory=dict)
    _kind_nbytes: dict[tuple[Kind, Tier, Tier], int] = field(default_factory=dict)
    stall_s: float = 0.0
    fetches: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    prefetch_dropped: int = 0
    prefetch_wasted: int = 0
    write_errors: int = 0
    background_stall_s: float = 0.0

    def begin(self, src: Tier, dst: Tier) -> None:
        """A transfer from ``src`` to ``dst`` starts; pair with :meth:`end`."""
        with self._lock:
            meter = self._meters.setdefault((src, dst), _Meter())
            if meter.active == 0:
                meter.since = time.monotonic()
            meter.active += 1

    def end(self, src: Tier, dst: Tier, nbytes: int | None, kind: Kind | None = None) -> None:
        """The transfer ended: moved ``nbytes`` bytes of ``kind``, or failed (None)."""
        with self._lock:
            meter = self._meters[(src, dst)]
            meter.active -= 1
            if meter.active == 0:
                meter.busy_s += time.monotonic() - meter.since
            if nbytes is not None:
                meter.nbytes += nbytes
                meter.count += 1
                if kind is not None:
                    by_kind = (kind, src, dst)
                    self._kind_nbytes[by_kind] = self._kind_nbytes.get(by_kind, 0) + nbytes

    @contextlib.contextmanager
    def transfer(
        self, src: Tier, dst: Tier, nbytes: int, kind: Kind | None = None
    ) -> Iterator[None]:
        """Time a transfer done within the block; it counts only if the block succeeds."""
        self.begin(src, dst)
        ok = False
        try:
            yield
            ok = True
        finally:
            self.end(src, dst, nbytes if ok else None, kind)

    def hit(self, count: int = 1) -> None:
        """``count`` fetches that found their tensors in place: each one fetch, one
        read-ahead hit, no stall (what ``add(fetches=count, prefetch_hits=count)`` counts,
        without its keyword loop)."""
        with self._lock:
            self.fetches += count
            self.prefetch_hits += count

    def add(self, **counts: float) -> None:
        """Add to the named counters (``stall_s=0.2, prefetch_hits=1``); a stall added by
        a thread in :func:`background_work` also counts as background stall."""
        background = getattr(_thread, "background", False)
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)
            if background and "stall_s" in counts:
                self.background_stall_s += counts["stall_s"]

    def snapshot(
        self, tiers: Mapping[Tier, TierStats], metadata: Mapping[str, int] | None = None
    ) -> ManagerStats:
        with self._lock:
            now = time.monotonic()
            transfers = {
                pair: TransferStats(
                    m.nbytes, m.count, m.busy_s + (now - m.since if m.active else 0.0)
                )
                for pair, m in self._meters.items()
            }
            return ManagerStats(
                transfers=MappingProxyType(transfers),
                tiers=MappingProxyType(dict(tiers)),
                stall_s=self.stall_s,
                fetches=self.fetches,
                prefetch_hits=self.prefetch_hits,
                prefetch_misses=self.prefetch_misses,
                prefetch_dropped=self.prefetch_dropped,
                prefetch_wasted=self.prefetch_wasted,
                write_errors=self.write_errors,
                kind_nbytes=MappingProxyType(dict(self._kind_nbytes)),
                background_stall_s=self.background_stall_s,
                metadata_written=MappingProxyType(dict(metadata or {})),
            )
