"""``swapper-bench``: measure a disk, find the best I/O settings, emit a config.

Run ``swapper-bench --help``; the subcommands are listed in :data:`cli.COMMANDS`
(``disk`` is the default). :func:`main` takes an argument list and returns the exit code.
"""

from swapper.bench.cli import main

__all__ = ["main"]
