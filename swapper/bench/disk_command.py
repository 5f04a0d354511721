"""``swapper-bench disk`` from arguments to output: check, plan, run, report.

Everything that can be wrong with the arguments is found before a file is made
(:class:`~swapper.cli_args.UsageError`, exit 2); the run itself only fails on I/O.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import swapper
from swapper.bench import report
from swapper.bench.args import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LOOPS,
    DEFAULT_QUEUE_DEPTH,
    DEFAULT_SIZE_NBYTES,
    DEFAULT_THREADS,
    DEFAULT_WARMUP,
    PLOT_HINT,
    PROG,
    SWEEP_BLOCK_SIZES,
    SWEEP_QUEUE_DEPTHS,
    SWEEP_THREADS,
)
from swapper.bench.checks import (
    check_backends,
    check_dirs,
    check_free_space,
    check_memory,
    default_sweep_backends,
    filesystem_type,
)
from swapper.bench.disk import (
    ENGINE_SWAPPER,
    DiskPlan,
    DiskRun,
    Measurement,
    Setting,
    baseline_settings,
    run_disk,
    split_nbytes,
)
from swapper.cli_args import UsageError, aio_environment, check_output_path, gib_per_s
from swapper.progress import Progress
from tiers.config import DIRECT_ALIGNMENT, AioConfig, Backend
from tiers.errors import SwapConfigError
from tiers.units import format_size

COMMAND = "disk"
_FLAGS = {"block_size": "--block-size", "queue_depth": "--queue-depth", "num_threads": "--threads"}


def _check_engine_values(
    block_sizes: list[int], queue_depths: list[int], threads: list[int]
) -> None:
    """Each value must make a valid AioConfig; the message names the flag.

    Raises:
        UsageError: one does not.
    """
    for b, q, t in itertools.product(block_sizes, queue_depths, threads):
        try:
            AioConfig(block_size=b, queue_depth=q, num_threads=t)
        except SwapConfigError as exc:
            message = str(exc)
            for field, flag in _FLAGS.items():
                message = message.replace(f"{field}=", f"{flag} ")
            raise UsageError(message) from None


def _block_sizes(
    args: argparse.Namespace, env: dict[str, Any], file_nbytes: int, ndirs: int
) -> list[int]:
    """Block sizes to try: --block-size, else SWAPPER_AIO_BLOCK_SIZE, else the defaults.
    Defaults larger than the file shrink to it; given ones must fit.

    Raises:
        UsageError: a given block size is larger than a file.
    """
    given, flag = args.block_size, "--block-size"
    if given is None and "block_size" in env:
        given, flag = [env["block_size"]], "SWAPPER_AIO_BLOCK_SIZE"
    if given is None:
        defaults = SWEEP_BLOCK_SIZES if args.sweep else (DEFAULT_BLOCK_SIZE,)
        fitting = [b for b in defaults if b <= file_nbytes]
        return fitting or [file_nbytes]
    for b in given:
        if b > file_nbytes:
            per = f" per file over {ndirs} dirs" if ndirs > 1 else ""
            raise UsageError(
                f"--size gives {format_size(file_nbytes)}{per}, smaller than "
                f"{flag} {format_size(b)}"
            )
    return list(dict.fromkeys(given))


def _unique(values: Sequence[int]) -> list[int]:
    """``values`` without repeats, in order."""
    return list(dict.fromkeys(values))


def _backends(args: argparse.Namespace, env: dict[str, Any]) -> list[Backend]:
    if args.backend is not None:
        return check_backends(args.backend)
    if "backend" in env:
        return check_backends([env["backend"]])
    if args.sweep:
        return default_sweep_backends()
    return check_backends([Backend.AUTO])


def _grid(
    args: argparse.Namespace, env: dict[str, Any], file_nbytes: int, ndirs: int
) -> list[Setting]:
    """The swapper engine settings to measure: the product of the lists. Each list is
    its flag's values, else the ``SWAPPER_AIO_*`` variable's one value (``env``, see
    :func:`~swapper.cli_args.aio_environment`), else the defaults (the sweep's grid).

    Raises:
        UsageError: a value cannot work here.
    """
    sweep = args.sweep

    def values(flag: list[int] | None, name: str, defaults: Sequence[int]) -> list[int]:
        if flag is not None:
            return _unique(flag)
        return [env[name]] if name in env else list(defaults)

    block_sizes = _block_sizes(args, env, file_nbytes, ndirs)
    queue_depths = values(
        args.queue_depth, "queue_depth", SWEEP_QUEUE_DEPTHS if sweep else [DEFAULT_QUEUE_DEPTH]
    )
    threads = values(args.threads, "num_threads", SWEEP_THREADS if sweep else [DEFAULT_THREADS])
    _check_engine_values(block_sizes, queue_depths, threads)
    direct = args.direct if args.direct is not None else env.get("direct", True)
    return [
        Setting(
            engine=ENGINE_SWAPPER,
            backend=backend,
            block_size=b,
            queue_depth=q,
            threads=t,
            direct=direct,
            role="sweep" if sweep else "main",
            single_submit=env.get("single_submit", AioConfig.single_submit),
            close_timeout_s=env.get("close_timeout_s", AioConfig.close_timeout_s),
        )
        # Backend innermost: neighbours in time differ by backend only, so a load change
        # on the shared disk (MACHINE.md: "compare in one sitting, alternating") hits
        # both backends alike instead of one half of the grid.
        for b, q, t, backend in itertools.product(
            block_sizes, queue_depths, threads, _backends(args, env)
        )
    ]


def _check_outputs(args: argparse.Namespace) -> None:
    """Output files must be writable where asked, and --plot needs matplotlib.

    Raises:
        UsageError: they cannot.
    """
    check_output_path("--json", args.json)
    check_output_path("--emit-config", args.emit_config)
    check_output_path("--plot", args.plot)
    if args.plot is not None:
        try:
            report.check_plotting()
        except ImportError:
            raise UsageError(f"--plot needs matplotlib: {PLOT_HINT}") from None


def build_plan(args: argparse.Namespace) -> DiskPlan:
    """Check the arguments and decide every setting to measure.

    Raises:
        UsageError: an argument cannot work here; the message names it.
    """
    dirs = check_dirs(args.dirs)
    env = aio_environment()
    total_nbytes = DEFAULT_SIZE_NBYTES if args.size is None else args.size
    file_nbytes = split_nbytes(total_nbytes, len(dirs))
    if file_nbytes < DIRECT_ALIGNMENT:
        raise UsageError(
            f"--size {format_size(total_nbytes)} is too small: each of the {len(dirs)} "
            f"file(s) needs at least {DIRECT_ALIGNMENT} bytes"
        )
    settings = _grid(args, env, file_nbytes, len(dirs))
    if args.baselines or (args.baselines is None and not args.sweep):
        settings += baseline_settings(settings[0])
    _check_outputs(args)
    check_free_space(dirs, file_nbytes)
    check_memory(file_nbytes * len(dirs))
    ops = {"both": ("write", "read"), "write": ("write",), "read": ("read",)}[args.op]
    return DiskPlan(
        dirs=dirs,
        file_nbytes=file_nbytes,
        ops=ops,
        settings=settings,
        loops=args.loops or (1 if args.sweep else DEFAULT_LOOPS),
        warmup=args.warmup if args.warmup is not None else (0 if args.sweep else DEFAULT_WARMUP),
    )


# ----------------------------------------------------------------------------------------
# Output


def _where(plan: DiskPlan) -> str:
    total = format_size(plan.total_nbytes)
    places = ", ".join(f"{d} ({filesystem_type(d)})" for d in plan.dirs)
    if len(plan.dirs) == 1:
        return f"{total} in {places}"
    return f"{total} over {len(plan.dirs)} dirs ({format_size(plan.file_nbytes)} each): {places}"


def _values(items: list[Any], fmt: Callable[[Any], str] = str) -> str:
    return ",".join(fmt(i) for i in dict.fromkeys(items))


def header(plan: DiskPlan, sweep: bool) -> str:
    """What will be measured, where and how; printed before the run."""
    main = [s for s in plan.settings if s.role != "baseline"]
    io = "O_DIRECT" if main[0].direct else "buffered"
    if len(main) == 1:
        s = main[0]
        what = (
            f"backend {s.backend.value}, {io}, bs {format_size(s.block_size)} "
            f"qd {s.queue_depth} threads {s.threads}"
        )
    else:
        what = (
            f"{io}, {len(main)} settings: bs {_values([s.block_size for s in main], format_size)}"
            f" x qd {_values([s.queue_depth for s in main])}"
            f" x threads {_values([s.threads for s in main])}"
            f" x backend {_values([s.backend.value for s in main])}"
        )
    name = f"{PROG} {COMMAND}{' --sweep' if sweep else ''}"
    lines = [f"{name}: {_where(plan)}, {what}"]
    warm = f" after {plan.warmup} warm-up" if plan.warmup else ""
    passes = f"{plan.loops} timed pass{'es' if plan.loops > 1 else ''}{warm} per setting"
    lines.append(f"  {passes}; ops: {', '.join(plan.ops)}")
    baselines = [s.label for s in plan.settings if s.role == "baseline"]
    if baselines:
        lines.append(f"  baselines: {', '.join(baselines)}")
    lines.append(
        "  writes timed up to fsync; reads: page cache bypassed (O_DIRECT) or emptied "
        "before each pass (buffered), see the cache column"
    )
    library = AioConfig().block_size
    if any(s.block_size != library for s in main):
        lines.append(
            f"  block size: the library's default (AioConfig(), SWAPPER_AIO_BLOCK_SIZE unset) "
            f"is {format_size(library)}; this measures the disk at the sizes above (8 MiB "
            "by default: its ceiling in the sweeps of docs/benchmarks.md); --block-size "
            f"{format_size(library).replace(' ', '')} measures what training uses"
        )
    return "\n".join(lines)


def _meta(plan: DiskPlan, run: DiskRun) -> dict[str, Any]:
    return {
        "command": COMMAND,
        "version": swapper.__version__,
        "dirs": [str(d) for d in plan.dirs],
        "filesystems": [filesystem_type(d) for d in plan.dirs],
        "total_nbytes": plan.total_nbytes,
        "file_nbytes": plan.file_nbytes,
        "loops": plan.loops,
        "warmup": plan.warmup,
        "buffer_backing": run.buffer_backing,
        "seconds": run.seconds,
        "gb": "10^9 bytes",
    }


def _run_with_progress(plan: DiskPlan, *, bar: bool | None) -> DiskRun:
    """run_disk, saying each measurement as it finishes (:class:`swapper.progress.Progress`:
    a line each, and a bar on a terminal unless ``bar`` is False)."""
    total = len(plan.settings) * len(plan.ops)
    with Progress(total, PROG, "measurement", bar=bar) as progress:

        def setting_done(done: list[Measurement]) -> None:
            for m in done:
                progress.done(measured_line(m))

        return run_disk(plan, on_setting_done=setting_done)


def measured_line(m: Measurement) -> str:
    """One finished measurement, as it is said during the run."""
    s = m.setting
    how = "O_DIRECT" if m.direct else "buffered"
    return (
        f"  {m.op:<5} {m.backend} {how} bs {format_size(s.block_size)} qd {s.queue_depth} "
        f"threads {s.threads}: {gib_per_s(m.gbps):.2f} GiB/s (median of {len(m.seconds)})"
    )


def _write_outputs(
    args: argparse.Namespace,
    plan: DiskPlan,
    run: DiskRun,
    best: dict[str, report.Choice],
) -> None:
    if args.json is not None:
        report.write_results(args.json, run.measurements, best, _meta(plan, run))
        print(f"results written to {args.json}")
    if args.emit_config is not None:
        # measured with SWAPPER_AIO_SINGLE_SUBMIT where set: emitted as measured
        report.write_config(args.emit_config, best["both"], plan.settings[0].single_submit)
        print(f"config written to {args.emit_config} (load with AioConfig.from_json)")
    if args.plot is not None:
        report.write_plot(args.plot, run.measurements)
        print(f"plot written to {args.plot}")


def run_disk_command(args: argparse.Namespace) -> int:
    """``swapper-bench disk``: returns the exit code."""
    plan = build_plan(args)
    print(header(plan, args.sweep), flush=True)
    run = _run_with_progress(plan, bar=False if args.json is not None else None)
    measurements: list[Measurement] = run.measurements
    print(report.format_table(measurements))
    best = report.best_settings(measurements)
    options = report.choices(measurements)
    if len(options) > 1 or args.sweep:
        print(report.format_best(best, options))
    print(
        f"host buffer: {format_size(plan.total_nbytes)} ({run.buffer_backing}); "
        f"finished in {run.seconds:.1f} s"
    )
    _write_outputs(args, plan, run, best)
    return 0
