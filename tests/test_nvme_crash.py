"""Crash-true durability: a writer process is SIGKILLed at random moments (20 seeded
trials) while it writes, deletes, syncs and saves; after each kill the store must open,
every write whose future had completed (and every delete whose sync returned) must be
there with exactly its bytes, and no temporary file may be left after open.

The writer reports to a pipe: an intent line before each request is issued, a done line
after its future (or sync) returned. A key may therefore be found in its last reported
state or in any state intended after it (the kill can fall between the request completing
and its line being written), and in no other.

A "zygote" process imports torch once and forks one writer per trial, so that a trial costs
a fork, not an interpreter start.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tiers.aio import AioEngine
from tiers.config import AioConfig
from tiers.nvme import NvmeStore, content_hash

ROOT = Path(__file__).resolve().parent.parent
TRIALS = 20
KEYS = [f"k{i}" for i in range(12)]

_ZYGOTE = textwrap.dedent(
    """
    import os, random, sys
    import torch
    import tiers.nvme.core
    from tiers.aio import AioEngine
    from tiers.config import AioConfig
    from tiers.nvme import NvmeStore, content_hash

    KEYS = [f"k{i}" for i in range(12)]

    def say(line):
        os.write(1, (line + "\\n").encode())  # one write per line: lines never interleave

    def writer(seed, dirs):
        # A small compaction threshold, so that kills also land in automatic compactions.
        tiers.nvme.core.JOURNAL_COMPACT_NBYTES = 16 << 10
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        engine = AioEngine(AioConfig(num_threads=2, block_size=64 << 10))
        store = NvmeStore.open(dirs, engine)
        say("READY")
        while True:
            roll = rng.random()
            if roll < 0.08:
                live = store.keys()
                if live:
                    key = rng.choice(live)
                    say(f"INTEND {key} -")
                    store.delete(key)
                    store.sync()
                    say(f"DONE {key} -")
            elif roll < 0.12:
                store.save_manifest()
            else:
                batch = rng.sample(KEYS, rng.randint(1, 4))
                tensors = {}
                for key in batch:
                    n = rng.randint(0, 300_000)
                    t = torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8)
                    tensors[key] = (t, content_hash(t))
                    say(f"INTEND {key} {tensors[key][1]}")
                futures = {key: store.write(key, t) for key, (t, _) in tensors.items()}
                for key, future in futures.items():
                    future.result()
                    say(f"DONE {key} {tensors[key][1]}")

    for line in sys.stdin:
        seed, *dirs = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                writer(int(seed), dirs)
            finally:
                os._exit(1)
        say(f"CHILD {pid}")
        _, status = os.waitpid(pid, 0)
        say(f"EXIT {pid} {status}")
    """
)


class Zygote:
    def __init__(self, script: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(script)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            },
        )
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        self._buffer = b""

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def line(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._fd], [], [], max(0.0, left))
            if not ready:
                raise TimeoutError(f"no line from the writer within {timeout_s}s")
            chunk = os.read(self._fd, 65536)
            if not chunk:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise EOFError(f"zygote exited: {err}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    script = tmp_path / "zygote.py"
    script.write_text(_ZYGOTE)
    z = Zygote(script)
    try:
        yield z
    finally:
        z.close()


def _state(store: NvmeStore) -> dict[str, int]:
    """key → digest of its bytes as read back (verified reads)."""
    out = {}
    for key in store:
        info = store.info(key)
        t = torch.empty(info.nbytes, dtype=torch.uint8)
        store.read(key, t).result(timeout=30)
        out[key] = content_hash(t)
    return out


def test_sigkill_at_random_moments_loses_nothing_completed(tmp_path: Path, zygote: Zygote) -> None:
    rng = random.Random(20240611)
    dirs = [tmp_path / "d0", tmp_path / "d1"]
    with AioEngine(AioConfig(num_threads=1)) as engine:
        NvmeStore(dirs, engine, stripe_nbytes=64 << 10).close()
        known: dict[str, int | None] = dict.fromkeys(KEYS)  # None: absent
        confirmed_total = 0
        for trial in range(TRIALS):
            zygote.send(" ".join([str(rng.randrange(1 << 30)), *map(str, dirs)]))
            first = zygote.line(30)
            assert first.startswith("CHILD "), first
            pid = int(first.split()[1])
            # Odd trials: killed once the writer has confirmed ``wait_done`` writes or
            # deletes (then a random few ms more), so that the kills land amid real work
            # however slow a loaded machine makes it. Even ones: after a random delay,
            # from a few ms (inside open()) to well into the writing.
            wait_done = rng.randint(6, 12) if trial % 2 else 0
            if not wait_done:
                time.sleep(rng.choice([rng.uniform(0.0, 0.05), rng.uniform(0.05, 0.6)]))
                os.kill(pid, signal.SIGKILL)
            done_here = 0
            allowed: dict[str, set[int | None]] = {k: {v} for k, v in known.items()}
            while True:
                line = zygote.line(30)
                what, key, value = [*line.split(), "", "", ""][:3]
                if what == "EXIT":
                    assert int(key) == pid
                    break
                if what == "READY":
                    continue
                digest = None if value == "-" else int(value)
                if what == "INTEND":
                    allowed[key].add(digest)
                elif what == "DONE":
                    allowed[key] = {digest}  # completed: nothing older may come back
                    confirmed_total += 1
                    done_here += 1
                    if done_here == wait_done:
                        time.sleep(rng.uniform(0.0, 0.05))
                        os.kill(pid, signal.SIGKILL)
                else:  # pragma: no cover
                    raise AssertionError(f"unexpected line {line!r}")
            # The store a SIGKILL left always opens, and open leaves no temporary file.
            with NvmeStore.open(dirs, engine) as store:
                state = _state(store)
                temps = [p.name for d in dirs for p in d.iterdir() if p.name.endswith(".tmp")]
                assert temps == [], f"trial {trial}: temporary files left: {temps}"
            for key in KEYS:
                found = state.get(key)
                assert found in allowed[key], (
                    f"trial {trial}: key {key} reads back as {found}, allowed {allowed[key]}"
                )
                known[key] = found
            assert set(state) <= set(KEYS)
    assert confirmed_total >= 60  # the writer did get work done between the kills (odd trials)
