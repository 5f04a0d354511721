"""Console-script entry points: signal handling first, then the tool.

``swapper-bench`` and ``swapper-pressure`` (and ``python -m swapper.bench`` /
``python -m swapper.pressure``) start here. Their signal handlers go in before anything
heavy is imported (torch takes seconds to import): a SIGINT, SIGTERM or SIGHUP at any
moment, importing included, ends the tool with exit code 128 + the signal number, one
line on stderr, and the tool's files removed as the exception unwinds
(:mod:`swapper.interrupts`). Only the standard library and :mod:`swapper.interrupts` are
imported at the top (``import swapper`` itself is lazy).

After a signal, once the tool's cleanup has run, the process ends with ``os._exit``:
nothing that is left (an I/O thread stuck in the kernel, a thread pool the interrupted
code did not shut down) can hold the exit back, and stdout and stderr are flushed first.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable

from swapper.interrupts import Interrupted, fired, ignore_further, install, settle

__all__ = ["bench", "pressure"]


def _run(prog: str, load: Callable[[], Callable[[], int]]) -> int:
    install()
    try:
        code = load()()
    except Interrupted as exc:  # while importing: the tool's own main is not running yet
        settle()
        print(f"{prog}: interrupted ({exc})", file=sys.stderr)
        code = exc.exit_code
    finally:
        # Exiting now: a late signal must not kill the interpreter on its way out and
        # change the exit status.
        ignore_further()
    if fired() is not None:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process with ``code`` without waiting for threads (see the module
    docstring)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # closed, or a broken pipe
            stream.flush()
    os._exit(code)


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
