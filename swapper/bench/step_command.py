# Size: ~680 lines: the plan, its checks, the timed rounds of every pass (the sampled
# compute floor included) and the report of one benchmark; split, each part would be read
# with the others open.
"""``swapper-bench step``: time optimizer steps over NVMe-resident state.

One run builds, over the same 16-bit parameters and gradients (``--params`` elements in
tensors of at most 10M, bf16), and in the same directories:

- **io-only**: the step pipeline with nothing computed: every sub-group's state read
  (with read-ahead) and written back (write-behind), as a step moves it;
- **compute-only**: :class:`~swapper.step.OffloadAdamW` with all state in memory (no NVMe
  tier): building fp32 gradients, the fused AdamW kernel, rounding the 16-bit params.
  Where all the state would not fit beside the rest (``--compute-pass sampled``; ``auto``
  above :data:`SAMPLE_ABOVE_NBYTES` of state), the pass runs over one sub-group's worth of
  parameters in memory and its seconds are multiplied by the sub-groups (the total elements
  over one sub-group's), as issue 23 defines the compute floor. It runs on the intra-op
  threads the step gives its update (``StreamedOptimizer.update_threads``: an element-wise
  update over streamed state leaves one core to the I/O threads), so that the floor is
  the step's own compute; where that is fewer than every thread, the same pass on every
  thread is timed too, as a diagnostic (``compute_all_threads``, not in the floor);
- **step**: :class:`~swapper.step.OffloadAdamW` with its state on NVMe: both at once;
- **legacy** (``--legacy-grad-swap``): the same, but fp32 gradients are written to NVMe
  at the start of the step and read back per sub-group, as DeepSpeed ZeRO-Infinity does;
- **step-bf16**, **step-int8** (``--moments bf16,int8``): **step** with the Adam moments
  stored compressed (``StepConfig.moments``), to weigh fewer bytes against the encoding;
- **step-ra1**, **step-ra2**, **step-raauto**, ... (``--readahead 1,2,auto``): **step**
  with that read-ahead window (``StepConfig.readahead``; "step" has the default);
- **disk**: the disk itself, through an engine with the stores' settings: a read pass, a
  write pass timed to fsync and both at once (:mod:`swapper.bench.step_floor`).

and runs them in turns, one step of each per round (the order rotating every round), so
that the shared disk's changes of speed hit all alike. The figures are medians over the
timed rounds. The figure of merit is ``step / floor``, the floor being
``max(the step's bytes at the disk's rates, compute-only)``
(:func:`~swapper.bench.step_floor.step_floor`; 1.0: the step runs at the disk's rate or
the update's). ``step / max(io-only, compute-only)`` stays as a diagnostic of the
overlap (the io-only pass is the pipeline's own I/O, not the disk's), and with
``--legacy-grad-swap`` ``legacy / step``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import swapper
from swapper.bench.args import (
    DEFAULT_PARAMS,
    DEFAULT_STEP_WARMUP,
    DEFAULT_STEPS,
    DEFAULT_SUB_GROUP,
    PROG,
)
from swapper.bench.checks import check_dirs, check_free_space, check_memory
from swapper.bench.disk import BenchError, Workspace
from swapper.bench.legacy_step import LegacyGradSwapAdamW
from swapper.bench.step_floor import PROBE_NBYTES, DiskProbe, DiskRound, floor_record
from swapper.cli_args import UsageError, aio_environment, check_output_path, table, write_json
from swapper.manager import ManagerConfig
from swapper.step import OffloadAdamW, StepConfig, StepPipeline, StreamedOptimizer
from swapper.step.layout import plan_sub_groups
from swapper.step.offload_optimizer import NAMED, make_optimizer, plan_named
from swapper.step.rules.torch_optim import NOT_ELEMENTWISE
from tiers.config import AioConfig
from tiers.units import format_size

COMMAND = "step"
#: Parameters are tensors of at most this many elements (like a model's layers), so that
#: sub-groups cut through some of them.
TENSOR_NUMEL = 10_000_000
#: Columns of the bench's 2-D parameters (for an optimizer that is not element-wise).
ROW_NUMEL = 1024
STATE_BYTES_PER_PARAM = 12
#: ``--compute-pass auto`` times one in-memory sub-group (scaled) above this much state:
#: 1B parameters' 12 GB beside their 4 GB of 16-bit tensors, the stores' host budgets and
#: the disk probe would not fit a 24 GB machine; 256M's 3 GB does.
SAMPLE_ABOVE_NBYTES = 4 << 30
COMPUTE_PASS_MODES = ("auto", "full", "sampled")
PASSES = ("io-only", "compute-only", "step", "legacy")
#: the disk probe's turn in a round (not a pass of the optimizer)
DISK = "disk"
#: the compute-only pass again on every intra-op thread, where the step's update runs on
#: fewer (a diagnostic beside the floor, not in it: ``compute_all_threads`` in the JSON)
COMPUTE_ALL = "compute-all-threads"

__all__ = ["build_plan", "run_step_command", "summarize"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepPlan:
    """Everything one ``step`` run does, checked before any file is made."""

    dirs: list[Path]
    params: int
    sub_group: int
    steps: int
    warmup: int
    host_nbytes: int
    legacy: bool
    seed: int
    #: compressed moments timed beside the fp32 "step" (a pass "step-<moments>" each)
    moments: tuple[str, ...] = ()
    #: read-ahead windows timed beside "step" (a pass "step-ra<value>" each)
    readaheads: tuple[int | str, ...] = ()
    #: the stores' I/O settings: SWAPPER_AIO_* over swapper's defaults
    aio: AioConfig = dataclasses.field(default_factory=AioConfig)
    #: whose step: "adamw" (OffloadAdamW) or a name of swapper.step.offload_optimizer.NAMED
    optimizer: str = "adamw"
    #: whether the io-only pass (a diagnostic: the floor is the disk's) runs; without it a
    #: 1B run needs one store of state on disk, not two
    io_only: bool = True
    #: the compute-only pass: "full" (every sub-group in memory) or "sampled" (one
    #: sub-group in memory, its seconds times :attr:`compute_scale`)
    compute_pass: str = "full"

    @property
    def compute_scale(self) -> float:
        """What the compute-only pass's seconds are multiplied by: 1 when it runs over all
        the parameters; the elements of every sub-group over the first's when sampled."""
        if self.compute_pass == "full":
            return 1.0
        sub_groups = self.sub_groups()
        return sum(sg.numel for sg in sub_groups) / sub_groups[0].numel

    def compute_shapes(self) -> list[tuple[int, ...]]:
        """The compute-only pass's parameters: all of them, or one sub-group's worth."""
        if self.compute_pass == "full":
            return self.shapes()
        return [(n,) for n in _tensor_numels(self.sub_groups()[0].numel)]

    @property
    def state_nbytes(self) -> int:
        return sum(sg.state_nbytes for sg in self.sub_groups())

    @property
    def probe_nbytes(self) -> int:
        """Bytes each disk-probe pass moves: the state's size, at most 1 GiB, at least
        4 KiB per directory."""
        return max(min(PROBE_NBYTES, self.state_nbytes), 4096 * len(self.dirs))

    def sub_groups(self) -> list[Any]:
        if self.optimizer == "adamw":
            return plan_sub_groups([_tensor_numels(self.params)], self.sub_group)
        return _named_plan(self.optimizer, tuple(self.shapes()), self.sub_group)

    def shapes(self) -> list[tuple[int, ...]]:
        """The bench's parameters: 1-D tensors of up to :data:`TENSOR_NUMEL` elements;
        for an optimizer whose update is not element-wise (Adafactor), 2-D tensors of
        :data:`ROW_NUMEL` columns and at most a sub-group's elements, so that its
        factored state is what a model's matrices get and its sub-groups (whole
        parameters) are the size asked for."""
        if self.optimizer == "adamw" or NAMED[self.optimizer][0].__name__ not in NOT_ELEMENTWISE:
            return [(n,) for n in _tensor_numels(self.params)]
        rows = max(1, min(TENSOR_NUMEL, self.sub_group) // ROW_NUMEL)
        full, rest = divmod(self.params, rows * ROW_NUMEL)
        shapes: list[tuple[int, ...]] = [(rows, ROW_NUMEL)] * full
        if rest:
            shapes.append((rest // ROW_NUMEL, ROW_NUMEL) if rest >= ROW_NUMEL else (rest,))
            if rest >= ROW_NUMEL and rest % ROW_NUMEL:
                shapes.append((rest % ROW_NUMEL,))
        return shapes

    @property
    def passes(self) -> tuple[str, ...]:
        return (
            tuple(
                p for p in (PASSES if self.legacy else PASSES[:3]) if p != "io-only" or self.io_only
            )
            + tuple(f"step-{m}" for m in self.moments)
            + tuple(f"step-ra{r}" for r in self.readaheads)
        )


@functools.lru_cache(maxsize=4)
def _named_plan(name: str, shapes: tuple[tuple[int, ...], ...], sub_group: int) -> list[Any]:
    """The optimizer's layout (its state discovered once per distinct tensor shape)."""
    return plan_named(name, list(shapes), sub_group)


def _tensor_numels(params: int) -> list[int]:
    full, rest = divmod(params, TENSOR_NUMEL)
    return [TENSOR_NUMEL] * full + ([rest] if rest else [])


def build_plan(args: argparse.Namespace) -> StepPlan:
    """Check the arguments.

    Raises:
        UsageError: an argument cannot work here; the message names it.
    """
    dirs = check_dirs(args.dirs)
    if args.size is not None:
        raise UsageError("--size does not apply to 'step': give --params")
    params = args.params or DEFAULT_PARAMS
    sub_group = args.sub_group or DEFAULT_SUB_GROUP
    check_output_path("--json", args.json)
    aio = AioConfig(**aio_environment())
    optimizer = getattr(args, "optimizer", "adamw")
    if optimizer != "adamw":
        if optimizer not in NAMED:
            raise UsageError(f"--optimizer {optimizer!r}: use adamw or one of {', '.join(NAMED)}")
        if getattr(args, "moments", None) or args.legacy_grad_swap:
            raise UsageError(
                "--moments and --legacy-grad-swap time AdamW's variants: leave them out "
                f"with --optimizer {optimizer}"
            )
    mode = getattr(args, "compute_pass", None) or "auto"
    if mode not in COMPUTE_PASS_MODES:
        raise UsageError(f"--compute-pass {mode!r}: use one of {', '.join(COMPUTE_PASS_MODES)}")
    if mode == "sampled" and optimizer != "adamw":
        raise UsageError(
            f"--compute-pass sampled times AdamW's update on one sub-group; with --optimizer "
            f"{optimizer} use full"
        )
    plan = StepPlan(
        optimizer=optimizer,
        dirs=dirs,
        params=params,
        sub_group=sub_group,
        steps=args.steps or DEFAULT_STEPS,
        warmup=DEFAULT_STEP_WARMUP if args.warmup is None else args.warmup,
        host_nbytes=0,
        legacy=args.legacy_grad_swap,
        seed=args.seed,
        io_only=not getattr(args, "no_io_only", False),
        aio=aio,
        moments=tuple(dict.fromkeys(getattr(args, "moments", None) or ())),
        readaheads=tuple(
            int(r) if r != "auto" else r
            for r in dict.fromkeys(getattr(args, "readahead", None) or ())
        ),
    )
    largest = max(sg.state_nbytes for sg in plan.sub_groups())
    if mode == "auto":
        sample = optimizer == "adamw" and plan.state_nbytes > SAMPLE_ABOVE_NBYTES
        mode = "sampled" if sample else "full"
    plan = dataclasses.replace(plan, compute_pass=mode)
    host = 4 * largest if args.host_budget is None else args.host_budget
    if host < largest:
        raise UsageError(
            f"--host-budget {format_size(host)} cannot hold one sub-group's state "
            f"({format_size(largest)}): raise it or lower --sub-group"
        )
    plan = dataclasses.replace(plan, host_nbytes=host)
    # io-only, step, legacy and each step-<moments> have their own state (the compressed
    # ones are smaller; counted as fp32: an upper bound)
    stores = (
        (3 if plan.legacy else 2) - (not plan.io_only) + len(plan.moments) + len(plan.readaheads)
    )
    # params + grads (bf16), the in-memory state, each store's host budget, grad buffers
    # (and the disk probe's buffer: a read half and a write half)
    in_memory = plan.state_nbytes if plan.compute_pass == "full" else largest + 4 * sub_group
    check_memory(4 * params + in_memory + stores * host + 4 * sub_group * 4 + 2 * plan.probe_nbytes)
    # every store may hold a second version of a sub-group while it is being rewritten;
    # the disk probe has a file to read and one to write
    per_dir = (stores * (plan.state_nbytes + 2 * largest) + 2 * plan.probe_nbytes) // len(dirs)
    if plan.legacy:
        per_dir += 4 * params // len(dirs)
    check_free_space(dirs, per_dir)
    return plan


@dataclasses.dataclass
class _Pass:
    seconds: list[float] = dataclasses.field(default_factory=list)
    read_nbytes: dict[str, int] = dataclasses.field(default_factory=dict)
    written_nbytes: dict[str, int] = dataclasses.field(default_factory=dict)
    stall_seconds: list[float] = dataclasses.field(default_factory=list)
    #: intra-op threads it ran on (the compute passes; 0: not set)
    threads: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def _make_params(plan: StepPlan, shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(plan.seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(torch.bfloat16))
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(torch.bfloat16)
        params.append(p)
    return params


def _manager_config(plan: StepPlan, dirs: list[Path], name: str) -> ManagerConfig:
    return ManagerConfig(
        device_nbytes=0,
        host_nbytes=plan.host_nbytes,
        nvme_dirs=dirs,
        aio=plan.aio,
        store_name=f"swapper-bench-{name}",
    )


def _run_rounds(
    plan: StepPlan, dirs: list[Path], say: Callable[[str], None]
) -> tuple[dict[str, _Pass], list[DiskRound]]:
    params = _make_params(plan, plan.shapes())
    # the compute-only pass's own parameters when it times one sub-group (the same values
    # as the first sub-group's: the same seed)
    compute_params = params if plan.compute_pass == "full" else None
    if compute_params is None:
        compute_params = _make_params(plan, plan.compute_shapes())
    sub_groups = plan.sub_groups()
    results = {name: _Pass() for name in plan.passes}
    disk_rounds: list[DiskRound] = []
    with contextlib.ExitStack() as stack:
        say(f"  setting up the disk probe ({format_size(plan.probe_nbytes)} a pass)")
        probe = stack.enter_context(DiskProbe(dirs, plan.aio, plan.probe_nbytes))
        stores = [n for n in plan.passes if n != "compute-only"]
        say(f"  setting up the state ({', '.join(stores)})")
        io_manager = stack.enter_context(
            swapper.TierManager(_manager_config(plan, dirs, "io-only"))
        ) if plan.io_only else None  # fmt: skip
        pipeline = None
        if io_manager is not None:
            pipeline = StepPipeline(io_manager, sub_groups, name="io-only")
            stack.callback(pipeline.close)
            pipeline.initialize(lambda sg, buffer: None)
        optimizers: dict[str, StreamedOptimizer] = {}
        for name in plan.passes:
            if name == "io-only":
                continue
            config: ManagerConfig
            if name == "compute-only":
                config = ManagerConfig(device_nbytes=0, host_nbytes=None)
            else:
                config = _manager_config(plan, dirs, name)
            # "legacy": DeepSpeed's way (fp32 gradients through the disk), the
            # benchmark's own subclass; the product optimizer never does it.
            optimizer_class = LegacyGradSwapAdamW if name == "legacy" else OffloadAdamW
            moments, readahead = "fp32", None
            if name.startswith("step-ra"):
                readahead = plan.readaheads[plan.passes.index(name) - len(plan.passes)]
            elif name.startswith("step-"):
                moments = name.removeprefix("step-")
            step_config = StepConfig(
                sub_group_numel=plan.sub_group, name=name, moments=moments, readahead=readahead
            )
            if plan.optimizer == "adamw":
                made: StreamedOptimizer = optimizer_class(
                    compute_params if name == "compute-only" else params,
                    lr=1e-4,
                    tiers=config,
                    config=step_config,
                )
            else:  # (its state layout discovered: the io-only pass moved the same bytes)
                made = make_optimizer(plan.optimizer, params, lr=1e-4, tiers=config,
                                      config=step_config)  # fmt: skip
            optimizers[name] = stack.enter_context(made)
        io_step = 0

        def io_only() -> _Outcome:
            nonlocal io_step
            if pipeline is None or io_manager is None:
                raise BenchError("the io-only pass was not set up (--no-io-only)")
            io_step += 1
            before = pipeline.counters()
            stall = io_manager.stats().stall_s
            start = time.perf_counter()
            pipeline.run(io_step, lambda sg, state, extra: None, lambda sg, state: None)
            seconds = time.perf_counter() - start
            traffic = pipeline.traffic_since(before)
            return _Outcome(seconds, traffic, io_manager.stats().stall_s - stall)

        def optimizer_step(opt: StreamedOptimizer, scale: float = 1.0) -> _Outcome:
            opt.step()
            report_ = opt.last_step
            if report_ is None:  # step() returns only once its report is set
                raise BenchError(f"{type(opt).__name__}.step() returned without a report")
            return _Outcome(report_.seconds * scale, report_.traffic, report_.stall_seconds)

        def on_threads(threads: int, run: Callable[[], _Outcome]) -> _Outcome:
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                return run()
            finally:
                torch.set_num_threads(before)

        runs: dict[str, Callable[[], _Outcome]] = {"io-only": io_only} if plan.io_only else {}
        for name, opt in optimizers.items():
            scale = plan.compute_scale if name == "compute-only" else 1.0
            runs[name] = lambda opt=opt, scale=scale: optimizer_step(opt, scale)
        # The compute floor is the step's own update alone: on the threads the step gives
        # it (SubGroupMath.update_threads: one core left to the I/O where it streams). On
        # every thread too, as a diagnostic, where that differs (COMPUTE_ALL).
        compute = runs["compute-only"]
        threads = torch.get_num_threads()
        compute_threads = optimizers["step"].update_threads()
        runs["compute-only"] = lambda: on_threads(compute_threads, compute)
        names = [*plan.passes, DISK]
        if compute_threads != threads:
            runs[COMPUTE_ALL] = compute
            results[COMPUTE_ALL] = _Pass()
            names.insert(names.index("compute-only") + 1, COMPUTE_ALL)
        results["compute-only"].threads = compute_threads
        results.get(COMPUTE_ALL, _Pass()).threads = threads
        for round_ in range(plan.warmup + plan.steps):
            timed = round_ >= plan.warmup
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            cells = []
            for name in order:
                if name == DISK:
                    rates = probe.round()
                    cells.append(
                        f"disk r {rates.read_bps / 1e9:.2f} w {rates.write_bps / 1e9:.2f} "
                        f"r+w {rates.mixed_bps / 1e9:.2f} GB/s"
                    )
                    if timed:
                        disk_rounds.append(rates)
                    continue
                outcome = runs[name]()
                cells.append(f"{name} {outcome.seconds:.2f}s")
                if timed:
                    outcome.add_to(results[name])
            label = f"round {round_ + 1 - plan.warmup}" if timed else "warm-up"
            say(f"  {label}: " + ", ".join(cells))
        if not probe.direct:
            say("  note: the disk probe's files are not O_DIRECT: its reads may be the cache's")
    return results, disk_rounds


@dataclasses.dataclass(frozen=True)
class _Outcome:
    seconds: float
    traffic: swapper.step.StepTraffic
    stall_seconds: float

    def add_to(self, result: _Pass) -> None:
        result.seconds.append(self.seconds)
        result.stall_seconds.append(self.stall_seconds)
        # the same every step; the last one is kept
        result.read_nbytes = {k.value: v for k, v in self.traffic.read_nbytes.items()}
        result.written_nbytes = {k.value: v for k, v in self.traffic.written_nbytes.items()}


def summarize(
    plan: StepPlan, results: dict[str, _Pass], disk_rounds: list[DiskRound]
) -> dict[str, Any]:
    """The JSON document (also what the table prints).

    Raises:
        SwapConfigError: ``disk_rounds`` is empty or holds a rate that is not positive.
    """
    step, compute = results["step"].median, results["compute-only"].median
    io = results["io-only"].median if "io-only" in results else None
    per_param = plan.params
    doc: dict[str, Any] = {
        "optimizer": plan.optimizer,
        "params": plan.params,
        "sub_group_numel": plan.sub_group,
        "sub_groups": len(plan.sub_groups()),
        "state_nbytes": plan.state_nbytes,
        "host_budget_nbytes": plan.host_nbytes,
        "steps": plan.steps,
        # "full": the compute-only pass ran over every parameter; "sampled": over one
        # sub-group, its seconds multiplied by compute_scale
        "compute_pass": plan.compute_pass,
        "compute_scale": plan.compute_scale,
        "step_seconds": step,
        "io_only_seconds": io,
        "compute_only_seconds": compute,
        # (None without the io-only pass)
        "overlap_ratio": None if io is None else step / max(io, compute),
        # each round's own ratio: the shared disk's speed drifts between rounds, and a
        # round's passes ran back to back, so these pair like with like
        "overlap_ratio_per_round": None
        if io is None
        else [
            s_ / max(i_, c_)
            for s_, i_, c_ in zip(
                results["step"].seconds,
                results["io-only"].seconds,
                results["compute-only"].seconds,
                strict=True,
            )
        ],
        "read_bytes_per_param": sum(results["step"].read_nbytes.values()) / per_param,
        "write_bytes_per_param": sum(results["step"].written_nbytes.values()) / per_param,
        "read_bytes_by_kind": results["step"].read_nbytes,
        "write_bytes_by_kind": results["step"].written_nbytes,
        "passes": {
            name: {
                "seconds": r.seconds,
                "median_seconds": r.median,
                "stall_seconds": r.stall_seconds,
                "read_nbytes": r.read_nbytes,
                "written_nbytes": r.written_nbytes,
            }
            for name, r in results.items()
            if name != COMPUTE_ALL
        },
        # the intra-op threads of the compute-only pass: the step's update's
        "compute_threads": results["compute-only"].threads or None,
    }
    if COMPUTE_ALL in results:  # (a diagnostic: the floor is the step's threads')
        every = results[COMPUTE_ALL]
        doc["compute_all_threads"] = {
            "threads": every.threads,
            "seconds": every.seconds,
            "median_seconds": every.median,
        }
    per_round = doc["overlap_ratio_per_round"]
    doc["overlap_ratio_median_per_round"] = (
        None if per_round is None else statistics.median(per_round)
    )
    step_pass = results["step"]
    doc.update(
        floor_record(
            step_seconds=step_pass.seconds,
            read_nbytes=sum(step_pass.read_nbytes.values()),
            written_nbytes=sum(step_pass.written_nbytes.values()),
            compute_seconds=results["compute-only"].seconds,
            disk_rounds=disk_rounds,
        )
    )
    if plan.legacy:
        legacy = results["legacy"]
        doc["legacy_step_seconds"] = legacy.median
        doc["legacy_read_bytes_per_param"] = sum(legacy.read_nbytes.values()) / per_param
        doc["legacy_write_bytes_per_param"] = sum(legacy.written_nbytes.values()) / per_param
        doc["legacy_speedup"] = legacy.median / step
        doc["legacy_speedup_per_round"] = [
            l_ / s_ for l_, s_ in zip(legacy.seconds, results["step"].seconds, strict=True)
        ]
        doc["legacy_speedup_median_per_round"] = statistics.median(doc["legacy_speedup_per_round"])
    for moments in plan.moments:
        r = results[f"step-{moments}"]
        doc.setdefault("moments", {})[moments] = {
            "step_seconds": r.median,
            "read_bytes_per_param": sum(r.read_nbytes.values()) / per_param,
            "write_bytes_per_param": sum(r.written_nbytes.values()) / per_param,
            # < 1: faster than fp32 moments; each round's passes ran back to back
            "time_ratio_per_round": [
                c_ / s_ for c_, s_ in zip(r.seconds, results["step"].seconds, strict=True)
            ],
        }
        entry = doc["moments"][moments]
        entry["time_ratio_median_per_round"] = statistics.median(entry["time_ratio_per_round"])
    for readahead in plan.readaheads:
        r = results[f"step-ra{readahead}"]
        doc.setdefault("readahead", {})[str(readahead)] = {
            "step_seconds": r.median,
            "stall_seconds_median": statistics.median(r.stall_seconds),
            # < 1: faster than "step" (the default window); a round's passes ran back to back
            "time_ratio_per_round": [
                c_ / s_ for c_, s_ in zip(r.seconds, results["step"].seconds, strict=True)
            ],
        }
        entry = doc["readahead"][str(readahead)]
        entry["time_ratio_median_per_round"] = statistics.median(entry["time_ratio_per_round"])
    return doc


def format_table(doc: dict[str, Any]) -> str:
    rows = [("pass", "s/step", "min-max", "stall s", "read B/param", "written B/param")]
    for name, r in doc["passes"].items():
        rows.append(
            (
                name,
                f"{r['median_seconds']:.3f}",
                f"{min(r['seconds']):.3f}-{max(r['seconds']):.3f}",
                f"{statistics.median(r['stall_seconds']):.3f}",
                f"{sum(r['read_nbytes'].values()) / doc['params']:.2f}",
                f"{sum(r['written_nbytes'].values()) / doc['params']:.2f}",
            )
        )
    lines = table(rows)
    if doc.get("compute_pass") == "sampled":
        lines.append(
            f"compute-only: one sub-group's update in memory, x {doc['compute_scale']:.2f} "
            "(--compute-pass sampled; auto samples where all the state would not fit beside "
            "the rest)"
        )
    every = doc.get("compute_all_threads")
    if doc.get("compute_threads"):
        lines.append(
            f"compute-only ran on {doc['compute_threads']} intra-op thread(s), as the step's "
            "update does"
            + (
                f"; on all {every['threads']}: {every['median_seconds']:.3f} s "
                f"({min(every['seconds']):.3f}-{max(every['seconds']):.3f}; diagnostic)"
                if every
                else ""
            )
        )
    disk, floor = doc["disk"], doc["floor"]
    mixed = floor["mixed_seconds"]
    lines.append(
        f"disk (same engine settings, medians): read {disk['read_bytes_per_second'] / 1e9:.2f}"
        f", write to fsync {disk['write_bytes_per_second'] / 1e9:.2f}, both at once "
        f"{disk['mixed_bytes_per_second'] / 1e9:.2f} GB/s"
    )
    lines.append(
        f"floor {floor['seconds']:.3f} s = max(disk {floor['disk_seconds']:.3f} s [read then "
        f"write {floor['separate_seconds']:.3f} s"
        + (f", both at once {mixed:.3f} s" if mixed is not None else "")
        + f"], compute-only {floor['compute_seconds']:.3f} s): bound by {floor['bound']}"
    )
    lines.append(
        f"step / floor = {doc['step_over_floor']:.3f} of the medians, "
        f"{doc['step_over_floor_median_per_round']:.3f} median of the rounds' own "
        "(1.0: the step at the disk's rate or the update's)"
    )
    if doc["overlap_ratio"] is not None:
        lines.append(
            f"step / max(io-only, compute-only) = {doc['overlap_ratio']:.3f} of the medians, "
            f"{doc['overlap_ratio_median_per_round']:.3f} median of the rounds' own "
            "(diagnostic: 1.0 = the pipeline's own I/O and compute fully overlapped)"
        )
    for moments, entry in doc.get("moments", {}).items():
        lines.append(
            f"step-{moments} / step = {entry['time_ratio_median_per_round']:.3f} median of the "
            f"rounds' own ({entry['read_bytes_per_param']:.2f} B read + "
            f"{entry['write_bytes_per_param']:.2f} B written per parameter, fp32 moments "
            f"{doc['read_bytes_per_param']:.2f} + {doc['write_bytes_per_param']:.2f})"
        )
    for readahead, entry in doc.get("readahead", {}).items():
        lines.append(
            f"step-ra{readahead} / step = {entry['time_ratio_median_per_round']:.3f} median of "
            f"the rounds' own (stall {entry['stall_seconds_median']:.3f} s)"
        )
    if "legacy_speedup" in doc:
        lines.append(
            f"legacy / step = {doc['legacy_speedup']:.3f} of the medians, "
            f"{doc['legacy_speedup_median_per_round']:.3f} median of the rounds' own (fp32 "
            "gradients through the disk vs built from the 16-bit ones)"
        )
    return "\n".join(lines)


def run_step_command(args: argparse.Namespace) -> int:
    """``swapper-bench step``: returns the exit code."""
    plan = build_plan(args)
    where = ", ".join(str(d) for d in plan.dirs)
    print(
        f"{PROG} {COMMAND}: {plan.optimizer}, {plan.params:,} bf16 params, "
        f"{len(plan.sub_groups())} sub-groups "
        f"of {plan.sub_group:,}, {format_size(plan.state_nbytes)} of fp32 state per store"
        + "".join(f" (and a store of {m} moments)" for m in plan.moments)
        + ", "
        f"in {where}; host budget {format_size(plan.host_nbytes)} per store; "
        f"{plan.steps} timed round(s) after {plan.warmup} warm-up",
        flush=True,
    )

    def say(line: str) -> None:
        print(line, flush=True)

    with Workspace(plan.dirs) as workspace:
        results, disk_rounds = _run_rounds(plan, list(workspace.tmpdirs), say)
    doc = summarize(plan, results, disk_rounds)
    print(format_table(doc))
    if doc["read_bytes_per_param"] == 0:  # measured, not predicted: say why it is 0.00
        print(
            f"note: the step read nothing from the disk: the state stayed in memory (host "
            f"budget {format_size(plan.host_nbytes)}, state {format_size(plan.state_nbytes)}); "
            "give --params several times --sub-group, or a smaller --host-budget, to "
            "measure the disk"
        )
    if args.json is not None:
        meta = {"command": COMMAND, "version": swapper.__version__, "torch": torch.__version__}
        write_json(args.json, {**doc, "meta": meta})
        print(f"results written to {args.json}")
    return 0
