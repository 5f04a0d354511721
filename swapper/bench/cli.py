"""The ``swapper-bench`` command line: subcommands over one set of shared flags.

``swapper-bench [COMMAND] [options]``; COMMAND defaults to ``disk``. Every subcommand gets
the shared flags ``--dir``, ``--size`` and ``--json`` (:func:`~swapper.bench.args.common_parser`);
a new subcommand is one entry in :data:`COMMANDS`: its help line, a function adding its
flags (in :mod:`swapper.bench.args`) and the function running it, named as
``module:function`` and imported only when it runs, after the signal handlers are in
(the commands load torch).

Imports go one way: this module → :mod:`~swapper.bench.args` and the commands (by name);
the commands → :mod:`~swapper.bench.args` and :mod:`~swapper.bench.checks`, never here.

Exit codes (:func:`swapper.cli_args.run_tool`): 0 done; 1 the I/O or the library failed
(one line on stderr); 2 bad arguments (one line on stderr, no usage dump); 128 + signal
number when stopped by SIGINT, SIGTERM or SIGHUP (130, 143, 129), temporary files
removed either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Callable, Sequence

from swapper.bench.args import (
    PROG,
    add_disk_arguments,
    add_step_arguments,
    add_tiers_arguments,
    common_parser,
)
from swapper.cli_args import OneLineParser, run_tool
from swapper.interrupts import nothing_to_undo

__all__ = ["COMMANDS", "DEFAULT_COMMAND", "Command", "build_parser", "main"]


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: its help line, a function adding its flags, and where the function
    running it is (``"module:function"``, taking the parsed arguments and returning the
    exit code)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: str

    def runner(self) -> Callable[[argparse.Namespace], int]:
        """Import the running function (and with it torch; nothing is made yet, so a
        signal meanwhile ends the tool at once: :func:`swapper.interrupts.nothing_to_undo`)."""
        module, _, function = self.run.partition(":")
        with nothing_to_undo(PROG):
            return getattr(importlib.import_module(module), function)


COMMANDS: dict[str, Command] = {
    "disk": Command(
        help="write and read throughput of swap files (the default command)",
        add_arguments=add_disk_arguments,
        run="swapper.bench.disk_command:run_disk_command",
    ),
    "tiers": Command(
        help="evict and fetch tensors through the tier manager, beside the raw disk figure",
        add_arguments=add_tiers_arguments,
        run="swapper.bench.tiers_command:run_tiers_command",
    ),
    "step": Command(
        help="time optimizer steps over NVMe-resident state: I/O only, compute only, the "
        "pipeline, and (--legacy-grad-swap) fp32 gradients through the disk",
        add_arguments=add_step_arguments,
        run="swapper.bench.step_command:run_step_command",
    ),
}
DEFAULT_COMMAND = "disk"


def build_parser() -> OneLineParser:
    """The top-level parser with one subparser per entry of :data:`COMMANDS`."""
    parser = OneLineParser(
        prog=PROG,
        description="Measure disks for swapper, find the best I/O settings, emit a config. "
        f"COMMAND defaults to {DEFAULT_COMMAND!r}.",
        epilog=f"With no COMMAND, {DEFAULT_COMMAND!r} runs with the options given: "
        f"'{PROG} --size 4GiB' is '{PROG} {DEFAULT_COMMAND} --size 4GiB'. "
        f"See '{PROG} {DEFAULT_COMMAND} --help' for its options.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = common_parser()
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, parents=[common], help=command.help, description=command.help)
        command.add_arguments(p)
    return parser


def _with_default_command(argv: Sequence[str]) -> list[str]:
    """Insert the default subcommand when none is named (``swapper-bench --size 1GiB``)."""
    args = list(argv)
    if not args or (args[0].startswith("-") and args[0] not in ("-h", "--help")):
        return [DEFAULT_COMMAND, *args]
    return args


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(_with_default_command(argv))
    return int(COMMANDS[args.command].runner()(args))


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``swapper-bench`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code
    (see the module docstring)."""
    return run_tool(PROG, argv, _run, interrupted_note="; temporary files removed")
