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
