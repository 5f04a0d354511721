"""Where an overlapped step (``StepConfig(overlap=True)``) waits, and what shortens it.

Who waited: the update's own fetch waits run beside the training and count as the
manager's ``background_stall_s``; the training's thread waits only at the gate, counted in
``OffloadAdamW.overlap_waited_s``. The pressure runner's stall split and stall fraction
use those two (its figures would otherwise charge the hidden update's waits to the
forward).

What shortens it: ``step()`` starts reading the state of the first sub-group the next
forward needs before it computes the gradient norm.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig
from swapper.manager import background_work
from swapper.manager.stats import StatsRecorder


def test_background_stall_counts_only_the_marked_thread() -> None:
    stats = StatsRecorder()
    stats.add(stall_s=0.25, fetches=1)

    def update() -> None:
        with background_work():
            stats.add(stall_s=0.5)
            with background_work():  # nests
                stats.add(stall_s=0.125)
            stats.add(stall_s=0.0625)
        stats.add(stall_s=1.0)  # after the block: the thread's own again

    thread = threading.Thread(target=update)
    thread.start()
    thread.join()
    snap = stats.snapshot({})
    assert snap.stall_s == 0.25 + 0.5 + 0.125 + 0.0625 + 1.0
    assert snap.background_stall_s == 0.5 + 0.125 + 0.0625
    assert snap.foreground_stall_s == 0.25 + 1.0


def _model() -> nn.Sequential:
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(6)))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.to(torch.bfloat16)


def _run(
    tmp_path: Path,
    overlap: bool,
    slow_s: float,
    prefetches: list[tuple[int, list[str]]] | None = None,
) -> tuple[Any, float]:
    """Four steps of a 6-layer MLP whose state spills to NVMe; each sub-group's AdamW
    delayed by ``slow_s``. Returns the manager's stats and ``overlap_waited_s``;
    ``prefetches`` gets each read-ahead request (thread id, keys)."""
    config = OffloadConfig.create(
        nvme_dirs=[tmp_path / f"swap-{overlap}"],
        device="cpu",
        device_nbytes=20_000,
        host_nbytes=120_000,
        step=StepConfig(sub_group_numel=4096, overlap=overlap),
    )
    g = torch.Generator().manual_seed(1)
    with (
        swapper.offload(_model(), config) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as opt,
    ):
        real = opt._update

        def slow(*args: Any, **kwargs: Any) -> None:
            time.sleep(slow_s)
            real(*args, **kwargs)

        opt._update = slow  # type: ignore[method-assign]
        if prefetches is not None:
            manager = wrapped.manager
            real_prefetch = manager.prefetch

            def record(keys: Any, tier: Any = None) -> int:
                keys = list(keys)
                prefetches.append((threading.get_ident(), keys))
                return real_prefetch(keys, tier)

            manager.prefetch = record  # type: ignore[method-assign]
        for _ in range(4):
            x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
            wrapped(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        waited = opt.overlap_waited_s
        opt.wait_pending()
        return wrapped.stats(), waited


def test_overlapped_update_waits_are_background_and_gate_waits_are_counted(
    tmp_path: Path,
) -> None:
    stats, waited = _run(tmp_path, overlap=True, slow_s=0.02)
    # the forward caught up with a 20 ms-per-sub-group update: it waited at the gate
    assert waited > 0.02
    # the update read its state back from NVMe in its own thread: background stall
    assert stats.background_stall_s > 0
    assert stats.foreground_stall_s == pytest.approx(stats.stall_s - stats.background_stall_s)


def test_ordinary_step_has_no_background_stall(tmp_path: Path) -> None:
    stats, waited = _run(tmp_path, overlap=False, slow_s=0.0)
    assert waited == 0.0
    assert stats.background_stall_s == 0.0
    assert stats.stall_s > 0  # (its fetches of state from NVMe waited, in the caller)


def test_step_reads_the_first_sub_group_of_the_forward_order_ahead(tmp_path: Path) -> None:
    """From the second step on (the forward order is known), ``step()`` itself, in the
    training's thread, asks for the state of sub-group 0 (the first layer's): its read
    runs beside the gradient norm instead of after the update's thread starts."""
    prefetches: list[tuple[int, list[str]]] = []
    _run(tmp_path, overlap=True, slow_s=0.0, prefetches=prefetches)
    main = threading.get_ident()
    asked = [keys for thread, keys in prefetches if thread == main and "adamw/state/0" in keys]
    assert len(asked) >= 3  # steps 2-4 (step 1's order is by index: sub-group 0 too)
    # nothing else of the state is asked for by the training's thread
    others = {k for thread, keys in prefetches if thread == main for k in keys if "/state/" in k}
    assert others == {"adamw/state/0"}
