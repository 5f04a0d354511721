"""Long runs do not grow (issue 29): the short form of ``tools/long_run.py``.

200 steps of a small MLP offloaded under tight budgets (parameters, gradients and the
optimizer state through host memory and NVMe). After a warm-up, open file descriptors,
threads, locked memory, the host tier's bytes, RSS, and the number and total size of the
files in the swap directory stay flat (:func:`swapper.pressure.growth.growth`): nothing a
step opens, starts, allocates or writes outlives it. (The store's journal grows by a
record per write until it is compacted into a manifest: bounded by the compaction
threshold, not flat.)
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from torch import nn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig
from swapper.pressure.growth import _status, growth, sample
from tiers.nvme.core import JOURNAL_COMPACT_NBYTES

STEPS = 200
EVERY = 5  # steps between samples (gc.collect costs more than a step here)
WARMUP_SAMPLES = 8  # the first 40 steps
KiB, MiB = 1 << 10, 1 << 20


def test_200_steps_under_tight_budgets_stay_flat(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(torch.bfloat16)
    config = OffloadConfig.create(
        device_nbytes=20_000,  # about the largest module's parameters
        host_nbytes=120_000,  # < params + grads + 12 B/param of state: the rest on NVMe
        nvme_dirs=[tmp_path / "nvme"],
        device="cpu",
        step=StepConfig(sub_group_numel=2048),
    )
    x = torch.randn(8, 64).to(torch.bfloat16)
    rows: list[dict[str, int]] = []
    with (
        swapper.OffloadedModel(model, config) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-3, tiers=wrapped) as opt,
    ):
        for step in range(1, STEPS + 1):
            wrapped(x).float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if step % EVERY == 0:
                gc.collect()
                host = wrapped.stats().tiers[swapper.Tier.HOST].used_nbytes
                rows.append(sample(tmp_path / "nvme", host))
        assert wrapped.stats().nvme_written_nbytes > STEPS * 12 * 2048  # it did swap
    # RSS: the allocator rounds. The data file: first fit may raise its high-water mark
    # by a few blocks as holes fragment; a leaked extent a step (a sub-group's state is
    # 24 KiB) would add 2.4 MiB over the late window.
    grew = growth(rows, WARMUP_SAMPLES, rss_slack_nbytes=4 * MiB, file_slack_nbytes=64 * KiB)
    assert grew == {}, (grew, rows[-1])
    assert max(r["journal_bytes"] for r in rows) <= 2 * JOURNAL_COMPACT_NBYTES


def test_growth_names_what_grew() -> None:
    row = {name: 1 for name in ("fds", "threads", "os_threads", "locked_bytes")}
    row |= {"host_used_bytes": 0, "rss_bytes": 0, "swap_files": 2, "swap_file_bytes": 0}
    row |= {"swap_disk_bytes": 0, "journal_bytes": 0}
    rows = [dict(row) for _ in range(10)]
    assert growth(rows, 2, rss_slack_nbytes=MiB) == {}
    rows[-1]["fds"] += 1
    rows[-1]["rss_bytes"] += 2 * MiB
    assert growth(rows, 2, rss_slack_nbytes=MiB) == {"fds": 1, "rss_bytes": 2 * MiB}
    with pytest.raises(ValueError, match="no two windows"):
        growth(rows[:3], 2, rss_slack_nbytes=MiB)


@pytest.mark.parametrize("field", ["Threads", "VmRSS", "VmLck"])
def test_status_fields_are_read(field: str) -> None:
    assert _status(field) >= 0
