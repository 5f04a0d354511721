"""Training snapshots and resume (swapper.zero.checkpoint.snapshot, swapper.step.resume,
swapper.manager.snapshot): a run stopped and resumed from a snapshot ends bit-identical
to an uninterrupted one; a snapshot writes only what is dirty; bad snapshots are refused
by name and the last good one is used. The SIGKILL test is tests/test_checkpoint_kill.py.
"""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest
import torch
from ckpt_train import config, model, train
from hypothesis import given
from hypothesis import strategies as st

import swapper
from swapper import OffloadAdamW, OffloadConfig, StateDictError, StepConfig, SwapConfigError
from swapper.manager import EntryInUseError
from swapper.pressure.model import GPT, GPTConfig
from swapper.step.resume import _decode_value, _encode_value
from swapper.zero.checkpoint.snapshot import final_digest, save_snapshot
from tiers.aio import AioEngine
from tiers.config import AioConfig
from tiers.errors import SwapEOFError, SwapIOError
from tiers.nvme import NvmeStore, SnapshotDamagedError, SnapshotNotFoundError

STORE = "swapper-offload"


@pytest.fixture(scope="module")
def whole_bf16(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The digest of an uninterrupted bf16 run of 6 steps (snapshots every 2)."""
    return train(tmp_path_factory.mktemp("whole"), steps=6, every=2)


def _snap_file(swap: Path, step: int) -> Path:
    return swap / f"{STORE}.step-{step:09d}.snap"


def _resumed_step(out: str) -> int:
    return int([line for line in out.splitlines() if line.startswith("resumed ")][-1].split()[1])


@pytest.mark.parametrize(("dtype", "host_fraction"), [("bf16", 0.0), ("fp16", 0.1)])
def test_stop_and_resume_ends_bit_identical(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: str, host_fraction: float
) -> None:
    whole = train(tmp_path / "a", steps=6, every=2, dtype=dtype, host_fraction=host_fraction)
    swap = tmp_path / "b"
    # snapshot at 2, then step 3 is done and lost: the resume goes back to 2
    train(swap, steps=6, every=2, dtype=dtype, host_fraction=host_fraction, stop_after=3)
    assert _snap_file(swap, 2).exists()
    capsys.readouterr()
    resumed = train(swap, steps=6, every=2, dtype=dtype, host_fraction=host_fraction)
    assert _resumed_step(capsys.readouterr().out) == 2
    assert resumed == whole
    # and the digest sees a difference: one step fewer is another state
    assert train(tmp_path / "c", steps=5, every=2, dtype=dtype) != whole


def test_snapshot_writes_only_what_is_dirty_and_keeps_the_last_k(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    gpt = model()
    with (
        swapper.offload(gpt, config(swap)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        names = []
        for _ in range(4):
            gpt.loss(torch.randint(0, 64, (2, 9))).backward()
            optimizer.step()
            optimizer.zero_grad()
            report = save_snapshot(wrapped, optimizer, keep_last=2)
            names.append(report.name)
            # params (2 B) + state (12 B, padded) per parameter: all named
            assert report.nbytes >= 14 * 28_032
            assert 0 < report.written_nbytes <= report.nbytes + 1_000_000
        again = save_snapshot(wrapped, optimizer, name="again")
        assert again.nbytes == report.nbytes
        # nothing changed since the last one: only its file is written
        file_nbytes = again.path.stat().st_size
        assert again.written_nbytes == file_nbytes
        # after a step, what the step left dirty is 16-bit params (the optimizer's state
        # is durable when step() returns), each its fp32 master rounded: left out and
        # rebuilt at resume (swapper.zero.checkpoint.rebuild), so only the file is written
        assert report.written_nbytes == report.path.stat().st_size
        assert 0 < report.rebuilt_nbytes <= 2 * 28_032
        store = wrapped.manager._ctx.store
        assert store is not None
        assert [s.name for s in store.snapshots()] == [*names[-2:], "again"]
        assert report.dropped == (names[-3],)
        # in use: refused, nothing taken
        wrapped.manager.fetch("param/ln_f.weight")
        with pytest.raises(EntryInUseError, match=r"ln_f\.weight"):
            save_snapshot(wrapped, optimizer, name="busy")
        wrapped.manager.release("param/ln_f.weight", modified=False)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_snapshot_leaves_out_gradient_entries_kept_empty(
    tmp_path: Path, persistent: bool
) -> None:
    """With budgets that hold everything ``zero_grad`` keeps the gradient entries (empty,
    to be copied into); a snapshot must not write them: they hold no gradient. Persistent
    parameters (swapper.zero.local.persist) keep no gradient entry at all."""
    gpt = model()
    unlimited = OffloadConfig.create(
        device_nbytes=None,
        host_nbytes=None,
        nvme_dirs=[tmp_path / "swap"],
        device="cpu",
        step=StepConfig(sub_group_numel=1024),
    )

    def grad_keys() -> list[str]:
        return [k for k in list(wrapped.manager.keys()) if k.startswith("grad/")]

    with (
        swapper.offload(gpt, unlimited) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        wrapped.set_persistent(persistent)
        tokens = torch.randint(0, 64, (2, 9))
        gpt.loss(tokens).backward()
        assert wrapped.persistent is persistent
        optimizer.step()
        optimizer.zero_grad()
        assert bool(grad_keys()) is not persistent  # kept (persistent: none made)
        report = save_snapshot(wrapped, optimizer)
        assert not grad_keys()
        store = wrapped.manager._ctx.store
        assert store is not None
        assert [s.name for s in store.snapshots()] == [report.name]
        # the next backward registers them afresh, and a step after it works
        gpt.loss(tokens).backward()
        assert len(grad_keys()) == (0 if persistent else sum(1 for _ in wrapped.parameters()))
        optimizer.step()


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_newest_snapshot_is_named_and_the_one_before_used(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str, whole_bf16: str
) -> None:
    whole = whole_bf16
    swap = tmp_path / "b"
    train(swap, steps=6, every=2, stop_after=4)
    newest = _snap_file(swap, 4)
    data = bytearray(newest.read_bytes())
    if damage == "truncate":
        del data[len(data) // 2 :]
    else:
        data[len(data) // 3] ^= 0x01
    newest.write_bytes(bytes(data))
    with pytest.raises(SnapshotDamagedError, match=re.escape(str(newest))):
        train(swap, steps=6, every=2, resume="step-000000004")
    capsys.readouterr()
    assert train(swap, steps=6, every=2) == whole
    assert _resumed_step(capsys.readouterr().out) == 2


def test_another_models_snapshot_is_refused_naming_the_file(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    train(swap, steps=2, every=2)
    with pytest.raises(StateDictError, match=re.escape(str(_snap_file(swap, 2)))):
        swapper.offload(model(d_model=48), config(swap), resume=True)
    # the store and its snapshot are untouched: the right model resumes
    with swapper.offload(model(), config(swap), resume=True) as wrapped:
        assert wrapped.resumed is not None and wrapped.resumed.step == 2
        assert wrapped.resumed.extra == {"at": 2}
        # an optimizer of another layout is refused too, by name
        with pytest.raises(StateDictError, match="sub-groups"):
            OffloadAdamW(
                wrapped.parameters(), tiers=wrapped, config=StepConfig(sub_group_numel=4096)
            )


def test_a_snapshot_holding_parameters_the_model_lacks_is_refused(tmp_path: Path) -> None:
    # Every parameter of the smaller model is adopted; the snapshot's others are found
    # after (checkpoint.snapshot.finish_resume, given the model's keys), named.
    swap = tmp_path / "swap"
    train(swap, steps=2, every=2)
    torch.manual_seed(0)
    smaller = GPT(GPTConfig(vocab_size=64, context=16, d_model=32, n_layers=1, n_heads=2))
    with pytest.raises(StateDictError, match=r"holds parameter 'blocks\.1\..*this model lacks"):
        swapper.offload(smaller.to(torch.bfloat16), config(swap), resume=True)


def test_resume_with_nothing_to_resume_starts_afresh(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    with swapper.offload(model(), config(swap), resume=True) as wrapped:
        assert wrapped.resumed is None
    with pytest.raises(SnapshotNotFoundError, match="no store"):
        train(swap, steps=2, every=2, stop_after=2, resume="nope")
    train(swap, steps=2, every=2)
    with pytest.raises(SnapshotNotFoundError, match="no snapshot of that name"):
        train(swap, steps=2, every=2, resume="nope")


def test_final_digest_does_not_depend_on_the_sub_group_size(tmp_path: Path) -> None:
    digests = []
    for sub in (1024, 4096):
        gpt = model()
        with (
            swapper.offload(gpt, config(tmp_path / str(sub), sub_group_numel=sub)) as wrapped,
            OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
        ):
            for _ in range(2):
                gpt.loss(torch.randint(0, 64, (2, 9))).backward()
                optimizer.step()
                optimizer.zero_grad()
            digests.append(final_digest(wrapped, optimizer))
            assert final_digest(wrapped) != digests[-1]  # the optimizer's state counts
    assert digests[0] == digests[1]
    assert digests[0].startswith("xxh3-128:")


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(),
)


@given(st.one_of(_SCALARS, st.tuples(_SCALARS, _SCALARS)))
def test_param_group_settings_round_trip(value: object) -> None:
    back = _decode_value(json.loads(json.dumps(_encode_value("k", value))), "here")
    assert back == value and type(back) is type(value)


def test_a_newest_snapshot_with_corrupt_data_is_passed_over(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    whole_bf16: str,
) -> None:
    whole = whole_bf16
    swap = tmp_path / "b"
    train(swap, steps=6, every=2, stop_after=4)
    engine = AioEngine(AioConfig())
    try:
        with NvmeStore.open([swap], engine, name=STORE) as store:
            newest, older = "step-000000004", "step-000000002"
            key = next(
                k
                for k in store.snapshots()[-1].keys
                if k.startswith("optim_state/")
                and store.snapshot_tensor(newest, k).extents[0].offset
                != store.snapshot_tensor(older, k).extents[0].offset
            )
            extent = store.snapshot_tensor(newest, key).extents[0]
    finally:
        engine.close()
    data = swap / f"{STORE}.bin"
    with open(data, "r+b") as f:  # one bit flipped in a tensor only the newest names
        f.seek(extent.offset + 100)
        byte = f.read(1)
        f.seek(extent.offset + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    capsys.readouterr()
    assert train(swap, steps=6, every=2) == whole
    assert _resumed_step(capsys.readouterr().out) == 2
    assert any(newest in r.getMessage() and "unusable" in r.getMessage() for r in caplog.records)


def test_resume_needs_an_nvme_tier_and_a_bool_or_name(tmp_path: Path) -> None:
    with pytest.raises(SwapConfigError, match="NVMe tier"):
        swapper.offload(model(), OffloadConfig.create(device="cpu"), resume=True)
    with pytest.raises(SwapConfigError, match="resume=5"):
        swapper.offload(model(), config(tmp_path / "swap"), resume=5)  # type: ignore[arg-type]
    with (
        swapper.offload(model(), OffloadConfig.create(device="cpu")) as wrapped,
        pytest.raises(SwapConfigError, match="NVMe tier"),  # nothing to snapshot into
    ):
        save_snapshot(wrapped)


def test_a_transient_read_error_is_raised_not_rolled_back(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    whole_bf16: str,
) -> None:
    """An EIO reading the newest snapshot proves nothing of its bytes: resume=True raises
    it, naming the snapshot and its file, instead of falling back to the one before (a
    silent roll-back of two steps); once the error is gone the newest is resumed."""
    swap = tmp_path / "b"
    train(swap, steps=6, every=2, stop_after=4)
    newest = "step-000000004"
    real = NvmeStore.read_snapshot
    injected: list[str] = []

    def flaky(self: NvmeStore, name: str, key: str, out: torch.Tensor) -> object:
        if name == newest and not injected:  # one transient failure
            injected.append(key)
            raise SwapIOError(errno.EIO, "Input/output error (injected)", str(swap / "x.bin"))
        return real(self, name, key, out)

    monkeypatch.setattr(NvmeStore, "read_snapshot", flaky)
    capsys.readouterr()
    with pytest.raises(SwapIOError) as info:
        train(swap, steps=6, every=2)
    assert injected, "no read of the newest snapshot: nothing is tested"
    assert "resumed " not in capsys.readouterr().out  # nothing trained from step 2
    assert info.value.errno == errno.EIO and not isinstance(info.value, SwapEOFError)
    message = str(info.value)
    assert newest in message and str(_snap_file(swap, 4)) in message, message
    assert "does not fall back" in message and "resume='<its name>'" in message
    assert train(swap, steps=6, every=2) == whole_bf16  # the error gone: from step 4
    assert _resumed_step(capsys.readouterr().out) == 4
