# Size: ~540 lines: run_ranks and run_ranks_budgeted with their plan, spawn and wait;
# RanksBudgeted (issue 23) could join ranks_report.py, which holds the other results.
"""``swapper-pressure --nproc N``: the pressure run over N gloo ranks it starts itself.

One run (:func:`run_ranks`):

1. starts N ranks (``torch.multiprocessing``, spawn; a ``tcp://127.0.0.1`` rendezvous on
   a free port; ``timeout_s`` on the process group and on every collective of
   :class:`~swapper.zero.sharded.model.ShardedModel`);
2. in those ranks, trains the model twice, one after the other: under the **per-rank**
   budgets (each rank spilling to NVMe in its own ``rank{r}of{N}`` directory), then with
   unlimited budgets; each rank trains its ``batch / N`` sequences of every global batch;
3. in this process, trains the same model on the whole batch with unlimited budgets
   (the single-process path);

and reports, per rank of the budgeted run, the tier peaks against the budgets, bytes
moved, bytes stored by kind, bytes offloaded during backward and the stall fraction;
whether the budgeted ranks are bit-identical to the unlimited ranks (losses, parameters,
and each rank's optimizer state through :func:`~swapper.zero.checkpoint.snapshot.final_digest`),
and how far the N ranks' parameters are from the single process's.

Why not bitwise against one process: the N ranks' gradients are the average of N
per-rank means, summed in another order than one process's mean over the whole batch and
reduced in the 16-bit dtype; AdamW's normalised update can turn an ulp of difference into
a whole lr-sized step, and where an element's gradient is near zero its sign can differ,
so the two runs step it lr-sized in opposite directions. The tolerance is therefore
AdamW's bound: ``2 * lr * steps`` on every parameter element (``|m_hat / sqrt(v_hat)|``
stays near or below 1 per step), plus one ulp of the 16-bit dtype at the element's
magnitude (the 16-bit copies of fp32 master weights a hair apart can round to
neighbouring values); and, as in ``tests/test_dist_train.py``, more than half of the
elements bitwise equal (what catches a run that went somewhere else within the bound).
``tests/test_dist_train.py`` judges by ``4 * lr``, measured over 10 steps of its tiny
model at lr 1e-2; on the pressure GPT at 2M parameters, 5 steps at lr 1e-3, a bias element
near zero was measured 0.0051 apart (5 steps in opposite directions), so ``4 * lr`` is
not a bound here.

A rank that fails makes the run fail with that rank's error (:class:`RankFailedError`):
the other ranks are given a few seconds to report, then killed; a rank that stalls
inside a collective is undone by the group's timeout. Nothing here waits without a bound
except on ranks that are still training and still alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from swapper.pressure.model import GPT, GPTConfig
from swapper.pressure.rank_train import _Plan, _train, _Trained
from swapper.pressure.ranks_report import (
    MIN_EQUAL_FRACTION,
    RankReport,
    RanksResult,
    compare_params,
)
from swapper.pressure.runner import DTYPES, PressureSettings, state_nbytes_per_param, swap_dirs
from swapper.zero.config.distributed import DistributedConfig
from swapper.zero.config.offload import OffloadConfig
from tiers.errors import SwapConfigError, SwapError
from tiers.units import format_size

__all__ = [
    "MAX_NPROC",
    "RankFailedError",
    "RankReport",
    "RanksBudgeted",
    "RanksResult",
    "run_ranks",
    "run_ranks_budgeted",
]

#: Where in each ``--dir`` the snapshots live (the single-process runner's name).
CHECKPOINT_DIR = "swapper-pressure-checkpoint"
#: The most ranks ``--nproc`` starts (all on this machine).
MAX_NPROC = 64
#: Seconds any collective, and the process group's own operations, may wait.
DEFAULT_TIMEOUT_S = 120.0
#: Seconds a collective may wait in a run with no reference (a model larger than memory:
#: a peer may spend minutes materialising or stepping while this rank waits).
SCALE_TIMEOUT_S = 900.0
#: Seconds the other ranks get to report once one has failed, before they are killed.
GRACE_S = 5.0


class RankFailedError(SwapError, RuntimeError):
    """A rank raised, or died without reporting; the message names the rank and its
    error (the first rank whose error is its own, not a peer's failure seen through a
    collective)."""


def run_ranks(
    settings: PressureSettings,
    nproc: int,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    fetch_collective: str = "all_gather",
    reduce_dtype: str | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> RanksResult:
    """Train under per-rank budgets on ``nproc`` ranks, with unlimited budgets on the same
    ranks, and in one process; compare (see the module docstring).

    Budgets (``settings.device_nbytes`` / ``host_nbytes``) are per rank; by default a
    quarter of the rank's share (1/N) of the 16-bit parameters / optimizer state (the
    device budget at least the floor of the gathered buffers that the wrap refuses to go
    below: :func:`~swapper.zero.sharded.setup.gather_floor`).
    ``settings.batch`` is the global batch and must be a multiple of ``nproc``.
    ``fetch_collective`` and ``reduce_dtype`` are those of
    :class:`~swapper.zero.config.distributed.DistributedConfig` (the unlimited ranks use the
    same; the one process has no collectives). With ``settings.checkpoint_every`` the
    budgeted ranks take a snapshot every that many steps
    (:func:`~swapper.zero.checkpoint.snapshot.save_snapshot`: each rank's part in
    ``<dir>/swapper-pressure-checkpoint/rank{r}of{N}``, rank 0's commit record in
    ``<dir>/swapper-pressure-checkpoint``; kept after the run, as the single-process
    runner keeps its store); with ``settings.resume`` they continue from the newest
    committed snapshot of the same world size (or start afresh) and their losses are
    those of the steps after it. With ``settings.export_dir`` the budgeted ranks export
    their final state there together (:func:`~swapper.pressure.export.export_final`:
    safetensors written by rank 0, a Distributed Checkpoint with a part per rank).

    Raises:
        SwapConfigError: ``nproc`` out of 2..MAX_NPROC, the batch not a multiple of it,
            or a bad ``fetch_collective`` / ``reduce_dtype``.
        RankFailedError: a rank failed (its error in the message).
        SwapError, OSError: the single-process run failed.
    """
    plan = _plan(settings, nproc, timeout_s, fetch_collective, reduce_dtype, say)
    model_config = GPTConfig.for_params(settings.params)
    num_params = model_config.num_params()
    budgets = {"device": plan.device_nbytes, "host": plan.host_nbytes}
    tight, free = _spawn_in_dirs(plan, say)
    say("  single process, unlimited budgets")
    single = _train(plan, rank=0, world=1, dirs=None, keep_params=True)
    resumed = tight[0].report.resumed_from
    identical = all(
        t.losses == f.losses[resumed:]
        and t.report.resumed_from == resumed
        and t.digest == f.digest
        and t.param_hashes == f.param_hashes
        for t, f in zip(tight, free, strict=True)
    )
    bound = 2 * settings.lr * settings.steps
    diff, equal, within = compare_params(
        free[0].params, single.params, bound, DTYPES[settings.dtype]
    )
    return RanksResult(
        settings=settings,
        world_size=nproc,
        fetch_collective=plan.distributed.fetch_collective,
        reduce_dtype=reduce_dtype or settings.dtype,
        model=model_config,
        num_params=num_params,
        budget_bytes=budgets,
        per_rank=[t.report for t in tight],
        reference_per_rank=[f.report for f in free],
        single_losses=single.losses[resumed:],
        identical=identical,
        max_abs_diff_vs_single=diff,
        equal_fraction_vs_single=equal,
        tolerance={
            "abs": bound,
            "plus_ulps": 1,
            "min_equal_fraction": MIN_EQUAL_FRACTION,
            "rule": "|a - b| <= 2 * lr * steps + ulp(max(|a|, |b|)) on every parameter "
            "element, and more than half of the elements equal",
        },
        within_tolerance=within,
    )


def _plan(
    settings: PressureSettings,
    nproc: int,
    timeout_s: float,
    fetch_collective: str,
    reduce_dtype: str | None,
    say: Callable[[str], None],
    *,
    budgeted_only: bool = False,
) -> _Plan:
    """The ranks' plan: per-rank budgets (see :func:`run_ranks`), said in one line.

    Raises:
        SwapConfigError: ``nproc`` out of 2..MAX_NPROC, the batch not a multiple of it,
            or a bad ``fetch_collective`` / ``reduce_dtype``.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or not 2 <= nproc <= MAX_NPROC:
        raise SwapConfigError(f"nproc={nproc!r} must be an int in 2..{MAX_NPROC}")
    if settings.batch % nproc:
        raise SwapConfigError(
            f"batch={settings.batch} must be a multiple of nproc={nproc} (each rank trains "
            "batch / nproc sequences of every step)"
        )
    distributed = DistributedConfig(  # checked here, before any rank starts
        timeout_s=timeout_s, fetch_collective=fetch_collective, reduce_dtype=reduce_dtype
    )
    model_config = GPTConfig.for_params(settings.params)
    num_params = model_config.num_params()
    share = -(-num_params // nproc)
    device = settings.device_nbytes
    if device is None:
        floor = _gather_floor(model_config, nproc, timeout_s, fetch_collective=fetch_collective)
        device = max(2 * share // 4, floor)
    per_param = state_nbytes_per_param(settings)  # (AdamW: 12)
    host = settings.host_nbytes
    if host is None:
        host = int(per_param * share) // 4
    sub_group = settings.sub_group_numel or max(1024, int(host // 4 // per_param))
    say(
        f"swapper-pressure: GPT of {num_params:,} params ({model_config.n_layers} layers, "
        f"d_model {model_config.d_model}), {settings.dtype}, {settings.steps} steps on "
        f"{nproc} ranks (gloo), {settings.batch // nproc} of {settings.batch} sequences "
        f"each; per-rank device budget {format_size(device)}, host budget "
        f"{format_size(host)}; fetch by "
        f"{fetch_collective}, gradients reduced in {reduce_dtype or settings.dtype}"
        + ("; the budgeted ranks overlap each step with the next forward" * settings.overlap)
        + ("; no unlimited reference" * budgeted_only)
    )
    return _Plan(
        settings,
        nproc,
        device,
        host,
        sub_group,
        timeout_s,
        distributed_config=distributed,
        budgeted_only=budgeted_only,
    )


def _spawn_in_dirs(
    plan: _Plan, say: Callable[[str], None]
) -> tuple[list[_Trained], list[_Trained]]:
    """:func:`_spawn` over the budgeted ranks' store directories: checkpointed, the parts
    live in DIR/swapper-pressure-checkpoint/rank{r}of{N}, kept for --resume (the store's
    name is the wrap's default, the same on every run); otherwise private ones, removed.
    """
    settings = plan.settings
    kept = [d / CHECKPOINT_DIR for d in settings.dirs]
    kept_dirs = contextlib.nullcontext(kept) if settings.checkpointing else None
    with kept_dirs or swap_dirs(settings.dirs) as dirs:
        return _spawn(plan, [str(d) for d in dirs], say)


@dataclasses.dataclass(frozen=True)
class RanksBudgeted:
    """What :func:`run_ranks_budgeted` found: each budgeted rank's report, no reference."""

    settings: PressureSettings
    world_size: int
    num_params: int
    budget_bytes: dict[str, int]
    per_rank: list[RankReport]

    @property
    def within_budgets(self) -> bool:
        return all(
            r.peak_bytes[t] <= limit
            for r in self.per_rank
            for t, limit in self.budget_bytes.items()
        )

    @property
    def losses_finite(self) -> bool:
        return all(math.isfinite(x) for r in self.per_rank for x in r.losses)

    @property
    def rss_within_bound(self) -> bool:
        """Every rank's peak RSS (training and final phase) within its bound."""
        return all(r.rss_within_bound(self.budget_bytes) for r in self.per_rank)

    @property
    def ok(self) -> bool:
        return self.within_budgets and self.losses_finite and self.rss_within_bound

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": "none",
            "world_size": self.world_size,
            "params": self.num_params,
            "budget_bytes": self.budget_bytes,
            "within_budgets": self.within_budgets,
            "losses_finite": self.losses_finite,
            "rss_within_bound": self.rss_within_bound,
            "per_rank": [
                {**dataclasses.asdict(r), **r.rss_json(self.budget_bytes)} for r in self.per_rank
            ],
            "ok": self.ok,
        }

    def summary(self) -> str:
        lines = []
        for r in self.per_rank:
            peaks = ", ".join(
                f"{t} peak {format_size(r.peak_bytes[t])} of {format_size(limit)}"
                for t, limit in self.budget_bytes.items()
            )
            steps = "; ".join(
                f"step {i}: loss {loss:.6f}, forward+backward {m:.1f} s, optimizer {o:.1f} s"
                for i, (loss, m, o) in enumerate(
                    zip(r.losses, r.model_s, r.optimizer_s, strict=True), r.resumed_from + 1
                )
            )
            lines.append(
                f"rank {r.rank}: {steps}; {peaks}; {r.rss_line(self.budget_bytes)}; "
                f"stalled {100 * r.stall_fraction:.1f}% of {r.seconds:.1f} s"
            )
        lines.append(f"final digest {self.per_rank[0].digest}")
        lines.append(
            f"result ({self.world_size} ranks, no reference): "
            + ("losses finite" if self.losses_finite else "NON-FINITE LOSS")
            + (", within budgets" if self.within_budgets else ", OVER BUDGET")
            + (", RSS within bound" if self.rss_within_bound else ", RSS OVER BOUND")
        )
        return "\n".join(lines)


def run_ranks_budgeted(
    settings: PressureSettings,
    nproc: int,
    *,
    timeout_s: float = SCALE_TIMEOUT_S,
    fetch_collective: str = "all_gather",
    reduce_dtype: str | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> RanksBudgeted:
    """Train the budgeted ranks only (``--reference none --nproc N``): no unlimited ranks,
    no one-process run, so the model may be larger than memory. Budgets per rank as
    :func:`run_ranks`; collectives wait up to ``timeout_s`` (at scale a rank may spend
    minutes in one phase while its peers wait in the next collective).

    Raises:
        SwapConfigError: as :func:`run_ranks`.
        RankFailedError: a rank failed (its error in the message).
    """
    plan = _plan(
        settings, nproc, timeout_s, fetch_collective, reduce_dtype, say, budgeted_only=True
    )
    tight, _ = _spawn_in_dirs(plan, say)
    return RanksBudgeted(
        settings=settings,
        world_size=nproc,
        num_params=GPTConfig.for_params(settings.params).num_params(),
        budget_bytes={"device": plan.device_nbytes, "host": plan.host_nbytes},
        per_rank=[t.report for t in tight],
    )


def _gather_floor(
    model_config: GPTConfig, nproc: int, timeout_s: float, *, fetch_collective: str = "all_gather"
) -> int:
    """Device bytes the wrap needs at least on each of ``nproc`` ranks (a meta model)."""
    from swapper.zero.sharded.setup import gather_floor

    with torch.device("meta"):
        model = GPT(model_config)
    distributed = DistributedConfig(timeout_s=timeout_s, fetch_collective=fetch_collective)
    config = OffloadConfig.create(device="cpu", distributed=distributed)
    return gather_floor(model, config, nproc)


def _free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it; the rendezvous binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def die_with_parent(parent_pid: int) -> None:
    """Make this process die with ``parent_pid``: a parent killed by SIGKILL cannot kill
    its ranks, which would otherwise train on (holding memory, disk and a port) until
    their collectives time out. Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``; then, since
    the parent may have died before that call, exit at once if it already has. Elsewhere
    (no prctl) only the second check applies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


def _entry(plan: _Plan, rank: int, port: int, dirs: list[str], out: str, parent_pid: int) -> None:
    """One rank: join the group, train budgeted then unlimited, write the result (or the
    error) to ``out``, and exit without tearing the group down (a broken group must not
    hang the exit). Dies with ``parent_pid`` (:func:`die_with_parent`)."""
    import torch.distributed as dist

    die_with_parent(parent_pid)
    result: dict[str, Any]
    try:
        # the ranks share this machine's cores: one rank per core share, not all each
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.world))
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=plan.world,
            timeout=timedelta(seconds=plan.timeout_s),
        )
        tight = _train(plan, rank=rank, world=plan.world, dirs=dirs)
        free = (
            None
            if plan.budgeted_only
            else _train(plan, rank=rank, world=plan.world, dirs=None, keep_params=True)
        )
        result = {"value": (tight, free)}
    except BaseException as exc:  # reported to the parent, which judges it
        result = {
            "error": type(exc).__name__,
            "message": str(exc),
            "peer": exc.__class__.__name__ in ("PeerFailedError", "CollectiveError"),
            "trace": traceback.format_exc(),
            "at": time.time(),
        }
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, out)  # whole or absent: the parent never reads half a result
    if "error" in result:
        Path(out + ".failed").touch()  # seen by the parent's poll without unpickling
    os._exit(0)


@contextlib.contextmanager
def _ranks_ignore_ctrl_c() -> Any:
    """Start the ranks (in the block) with SIGINT ignored, which they keep: a process
    inherits an ignored signal through fork and exec, and Python turns SIGINT into
    KeyboardInterrupt only where its parent left it at the default.

    Ctrl-C reaches every process of the terminal's group: a rank still importing torch
    printed a KeyboardInterrupt traceback of ~30 lines before the tool's one-line message
    (issue 28). The tool alone answers it, killing the ranks by handle as it stops.
    Meanwhile SIGINT is blocked here, so one that comes while the ranks start waits (a
    blocked signal is kept, not ignored) and reaches the tool's own handler after it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield  # (only the main thread may set a handler; a library caller's ranks as before)
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, handler)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _spawn(
    plan: _Plan, dirs: list[str], say: Callable[[str], None], *, grace_s: float = GRACE_S
) -> tuple[list[_Trained], list[_Trained]]:
    """Start the ranks, wait for all of them (or for a failure), return per rank the
    budgeted and the unlimited run (none with ``plan.budgeted_only``).

    Raises:
        RankFailedError: a rank raised or died; the others are killed after ``grace_s``.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="swapper-pressure-ranks-") as tmp:
        outs = [os.path.join(tmp, f"rank{r}.pkl") for r in range(plan.world)]
        procs = [
            ctx.Process(
                target=_entry, args=(plan, r, port, dirs, outs[r], os.getpid()), daemon=True
            )
            for r in range(plan.world)
        ]
        try:
            with _ranks_ignore_ctrl_c():
                for p in procs:
                    p.start()
            say(f"  started {plan.world} ranks (rendezvous on 127.0.0.1:{port})")
            results = _wait(procs, outs, grace_s)
        finally:
            for p in procs:  # ours, by handle: killed if still running, always reaped
                if p.is_alive():
                    p.kill()
                p.join(grace_s)
    failures = [(r, res) for r, res in enumerate(results) if "value" not in res]
    if failures:
        # the rank whose error is its own, rather than a peer's failure seen in a collective
        own = [f for f in failures if not f[1].get("peer")] or failures
        rank, res = min(own, key=lambda f: f[1].get("at", float("inf")))
        for line in res.get("trace", "").rstrip().splitlines():
            say(f"  rank {rank}: {line}")
        raise RankFailedError(
            f"rank {rank} of {plan.world} failed: {res['error']}: {res['message']}"
        )
    values = [res["value"] for res in results]
    return [v[0] for v in values], [v[1] for v in values if v[1] is not None]


def _wait(procs: list[Any], outs: list[str], grace_s: float) -> list[dict[str, Any]]:
    """Poll until every rank has reported or exited; once one has failed (an error
    reported, or an exit without a report), the others get ``grace_s`` to report."""
    failed_at: float | None = None
    while True:
        done = [os.path.exists(o) or not p.is_alive() for p, o in zip(procs, outs, strict=True)]
        if failed_at is None and any(
            not os.path.exists(o) and not p.is_alive() for p, o in zip(procs, outs, strict=True)
        ):
            failed_at = time.monotonic()
        if failed_at is None and any(os.path.exists(o + ".failed") for o in outs):
            failed_at = time.monotonic()
        if all(done) or (failed_at is not None and time.monotonic() - failed_at > grace_s):
            break
        time.sleep(0.05)
    results: list[dict[str, Any]] = []
    for r, (p, o) in enumerate(zip(procs, outs, strict=True)):
        if os.path.exists(o):
            with open(o, "rb") as f:
                results.append(pickle.load(f))
        else:
            code = p.exitcode
            if code is None:  # still running: stopped below, after another rank failed
                how, error = "was stopped after another rank failed", "RankStopped"
            elif code < 0:
                how, error = f"was killed by signal {-code} without a result", "RankDied"
            else:
                how, error = f"exited with code {code} without a result", "RankDied"
            results.append({"error": error, "message": f"rank {r} {how}", "peer": code is None})
    return results
