"""The ``swapper-bench`` command line: subcommands over one set of shared flags.

``swapper-bench [COMMAND] [options]``; COMMAND defaults to ``disk``. Every subcommand gets
the shared flags ``--dir``, ``--size`` and ``--json`` from :func:`common_parser`; a new
subcommand is one entry in :data:`COMMANDS` (a function adding its flags, and one running
it).

Exit codes: 0 done; 1 the I/O or the library failed (one line on stderr); 2 bad
arguments (one line on stderr, no usage dump); 128 + signal number when interrupted
(130 for Ctrl-C, 143 for SIGTERM), temporary files removed either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from swapper.cli_args import OneLineParser, UsageError, one_line, size_arg
from swapper.interrupts import Interrupted, interrupts_raise
from tiers.aio import resolve_backend
from tiers.config import Backend
from tiers.errors import BackendUnavailableError, SwapError
from tiers.units import format_size

PROG = "swapper-bench"

DEFAULT_SIZE_NBYTES = 1 << 30
DEFAULT_BLOCK_SIZE = 8 << 20
DEFAULT_QUEUE_DEPTH = 32
DEFAULT_THREADS = 1
DEFAULT_LOOPS = 3
DEFAULT_WARMUP = 1
#: The --sweep grid when no list is given (like DeepSpeed's ds_nvme_tune, trimmed so
#: that 1 GiB finishes in well under 3 minutes on a ~2 GB/s disk): 3 x 2 x 2 x 2 points.
SWEEP_BLOCK_SIZES = (1 << 20, 4 << 20, 8 << 20)
SWEEP_QUEUE_DEPTHS = (8, 32)
SWEEP_THREADS = (1, 2)
PLOT_HINT = "pip install 'swapper[plot]'"


# ----------------------------------------------------------------------------------------
# Argument types: ArgumentTypeError keeps our message (argparse hides other errors').


def _list(text: str, parse: Callable[[str], Any]) -> list[Any]:
    items = [t.strip() for t in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"empty item in list {text!r}")
    return [parse(t) for t in items]


def _size_list(text: str) -> list[int]:
    return _list(text, size_arg)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def _int_list(text: str) -> list[int]:
    return _list(text, _int)


def _backend(text: str) -> Backend:
    try:
        return Backend(text.lower())
    except ValueError:
        names = ", ".join(b.value for b in Backend)
        raise argparse.ArgumentTypeError(f"unknown backend {text!r} (use {names})") from None


def _backend_list(text: str) -> list[Backend]:
    return _list(text, _backend)


def _at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = _int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


# ----------------------------------------------------------------------------------------
# Parser


def common_parser() -> argparse.ArgumentParser:
    """The flags every subcommand shares: --dir, --size, --json."""
    common = OneLineParser(add_help=False)
    group = common.add_argument_group("common options")
    group.add_argument(
        "--dir",
        dest="dirs",
        action="append",
        type=Path,
        metavar="DIR",
        help="directory to work in (repeat for several; the size is split evenly and all "
        "are driven at once); a private temporary directory is made inside and removed "
        "at exit (default: the current directory)",
    )
    group.add_argument(
        "--size",
        type=size_arg,
        metavar="SIZE",
        help="bytes to move per pass, e.g. 1GiB, 512MiB (disk default: 1GiB)",
    )
    group.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    return common


def add_disk_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``disk``. List-valued flags take comma-separated values."""
    p.add_argument("--op", choices=("read", "write", "both"), default="both", help="default: both")
    p.add_argument(
        "--block-size",
        type=_size_list,
        metavar="SIZE[,SIZE...]",
        help=f"bytes per kernel request (default {format_size(DEFAULT_BLOCK_SIZE)}; "
        "sweep: 1MiB,4MiB,8MiB)",
    )
    p.add_argument(
        "--queue-depth",
        type=_int_list,
        metavar="N[,N...]",
        help=f"requests in flight per thread (default {DEFAULT_QUEUE_DEPTH}; sweep: 8,32)",
    )
    p.add_argument(
        "--threads",
        type=_int_list,
        metavar="N[,N...]",
        help=f"I/O threads (default {DEFAULT_THREADS}; sweep: 1,2)",
    )
    p.add_argument(
        "--backend",
        type=_backend_list,
        metavar="NAME[,NAME...]",
        help="auto, libaio, kernel or threads (default auto; sweep: libaio or kernel, and threads)",
    )
    p.add_argument(
        "--direct",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="O_DIRECT, bypassing the page cache (default: on)",
    )
    p.add_argument(
        "--loops",
        type=_at_least(1),
        metavar="N",
        help=f"timed passes per setting (default {DEFAULT_LOOPS}; sweep: 1)",
    )
    p.add_argument(
        "--warmup",
        type=_at_least(0),
        metavar="N",
        help=f"untimed passes before them (default {DEFAULT_WARMUP}; sweep: 0)",
    )
    p.add_argument(
        "--baselines",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also measure the thread backend, buffered I/O and aiofiles "
        "(default: on, off with --sweep)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="try a grid of block size x queue depth x threads x backend and name the best",
    )
    p.add_argument(
        "--emit-config",
        type=Path,
        metavar="FILE",
        help="write the best setting as JSON (swapper and DeepSpeed 'aio' sections)",
    )
    p.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help=f"plot throughput vs block size and queue depth (needs {PLOT_HINT})",
    )


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: its help line, a function adding its flags, and one running it."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _run_disk(args: argparse.Namespace) -> int:
    from swapper.bench.disk_command import run_disk_command  # torch loads only now

    return run_disk_command(args)


def _add_tiers(p: argparse.ArgumentParser) -> None:
    from swapper.bench.tiers_command import add_tiers_arguments

    add_tiers_arguments(p)


def _run_tiers(args: argparse.Namespace) -> int:
    from swapper.bench.tiers_command import run_tiers_command

    return run_tiers_command(args)


def _add_step(p: argparse.ArgumentParser) -> None:
    from swapper.bench.step_command import add_step_arguments

    add_step_arguments(p)


def _run_step(args: argparse.Namespace) -> int:
    from swapper.bench.step_command import run_step_command

    return run_step_command(args)


COMMANDS: dict[str, Command] = {
    "disk": Command(
        help="write and read throughput of swap files (the default command)",
        add_arguments=add_disk_arguments,
        run=_run_disk,
    ),
    "tiers": Command(
        help="evict and fetch tensors through the tier manager, beside the raw disk figure",
        add_arguments=_add_tiers,
        run=_run_tiers,
    ),
    "step": Command(
        help="time optimizer steps over NVMe-resident state: I/O only, compute only, the "
        "pipeline, and (--legacy-grad-swap) fp32 gradients through the disk",
        add_arguments=_add_step,
        run=_run_step,
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
        p.set_defaults(run=command.run)
    return parser


def _with_default_command(argv: Sequence[str]) -> list[str]:
    """Insert the default subcommand when none is named (``swapper-bench --size 1GiB``)."""
    args = list(argv)
    if not args or (args[0].startswith("-") and args[0] not in ("-h", "--help")):
        return [DEFAULT_COMMAND, *args]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``swapper-bench``; returns the exit code (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        with interrupts_raise():
            try:
                args = build_parser().parse_args(_with_default_command(argv))
            except SystemExit as exc:  # --help
                return exc.code if isinstance(exc.code, int) else 0
            return int(args.run(args))
    except UsageError as exc:
        print(f"{PROG}: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"{PROG}: interrupted ({exc}); temporary files removed", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; temporary files removed", file=sys.stderr)
        return 130
    except (SwapError, OSError, MemoryError) as exc:
        print(f"{PROG}: error: {one_line(str(exc) or type(exc).__name__)}", file=sys.stderr)
        return 1


# ----------------------------------------------------------------------------------------
# Checks shared by subcommands


def check_dirs(dirs: Sequence[Path] | None) -> list[Path]:
    """The --dir values, absolute; each must be an existing, writable directory.

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


def check_free_space(dirs: Sequence[Path], file_nbytes: int) -> None:
    """Each directory must have room for its file.

    Raises:
        UsageError: one has not.
    """
    for d in dirs:
        free_nbytes = shutil.disk_usage(d).free
        if free_nbytes < file_nbytes:
            raise UsageError(
                f"--dir {d}: {format_size(free_nbytes)} free, the test file needs "
                f"{format_size(file_nbytes)}; use a smaller --size"
            )


def _meminfo_nbytes() -> dict[str, int]:
    """/proc/meminfo in bytes (page counts such as HugePages_Free stay counts)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    scale = 1024 if len(fields) > 1 and fields[1] == "kB" else 1
                    out[name] = int(fields[0]) * scale
    except OSError:
        pass
    return out


def check_memory(total_nbytes: int) -> None:
    """The host buffer must fit in memory: a buffer that is prefaulted beyond what is
    available would bring the OOM killer instead of an error message.

    Free reserved huge pages count too (they are not part of MemAvailable). Machines
    without /proc/meminfo are let through.

    Raises:
        UsageError: it does not fit.
    """
    info = _meminfo_nbytes()
    if "MemAvailable" not in info:
        return
    huge_free = info.get("HugePages_Free", 0) * info.get("Hugepagesize", 0)
    room = max(int(info["MemAvailable"] * 0.9), huge_free)
    if total_nbytes > room:
        raise UsageError(
            f"--size {format_size(total_nbytes)} needs a host buffer that large, but only "
            f"about {format_size(room)} of memory is available; use a smaller --size"
        )


def check_output_path(flag: str, path: Path | None) -> None:
    """An output file's directory must exist.

    Raises:
        UsageError: it does not.
    """
    if path is not None and not path.resolve().parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {path.resolve().parent} does not exist")


def filesystem_type(path: Path) -> str:
    """The filesystem type of ``path`` from /proc/self/mountinfo ("?" if unknown)."""
    best_mount, best_type = "", "?"
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return best_type
    target = str(path)
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = fields[4].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best_mount):
            best_mount, best_type = mount, right.split()[0]
    return best_type


# ----------------------------------------------------------------------------------------
# Grid


def check_backends(backends: Sequence[Backend]) -> list[Backend]:
    """Resolve AUTO and check each backend can run here; duplicates dropped.

    Raises:
        UsageError: a named backend is unavailable.
    """
    out: list[Backend] = []
    for b in backends:
        try:
            resolved = resolve_backend(b)[0]
        except BackendUnavailableError as exc:
            raise UsageError(str(exc)) from None
        if resolved not in out:
            out.append(resolved)
    return out


def default_sweep_backends() -> list[Backend]:
    """Native AIO (libaio, else kernel) where available, and the thread backend."""
    native = resolve_backend(Backend.AUTO)[0]
    return [native, Backend.THREADS] if native is not Backend.THREADS else [Backend.THREADS]
