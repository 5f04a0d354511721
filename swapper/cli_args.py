"""What the command-line tools (``swapper-bench``, ``swapper-pressure``) share: the run
around their ``main`` (signals, exit codes, one-line errors), argument types that keep
their messages, the ``SWAPPER_AIO_*`` settings, the units of their human output, and
output files written whole or not at all.

Units: what both tools print for people uses binary prefixes, always labelled —
sizes as :func:`tiers.units.format_size` writes them (``95.2 MiB``; re-exported here for
the tools, the one formatter of every size swapper prints), throughput in GiB/s
(:func:`gib_per_s`), times in seconds (``s``), fractions as percentages. ``--json`` keeps
its keys: bytes as integers, and ``gbps`` fields in GB/s (10^9 bytes), as they always were.

Exit codes of both tools: 0 done; 1 the I/O or the library failed (one line on stderr);
2 bad arguments (one line on stderr, no usage dump); 128 + signal number when stopped
by SIGINT, SIGTERM or SIGHUP (130, 143, 129), after removing the files the tool made.

Imports stay light (no torch): ``--help`` and bad arguments are answered without
loading it.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from swapper.interrupts import fired, interrupts_raise, settle
from tiers.config import AioConfig
from tiers.errors import SwapConfigError, SwapError
from tiers.units import format_size, parse_size

__all__ = [
    "OneLineParser",
    "UsageError",
    "aio_environment",
    "at_least_arg",
    "check_dirs",
    "check_output_path",
    "count_arg",
    "enum_arg",
    "finite_arg",
    "format_size",
    "gib_per_s",
    "int_arg",
    "list_arg",
    "one_line",
    "output_file",
    "run_tool",
    "size_arg",
    "table",
    "write_json",
]

E = TypeVar("E", bound=enum.Enum)
T = TypeVar("T")


class UsageError(Exception):
    """Bad command-line arguments: reported in one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are exceptions, so main() can print one line."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def run_tool(
    prog: str,
    argv: Sequence[str] | None,
    body: Callable[[list[str]], int],
    *,
    interrupted_note: str | Callable[[], str] = "",
) -> int:
    """Run a tool's ``body(arguments)`` with the exit codes of the module docstring.

    Within it SIGINT, SIGTERM and SIGHUP raise
    :class:`~swapper.interrupts.Interrupted` (installed here unless
    :mod:`swapper.console` did so for the whole process), which unwinds through
    ``body``'s cleanup; a later signal does not cut that short (see
    :mod:`swapper.interrupts`). ``--help`` (argparse's SystemExit) returns its code.

    Args:
        prog: the tool's name, which starts every line it prints on stderr.
        argv: the arguments (``None``: ``sys.argv[1:]``).
        body: parses the arguments and runs the tool; returns the exit code.
        interrupted_note: appended to the "interrupted" line, e.g. "; temporary files
            removed"; or a function giving it when the line is printed (what was removed
            and what kept can depend on the arguments the body has read).

    Returns:
        The exit code.
    """
    arguments = sys.argv[1:] if argv is None else list(argv)
    with interrupts_raise():
        try:
            return_code = body(arguments)
        except BaseException as exc:
            if fired() is not None:
                settle()  # first thing: from here on no signal raises again
            code = _exit_code(prog, exc, _note(interrupted_note))
            if code is None:
                raise
            return_code = code
        signum = fired()
        if signum is None:
            return return_code
        settle()  # (also when the body caught the Interrupted and returned)
        name = signal.Signals(signum).name
        print(f"{prog}: interrupted ({name}){_note(interrupted_note)}", file=sys.stderr)
        return 128 + signum


def _note(note: str | Callable[[], str]) -> str:
    return note if isinstance(note, str) else note()


def _exit_code(prog: str, exc: BaseException, interrupted_note: str) -> int | None:
    """The exit code for ``exc``, with its line printed; ``None`` for an exception none
    of the module docstring's (a bug: its traceback is wanted). After a signal, whatever
    the cleanup raised is left unsaid: the signal's line is printed instead."""
    if isinstance(exc, SystemExit):  # --help
        return exc.code if isinstance(exc.code, int) else 0
    if isinstance(exc, UsageError):
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    if fired() is not None:
        return 1
    if isinstance(exc, KeyboardInterrupt):  # raised by the code itself, not by a signal
        print(f"{prog}: interrupted{interrupted_note}", file=sys.stderr)
        return 130
    if isinstance(exc, (SwapError, OSError, MemoryError)):
        print(f"{prog}: error: {one_line(str(exc) or type(exc).__name__)}", file=sys.stderr)
        return 1
    return None


def check_dirs(dirs: Sequence[Path] | None) -> list[Path]:
    """The --dir values (the current directory if none), absolute; each must be an existing,
    writable directory. Checked before any work starts, so a typo costs nothing.

    Raises:
        UsageError: one is missing, not a directory, or not writable.
    """
    out = []
    for d in dirs or [Path(".")]:
        if not d.exists():
            raise UsageError(f"--dir {d}: no such directory")
        if not d.is_dir():
            raise UsageError(f"--dir {d}: not a directory")
        if not os.access(d, os.W_OK | os.X_OK):
            raise UsageError(f"--dir {d}: not writable")
        out.append(d.resolve())
    return out


def aio_environment() -> dict[str, Any]:
    """The I/O settings the ``SWAPPER_AIO_*`` variables set (AioConfig field → value as
    the config holds it, e.g. a :class:`~tiers.config.Backend`; a variable not set is
    absent), read by :meth:`AioConfig.env_values` and validated.

    Both tools take them over their own defaults, and their flags over them: with
    ``SWAPPER_AIO_BLOCK_SIZE=4MiB``, ``swapper-bench`` measures 4 MiB requests unless
    ``--block-size`` says otherwise, and ``swapper-pressure`` swaps with them.

    Raises:
        UsageError: a variable's value does not parse or validate (the message names the
            variable); checked before any work, like a bad flag.
    """
    try:
        config = AioConfig.from_env()  # validates what is set, naming the variable
        return {name: getattr(config, name) for name in AioConfig.env_values()}
    except SwapConfigError as exc:
        raise UsageError(f"environment: {exc}") from None


# ----------------------------------------------------------------------------------------
# Argument types: ArgumentTypeError keeps our message (argparse hides other errors').


def size_arg(text: str) -> int:
    """Bytes, with a binary or decimal suffix: ``8MiB``, ``1GB``, ``4096``."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


#: Seconds of each period a write rate may be given per ("1TB/day", "20GB/h").
_PERIOD_S = {"day": 86400.0, "d": 86400.0, "hour": 3600.0, "h": 3600.0, "s": 1.0}


def rate_per_day_arg(text: str) -> float:
    """A byte rate, as bytes per day: ``1TB/day``, ``20GB/h``, ``100MB/s`` (a size without
    a period is per day).

    Raises:
        argparse.ArgumentTypeError: not a size per period, or not > 0.
    """
    size, _, period = text.strip().partition("/")
    seconds = _PERIOD_S.get(period.strip().lower() or "day")
    if seconds is None:
        raise argparse.ArgumentTypeError(
            f"{text!r}: the period must be /day, /h or /s (e.g. 1TB/day)"
        )
    try:
        nbytes = parse_size(size.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if nbytes <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 bytes")
    return nbytes * 86400.0 / seconds


def count_arg(text: str) -> int:
    """A count with an optional decimal suffix: ``200M``, ``25M``, ``1.5G``, ``2.2B``, ``4096``.

    ``K``, ``M``, ``G`` (or ``B``, as in "a 7B model") and ``T`` are powers of 1000; the
    product is exact (``Fraction``), so ``2.17B`` is 2,170,000,000 with no float rounding.
    """
    text = text.strip()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9, "T": 10**12}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale != 1 else text
    try:
        # float first: it refuses what is not a number and lets inf/nan/1e400 be caught below.
        approx = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 200M, 2B)") from None
    if not math.isfinite(approx):
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number > 0")
    value = Fraction(number) * scale
    if value.denominator != 1 or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number > 0")
    return int(value)


def int_arg(text: str) -> int:
    """A whole number."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def finite_arg(text: str) -> float:
    """A finite number ``>= 0`` (a learning rate): ``1e-3``, ``0``; not ``inf``, ``nan``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def at_least_arg(minimum: int) -> Callable[[str], int]:
    """A whole number ``>= minimum``."""

    def parse(text: str) -> int:
        value = int_arg(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


def enum_arg(cls: type[E], what: str) -> Callable[[str], E]:
    """A member of the string enum ``cls`` by its value, any case; the error names
    ``what`` and every value (``unknown backend 'x' (use auto, libaio, ...)``)."""

    def parse(text: str) -> E:
        try:
            return cls(text.lower())
        except ValueError:
            names = ", ".join(str(member.value) for member in cls)
            raise argparse.ArgumentTypeError(f"unknown {what} {text!r} (use {names})") from None

    parse.__name__ = what
    return parse


def list_arg(parse: Callable[[str], T]) -> Callable[[str], list[T]]:
    """Comma-separated values, each read by ``parse``: ``1MiB,4MiB``."""

    def parse_list(text: str) -> list[T]:
        items = [t.strip() for t in text.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"empty item in list {text!r}")
        return [parse(t) for t in items]

    parse_list.__name__ = f"list of {getattr(parse, '__name__', 'values')}"
    return parse_list


# ----------------------------------------------------------------------------------------
# Output


def check_output_path(flag: str, path: Path | None) -> None:
    """An output file must be writable where asked: its directory exists and is writable
    (the file is written beside it first, then renamed: :func:`output_file`), and the
    path is not a directory. Checked before any work, not after a long run.

    Raises:
        UsageError: it is not.
    """
    if path is None:
        return
    parent = path.resolve().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {parent} does not exist")
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: directory {parent} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {path}: the file exists and is not writable")


#: Bytes in a GiB, and in the GB of ``--json``'s ``gbps`` fields.
GIB = 1 << 30
GB = 10**9


def gib_per_s(gbps: float) -> float:
    """A throughput in GB/s (10^9 bytes, the ``--json`` unit) as GiB/s (2^30 bytes)."""
    return gbps * GB / GIB


def one_line(text: object) -> str:
    """``text`` with every run of whitespace (newlines too) made one space: error messages
    print as one line."""
    return " ".join(str(text).split())


def table(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows of cells as aligned lines: the first column left, the others right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(cells))
        for cells in (list(zip(row, widths, strict=True)) for row in rows)
    ]


@contextlib.contextmanager
def output_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed to ``path`` when the block
    ends, removed if it raises (an interrupted tool leaves no half-written file)."""
    final = Path(path)
    # same suffix: writers that pick a format by it (matplotlib) pick the right one
    tmp = final.with_name(f".{final.stem}.tmp-{os.getpid()}{final.suffix}")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """``data`` as indented JSON, written whole or not at all (see :func:`output_file`)."""
    with output_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
