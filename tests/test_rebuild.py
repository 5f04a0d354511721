"""16-bit parameters left out of a training snapshot and rebuilt from the fp32 master at
resume (swapper.zero.checkpoint.rebuild): left out only when they are exactly their masters rounded,
written otherwise; a rebuilt parameter whose digest differs refuses its snapshot by name;
malformed records are refused; and the rounding the design rests on (``copy_`` into a
16-bit tensor == ``.to``) holds bit for bit, NaN, -0.0 and subnormals included.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from ckpt_train import config, model, resume_digest, steps
from hypothesis import given, settings
from hypothesis import strategies as st

import swapper
from swapper import DynamicLossScaler, OffloadAdamW
from swapper.zero.checkpoint import rebuild
from swapper.zero.checkpoint.snapshot import SnapshotReport, final_digest, save_snapshot
from tiers.aio import AioEngine
from tiers.config import AioConfig
from tiers.nvme import NvmeStore, SnapshotDamagedError

STORE = "swapper-offload"


def _store_keys(swap: Path, name: str) -> tuple[str, ...]:
    engine = AioEngine(AioConfig())
    try:
        with NvmeStore.open([swap], engine, name=STORE) as store:
            return next(s.keys for s in store.snapshots() if s.name == name)
    finally:
        engine.close()


@pytest.mark.parametrize("host_fraction", [0.0, 0.1])
def test_params_a_step_left_dirty_are_left_out_and_rebuilt_exactly(
    tmp_path: Path, host_fraction: float
) -> None:
    swap = tmp_path / "swap"
    gpt = model()
    with (
        swapper.offload(gpt, config(swap, host_fraction=host_fraction)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        # before any step: nothing is known to equal its master; all is written
        first = save_snapshot(wrapped, optimizer, name="first")
        assert first.rebuilt_nbytes == 0
        steps(gpt, optimizer, 2)
        report: SnapshotReport = save_snapshot(wrapped, optimizer, name="after")
        expected = final_digest(wrapped, optimizer)
    assert report.rebuilt_nbytes > 0
    if host_fraction == 0.0:  # (kept sub-groups are written by every snapshot)
        assert report.written_nbytes == report.path.stat().st_size
    keys = _store_keys(swap, "after")
    assert sum("/param/" in k for k in keys) < sum(
        "/param/" in k for k in _store_keys(swap, "first")
    )
    assert resume_digest(swap, host_fraction=host_fraction) == (expected, 2)


def test_a_param_written_outside_the_step_is_written_by_the_snapshot(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    gpt = model()
    with (
        swapper.offload(gpt, config(swap)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        steps(gpt, optimizer, 1)
        # the user's own value, which is not its master rounded
        wrapped.load_state_dict(
            {"ln_f.weight": torch.full((32,), 0.5, dtype=torch.bfloat16)}, strict=False
        )
        save_snapshot(wrapped, optimizer, name="s")
        expected = final_digest(wrapped, optimizer)
    assert "param16/param/ln_f.weight" in _store_keys(swap, "s")
    assert resume_digest(swap)[0] == expected


def test_an_optimizer_load_since_the_step_makes_the_snapshot_write_the_params(
    tmp_path: Path,
) -> None:
    swap = tmp_path / "swap"
    gpt = model()
    with (
        swapper.offload(gpt, config(swap)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        steps(gpt, optimizer, 1)
        lazy = optimizer.state_dict()
        saved = {**lazy, "state": dict(lazy["state"].items())}  # read now
        steps(gpt, optimizer, 1, seed=2)
        optimizer.load_state_dict(saved)  # masters of step 1, params of step 2
        report = save_snapshot(wrapped, optimizer, name="s")
        expected = final_digest(wrapped, optimizer)
    assert report.rebuilt_nbytes == 0
    assert resume_digest(swap)[0] == expected


def test_a_skipped_step_keeps_the_params_left_out(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    gpt = model().to(torch.float16)
    scaler = DynamicLossScaler(2.0**12)
    with (
        swapper.offload(gpt, config(swap)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped, loss_scaler=scaler) as opt,
    ):
        g = torch.Generator().manual_seed(3)
        scaler.scale(gpt.loss(torch.randint(0, 64, (2, 9), generator=g))).backward()
        opt.step()
        opt.zero_grad()
        (gpt.loss(torch.randint(0, 64, (2, 9), generator=g)) * float("inf")).backward()
        opt.step()  # inf gradients: skipped, nothing changed
        assert opt.last_step is not None and opt.last_step.skipped
        opt.zero_grad()
        report = save_snapshot(wrapped, opt, name="s")
        expected = final_digest(wrapped, opt)
    assert report.rebuilt_nbytes > 0
    gpt = model().to(torch.float16)
    with (
        swapper.offload(gpt, config(swap), resume=True) as wrapped,
        OffloadAdamW(
            wrapped.parameters(), lr=1e-2, tiers=wrapped, loss_scaler=DynamicLossScaler()
        ) as opt,
    ):
        assert final_digest(wrapped, opt) == expected


def test_frozen_params_are_written(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    gpt = model()
    gpt.ln_f.weight.requires_grad_(False)
    with swapper.offload(gpt, config(swap)) as wrapped:
        trained = [p for p in wrapped.parameters() if p.requires_grad]
        with OffloadAdamW(trained, lr=1e-2, tiers=wrapped) as optimizer:
            steps(gpt, optimizer, 1)
            report = save_snapshot(wrapped, optimizer, name="s")
    assert report.rebuilt_nbytes > 0
    keys = _store_keys(swap, "s")
    frozen = [k for k in keys if k.endswith("ln_f.weight")]
    assert frozen, keys  # no master: named (written if it was dirty)


def test_a_rebuilt_param_that_differs_refuses_its_snapshot_and_the_one_before_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    swap = tmp_path / "swap"
    gpt = model()
    with (
        swapper.offload(gpt, config(swap)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        steps(gpt, optimizer, 1)
        save_snapshot(wrapped, optimizer, name="good")
        good = final_digest(wrapped, optimizer)
        steps(gpt, optimizer, 1, seed=2)
        with monkeypatch.context() as m:  # a digest that no rebuild can match
            m.setattr(rebuild, "content_hash", lambda t: 0x0123456789ABCDEF)
            save_snapshot(wrapped, optimizer, name="bad")
    path = swap / f"{STORE}.bad.snap"
    with pytest.raises(SnapshotDamagedError, match=re.escape(str(path)) + ".*rebuilt from"):
        resume_digest(swap, resume="bad")
    assert resume_digest(swap) == (good, 1)


class _Store:
    """What Rebuilder asks of a store: one fp32 state tensor of 2048 elements."""

    def snapshot_tensor(self, name: str, key: str) -> object:
        class T:
            dtype = torch.float32
            shape = (2, 1024)

        return T()


class _Info:
    name = "s"
    keys = ("optim_state/s/0",)


def _row(**change: object) -> dict[str, object]:
    row: dict[str, object] = {
        "key": "param16/param/w",
        "dtype": "bfloat16",
        "shape": [2, 3],
        "xxh3_64": "0" * 16,
        "pieces": [["optim_state/s/0", 0, 0, 4], ["optim_state/s/0", 100, 4, 2]],
    }
    row.update(change)
    return row


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        ({}, "not a list"),
        ([{"key": "param/w"}], "not an object of fields"),
        ([_row(key="optim_state/s/0")], "is not a param16/... key the snapshot lacks"),
        ([_row(key="param/w")], "is not a param16/... key the snapshot lacks"),
        ([_row(dtype="int8")], "not bfloat16, float16 or float32"),
        ([_row(shape=[2, -3])], "shape"),
        ([_row(xxh3_64="xyz")], "16 hex digits"),
        ([_row(pieces=[["optim_state/s/0", 0, 0, 6.0]])], "is not \\[str, int, int, int\\]"),
        ([_row(pieces=[["optim_state/s/0", 0, 1, 6]])], "do not tile"),
        ([_row(pieces=[["optim_state/s/0", 0, 0, 4]])], "cover 4 of 6"),
        ([_row(pieces=[["optim_state/s/9", 0, 0, 6]])], "holds no state"),
        ([_row(pieces=[["optim_state/s/0", 2045, 0, 6]])], "has no fp32 elements"),
    ],
)
def test_malformed_rebuilt_records_are_refused_naming_the_file(raw: object, why: str) -> None:
    with pytest.raises(SnapshotDamagedError, match=f"^snapshot file F.*{why}"):
        rebuild.Rebuilder(raw, _Store(), _Info(), "snapshot file F")  # type: ignore[arg-type]


@settings(max_examples=200)
@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64),
    st.sampled_from([torch.bfloat16, torch.float16]),
)
def test_publish_rounds_as_to_does(bits: list[int], dtype: torch.dtype) -> None:
    # every fp32 bit pattern: NaN payloads, -0.0, subnormals, infinities, overflow to fp16
    master = torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32))
    published = torch.empty(len(bits), dtype=dtype)
    published.copy_(master)  # what OffloadAdamW._publish does (via copy_in)
    assert torch.equal(published.view(torch.int16), master.to(dtype).view(torch.int16))


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_params_left_out_over_compressed_moments_resume_bit_exactly(
    tmp_path: Path, moments: str
) -> None:
    # a uint8 state whose first bytes are the fp32 masters (swapper.step.layout)
    swap = tmp_path / "swap"

    def cfg(host_fraction: float) -> swapper.OffloadConfig:
        base = config(swap, host_fraction=host_fraction)
        step = dataclasses.replace(base.step, moments=moments)
        return dataclasses.replace(base, step=step)

    for host_fraction in (0.0, 0.1):
        shutil.rmtree(swap, ignore_errors=True)
        gpt = model()
        with (
            swapper.offload(gpt, cfg(host_fraction)) as wrapped,
            OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
        ):
            steps(gpt, optimizer, 2)
            report = save_snapshot(wrapped, optimizer, name="s")
            expected = final_digest(wrapped, optimizer)
        assert report.rebuilt_nbytes > 0
        gpt = model()
        with (
            swapper.offload(gpt, cfg(host_fraction), resume=True) as wrapped,
            OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
        ):
            assert final_digest(wrapped, optimizer) == expected
