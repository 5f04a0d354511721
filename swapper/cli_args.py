"""What the command-line tools (``swapper-bench``, ``swapper-pressure``) share: one-line
usage errors and argument types that keep their messages."""

from __future__ import annotations

import argparse
from typing import NoReturn

from tiers.units import parse_size

__all__ = ["OneLineParser", "UsageError", "count_arg", "one_line", "size_arg", "table"]


class UsageError(Exception):
    """Bad command-line arguments: reported in one line, exit code 2."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are exceptions, so main() can print one line."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


# ArgumentTypeError keeps our message (argparse hides other errors').


def size_arg(text: str) -> int:
    """Bytes, with a binary or decimal suffix: ``8MiB``, ``1GB``, ``4096``."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def count_arg(text: str) -> int:
    """A count with an optional decimal suffix: ``200M``, ``25M``, ``1.5G``, ``4096``."""
    text = text.strip()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:].upper(), 1)
    number = text[:-1] if scale != 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count (e.g. 200M)") from None
    if value != int(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number > 0")
    return int(value)


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
