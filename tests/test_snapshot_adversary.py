"""Adversarial checks of training snapshots and resume (issue 13): Ctrl-C at the moments
that leave state half-changed, damaged or missing snapshot files, retention and the
copy-on-write invariant. Each test here failed before the fix its docstring names.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_train import config, model

import swapper
from swapper import OffloadAdamW
from swapper.manager import EntryState, TierManager
from swapper.zero.checkpoint import final_digest, save_snapshot
from tiers.nvme import NvmeStore


def _steps(gpt: torch.nn.Module, optimizer: OffloadAdamW, n: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        gpt.loss(torch.randint(0, 64, (2, 9), generator=g)).backward()  # type: ignore[operator]
        optimizer.step()
        optimizer.zero_grad()


def _sigint_after_fetch(
    monkeypatch: pytest.MonkeyPatch, manager: TierManager, *, times: int = 1
) -> list[int]:
    """A real SIGINT during the first ``times`` fetches of ``manager``, just after the
    fetch's own signal section ended (in ``_maybe_log``, the last thing a fetch does):
    the window no fetch can close, which callers close by fetching inside their own
    ``signals.at_waits`` section (tiers/signals.py). Outside one, the handler raises
    KeyboardInterrupt there and the fetched tensor is lost to its caller. Returns the
    list of calls (one item per fetch seen)."""
    real = manager._maybe_log
    calls: list[int] = []

    def cut() -> None:
        calls.append(1)
        real()
        if len(calls) <= times:
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(manager, "_maybe_log", cut)
    return calls


def _resume_digest(swap: Path, **kw: Any) -> tuple[str, int]:
    gpt = model()
    with (
        swapper.offload(gpt, config(swap, **kw), resume=True) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        return final_digest(wrapped, optimizer), optimizer.step_count


def test_ctrl_c_as_a_left_out_param_is_fetched_leaves_no_entry_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """choose_left_out fetched each dirty 16-bit parameter outside a signal section: a
    Ctrl-C delivered as the fetch returned left the entry IN_USE with no holder, and every
    later snapshot failed with EntryInUseError (fix: the fetch and its try in a section)."""
    swap = tmp_path / "swap"
    gpt = model()
    with (
        swapper.offload(gpt, config(swap)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        _steps(gpt, optimizer, 2)
        with monkeypatch.context() as patch:
            calls = _sigint_after_fetch(patch, wrapped.manager)
            with pytest.raises(KeyboardInterrupt):
                save_snapshot(wrapped, optimizer, name="cut")
        assert calls, "the snapshot fetched nothing: the attack missed"
        ctx = wrapped.manager._ctx
        with ctx.cond:
            in_use = [e.key for e in ctx.entries.values() if e.state is EntryState.IN_USE]
        assert in_use == []
        report = save_snapshot(wrapped, optimizer, name="again")
        assert report.rebuilt_nbytes > 0
        _steps(gpt, optimizer, 1, seed=2)
        save_snapshot(wrapped, optimizer, name="last")
        expected = final_digest(wrapped, optimizer)
    assert _resume_digest(swap) == (expected, 3)


def test_ctrl_c_during_a_snapshot_keeps_the_kept_sub_groups_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C arriving while the store snapshot was taken was delivered at the first
    re-fetch of kept_released (the sub-groups kept in memory, host_fraction): the others
    stayed released, the pipeline streamed them from then on (fix: the re-fetches run
    with signals held, each tried even when one fails; the Ctrl-C comes after them)."""
    swap = tmp_path / "swap"
    gpt = model()
    with (
        swapper.offload(gpt, config(swap, host_fraction=0.1)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        pipeline = optimizer._pipeline
        assert pipeline.kept >= 2
        _steps(gpt, optimizer, 2)
        kept = dict(pipeline._held)
        real = NvmeStore.snapshot

        def snapshot(store: NvmeStore, *args: Any, **kwargs: Any) -> Any:
            signal.raise_signal(signal.SIGINT)  # arrives mid-snapshot: recorded
            return real(store, *args, **kwargs)

        with monkeypatch.context() as patch:
            patch.setattr(NvmeStore, "snapshot", snapshot)
            with pytest.raises(KeyboardInterrupt):
                save_snapshot(wrapped, optimizer, name="cut")
        assert sorted(pipeline._held) == sorted(kept)
        ctx = wrapped.manager._ctx
        with ctx.cond:
            users = {k: ctx.entries[pipeline.key(k)].users for k in kept}
        assert users == dict.fromkeys(kept, 1)
        _steps(gpt, optimizer, 1, seed=2)
        save_snapshot(wrapped, optimizer, name="last")
        expected = final_digest(wrapped, optimizer)
    assert _resume_digest(swap, host_fraction=0.1) == (expected, 3)
