"""The tier manager's promises across processes: a completed ``evict(...).result()``
survives a SIGKILL, and two processes never share a store.

A child process registers tensors, evicts each to NVMe and, once ``result()`` returns,
prints the key and the digest of its bytes; the parent SIGKILLs it at a seeded random
moment, reopens the store with ``TierManager.open`` and fetches every key the child
reported: each must come back with exactly those bytes, and no temporary file may be left.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from swapper.manager import ManagerConfig, TierManager
from tiers.nvme import StoreLockedError

_KEYS = 50

_CHILD = textwrap.dedent(
    f"""
    import sys, torch
    from swapper.manager import Kind, ManagerConfig, TierManager

    def content(i):
        k = i % {_KEYS}
        g = torch.Generator().manual_seed(i)
        n = 1024 * (1 + k % 37) + k % 3  # 4 KiB .. 148 KiB, unaligned tails
        return torch.randint(-2**31, 2**31 - 1, (n,), generator=g, dtype=torch.int32)

    config = ManagerConfig(device_nbytes=0, host_nbytes=8 << 20, nvme_dirs=[sys.argv[1]],
                           timeout_s=10)
    manager = TierManager(config)
    print("ready", flush=True)
    i = 0
    while True:
        key = f"t{{i % {_KEYS}}}"
        if key in manager:  # rewritten: each report must name the newest bytes
            manager.fetch(key).copy_(content(i))
            manager.release(key)
        else:
            manager.register(key, content(i), Kind.OPTIM_STATE)
        manager.evict(key).result()
        print(i, flush=True)
        i += 1
    """
)


def _content(i: int) -> torch.Tensor:
    k = i % _KEYS
    g = torch.Generator().manual_seed(i)
    n = 1024 * (1 + k % 37) + k % 3
    return torch.randint(-(2**31), 2**31 - 1, (n,), generator=g, dtype=torch.int32)


def _config(swap: Path) -> ManagerConfig:
    return ManagerConfig(device_nbytes=0, host_nbytes=8 << 20, nvme_dirs=[swap], timeout_s=10)


@pytest.mark.parametrize("trial", range(20))
def test_sigkill_during_evictions_loses_no_completed_evict(trial: int, tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(swap)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(random.Random(trial).uniform(0.0, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    done = [int(line) for line in out.splitlines() if line.strip().isdigit()]
    # (a line cut by the kill is at most the last one; every earlier one was complete)
    last = done[-1] if done else -1
    with TierManager.open(_config(swap)) as manager:
        for k in range(min(_KEYS, last + 1)):
            key = f"t{k}"
            newest = max(i for i in done if i % _KEYS == k)
            # The evict of i = last + 1 may have completed with its line unprinted.
            allowed = [newest] + ([last + 1] if (last + 1) % _KEYS == k else [])
            got = manager.fetch(key).clone()
            manager.release(key, modified=False)
            assert any(torch.equal(got, _content(i)) for i in allowed), (
                f"trial {trial}: {key} is not version {allowed} (last completed {last})"
            )
    leftovers = [p.name for p in swap.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == [], leftovers


def test_a_second_process_is_refused_every_time(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    with TierManager(_config(swap)) as manager:
        manager.register("x", torch.arange(10, dtype=torch.float32), "optim_state")
        manager.evict("x").result()
        manager.flush()
        code = textwrap.dedent(
            f"""
            import sys
            from swapper.manager import ManagerConfig, TierManager
            from tiers.nvme import StoreLockedError
            config = ManagerConfig(device_nbytes=0, host_nbytes=1 << 20,
                                   nvme_dirs=[{str(swap)!r}])
            refused = 0
            for opener in (TierManager, TierManager.open) * 3:
                try:
                    opener(config).close()
                except StoreLockedError as exc:
                    refused += str(exc).count("pid") > 0
            print(refused)
            """
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
        assert out.stdout.strip() == "6", out.stderr
        # The same process, a second manager on the same store: refused too.
        for opener in (TierManager, TierManager.open):
            with pytest.raises(StoreLockedError):
                opener(_config(swap)).close()
        assert torch.equal(manager.fetch("x"), torch.arange(10, dtype=torch.float32))
        manager.release("x", modified=False)
