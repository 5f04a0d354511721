"""Console-script entry points: signal handling first, then the tool.

``swapper-bench`` and ``swapper-pressure`` start here. Their signal handlers go in before
anything heavy is imported (torch takes about two seconds to import here): a SIGINT,
SIGTERM or SIGHUP at any moment, importing included, ends the tool with exit code 128 +
the signal number, one line on stderr, and the tool's files removed as the exception
unwinds (:mod:`swapper.interrupts`). Only the standard library is imported at the top.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from swapper.interrupts import Interrupted, ignore_further, install

__all__ = ["bench", "pressure"]


def _run(prog: str, load: Callable[[], Callable[[], int]]) -> int:
    install()
    try:
        main = load()
        return main()
    except Interrupted as exc:
        print(f"{prog}: interrupted by {exc}; its files removed", file=sys.stderr)
        return exc.exit_code
    finally:
        # Exiting now: a late signal must not kill the interpreter on its way out and
        # change the exit status.
        ignore_further()


def _bench_main() -> Callable[[], int]:
    from swapper.bench.cli import main

    return main


def _pressure_main() -> Callable[[], int]:
    from swapper.pressure.cli import main

    return main


def bench() -> None:
    """``swapper-bench``."""
    sys.exit(_run("swapper-bench", _bench_main))


def pressure() -> None:
    """``swapper-pressure``."""
    sys.exit(_run("swapper-pressure", _pressure_main))
