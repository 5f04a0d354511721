"""Every flag of ``swapper-bench`` and its default, per subcommand.

The I/O flags (``--block-size``, ``--queue-depth``, ``--threads``, ``--backend``,
``--direct``) default to the ``SWAPPER_AIO_*`` variables where they are set, else to the
defaults here (:func:`swapper.cli_args.aio_environment`).

The flags live apart from the commands that use them: the parser is built (and
``--help`` answered) without importing torch, and the commands import this module, never
the command line (:mod:`swapper.bench.cli`) that dispatches to them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from swapper.cli_args import (
    OneLineParser,
    at_least_arg,
    count_arg,
    enum_arg,
    int_arg,
    list_arg,
    size_arg,
)
from tiers.config import AioConfig, Backend
from tiers.units import format_size

PROG = "swapper-bench"

# -- disk (DEFAULT_QUEUE_DEPTH and DEFAULT_THREADS are also tiers' defaults; the block size
# is not: 8 MiB measures the disk's ceiling, AioConfig's 1 MiB is what training uses)
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

# -- tiers
DEFAULT_TIERS_SIZE_NBYTES = 1 << 30
#: Untimed passes: the store writes a new version beside the old one and frees the old
#: one only when the new one is durable (nothing is lost if a write fails), so the first
#: two passes allocate fresh file space; from the third on it reuses freed extents, the
#: steady state of a training loop.
DEFAULT_TIERS_WARMUP = 2
DEFAULT_TENSOR_MIN_NBYTES = 4 << 20
DEFAULT_TENSOR_MAX_NBYTES = 64 << 20

# -- step
DEFAULT_PARAMS = 200_000_000
DEFAULT_SUB_GROUP = 25_000_000
DEFAULT_STEPS = 3
DEFAULT_STEP_WARMUP = 1
#: StepConfig.moments' compressed values (swapper.step.layout.MOMENTS; no torch here).
COMPRESSED_MOMENTS = ("bf16", "int8")


def moments_arg(text: str) -> str:
    """A compressed moments format for ``--moments``."""
    if text not in COMPRESSED_MOMENTS:
        raise argparse.ArgumentTypeError(
            f"unknown moments {text!r} (use {', '.join(COMPRESSED_MOMENTS)}; fp32 is the "
            "'step' pass, always run)"
        )
    return text


def readahead_arg(text: str) -> str:
    """A ``StepConfig.readahead`` value for ``--readahead``: an int >= 0 or ``auto``."""
    if text == "auto" or (text.isdigit() and text.isascii()):
        return text
    raise argparse.ArgumentTypeError(
        f"readahead {text!r} must be an int >= 0 (sub-groups read ahead) or 'auto'"
    )


backend_arg = enum_arg(Backend, "backend")


def common_parser() -> OneLineParser:
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
        type=list_arg(size_arg),
        metavar="SIZE[,SIZE...]",
        help="bytes per kernel request (default SWAPPER_AIO_BLOCK_SIZE, else "
        f"{format_size(DEFAULT_BLOCK_SIZE)}, the disk's ceiling here, larger than "
        f"the library's own default of {format_size(AioConfig().block_size)}: give "
        f"--block-size {format_size(AioConfig().block_size).replace(' ', '')} to measure "
        "what training uses; sweep: 1MiB,4MiB,8MiB)",
    )
    p.add_argument(
        "--queue-depth",
        type=list_arg(int_arg),
        metavar="N[,N...]",
        help="requests in flight per thread (default SWAPPER_AIO_QUEUE_DEPTH, else "
        f"{DEFAULT_QUEUE_DEPTH}; sweep: 8,32)",
    )
    p.add_argument(
        "--threads",
        type=list_arg(int_arg),
        metavar="N[,N...]",
        help=f"I/O threads (default SWAPPER_AIO_THREADS, else {DEFAULT_THREADS}; sweep: 1,2)",
    )
    p.add_argument(
        "--backend",
        type=list_arg(backend_arg),
        metavar="NAME[,NAME...]",
        help="auto, libaio, kernel or threads (default SWAPPER_AIO_BACKEND, else auto; "
        "sweep: libaio or kernel, and threads)",
    )
    p.add_argument(
        "--direct",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="O_DIRECT, bypassing the page cache (default: SWAPPER_AIO_DIRECT, else on)",
    )
    p.add_argument(
        "--loops",
        type=at_least_arg(1),
        metavar="N",
        help=f"timed passes per setting (default {DEFAULT_LOOPS}; sweep: 1)",
    )
    p.add_argument(
        "--warmup",
        type=at_least_arg(0),
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


def add_tiers_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``tiers`` (besides the shared --dir, --size, --json)."""
    p.add_argument("--tensor-min", type=size_arg, metavar="SIZE", help="default 4MiB")
    p.add_argument("--tensor-max", type=size_arg, metavar="SIZE", help="default 64MiB")
    p.add_argument(
        "--block-size",
        type=size_arg,
        metavar="SIZE",
        help="bytes per kernel request (default SWAPPER_AIO_BLOCK_SIZE, else "
        f"{format_size(DEFAULT_BLOCK_SIZE)})",
    )
    p.add_argument(
        "--queue-depth",
        type=at_least_arg(1),
        metavar="N",
        help=f"default SWAPPER_AIO_QUEUE_DEPTH, else {DEFAULT_QUEUE_DEPTH}",
    )
    p.add_argument(
        "--threads",
        type=at_least_arg(1),
        metavar="N",
        help=f"default SWAPPER_AIO_THREADS, else {DEFAULT_THREADS}",
    )
    p.add_argument(
        "--backend",
        type=backend_arg,
        metavar="NAME",
        help="auto, libaio, kernel or threads (default SWAPPER_AIO_BACKEND, else auto)",
    )
    p.add_argument(
        "--loops", type=at_least_arg(1), metavar="N", help=f"timed passes (default {DEFAULT_LOOPS})"
    )
    p.add_argument(
        "--warmup", type=at_least_arg(0), metavar="N", help=f"default {DEFAULT_TIERS_WARMUP}"
    )
    p.add_argument(
        "--checksum",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hash every tensor written, as the manager does by default (default: on)",
    )
    p.add_argument(
        "--verify",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check every chunk fetched against its digest, as the manager does by default "
        "(default: on; needs --checksum)",
    )
    p.add_argument("--seed", type=int, default=0, help="tensor sizes and contents (default 0)")


def add_step_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``step`` (besides the shared --dir and --json; --size is unused)."""
    p.add_argument("--params", type=count_arg, metavar="N", help="parameters (default 200M)")
    p.add_argument(
        "--sub-group", type=count_arg, metavar="N", help="elements per sub-group (default 25M)"
    )
    p.add_argument(
        "--steps", type=at_least_arg(1), metavar="N", help=f"timed rounds (default {DEFAULT_STEPS})"
    )
    p.add_argument(
        "--warmup", type=at_least_arg(0), metavar="N", help=f"default {DEFAULT_STEP_WARMUP}"
    )
    p.add_argument(
        "--host-budget",
        type=size_arg,
        metavar="SIZE",
        help="host (pinned) budget of each NVMe-backed optimizer; bounds the sub-groups in "
        "flight (default: 4 sub-groups' state)",
    )
    p.add_argument(
        "--moments",
        type=list_arg(moments_arg),
        default=[],
        metavar="LIST",
        help="also time steps with the Adam moments stored compressed: bf16, int8 or "
        "bf16,int8 (a pass step-<moments> each, alternating with the fp32 'step')",
    )
    p.add_argument(
        "--readahead",
        type=list_arg(readahead_arg),
        default=[],
        metavar="LIST",
        help="also time steps with these read-ahead windows (StepConfig.readahead: sub-groups "
        "read ahead, or auto), e.g. 1,2,3,auto (a pass step-ra<value> each, alternating with "
        "'step', whose window is the default)",
    )
    p.add_argument(
        "--legacy-grad-swap",
        action="store_true",
        help="also time steps that write fp32 gradients to NVMe and read them back "
        "(DeepSpeed ZeRO-Infinity's way)",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        metavar="NAME",
        help="the optimizer whose step is timed: adamw (OffloadAdamW, the fused kernel; the "
        "default) or a torch.optim one under OffloadOptimizer: sgd (momentum 0.9), adam, "
        "nadam, radam, adamax, adagrad, rmsprop, asgd, adafactor",
    )
    p.add_argument(
        "--no-io-only",
        action="store_true",
        help="leave out the io-only pass (a diagnostic; the floor is the disk's): one store "
        "of state on disk instead of two",
    )
    p.add_argument(
        "--compute-pass",
        choices=("auto", "full", "sampled"),
        default="auto",
        help="the compute-only pass (the floor's compute): full (all the state in memory), "
        "sampled (one sub-group in memory, its seconds times the sub-groups), or auto "
        "(sampled above 4 GiB of state; the default)",
    )
    p.add_argument("--seed", type=int, default=0, help="parameters and gradients (default 0)")
