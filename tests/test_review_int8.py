"""Review finding on the int8 scales' conversion at resume (swapper.step.resume)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_step_int8_scales import _config, _old_snapshot, model

import swapper
from swapper import OffloadAdamW
from swapper.step.scales import HeldScales
from swapper.zero.checkpoint.snapshot import final_digest
from tiers.errors import SwapIOError


def test_a_failure_after_the_conversion_leaves_the_model_usable_by_the_next_optimizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The old-layout state is converted in the resumed model's manager, then holding the
    scales fails (an I/O error): the optimizer's construction fails, and the next
    optimizer made over the same model must adopt the converted state (it was refused: the
    record still said the old layout, so the converted tensors' shapes were 'wrong')."""
    swap = tmp_path / "swap"
    name, digest, _ = _old_snapshot(swap, monkeypatch)
    gpt = model()
    with swapper.offload(gpt, _config(swap), resume=name) as wrapped:
        with monkeypatch.context() as patch:

            def failing_hold(self: HeldScales) -> None:
                raise SwapIOError("injected: reading the scales failed")

            patch.setattr(HeldScales, "hold", failing_hold)
            with pytest.raises(SwapIOError, match="injected"):
                OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
        with OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as opt:
            assert opt.step_count == 2
            assert final_digest(wrapped, opt) == digest
