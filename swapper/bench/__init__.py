"""``swapper-bench``: measure a disk, find the best I/O settings, emit a config.

Run ``swapper-bench --help``; the subcommands are listed in :data:`cli.COMMANDS`
(``disk`` is the default). :func:`main` takes an argument list and returns the exit code.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """:func:`swapper.bench.cli.main`, imported when called: ``python -m swapper.bench``
    imports this package before its signal handlers go in (:mod:`swapper.console`)."""
    from swapper.bench.cli import main as cli_main

    return cli_main(argv)
