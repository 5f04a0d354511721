"""Presenting measurements: the table, the best settings, JSON, the emitted config, a plot.

Units (:mod:`swapper.cli_args`): what is printed for people (the table, the best
settings, the plot) gives throughput in GiB/s (2^30 bytes) and CPU time in seconds per
GiB; ``--json`` keeps its ``gbps`` fields in GB/s (10^9 bytes, as fio and disk vendors
count), the keys they always had.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

from swapper.bench.disk import ENGINE_SWAPPER, Measurement
from swapper.cli_args import GB, GIB, gib_per_s, output_file, write_json
from tiers.config import AioConfig
from tiers.units import format_size

_COLUMNS = (
    "op",
    "engine",
    "backend",
    "io",
    "bs",
    "qd",
    "thr",
    "GiB/s",
    "min-max",
    "CPU s/GiB",
    "cache",
)


def _row(m: Measurement) -> tuple[str, ...]:
    s = m.setting
    return (
        m.op,
        s.engine,
        m.backend,
        "direct" if m.direct else "buffered",
        format_size(s.block_size),
        str(s.queue_depth),
        str(s.threads),
        f"{gib_per_s(m.gbps):.2f}",
        f"{gib_per_s(m.gbps_min):.2f}-{gib_per_s(m.gbps_max):.2f}",
        f"{m.cpu_seconds_per_gb * GIB / GB:.3f}",
        m.cache,
    )


def format_table(measurements: Sequence[Measurement]) -> str:
    """An aligned text table, one row per measurement, with a units footnote."""
    rows = [_COLUMNS, *(_row(m) for m in measurements)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
    numeric = {"bs", "qd", "thr", "GiB/s", "min-max", "CPU s/GiB"}
    lines = []
    for r in rows:
        cells = [
            cell.rjust(w) if name in numeric else cell.ljust(w)
            for cell, w, name in zip(r, widths, _COLUMNS, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    lines.append(
        "GiB/s: median of the timed passes, GiB = 2^30 bytes; min-max over the passes. "
        "Writes are timed up to fsync. (--json: gbps in GB/s, GB = 10^9 bytes.)"
    )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Best settings


@dataclasses.dataclass(frozen=True)
class Choice:
    """A swapper engine setting and its measured throughput."""

    backend: str
    direct: bool
    block_size: int
    queue_depth: int
    threads: int
    read_gbps: float | None
    write_gbps: float | None

    @property
    def score(self) -> float:
        """Harmonic mean of read and write GB/s (or the one measured).

        The harmonic mean is the throughput of moving equal bytes each way, so a setting
        fast one way and slow the other cannot win.
        """
        measured = [g for g in (self.read_gbps, self.write_gbps) if g is not None]
        return len(measured) / sum(1 / g for g in measured)

    def describe(self) -> str:
        io = "O_DIRECT" if self.direct else "buffered"
        figures = ", ".join(
            f"{op} {gib_per_s(g):.2f} GiB/s"
            for op, g in (("read", self.read_gbps), ("write", self.write_gbps))
            if g is not None
        )
        return (
            f"{self.backend} {io} bs {format_size(self.block_size)} qd {self.queue_depth} "
            f"threads {self.threads} ({figures})"
        )

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "score_gbps": self.score}


def choices(measurements: Sequence[Measurement]) -> list[Choice]:
    """Swapper engine settings with their read and write figures paired up."""
    by_key: dict[tuple[str, bool, int, int, int], dict[str, float]] = {}
    for m in measurements:
        if m.setting.engine != ENGINE_SWAPPER:
            continue  # aiofiles is not a setting swapper can use
        s = m.setting
        key = (m.backend, m.direct, s.block_size, s.queue_depth, s.threads)
        by_key.setdefault(key, {})[m.op] = m.gbps
    return [Choice(*key, ops.get("read"), ops.get("write")) for key, ops in by_key.items()]


def best_settings(measurements: Sequence[Measurement]) -> dict[str, Choice]:
    """The best swapper setting for ``read``, for ``write`` and for ``both``.

    ``both`` (the one ``--emit-config`` writes) maximizes :attr:`Choice.score`, the
    harmonic mean of read and write GB/s, among settings measured both ways; when only
    one direction was measured it is that direction's best.
    """
    options = choices(measurements)
    best: dict[str, Choice] = {}
    reads = [c for c in options if c.read_gbps is not None]
    writes = [c for c in options if c.write_gbps is not None]
    if reads:
        best["read"] = max(reads, key=lambda c: c.read_gbps or 0.0)
    if writes:
        best["write"] = max(writes, key=lambda c: c.write_gbps or 0.0)
    pairs = [c for c in options if c.read_gbps is not None and c.write_gbps is not None]
    candidates = pairs or options
    if candidates:
        best["both"] = max(candidates, key=lambda c: c.score)
    return best


#: Settings closer than this to the best are reported as ties: single passes on a shared
#: virtual disk vary by several percent from run to run.
NOISE_FRACTION = 0.05


def _near_best(
    options: Sequence[Choice], best: Choice, gbps: Callable[[Choice], float | None]
) -> int:
    """How many other settings come within NOISE_FRACTION of ``best`` by ``gbps``."""
    top = gbps(best) or 0.0
    figures = [gbps(c) for c in options if c != best]
    return sum(1 for g in figures if g is not None and g >= top * (1 - NOISE_FRACTION))


def format_best(best: dict[str, Choice], options: Sequence[Choice] = ()) -> str:
    """Lines naming the best read, write and overall settings, and how many tie with it."""
    names = {
        "read": "best read ",
        "write": "best write",
        "both": "best both (harmonic mean of read and write)",
    }
    measures: dict[str, Callable[[Choice], float | None]] = {
        "read": lambda c: c.read_gbps,
        "write": lambda c: c.write_gbps,
        "both": lambda c: c.score,
    }
    lines = []
    for key, choice in best.items():
        if key == "both" and (choice.read_gbps is None or choice.write_gbps is None):
            continue  # one direction measured: "both" would repeat its best
        line = f"{names[key]}: {choice.describe()}"
        ties = _near_best(options, choice, measures[key])
        if ties:
            line += f" [+{ties} within {NOISE_FRACTION:.0%}: a tie; more --loops to separate]"
        lines.append(line)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Files


def write_results(
    path: str | os.PathLike[str],
    measurements: Sequence[Measurement],
    best: dict[str, Choice] | None,
    meta: dict[str, Any],
) -> None:
    """``--json``: ``{"results": [...], "best": {...} (sweeps), "meta": {...}}``."""
    data: dict[str, Any] = {"results": [m.to_record() for m in measurements]}
    if best is not None:
        data["best"] = {k: c.to_json() for k, c in best.items()}
    data["meta"] = meta
    write_json(path, data)


def emitted_config(choice: Choice, single_submit: bool = AioConfig.single_submit) -> dict[str, Any]:
    """The ``--emit-config`` document: swapper's ``aio`` section and DeepSpeed's.

    Current DeepSpeed reads the thread count from ``intra_op_parallelism`` (older releases
    called it ``thread_count``, which current ones ignore);
    ``single_submit`` is the one measured: swapper's default (one request per
    ``io_submit``, measured faster on virtio disks: see :class:`tiers.AioConfig`) unless
    ``SWAPPER_AIO_SINGLE_SUBMIT`` said otherwise; ``overlap_events`` and
    ``use_gds`` are DeepSpeed's defaults. ``measured`` records
    the figures the choice was made on; loaders ignore it.
    """
    return {
        "swapper": {
            "aio": {
                "backend": choice.backend,
                "block_size": choice.block_size,
                "queue_depth": choice.queue_depth,
                "num_threads": choice.threads,
                "direct": choice.direct,
                "single_submit": single_submit,
            }
        },
        "deepspeed": {
            "aio": {
                "block_size": choice.block_size,
                "queue_depth": choice.queue_depth,
                "intra_op_parallelism": choice.threads,
                "single_submit": single_submit,
                "overlap_events": True,
                "use_gds": False,
            }
        },
        "measured": choice.to_json(),
    }


def write_config(
    path: str | os.PathLike[str], choice: Choice, single_submit: bool = AioConfig.single_submit
) -> None:
    """Write :func:`emitted_config` to ``path``."""
    write_json(path, emitted_config(choice, single_submit))


# ----------------------------------------------------------------------------------------
# Plot


def check_plotting() -> None:
    """Import matplotlib now, so that a missing one fails before the run, not after.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed


def _line_order(m: Measurement) -> tuple[Any, ...]:
    """Legend order: backend, io, then queue depth and threads as numbers."""
    return (m.setting.engine, m.backend, not m.direct, m.setting.queue_depth, m.setting.threads)


def write_plot(path: str | os.PathLike[str], measurements: Sequence[Measurement]) -> None:
    """Throughput vs block size, one line per (backend, io, queue depth, threads).

    One panel per operation; the x axis is logarithmic in the block size.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in ("write", "read") if any(m.op == op for m in measurements)]
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.5), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        lines: dict[str, list[Measurement]] = {}
        for m in measurements:
            if m.op != op:
                continue
            io = "direct" if m.direct else "buffered"
            s = m.setting
            name = f"{m.backend} {io} qd{s.queue_depth} t{s.threads}"
            lines.setdefault(name, []).append(m)
        for name, points in sorted(lines.items(), key=lambda item: _line_order(item[1][0])):
            points.sort(key=lambda m: m.setting.block_size)
            xs = [m.setting.block_size / 2**20 for m in points]
            ys = [gib_per_s(m.gbps) for m in points]
            errs = [
                [gib_per_s(m.gbps - m.gbps_min) for m in points],
                [gib_per_s(m.gbps_max - m.gbps) for m in points],
            ]
            ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=name)
        ax.set_xscale("log", base=2)
        sizes = sorted({m.setting.block_size for m in measurements if m.op == op})
        ax.set_xticks([b / 2**20 for b in sizes], [format_size(b) for b in sizes])
        ax.minorticks_off()
        ax.set_xlabel("block size")
        ax.set_ylabel("GiB/s (2^30 bytes/s), median")
        ax.set_title(op)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("swapper-bench disk")
    fig.tight_layout()
    try:
        with output_file(path) as tmp:
            fig.savefig(tmp, dpi=100)
    finally:
        plt.close(fig)
