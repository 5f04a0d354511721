# Size: ~580 lines: the parser of every flag, the argument checks before torch loads, and
# the four report paths (reference, no reference, ranks, ranks with no reference).
"""``swapper-pressure``: train a GPT under tight budgets and prove it equals an unlimited run.

Human output uses the units of :mod:`swapper.cli_args` (binary prefixes, labelled; times
in seconds); ``--json`` keeps its keys (bytes as integers, ``stall_fraction`` a fraction).

With ``--nproc N`` (N > 1) it starts N gloo ranks and trains under per-rank budgets beside
N unlimited ranks and one process (:mod:`swapper.pressure.ranks`); it also needs the ranks
within tolerance of the one process, and a rank that fails fails the run (exit 1, that
rank's error on stderr).

Exit codes: 0 the runs are bit-identical and every tier stayed within its budget; 1 they
differ, a budget was exceeded, or the tiers failed (one line on stderr); 2 bad arguments
(``--nproc`` outside 1..64, or ``--batch`` not a multiple of it, among others);
128 + signal number when stopped by SIGINT, SIGTERM or SIGHUP (130, 143, 129), its swap
directories removed (:func:`swapper.cli_args.run_tool`).

This module imports no torch: ``--help`` and bad arguments are answered without it, and
the runner (which loads it) is imported once the arguments are good.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swapper.cli_args import (
    OneLineParser,
    aio_environment,
    at_least_arg,
    check_dirs,
    check_output_path,
    count_arg,
    finite_arg,
    format_size,
    int_arg,
    rate_per_day_arg,
    run_tool,
    size_arg,
    write_json,
)
from swapper.interrupts import nothing_to_undo
from swapper.pressure.export import DCP_SUBDIR, existing_export
from swapper.pressure.leftovers import CHECKPOINT_DIR, checkpoint_in_the_way
from tiers.config import AioConfig

if TYPE_CHECKING:
    from swapper.pressure.ranks import RanksResult
    from swapper.pressure.runner import PressureResult, PressureSettings

PROG = "swapper-pressure"
#: The most ranks --nproc starts (swapper.pressure.ranks.MAX_NPROC; not imported: no torch).
MAX_NPROC = 64
#: --optimizer's names: adamw and swapper.step.offload_optimizer.NAMED's (not imported: no
#: torch here; tests/test_pressure_run.py keeps them equal).
OPTIMIZER_NAMES = (
    "adamw", "sgd", "adam", "nadam", "radam", "adamax", "adagrad", "rmsprop", "asgd", "adafactor",
)  # fmt: skip
#: Those whose update is not element-wise (needs each parameter whole:
#: swapper.step.rules.torch_optim.NOT_ELEMENTWISE; not imported: no torch).
WHOLE_PARAMETER_OPTIMIZERS = ("adafactor",)

#: StepConfig.moments' values (swapper.step.layout.MOMENTS; not imported: no torch).
MOMENTS = ("fp32", "bf16", "int8")
#: --batch when not given (rounded up to a multiple of --nproc).
DEFAULT_BATCH = 4
#: The store's files among ManagerStats.nvme_written's kinds
#: (swapper.manager.stats.METADATA_KINDS; not imported: no torch).
METADATA_KINDS = ("journal", "manifest", "snapshot")


def nproc_arg(text: str) -> int:
    """A rank count in 1..MAX_NPROC."""
    value = int_arg(text)
    if not 1 <= value <= MAX_NPROC:
        raise argparse.ArgumentTypeError(f"must be in 1..{MAX_NPROC}, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG,
        description="Train a GPT-style model under per-tier budgets (device, pinned host, "
        "NVMe) next to a run with unlimited budgets and the same seed; report per-step "
        "losses, peaks per tier, peak RSS, bytes moved and stall fraction; exit non-zero "
        "when the runs differ or a budget was exceeded.",
    )
    p.add_argument(
        "--params",
        type=count_arg,
        default=2_000_000,
        metavar="N",
        help="model parameters, e.g. 2M, 100M, 2.2B (default 2M)",
    )
    p.add_argument("--steps", type=at_least_arg(1), default=5, metavar="N", help="default 5")
    p.add_argument("--seed", type=int_arg, default=0, help="model and data (default 0)")
    p.add_argument(
        "--device-budget",
        type=size_arg,
        metavar="SIZE",
        help="device tier budget (default: a quarter of the 16-bit params)",
    )
    p.add_argument(
        "--host-budget",
        type=size_arg,
        metavar="SIZE",
        help="host tier budget (default: a quarter of the optimizer state)",
    )
    p.add_argument(
        "--dir",
        dest="dirs",
        action="append",
        type=Path,
        metavar="DIR",
        help="directory to swap to (repeat for several); a private directory is made "
        "inside and removed at exit (default: a temporary directory)",
    )
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="default bf16")
    p.add_argument(
        "--batch",
        type=at_least_arg(1),
        metavar="N",
        help=f"sequences per step, over all ranks (default {DEFAULT_BATCH}; with --nproc N, "
        f"the least multiple of N from {DEFAULT_BATCH})",
    )
    p.add_argument(
        "--seq", type=at_least_arg(1), default=64, metavar="N", help="tokens per sequence"
    )
    p.add_argument(
        "--sub-group",
        type=count_arg,
        metavar="N",
        help="optimizer sub-group elements (default: a quarter of the host budget)",
    )
    p.add_argument("--lr", type=finite_arg, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument(
        "--checkpoint-every",
        type=at_least_arg(1),
        metavar="K",
        help="take a training snapshot every K steps in DIR/swapper-pressure-checkpoint "
        "(kept after the run; needs --dir)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest usable snapshot there (or start afresh); an "
        "older one only if the newer are damaged: an I/O error reading one stops the run",
    )
    p.add_argument(
        "--keep-last",
        type=at_least_arg(1),
        default=2,
        metavar="N",
        help="snapshots kept (default 2)",
    )
    p.add_argument(
        "--export",
        type=Path,
        metavar="DIR",
        help="after the run, write its final state to DIR: the 16-bit weights as "
        f"safetensors shards + index, and weights + optimizer state as a PyTorch "
        f"Distributed Checkpoint in DIR/{DCP_SUBDIR} (with --nproc N: every rank takes part)",
    )
    p.add_argument(
        "--nproc",
        type=nproc_arg,
        default=1,
        metavar="N",
        help="train on N gloo ranks started here (ZeRO-3; budgets are per rank, by default "
        "a quarter of the rank's 1/N share; --batch is the global batch, a multiple of N), "
        "beside N unlimited ranks and one process (default 1: one process, as without it)",
    )
    p.add_argument(
        "--fetch-collective",
        choices=("all_gather", "all_reduce"),
        help="with --nproc N > 1: how a module's parameters are gathered from the ranks' "
        "shards (default all_gather; all_reduce copies nothing after the collective)",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=("param", "float32"),
        help="with --nproc N > 1: the dtype gradients are summed in over the ranks: param "
        "(the default: the parameters' 16-bit dtype) or float32 (twice the bytes)",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="overlap each optimizer step with the next forward in the budgeted run "
        "(StepConfig(overlap=True); with --nproc N, on every budgeted rank)",
    )
    p.add_argument(
        "--moments",
        choices=MOMENTS,
        default="fp32",
        help="how the optimizer stores its Adam moments, in both runs (StepConfig.moments; "
        "default fp32)",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        metavar="NAME",
        help="the optimizer of both runs: adamw (OffloadAdamW, the default) or a torch.optim "
        "one under OffloadOptimizer: sgd (momentum 0.9), adam, nadam, radam, adamax, "
        "adagrad, rmsprop, asgd, adafactor (single process)",
    )
    p.add_argument(
        "--reference",
        choices=("unlimited", "none"),
        default="unlimited",
        help="unlimited (the default): compare with an in-memory run of the same seed; "
        "none: train only the budgeted model (built on the meta device straight into the "
        "tiers, so it may be larger than memory) and report per step its seconds, stall, "
        "NVMe bytes by kind, I/O and compute floors and peak RSS",
    )
    p.add_argument(
        "--compare-budgets",
        action="store_true",
        help="with no reference: train the model twice, the second time with the device "
        "budget doubled out of the host budget, half the sub-group and --overlap flipped, "
        "and fail unless losses and final digests are bit-identical",
    )
    p.add_argument(
        "--write-budget",
        type=rate_per_day_arg,
        metavar="RATE",
        help="the most the budgeted run may write to NVMe, e.g. 1TB/day or 20GB/h "
        "(write_budget_bytes_per_day): over it, one warning with what would lower it",
    )
    p.add_argument(
        "--write-budget-strict",
        action="store_true",
        help="with --write-budget: stop with an error at the step that crosses it, every "
        "tensor durable (resumable with --checkpoint-every/--resume)",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="print each step's phases (forward, backward, optimizer step): seconds, stall, "
        "busy, NVMe bytes, their I/O floor and plain PyTorch's seconds (the JSON's "
        "'timeline' has them either way)",
    )
    p.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    return p


def _writes_line(res: PressureResult) -> str:
    """What the disk pays: bytes written per step and per token (split by kind) and the
    drive writes a day at this run's measured rate."""
    kinds = res.nvme_written_by_kind
    steps = max(1, res.steps_run)
    metadata = sum(kinds.get(k, 0) for k in METADATA_KINDS)
    split = ", ".join(
        f"{name} {format_size(kinds.get(kind, 0) / steps)}"
        for name, kind in (("params", "param16"), ("grads", "grad16"), ("state", "optim_state"))
    )
    return (
        f"NVMe written per step: {format_size(res.nvme_written_bytes_per_step)} "
        f"({res.nvme_written_bytes_per_token:,.0f} B per token; {split}, metadata "
        f"{format_size(metadata / steps)}); at this rate the drive writes "
        f"{format_size(res.nvme_written_bytes_per_day)} per day"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``swapper-pressure`` with ``argv`` (default ``sys.argv[1:]``); returns the exit
    code (see the module docstring)."""
    kept: list[Path] = []  # the snapshot directories a run keeps, once the flags are read

    def note() -> str:
        if not kept:
            return "; its files removed"
        where = ", ".join(str(d / CHECKPOINT_DIR) for d in kept)
        return f"; its temporary files removed, its snapshots kept in {where} (--resume continues)"

    return run_tool(PROG, argv, lambda arguments: _run(arguments, kept), interrupted_note=note)


def _run(argv: list[str], kept: list[Path] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Every argument (and SWAPPER_AIO_*) is checked before torch loads or a file is made.
    check_output_path("--json", args.json)
    if args.write_budget_strict and args.write_budget is None:
        parser.error("--write-budget-strict needs --write-budget RATE")
    if (args.checkpoint_every is not None or args.resume) and not args.dirs:
        parser.error("--checkpoint-every and --resume need --dir (the snapshots outlive the run)")
    if args.export is not None and args.export.exists() and not args.export.is_dir():
        parser.error(f"--export {args.export}: not a directory")
    if args.export is not None and (found := existing_export(args.export)) is not None:
        parser.error(f"--export {args.export}: {found} exists; export into an empty directory")
    if args.batch is None:  # the default fits any --nproc (--nproc 3 trains 6 sequences)
        args.batch = -(-DEFAULT_BATCH // args.nproc) * args.nproc
    if args.host_budget == 0:
        parser.error(
            "--host-budget 0: the host tier holds every transfer's staging buffer and the "
            "optimizer's sub-group in flight, so it cannot be empty; give a size (e.g. "
            "1MiB) or leave the flag out for the default (a quarter of the optimizer state)"
        )
    if args.nproc == 1 and (args.fetch_collective or args.reduce_dtype):
        parser.error("--fetch-collective and --reduce-dtype need --nproc N > 1 (collectives)")
    if args.optimizer not in OPTIMIZER_NAMES:
        parser.error(f"--optimizer {args.optimizer!r}: one of {', '.join(OPTIMIZER_NAMES)}")
    if args.optimizer != "adamw" and args.moments != "fp32":
        parser.error(f"--moments {args.moments} is AdamW's: leave it out with --optimizer")
    if args.nproc > 1:
        if args.optimizer in WHOLE_PARAMETER_OPTIMIZERS:
            parser.error(
                f"--optimizer {args.optimizer} is not element-wise (it needs each parameter "
                "whole) and the ranks' runner shards parameters over the ranks: use it "
                "with --nproc 1"
            )
        if args.moments != "fp32":
            parser.error(
                "--moments other than fp32 is single-process here (--nproc 1): the ranks "
                "runner compares with a one-process run, and compressed moments round per "
                "rank's shard"
            )
        if args.batch % args.nproc:
            parser.error(
                f"--batch {args.batch} is not a multiple of --nproc {args.nproc} (each rank "
                "trains batch / nproc sequences of every step)"
            )
    if args.compare_budgets:
        args.reference = "none"
        if args.resume:
            parser.error("--compare-budgets runs from scratch twice; drop --resume")
    if args.compare_budgets and args.nproc > 1:
        parser.error("--compare-budgets is one process here (--nproc 1)")
    dirs = tuple(check_dirs(args.dirs)) if args.dirs else ()
    if args.checkpoint_every is not None or args.resume:
        in_the_way = checkpoint_in_the_way(dirs, resume=args.resume)
        if in_the_way is not None:
            parser.error(in_the_way)
        if kept is not None:
            kept.extend(dirs)
    aio = aio_environment()
    with nothing_to_undo(PROG):  # torch loads now; a signal meanwhile ends the tool at once
        from swapper.pressure.runner import PressureSettings, run_pressure

    settings = PressureSettings(
        params=args.params,
        steps=args.steps,
        seed=args.seed,
        device_nbytes=args.device_budget,
        host_nbytes=args.host_budget,
        dirs=dirs,
        dtype=args.dtype,
        batch=args.batch,
        seq=args.seq,
        sub_group_numel=args.sub_group,
        lr=args.lr,
        aio=AioConfig(**aio),
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        keep_last=args.keep_last,
        export_dir=args.export,
        overlap=args.overlap,
        moments=args.moments,
        optimizer=args.optimizer,
        write_budget_bytes_per_day=args.write_budget,
        write_budget_strict=args.write_budget_strict,
    )
    if args.nproc > 1 and args.reference == "none":
        return _run_ranks_budgeted(
            settings,
            args.nproc,
            args.json,
            fetch_collective=args.fetch_collective or "all_gather",
            reduce_dtype="float32" if args.reduce_dtype == "float32" else None,
        )
    if args.nproc > 1:
        return _run_ranks(
            settings,
            args.nproc,
            args.json,
            fetch_collective=args.fetch_collective or "all_gather",
            reduce_dtype="float32" if args.reduce_dtype == "float32" else None,
        )
    if args.reference == "none":
        return _run_budgeted(
            settings, args.json, compare=args.compare_budgets, timeline=args.timeline
        )
    result = run_pressure(settings, say=lambda line: print(line, flush=True))
    print(_summary(result))
    if args.timeline:
        from swapper.pressure.timeline import format_timeline

        print(format_timeline(result.timeline))
    if args.json is not None:
        write_json(args.json, result.to_json())
        print(f"results written to {args.json}")
    if not result.identical:
        print(f"{PROG}: FAILED: the budgeted run differs from the unlimited one", file=sys.stderr)
    if not result.within_budgets:
        print(f"{PROG}: FAILED: a tier went over its budget", file=sys.stderr)
    return 0 if result.ok else 1


def _run_budgeted(
    settings: PressureSettings, json_path: Path | None, *, compare: bool, timeline: bool = False
) -> int:
    from swapper.pressure.budgeted import BudgetComparison, compare_budgets, run_budgeted
    from swapper.pressure.timeline import format_timeline

    say = lambda line: print(line, flush=True)  # noqa: E731
    result = compare_budgets(settings, say=say) if compare else run_budgeted(settings, say=say)
    summary = result.summary()
    if timeline:
        runs = [result.first, result.second] if isinstance(result, BudgetComparison) else [result]
        summary += "".join("\n" + format_timeline(run.timeline) for run in runs)
    _show(summary, json_path, result.to_json)
    what = "budget splits differ, or a run" if compare else "run"
    if not result.ok:
        print(f"{PROG}: FAILED: the {what} failed its checks (see above)", file=sys.stderr)
    return 0 if result.ok else 1


def _show(summary: str, json_path: Path | None, to_json: Callable[[], dict[str, Any]]) -> None:
    """Print a no-reference run's summary; write its JSON to ``json_path`` if given."""
    print(summary)
    if json_path is not None:
        write_json(json_path, to_json())
        print(f"results written to {json_path}")


def _run_ranks_budgeted(
    settings: PressureSettings,
    nproc: int,
    json_path: Path | None,
    *,
    fetch_collective: str,
    reduce_dtype: str | None,
) -> int:
    from swapper.pressure.ranks import run_ranks_budgeted

    say = lambda line: print(line, flush=True)  # noqa: E731
    kwargs = {"fetch_collective": fetch_collective, "reduce_dtype": reduce_dtype}
    result = run_ranks_budgeted(settings, nproc, say=say, **kwargs)
    _show(result.summary(), json_path, result.to_json)
    if not result.ok:
        print(
            f"{PROG}: FAILED: a rank's loss is not finite, a tier over budget or its peak "
            "RSS over its bound (see the rank lines above)",
            file=sys.stderr,
        )
    return 0 if result.ok else 1


def _run_ranks(
    settings: PressureSettings,
    nproc: int,
    json_path: Path | None,
    *,
    fetch_collective: str,
    reduce_dtype: str | None,
) -> int:
    from swapper.pressure.ranks import run_ranks

    result = run_ranks(
        settings,
        nproc,
        fetch_collective=fetch_collective,
        reduce_dtype=reduce_dtype,
        say=lambda line: print(line, flush=True),
    )
    print(_ranks_summary(result))
    if json_path is not None:
        write_json(json_path, result.to_json())
        print(f"results written to {json_path}")
    if not result.identical:
        print(f"{PROG}: FAILED: the budgeted ranks differ from the unlimited ones", file=sys.stderr)
    if not result.within_budgets:
        print(f"{PROG}: FAILED: a rank's tier went over its budget", file=sys.stderr)
    if not result.rss_within_bound:
        print(
            f"{PROG}: FAILED: a rank's peak RSS went over its bound (budgets + 2 x "
            "activations + 1.5 GiB); see its line above",
            file=sys.stderr,
        )
    if not result.within_tolerance:
        print(
            f"{PROG}: FAILED: the ranks are further than the tolerance from one process",
            file=sys.stderr,
        )
    return 0 if result.ok else 1


def _ranks_summary(res: RanksResult) -> str:
    lines = ["step  mean loss (N ranks)  loss (one process)"]
    if res.resumed_from_step:
        lines.insert(0, f"resumed from step {res.resumed_from_step}")
    first = res.resumed_from_step + 1
    for i, (a, b) in enumerate(zip(res.losses, res.single_losses, strict=True), first):
        lines.append(f"{i:>4}  {a:<19.12g}  {b:<19.12g}")
    for r in res.per_rank:
        peaks = ", ".join(
            f"{tier} peak {format_size(r.peak_bytes[tier])} of {format_size(limit)}"
            for tier, limit in res.budget_bytes.items()
        )
        lines.append(
            f"rank {r.rank}: {peaks}; moved {format_size(r.bytes_moved)}; offloaded "
            f"{format_size(r.offload_nbytes)} during backward; stalled "
            f"{100 * r.stall_fraction:.1f}% of {r.seconds:.2f} s; " + r.rss_line(res.budget_bytes)
        )
    if res.export_seconds is not None:
        lines.append(_export_line(res.settings.export_dir, res.export_seconds))
    lines.append(f"final_digest {res.final_digest}")
    balance = res.offload_balance
    lines.append(
        f"last backward's gradient offload over the ranks: max/mean {balance.max_over_mean:.2f} "
        f"over module windows (1.00 even; worst window {balance.worst_window:.2f})"
    )
    lines.append(
        f"vs one process: max |diff| {res.max_abs_diff_vs_single:.3g}, "
        f"{100 * res.equal_fraction_vs_single:.1f}% of elements equal (tolerance "
        f"{res.tolerance['rule']}; 2 * lr * steps = {res.tolerance['abs']:g})"
    )
    lines.append(
        f"result ({res.world_size} ranks, {res.fetch_collective}, gradients summed in "
        f"{res.reduce_dtype}): "
        + ("bit-identical to the unlimited ranks" if res.identical else "DIFFERENT")
        + (", within budgets" if res.within_budgets else ", OVER BUDGET")
        + (", RSS within bound" if res.rss_within_bound else ", RSS OVER BOUND")
        + (", within tolerance of one process" if res.within_tolerance else ", OUT OF TOLERANCE")
    )
    return "\n".join(lines)


def _summary(res: PressureResult) -> str:
    lines = ["step  loss (budgeted)      loss (unlimited)     same"]
    for i, (a, b) in enumerate(zip(res.losses, res.reference_losses, strict=True), 1):
        lines.append(f"{i:>4}  {a:<19.12g}  {b:<19.12g}  {'yes' if a == b else 'NO'}")
    for tier in ("device", "host"):
        limit = res.budget_bytes[tier]
        shown = "unlimited" if limit is None else format_size(limit)
        lines.append(f"{tier} peak {format_size(res.peak_bytes[tier])} of budget {shown}")
    lines.append(
        f"peak RSS {format_size(res.peak_rss_bytes)}, bound {format_size(res.rss_bound_bytes)} "
        f"(budgets + baseline {format_size(res.baseline_rss_bytes)} + optimizer buffers "
        f"{format_size(res.optimizer_buffer_bytes)} + 2 x activations "
        f"{format_size(res.activation_bytes)})"
    )
    lines.append(
        f"moved {format_size(res.bytes_moved)} between tiers; stalled "
        f"{res.stall_fraction * res.seconds:.2f} s waiting for bytes "
        f"({100 * res.stall_fraction:.1f}% of the budgeted run); "
        f"{res.seconds:.2f} s budgeted vs {res.reference_seconds:.2f} s unlimited"
    )
    lines.append(
        f"optimizer state through NVMe per step ({res.settings.moments} moments): "
        "not measured with --overlap"
        if res.settings.overlap
        else f"optimizer state through NVMe per step ({res.settings.moments} moments): "
        f"{res.state_read_bytes_per_param:.2f} B read + "
        f"{res.state_written_bytes_per_param:.2f} B written per parameter"
    )
    lines.append(_writes_line(res))
    if res.timing is not None:
        lines.append(res.timing.summary())
    if res.resumed_from_step:
        lines.append(f"resumed from step {res.resumed_from_step}")
    for snap in res.snapshots:
        lines.append(
            f"snapshot {snap.name}: {format_size(snap.written_nbytes)} written of "
            f"{format_size(snap.nbytes)} of state in {snap.seconds:.3f} s"
        )
    if res.export_seconds is not None:
        lines.append(_export_line(res.settings.export_dir, res.export_seconds))
    lines.append(f"final digest {res.final_digest}")
    lines.append(
        "result: "
        + ("bit-identical to the unlimited run" if res.identical else "DIFFERENT")
        + (", within budgets" if res.within_budgets else ", OVER BUDGET")
    )
    return "\n".join(lines)


def _export_line(directory: Path | None, seconds: float) -> str:
    return (
        f"export: safetensors and a Distributed Checkpoint ({DCP_SUBDIR}/) in {directory}, "
        f"{seconds:.2f} s"
    )
