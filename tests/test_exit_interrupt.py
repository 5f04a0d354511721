"""A Ctrl-C while ``with swapper.offload(...)`` is left (``OffloadedModel.__exit__``
fetching every weight back) must not leave the wrapper open: its store stayed locked by
this process and the next ``swapper.offload`` on that directory failed with
StoreLockedError. A real SIGINT is raised at each wait point the main thread passes
during the exit (the hook of tests/test_interrupts.py): delivered there, or where the
code's signal sections deliver it.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_train import config, model
from sigint_cut import SigintAt as _Cut

import swapper
from swapper import OffloadAdamW
from swapper.zero.checkpoint.snapshot import save_snapshot
from tiers import signals


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt here, whatever the test runner set."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _leave(swap: Path, at: int | None) -> tuple[_Cut, BaseException | None, bool]:
    """Wrap a tiny model and leave the ``with`` with the cut armed; returns the hook,
    what the exit raised, and (nothing raised) whether the weights came back whole."""
    gpt = model()
    expected = {k: v.clone() for k, v in gpt.state_dict().items()}
    cut = _Cut(at)
    previous = signals.set_wait_hook(None)
    raised: BaseException | None = None
    try:
        with swapper.offload(gpt, config(swap)) as wrapped:
            gpt(torch.zeros(1, 8, dtype=torch.long))  # a forward: weights moved about
            signals.set_wait_hook(cut)  # (only the exit follows)
    except KeyboardInterrupt as exc:
        raised = exc
    finally:
        signals.set_wait_hook(previous)
    assert wrapped.core.closed, f"cut at {cut.hit}: the wrapper was left open"
    whole = False
    if raised is None:
        state = gpt.state_dict()
        whole = state.keys() == expected.keys() and all(
            torch.equal(state[k], v) for k, v in expected.items()
        )
    return cut, raised, whole


def test_ctrl_c_at_each_wait_while_leaving_the_with_closes_the_wrapper(
    tmp_path: Path, sigint_raises: None
) -> None:
    cut, raised, whole = _leave(tmp_path / "first", None)
    assert raised is None and whole
    waits = len(cut.passed)
    assert waits > 0, "no wait point during the exit: nothing is tested"
    for at in range(1, waits + 1):
        swap = tmp_path / f"cut{at}"
        cut, raised, whole = _leave(swap, at)
        if cut.hit is None:  # (fewer waits this time: they depend on the I/O threads)
            assert raised is None and whole
            continue
        # the interrupt propagates (the block's caller is stopped), or the exit completed
        # first (the weights given back whole) and it is raised then
        assert isinstance(raised, KeyboardInterrupt), f"cut at {at} ({cut.hit}): {raised!r}"
        # the store is not left locked: the same directory can be used again at once
        again = swapper.offload(model(), config(swap))
        again.close()


def _close_cut(swap: Path, at: int | None) -> tuple[_Cut, BaseException | None, Any]:
    """A store with a training snapshot (kept at close: the close writes what is dirty),
    closed with the cut armed."""
    gpt = model()
    wrapped = swapper.offload(gpt, config(swap))
    with OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer:
        for k in range(2):
            gpt.loss(torch.randint(0, 64, (2, 9))).backward()  # type: ignore[operator]
            optimizer.step()
            optimizer.zero_grad()
            if k == 0:
                save_snapshot(wrapped, optimizer, name="a")
    cut = _Cut(at)
    previous = signals.set_wait_hook(cut)
    raised: BaseException | None = None
    try:
        wrapped.close()
    except KeyboardInterrupt as exc:
        raised = exc
    finally:
        signals.set_wait_hook(previous)
    return cut, raised, wrapped


def test_ctrl_c_at_each_wait_of_close_then_close_again_frees_the_store(
    tmp_path: Path, sigint_raises: None
) -> None:
    cut, raised, _ = _close_cut(tmp_path / "first", None)
    assert raised is None
    # (a sample, to keep it short: the first wait of each kind, the first and the last)
    first = {name: n for n, name in reversed(list(enumerate(cut.passed, 1)))}
    for at in sorted({1, len(cut.passed), *first.values()}):
        swap = tmp_path / f"cut{at}"
        cut, raised, wrapped = _close_cut(swap, at)
        if cut.hit is None:  # (fewer waits this time)
            assert raised is None
            continue
        assert isinstance(raised, KeyboardInterrupt), f"cut at {at} ({cut.hit}): {raised!r}"
        wrapped.close()  # (close() again finishes it)
        again = swapper.offload(model(), config(swap), resume=True)
        again.close()
