#!/usr/bin/env python3
"""Draw the plots of docs/benchmarks.md from the recorded figures in docs/results/*.json.

Each JSON file holds one measurement: ``title``, ``date``, ``machine``, ``command``,
``unit``, ``source`` (the dated lab note it comes from) and ``rows``. This script draws
one PNG per file that it knows how to plot, named after the file, and labels each with
its machine and date, so a plot never stands apart from where it was measured::

    python tools/plot_results.py                       # docs/results -> docs/img
    python tools/plot_results.py --results R --out O

Needs matplotlib (``pip install -e '.[plot]'``). Exit status 2 when it is missing or a
results file lacks a field the plot needs (the message names the file and the field).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

Record = dict[str, Any]


class ResultsError(Exception):
    """A results file cannot be plotted; the message names the file and what is wrong."""


def _field(record: Record, name: str, path: Path) -> Any:
    if name not in record:
        raise ResultsError(f"{path}: no field {name!r}; add it or remove the file")
    return record[name]


def _footer(fig: Any, record: Record, path: Path) -> None:
    """The machine, date and command under the plot: a figure is its machine's."""
    machine = _field(record, "machine", path)
    date = _field(record, "date", path)
    command = _field(record, "command", path)
    lines = textwrap.wrap(f"{date}, {machine}", 140) + textwrap.wrap(f"$ {command}", 140)
    fig.text(0.01, 0.01, "\n".join(lines), fontsize=6, va="bottom")


def _grouped(
    record: Record,
    path: Path,
    plt: Any,
    labels: list[str],
    columns: dict[str, str],
    title: str,
) -> tuple[Any, Any]:
    """Grouped bars: one group per row (``labels``), one bar per ``columns`` entry
    (legend text -> the row's field); the unit on the y axis, ``title`` above."""
    rows = _field(record, "rows", path)
    series = {name: [_field(r, key, path) for r in rows] for name, key in columns.items()}
    fig, ax = plt.subplots(figsize=(8, 4.6))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(labels)), labels)
    top = max(v for values in series.values() for v in values)
    ax.set_ylim(0, top * 1.35)  # room for the legend above the tallest bar
    ax.legend(fontsize=8, ncols=len(series), loc="upper center")
    ax.set_ylabel(_field(record, "unit", path))
    ax.set_title(title, fontsize=10)
    return fig, ax


def plot_disk_vs_fio(record: Record, path: Path, plt: Any) -> Any:
    rows = _field(record, "rows", path)
    labels = [f"{r['op']} {r['block_size']} qd{r['queue_depth']}" for r in rows]
    columns = {
        "fio, hugetlb buffers (its best here)": "fio_shmhuge",
        "fio, default buffers": "fio_malloc",
        "swapper-bench disk": "swapper",
    }
    fig, _ = _grouped(record, path, plt, labels, columns, "Disk throughput: swapper against fio")
    return fig


def plot_optimizer_step(record: Record, path: Path, plt: Any) -> Any:
    rows = _field(record, "rows", path)
    fig, ax = plt.subplots(figsize=(8, 4.6))
    labels = [r["pass"].replace(" (", "\n(") for r in rows]
    values = [r["seconds"] for r in rows]
    errors = [
        [v - r["min"] for v, r in zip(values, rows, strict=True)],
        [r["max"] - v for v, r in zip(values, rows, strict=True)],
    ]
    bars = ax.bar(labels, values, yerr=errors, capsize=4, color="tab:blue")
    bars[2].set_color("tab:green")
    ax.bar_label(bars, fmt="%.2f", fontsize=8, padding=6)
    ax.set_ylabel(_field(record, "unit", path))
    ax.set_title("Optimizer step at 200M: the step against its I/O and compute floors", fontsize=10)
    return fig


def plot_pressure_100m(record: Record, path: Path, plt: Any) -> Any:
    rows = _field(record, "rows", path)
    labels = [f"{r['tokens']} tokens\n{r['step']} step" for r in rows]
    columns = {
        "budgeted (NVMe)": "budgeted",
        "unlimited budgets": "unlimited",
        "plain PyTorch": "plain",
    }
    title = "Training a 100M GPT under budgets, against in-memory runs"
    fig, ax = _grouped(record, path, plt, labels, columns, title)
    for x, r in enumerate(rows):
        stall = _field(r, "stall_fraction", path)
        ax.annotate(f"stall {100 * stall:.1f} %", (x, 2.0), ha="center", fontsize=7, color="white")
    return fig


def plot_step_vs_size(record: Record, path: Path, plt: Any) -> Any:
    rows = _field(record, "rows", path)
    fig, ax = plt.subplots(figsize=(8, 4.6))
    styles = {"step": "o-", "io_only": "s--", "compute_only": "^:"}
    names = {"step": "step (state on NVMe)", "io_only": "io-only", "compute_only": "compute-only"}
    for run in sorted({_field(r, "pass", path) for r in rows}):
        mine = sorted((r for r in rows if r["pass"] == run), key=lambda r: r["params"])
        millions = [_field(r, "params", path) / 1e6 for r in mine]
        for key, style in styles.items():
            color = {"step": "tab:green", "io_only": "tab:blue", "compute_only": "tab:orange"}[key]
            values = [_field(r, key, path) for r in mine]
            label = f"{names[key]}, pass {run}"
            alpha = 1.0 if run == 1 else 0.5  # the second pass fainter
            ax.plot(millions, values, style, color=color, alpha=alpha, label=label)
    ax.set_xlabel("parameters, millions (bf16; 12 B of fp32 state per parameter, 8 sub-groups)")
    ax.set_ylabel(_field(record, "unit", path))
    ax.set_title("Optimizer step against model size, beside its I/O and compute", fontsize=10)
    ax.legend(fontsize=7, ncols=2)
    return fig


PLOTS: dict[str, Callable[[Record, Path, Any], Any]] = {
    "disk_vs_fio": plot_disk_vs_fio,
    "optimizer_step": plot_optimizer_step,
    "pressure_100m": plot_pressure_100m,
    "step_vs_size": plot_step_vs_size,
}


def draw(results: Path, out: Path) -> list[Path]:
    """Draw every known plot from ``results`` into ``out``; return the files written.

    Raises:
        ResultsError: a results file is not valid JSON or lacks a field its plot needs.
        ModuleNotFoundError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, plot in PLOTS.items():
        path = results / f"{name}.json"
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ResultsError(f"{path}: cannot read it ({exc})") from exc
        fig = plot(record, path, plt)
        fig.subplots_adjust(bottom=0.26)
        _footer(fig, record, path)
        target = out / f"{name}.png"
        fig.savefig(target, dpi=110)
        plt.close(fig)
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = parser.parse_args(argv)
    try:
        for path in draw(args.results, args.out):
            print(f"wrote {path}")
    except ModuleNotFoundError as exc:
        print(f"plot_results: {exc}; install it with pip install -e '.[plot]'", file=sys.stderr)
        return 2
    except ResultsError as exc:
        print(f"plot_results: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
