"""``swapper-pressure``: train a GPT under tight budgets and prove it equals an unlimited run.

Exit codes: 0 the runs are bit-identical and every tier stayed within its budget; 1 they
differ, a budget was exceeded, or the tiers failed (one line on stderr); 2 bad arguments;
128 + signal number when stopped by SIGINT, SIGTERM or SIGHUP (130, 143, 129), its swap
directories removed (:func:`swapper.cli_args.run_tool`).

This module imports no torch: ``--help`` and bad arguments are answered without it, and
the runner (which loads it) is imported once the arguments are good.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from swapper.cli_args import (
    OneLineParser,
    check_dirs,
    check_output_path,
    count_arg,
    run_tool,
    size_arg,
    write_json,
)
from tiers.units import format_size

if TYPE_CHECKING:
    from swapper.pressure.runner import PressureResult

PROG = "swapper-pressure"


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
        help="model parameters, e.g. 2M, 100M (default 2M)",
    )
    p.add_argument("--steps", type=int, default=5, metavar="N", help="default 5")
    p.add_argument("--seed", type=int, default=0, help="model and data (default 0)")
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
    p.add_argument("--batch", type=int, default=4, metavar="N", help="sequences per step")
    p.add_argument("--seq", type=int, default=64, metavar="N", help="tokens per sequence")
    p.add_argument(
        "--sub-group",
        type=count_arg,
        metavar="N",
        help="optimizer sub-group elements (default: a quarter of the host budget)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the results as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``swapper-pressure`` with ``argv`` (default ``sys.argv[1:]``); returns the exit
    code (see the module docstring)."""
    return run_tool(PROG, argv, _run, interrupted_note="; its files removed")


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    check_output_path("--json", args.json)
    from swapper.pressure.runner import PressureSettings, run_pressure  # torch loads now

    settings = PressureSettings(
        params=args.params,
        steps=args.steps,
        seed=args.seed,
        device_nbytes=args.device_budget,
        host_nbytes=args.host_budget,
        dirs=tuple(check_dirs(args.dirs)) if args.dirs else (),
        dtype=args.dtype,
        batch=args.batch,
        seq=args.seq,
        sub_group_numel=args.sub_group,
        lr=args.lr,
    )
    result = run_pressure(settings, say=lambda line: print(line, flush=True))
    print(_summary(result))
    if args.json is not None:
        write_json(args.json, result.to_json())
        print(f"results written to {args.json}")
    if not result.identical:
        print(f"{PROG}: FAILED: the budgeted run differs from the unlimited one", file=sys.stderr)
    if not result.within_budgets:
        print(f"{PROG}: FAILED: a tier went over its budget", file=sys.stderr)
    return 0 if result.ok else 1


def _summary(res: PressureResult) -> str:
    lines = ["step  loss (budgeted)      loss (unlimited)     same"]
    for i, (a, b) in enumerate(zip(res.losses, res.reference_losses, strict=True), 1):
        lines.append(f"{i:>4}  {a:<19.12g}  {b:<19.12g}  {'yes' if a == b else 'NO'}")
    for tier in ("device", "host"):
        limit = res.budget_bytes[tier]
        shown = "unlimited" if limit is None else format_size(limit)
        lines.append(f"{tier} peak {format_size(res.peak_bytes[tier])} of budget {shown}")
    mib = 1 << 20
    lines.append(
        f"peak RSS {res.peak_rss_bytes / mib:.1f} MiB, bound {res.rss_bound_bytes / mib:.1f} "
        f"MiB (budgets + baseline {res.baseline_rss_bytes / mib:.1f} + optimizer buffers "
        f"{16 * res.sub_group_numel / mib:.1f} + 2 x activations "
        f"{res.activation_bytes / mib:.1f})"
    )
    lines.append(
        f"bytes moved {format_size(res.bytes_moved)}; stall fraction {res.stall_fraction:.3f}; "
        f"{res.seconds:.2f} s budgeted vs {res.reference_seconds:.2f} s unlimited"
    )
    lines.append(
        "result: "
        + ("bit-identical to the unlimited run" if res.identical else "DIFFERENT")
        + (", within budgets" if res.within_budgets else ", OVER BUDGET")
    )
    return "\n".join(lines)
