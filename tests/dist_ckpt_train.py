"""A tiny multi-rank offloaded training run with snapshots, for tests/test_dist_checkpoint*.py.

Imported by the tests (:func:`train`, :func:`spawn`), and run as one rank of a job by
tests/dist_ckpt_launch.py for the kill test::

    python tests/dist_ckpt_train.py SWAP_DIR --world 2 --rank R --rdv DIR --steps 8 \
        --every 2 [--kill PHASE:STEP:DELAY_MS]

Rank 0 prints ``resumed <step>`` and, at the end, ``digest <final_digest>`` (the same on
every rank). ``--kill`` SIGKILLs the whole process group (the launcher and every rank)
``DELAY_MS`` after phase ``PHASE``
(``forward``, ``backward``, ``step``, ``snapshot``) of step ``STEP`` begins on rank 0,
or for ``snapshot-commit`` / ``snapshot-done`` just before / just after rank 0 writes
the commit record (every part is durable by then).

The run always asks for ``resume=True``. Everything random is seeded and the data comes
from the global RNG (the same on every rank: each takes its share of one batch), so a
resumed run is bit-identical to an uninterrupted one only if every rank's RNG state is
resumed too.
"""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig
from swapper.pressure.model import GPT, GPTConfig, init_weights_
from swapper.zero.checkpoint.snapshot import final_digest, save_snapshot
from swapper.zero.config.distributed import DistributedConfig

CONFIG = GPTConfig(vocab_size=64, context=16, d_model=32, n_layers=2, n_heads=2)
#: Per rank, below its optimizer state (12 B x ~14 000 elements): the state spills to NVMe.
HOST_NBYTES = 100_000
PG_TIMEOUT_S = 20.0
PER_RANK = 2  # sequences per rank and step


def config(swap: Path | str, *, clip: float | None = 1.0) -> OffloadConfig:
    return OffloadConfig(
        manager=OffloadConfig.create(
            device="cpu", host_nbytes=HOST_NBYTES, nvme_dirs=[swap]
        ).manager,
        step=StepConfig(sub_group_numel=1024, max_grad_norm=clip),
        distributed=DistributedConfig(timeout_s=PG_TIMEOUT_S),
    )


def model() -> GPT:
    torch.manual_seed(0)
    gpt = GPT(CONFIG).to(torch.bfloat16)
    init_weights_(gpt, seed=0)
    return gpt


class _CutForward(Exception):
    pass


def leave_gathers_in_flight(wrapped: Any, gpt: GPT) -> list[Any]:
    """One forward and backward of ``wrapped`` (records the gather order: read-ahead
    follows it), then a no-grad forward stopped as the first block's forward ends, so
    the gathers started ahead of it are left in flight; returns their parameters' states."""
    blocks = next(m for m in gpt.modules() if isinstance(m, torch.nn.ModuleList))
    tokens = torch.zeros(1, 8, dtype=torch.long)
    wrapped(tokens).float().sum().backward()

    def stop(*_: Any) -> None:
        raise _CutForward

    handle = blocks[0].register_forward_hook(stop)
    try:
        with torch.no_grad():
            wrapped(tokens)
    except _CutForward:
        pass
    finally:
        handle.remove()
    return [s for s in wrapped._states.values() if s.pending is not None]


def _say(rank: int, *words: object) -> None:
    if rank == 0:
        print(*words, flush=True)


def _kill_job() -> None:
    os.killpg(os.getpgrp(), signal.SIGKILL)


def train(
    rank: int,
    world: int,
    swap: str,
    *,
    steps: int,
    every: int,
    keep_last: int | None = 2,
    resume: bool | str = True,
    stop_after: int | None = None,
    kill: tuple[str, int, float] | None = None,
    same_data: bool = False,
    clip: float | None = 1.0,
) -> dict[str, Any]:
    """Train to ``steps`` (from where a resume starts), a snapshot every ``every`` steps.
    Returns ``{"resumed", "losses", "digest", "reports"}``. ``stop_after``: close after
    that step without finishing (a clean stop). ``same_data``: every rank trains on the
    same sequences (its gradient average is then exactly one process's gradient)."""
    gpt = model()
    torch.manual_seed(1234)  # the data's RNG; a resume restores the snapshot's instead
    group = dist.group.WORLD if world > 1 else None
    wrapped = swapper.offload(gpt, config(swap, clip=clip), group, resume=resume)
    optimizer = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
    resumed = optimizer.step_count
    _say(rank, "resumed", resumed)

    def phase(name: str, step: int) -> None:
        if kill is not None and rank == 0 and kill[0] == name and kill[1] == step:
            if kill[2] <= 0:
                _kill_job()
            timer = threading.Timer(kill[2] / 1000, _kill_job)
            timer.daemon = True
            timer.start()

    if kill is not None and rank == 0 and kill[0] in ("snapshot-commit", "snapshot-done"):
        _arm_commit_kill(kill[0], kill[1], optimizer)
    losses: list[float] = []
    reports: list[Any] = []
    try:
        for step in range(optimizer.step_count + 1, steps + 1):
            # (same_data: one share's draw, so that every world size draws alike)
            rows = PER_RANK * (1 if same_data else world)
            tokens = torch.randint(0, CONFIG.vocab_size, (rows, 9))
            share = tokens if same_data else tokens[rank * PER_RANK :][:PER_RANK]
            phase("forward", step)
            logits = wrapped(share[:, :-1])
            loss = F.cross_entropy(
                logits.float().reshape(-1, CONFIG.vocab_size), share[:, 1:].reshape(-1)
            )
            phase("backward", step)
            loss.backward()
            phase("step", step)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
            if step % every == 0:
                phase("snapshot", step)
                reports.append(
                    save_snapshot(wrapped, optimizer, keep_last=keep_last, extra={"at": step})
                )
            if stop_after is not None and step >= stop_after:
                break
        digest = final_digest(wrapped, optimizer)
        return {"resumed": resumed, "losses": losses, "digest": digest, "reports": reports}
    finally:
        optimizer.close()
        wrapped.close()


def _arm_commit_kill(when: str, step: int, optimizer: OffloadAdamW) -> None:
    """SIGKILL the job just before (``snapshot-commit``) or after (``snapshot-done``)
    rank 0 writes the commit record of ``step``'s snapshot."""
    from swapper.zero.checkpoint import shard_snapshot

    original = shard_snapshot.write_commit

    def write_commit(base: Path, data: bytes, store: str, name: str) -> Path:
        if optimizer.step_count == step and when == "snapshot-commit":
            _kill_job()
        path = original(base, data, store, name)
        if optimizer.step_count == step and when == "snapshot-done":
            _kill_job()
        return path

    shard_snapshot.write_commit = write_commit  # type: ignore[assignment]


# -- spawning ranks -----------------------------------------------------------------------


def _entry(
    target: Callable[..., Any], rank: int, world: int, tmp: str, args: tuple, backend: str
) -> None:
    out: dict[str, Any]
    try:
        torch.set_num_threads(1)
        dist.init_process_group(
            backend,
            init_method=f"file://{tmp}/rendezvous",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=PG_TIMEOUT_S),
        )
        out = {"value": target(rank, world, tmp, *args)}
    except BaseException as exc:  # recorded for the parent, which judges it
        out = {"error": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()}
    Path(tmp, f"result{rank}.pkl").write_bytes(pickle.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # no teardown: a broken group must not hang the exit


def spawn(
    target: Callable[..., Any],
    world: int,
    tmp: Path,
    *args: Any,
    join_s: float = 120.0,
    backend: str = "gloo",
) -> list[dict[str, Any]]:
    """Run ``target(rank, world, str(tmp), *args)`` on ``world`` ranks of ``backend``
    (``"nccl"``: the target picks its GPU); each rank's ``{"value": ...}`` or
    ``{"error", "message", "trace"}``. Raises RuntimeError when a rank hangs past
    ``join_s`` or leaves no result."""
    tmp.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_entry, args=(target, r, world, str(tmp), args, backend))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + join_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join(5)
    if hung:
        raise RuntimeError(f"ranks {hung} still running after {join_s} s: a hang")
    results = []
    for r in range(world):
        path = tmp / f"result{r}.pkl"
        if not path.exists():
            raise RuntimeError(f"rank {r} left no result (exit code {procs[r].exitcode})")
        results.append(pickle.loads(path.read_bytes()))
        path.unlink()
    (tmp / "rendezvous").unlink(missing_ok=True)
    return results


def values(results: list[dict[str, Any]]) -> list[Any]:
    """Each rank's value; AssertionError with the traces when a rank raised."""
    failed = [f"rank {r}: {res['trace']}" for r, res in enumerate(results) if "value" not in res]
    assert not failed, "\n".join(failed)
    return [res["value"] for res in results]


def main() -> None:
    """One rank of a job started by tests/dist_ckpt_launch.py."""
    parser = argparse.ArgumentParser()
    parser.add_argument("swap", type=Path)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--rdv", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--kill", default=None, help="PHASE:STEP:DELAY_MS")
    args = parser.parse_args()
    kill = None
    if args.kill:
        name, step, delay = args.kill.split(":")
        kill = (name, int(step), float(delay))
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.rdv}/rendezvous",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )
    run = train(
        args.rank, args.world, str(args.swap), steps=args.steps, every=args.every, kill=kill
    )
    _say(args.rank, "digest", run["digest"])
    sys.stdout.flush()
    os._exit(0)  # no teardown: the peers may be gone already


if __name__ == "__main__":
    main()
