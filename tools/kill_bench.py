"""Kill a checkpointed ``swapper-pressure`` run 20 times and resume it each time: does it
end where the uninterrupted run ends? (issue 13's benchmark-sized kill run)

1. The uninterrupted run: ``swapper-pressure --params P --steps S --checkpoint-every K
   --dir A --json`` (its ``final_digest``, and its per-step timings, which place the kills).
2. ``--kills`` times (default 20): ``swapper-pressure ... --dir B --resume`` (the first one
   starts afresh), SIGKILLed (its whole process group) at a moment drawn at random
   (``--seed``) in a phase taken in turn from forward, backward, step, snapshot, of a
   step drawn after the one it resumed from (up to ``2 K`` steps on, so the run advances).
   Moments are placed by time from the line the run prints when the step before ends
   (``pressure step N: ...``; for the first step after a resume, ``resumed from step``),
   using the uninterrupted run's times for that step: forward in the first 5-30 % of
   forward + backward, backward in 45-95 %, the optimizer step within it, a snapshot within
   the median snapshot time after the ``step N`` line of a snapshot step. Whether the kill
   came before the run printed the end of that step (or snapshot) is recorded per kill.
3. A last ``--resume`` run that finishes; its ``final_digest`` must equal step 1's.

Each child must die by SIGKILL (a child that ends first is reported), and each resume must
start at a snapshot no later than the step it was killed in.

``--nproc N`` passes ``--nproc N`` to ``swapper-pressure``: its ranks snapshot together
(rank 0 prints the lines the kills are placed by), and a snapshot exists once rank 0's
commit record does (``<dir>/swapper-pressure-checkpoint/<store>.step-N.commit``), which is
what the tool reads for where the next ``--resume`` starts. A ``swapper-pressure`` that
refuses ``--checkpoint-every`` with ``--nproc`` > 1 makes the tool say so and exit 2.

    python tools/kill_bench.py --params 10M --steps 30 --every 2 --dir /work/scratch/kill \\
        --json kill10m.json

Exit code 0 when the digests are equal and every kill landed (1 otherwise, 2 for a
refusal). The run's directories are made under ``--dir`` and removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PHASES = ("forward", "backward", "step", "snapshot")


@dataclass
class Kill:
    """One killed child."""

    phase: str
    step: int  # the step whose phase was aimed at
    delay_s: float  # after the anchor line
    resumed_from: int  # the step this child resumed from (0: fresh)
    next_resumed_from: int = -1  # where the next child resumed from
    exit_code: int | None = None
    landed: str = ""  # "in time" (before the step / snapshot ended), or what came first
    seconds: float = 0.0  # the child's life


def _pressure(args: argparse.Namespace, swap: Path, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "swapper.pressure", "--params", str(args.params)]
    cmd += ["--steps", str(args.steps), "--checkpoint-every", str(args.every)]
    cmd += ["--dir", str(swap), "--nproc", str(args.nproc), *extra]
    return cmd


def _reader(proc: subprocess.Popen[str], lines: queue.Queue[tuple[float, str | None]]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put((time.monotonic(), line.rstrip("\n")))
    lines.put((time.monotonic(), None))


def _timings(ref: dict[str, Any]) -> tuple[list[float], list[float], float]:
    detail = ref["steps_detail"]
    snaps = [s["seconds"] for s in ref["snapshots"]] or [0.05]
    return detail["forward_backward_seconds"], detail["optimizer_seconds"], statistics.median(snaps)


def _aim(
    rng: random.Random, phase: str, resumed: int, args: argparse.Namespace, ref: dict[str, Any]
) -> tuple[int, float, str] | None:
    """(step, delay after the anchor, anchor line's start) for ``phase``; None when no
    step after ``resumed`` is left for it."""
    fb, opt, snap = _timings(ref)
    first = resumed + 1 if resumed > 0 else 2  # a fresh run's first step has no anchor
    last = min(args.steps, resumed + 2 * args.every)
    if phase == "snapshot":
        steps = [s for s in range(first, last + 1) if s % args.every == 0]
    else:
        steps = list(range(first, last + 1))
    if not steps:
        return None
    step = rng.choice(steps)
    if phase == "snapshot":
        return step, rng.uniform(0.0, snap), f"  pressure step {step}:"
    i = step - 1
    if phase == "forward":
        delay = rng.uniform(0.05, 0.30) * fb[i]
    elif phase == "backward":
        delay = rng.uniform(0.45, 0.95) * fb[i]
    else:
        delay = fb[i] + rng.uniform(0.05, 0.95) * opt[i]
    if (step - 1) % args.every == 0 and step - 1 > 0:
        anchor = f"  pressure snapshot step-{step - 1:09d}"
    else:
        anchor = f"  pressure step {step - 1}:"
    if step - 1 == resumed:
        anchor = f"  pressure: resumed from step {resumed}"
    return step, delay, anchor


def _kill_one(
    args: argparse.Namespace, swap: Path, kill: Kill, anchor: str
) -> tuple[Kill, list[str]]:
    started = time.monotonic()
    proc = subprocess.Popen(
        _pressure(args, swap, "--resume"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: ranks die with it
    )
    lines: queue.Queue[tuple[float, str | None]] = queue.Queue()
    threading.Thread(target=_reader, args=(proc, lines), daemon=True).start()
    seen: list[str] = []
    fire_at: float | None = None
    end = (
        f"  pressure snapshot step-{kill.step:09d}"
        if kill.phase == "snapshot"
        else f"  pressure step {kill.step}:"
    )
    killed_at: float | None = None
    while True:
        timeout = None if fire_at is None else max(0.0, fire_at - time.monotonic())
        try:
            at, line = lines.get(timeout=timeout)
        except queue.Empty:
            os.killpg(proc.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            break
        if line is None:
            break
        seen.append(line)
        if line.startswith("  pressure: resumed from step "):
            kill.resumed_from = int(line.rsplit(" ", 1)[1])
        if fire_at is None and line.startswith(anchor):
            fire_at = at + kill.delay_s
        if line.startswith(end):
            kill.landed = f"late: {line.strip()[:60]!r} came first"
    proc.wait()
    kill.exit_code = proc.returncode
    kill.seconds = time.monotonic() - started
    if killed_at is None:
        kill.landed = f"the child ended before the kill (exit code {proc.returncode})"
    elif not kill.landed:
        kill.landed = "in time"
    return kill, seen


def run(args: argparse.Namespace) -> tuple[int, dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="kill-bench-", dir=args.dir))
    try:
        return _run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> tuple[int, dict[str, Any]]:
    (work / "whole").mkdir()
    (work / "killed").mkdir()
    started = time.monotonic()
    ref_json = work / "whole.json"
    proc = subprocess.run(
        _pressure(args, work / "whole", "--json", str(ref_json)),
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode == 2 and args.nproc > 1 and "single-process" in proc.stderr:
        print(
            f"kill_bench: snapshots of several ranks are not in this swapper yet: "
            f"swapper-pressure refuses --checkpoint-every with --nproc {args.nproc} "
            f"({proc.stderr.strip().splitlines()[-1]})",
            file=sys.stderr,
        )
        return 2, {"refused": proc.stderr.strip()}
    if proc.returncode != 0:
        print(proc.stdout[-3000:] + proc.stderr[-3000:], file=sys.stderr)
        print(f"kill_bench: the uninterrupted run failed (exit {proc.returncode})", file=sys.stderr)
        return 1, {}
    ref = json.loads(ref_json.read_text())
    whole_s = time.monotonic() - started
    print(f"uninterrupted run: {whole_s:.1f} s, final_digest {ref['final_digest']}", flush=True)
    rng = random.Random(args.seed)
    kills: list[Kill] = []
    swap = work / "killed"
    for n in range(args.kills):
        resumed = _newest_snapshot(swap, args.nproc)
        if kills:
            kills[-1].next_resumed_from = resumed
        phase = PHASES[n % len(PHASES)]
        aim = _aim(rng, phase, resumed, args, ref)
        if aim is None:
            phase, aim = "step", _aim(rng, "step", resumed, args, ref)
        if aim is None:
            print(f"kill {n + 1}: no step left to kill in (resumed from {resumed})", flush=True)
            break
        step, delay, anchor = aim
        kill, seen = _kill_one(args, swap, Kill(phase, step, delay, resumed), anchor)
        kills.append(kill)
        print(
            f"kill {n + 1:2d}: {phase:8s} of step {step:3d} (+{delay:.3f} s after "
            f"{anchor.strip()!r}); resumed from {kill.resumed_from}; exit {kill.exit_code}; "
            f"{kill.landed}; {kill.seconds:.1f} s",
            flush=True,
        )
        if kill.exit_code != -signal.SIGKILL:
            print("\n".join(seen[-20:]), file=sys.stderr)
    if kills:
        kills[-1].next_resumed_from = _newest_snapshot(swap, args.nproc)
    final_json = work / "final.json"
    proc = subprocess.run(
        _pressure(args, swap, "--resume", "--json", str(final_json)),
        capture_output=True,
        text=True,
        check=False,
    )
    final = json.loads(final_json.read_text()) if final_json.exists() else {}
    digest = final.get("final_digest", "")
    equal = digest == ref["final_digest"]
    # a kill never loses a snapshot taken before the step it hit, nor invents a later one
    resumes_ok = all(
        k.resumed_from <= k.next_resumed_from <= k.step
        and k.next_resumed_from >= (k.step - 1) // args.every * args.every
        for k in kills
    )
    landed = all(k.exit_code == -signal.SIGKILL for k in kills)
    total_s = time.monotonic() - started
    print(
        f"final run (exit {proc.returncode}) resumed from step {final.get('resumed_from_step')}: "
        f"final_digest {digest}: " + ("EQUAL" if equal else "DIFFERENT") + " to the "
        f"uninterrupted run's; {len(kills)} kills, all by SIGKILL: {landed}, resumes where "
        f"expected: {resumes_ok}; total {total_s:.0f} s",
        flush=True,
    )
    result = {
        "params": ref["params"],
        "steps": args.steps,
        "every": args.every,
        "nproc": args.nproc,
        "seed": args.seed,
        "kills": [asdict(k) for k in kills],
        "reference_final_digest": ref["final_digest"],
        "final_digest": digest,
        "equal": equal,
        "final_identical_to_its_reference": final.get("identical"),
        "final_resumed_from_step": final.get("resumed_from_step"),
        "all_sigkilled": landed,
        "resumes_not_after_kill": resumes_ok,
        "seconds": time.monotonic() - started,
        "uninterrupted_seconds": whole_s,
    }
    ok = equal and landed and resumes_ok and len(kills) == args.kills
    return (0 if ok else 1), result


def _newest_snapshot(swap: Path, nproc: int = 1) -> int:
    """The step of the newest snapshot in the run's store (0: none), where the next
    ``--resume`` starts: a snapshot's file appears (rename) only once it is whole; over
    several ranks, its commit record (written once every rank's part is durable)."""
    pattern = "*.step-*.commit" if nproc > 1 else "*.step-*.snap"
    steps = [int(p.name.rsplit("step-", 1)[1].split(".")[0]) for p in swap.rglob(pattern)]
    return max(steps, default=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--params", default="10M", help="swapper-pressure --params (default 10M)")
    p.add_argument("--steps", type=int, default=30, help="S (default 30)")
    p.add_argument("--every", type=int, default=2, help="K: --checkpoint-every (default 2)")
    p.add_argument("--kills", type=int, default=20, help="default 20")
    p.add_argument("--nproc", type=int, default=1, help="swapper-pressure --nproc (default 1)")
    p.add_argument("--seed", type=int, default=13, help="of the kill moments (default 13)")
    p.add_argument("--dir", type=Path, required=True, help="where the runs' directories go")
    p.add_argument("--json", type=Path, help="write the results as JSON")
    args = p.parse_args(argv)
    if args.steps < 2 or args.every < 1 or args.kills < 0 or args.nproc < 1:
        p.error("--steps >= 2, --every >= 1, --kills >= 0, --nproc >= 1")
    code, result = run(args)
    if args.json is not None and result:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
