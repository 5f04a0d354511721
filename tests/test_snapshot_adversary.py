"""Adversarial checks of training snapshots and resume (issue 13): Ctrl-C at the moments
that leave state half-changed, damaged or missing snapshot files, retention and the
copy-on-write invariant. Each test here failed before the fix its docstring names.
"""

from __future__ import annotations

import errno
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_train import config, model, resume_digest, steps

import swapper
from swapper import OffloadAdamW, StepConfig, SwapConfigError
from swapper.manager import EntryState, TierManager
from swapper.step import optimizer as optimizer_module
from swapper.zero.checkpoint import resume as checkpoint
from swapper.zero.checkpoint.snapshot import final_digest, save_snapshot
from tiers.aio import AioEngine
from tiers.config import AioConfig
from tiers.errors import SwapIOError
from tiers.nvme import NvmeStore, SnapshotExistsError, snapshotting


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
        steps(gpt, optimizer, 2)
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
        steps(gpt, optimizer, 1, seed=2)
        save_snapshot(wrapped, optimizer, name="last")
        expected = final_digest(wrapped, optimizer)
    assert resume_digest(swap) == (expected, 3)


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
        steps(gpt, optimizer, 2)
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
        steps(gpt, optimizer, 1, seed=2)
        save_snapshot(wrapped, optimizer, name="last")
        expected = final_digest(wrapped, optimizer)
    assert resume_digest(swap, host_fraction=0.1) == (expected, 3)


def test_a_snapshot_that_fails_keeps_the_one_of_the_same_name_it_was_to_replace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taking a snapshot under a name that exists (the default name, twice at one step:
    a periodic snapshot, then one at exit; or after a step skipped for overflow, which
    does not count) dropped the old one first: a failure (here the disk full as its file
    is written) or a kill before the new one was durable left none of that name, and
    with keep_last=1 no snapshot at all, so a resume started afresh and deleted the store
    (fix: NvmeStore.snapshot(replace=True) renames the new file over the old one, and
    the old one's extents are freed only after)."""
    swap = tmp_path / "swap"
    gpt = model()
    with (
        swapper.offload(gpt, config(swap)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        steps(gpt, optimizer, 2)
        first = save_snapshot(wrapped, optimizer, keep_last=1)
        expected = final_digest(wrapped, optimizer)

        def full(path: Path, data: bytes, what: str, **kw: Any) -> None:
            raise SwapIOError(errno.ENOSPC, f"cannot write the {what}: No space left", str(path))

        with monkeypatch.context() as patch:
            patch.setattr(snapshotting, "replace_file", full)
            with pytest.raises(SwapIOError, match="No space"):
                save_snapshot(wrapped, optimizer, keep_last=1)  # the same name
        store = wrapped.manager._ctx.store
        assert store is not None
        assert [s.name for s in store.snapshots()] == [first.name]
        assert first.path.exists()
        again = save_snapshot(wrapped, optimizer, keep_last=1)  # and now it works
        assert again.name == first.name
        assert again.dropped == (first.name,)
        assert [s.name for s in store.snapshots()] == [first.name]
    assert resume_digest(swap) == (expected, 2)


def test_a_snapshot_replaced_under_its_name_frees_only_what_the_old_one_alone_held(
    tmp_path: Path,
) -> None:
    """NvmeStore.snapshot(replace=True): the new file takes the old one's place in one
    rename; the old one's extents stay pinned until then and are freed after, except
    those the live state or another snapshot still names (copy-on-write)."""
    kib = 1024
    a0, a1, a2, b = (torch.full((64 * kib,), v, dtype=torch.uint8) for v in (1, 2, 3, 4))
    out = torch.empty(64 * kib, dtype=torch.uint8)
    with AioEngine(AioConfig(num_threads=2, block_size=64 * kib)) as engine:
        with NvmeStore([tmp_path], engine, stripe_nbytes=64 * kib) as store:
            store.write("a", a0).result()
            store.write("b", b).result()
            store.snapshot("x")
            store.snapshot("keep")
            store.write("a", a1).result()  # "x" and "keep" hold a0
            with pytest.raises(SnapshotExistsError):
                store.snapshot("x")
            store.sync()
            assert store.dir_usage()[0].allocated_nbytes == 192 * kib
            info = store.snapshot("x", replace=True)
            assert info.keys == ("a", "b")
            assert [s.name for s in store.snapshots()] == ["keep", "x"]
            assert store.dir_usage()[0].allocated_nbytes == 192 * kib  # a0 is "keep"'s
            store.read_snapshot("keep", "a", out).result()
            assert torch.equal(out, a0)
            store.drop_snapshot("keep")  # a0 named by nothing now
            assert store.dir_usage()[0].allocated_nbytes == 128 * kib
            store.write("a", a2).result()  # a1 stays: it is x's
            store.sync()
            store.read_snapshot("x", "a", out).result()
            assert torch.equal(out, a1)
            assert store.dir_usage()[0].allocated_nbytes == 192 * kib
        with NvmeStore.open([tmp_path], engine) as store:
            assert [s.name for s in store.snapshots()] == ["x"]
            assert store.damaged_snapshots() == {}
            store.read_snapshot("x", "a", out).result()
            assert torch.equal(out, a1)


@pytest.mark.parametrize("where", ["open_at_snapshot", "open_manager"])
def test_ctrl_c_as_a_resume_opens_its_manager_leaves_the_store_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A Ctrl-C just as the resumed manager was opened (after open_at_snapshot returned,
    before open_manager's try; or after open_manager returned, before OffloadedModel's)
    left the manager open with nobody to close it: its store stayed locked by this
    process, and the next resume failed with StoreLockedError (fix: both in a signal
    section whose end is inside the try that closes the manager)."""
    swap = tmp_path / "swap"
    gpt = model()
    with (
        swapper.offload(gpt, config(swap)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        steps(gpt, optimizer, 2)
        save_snapshot(wrapped, optimizer, name="a")
        expected = final_digest(wrapped, optimizer)
    real = getattr(checkpoint, where)  # (offload.py calls checkpoint.open_manager)

    def opened(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # arrives as it returns
        return result

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, where, opened)
        with pytest.raises(KeyboardInterrupt):
            swapper.offload(model(), config(swap), resume=True)
    assert resume_digest(swap) == (expected, 2)


def _ctrl_c_in_a_resume(rank: int, world: int, tmp: str, where: str) -> dict[str, Any]:
    """One rank: train 2 steps with a snapshot at 2, then resume with a Ctrl-C (on every
    rank, as a terminal's) at ``where``; then resume again."""
    import dist_ckpt_train
    import torch.distributed as dist

    from swapper.zero.checkpoint import shard_resume
    from swapper.zero.sharded import setup as shard_setup

    swap = str(Path(tmp) / "swap")
    first = dist_ckpt_train.train(rank, world, swap, steps=2, every=2)
    gpt = dist_ckpt_train.model()
    values = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    # "place": once the shards are placed; "open": as the store's parts are digested
    module: Any = shard_setup if where == "place" else shard_resume
    name = "_place" if where == "place" else "read_metadata"
    real = getattr(module, name)

    def cut_after(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return result

    setattr(module, name, cut_after)
    cut = ""
    try:
        swapper.offload(gpt, dist_ckpt_train.config(swap), dist.group.WORLD, resume=True)
    except KeyboardInterrupt:
        cut = "KeyboardInterrupt"
    finally:
        setattr(module, name, real)
    intact = all(torch.equal(p, values[n]) for n, p in gpt.named_parameters())
    again = dist_ckpt_train.train(rank, world, swap, steps=2, every=2)
    return {
        "cut": cut,
        "intact": intact,
        "digest": (first["digest"], again["digest"]),
        "resumed": again["resumed"],
    }


@pytest.mark.parametrize("where", ["place", "open"])
def test_ctrl_c_in_a_resume_over_ranks_leaves_nothing_open(tmp_path: Path, where: str) -> None:
    """Several ranks: a Ctrl-C while the resume's stores were opened and their parts
    digested (choose_sharded caught only Exception there, and closed its store only
    around the decision), or while the shards were placed (place_model caught only
    Exception: its clean-up was skipped, the parameters stayed emptied): the store
    stayed open, locked, and the next resume in the process failed with
    StoreLockedError (fix: the store closed on any exception; place_model agrees on a
    KeyboardInterrupt and cleans up as for an error, then raises it)."""
    import dist_ckpt_train

    runs = dist_ckpt_train.values(
        dist_ckpt_train.spawn(_ctrl_c_in_a_resume, 2, tmp_path, where, join_s=150)
    )
    for run in runs:
        assert run["cut"] == "KeyboardInterrupt"
        assert run["intact"]
        assert run["resumed"] == 2
        assert run["digest"][0] == run["digest"][1]


def test_keep_last_zero_is_refused_not_a_snapshot_dropped_as_it_is_taken(tmp_path: Path) -> None:
    """save_snapshot(keep_last=0) with one process took the snapshot, then pruned every
    snapshot, itself included, and returned its report as if it had been kept: the run
    believed it had a checkpoint and had none (several ranks refused it already).
    Fix: refused (SwapConfigError) before anything is taken, at any world size."""
    swap = tmp_path / "swap"
    gpt = model()
    with (
        swapper.offload(gpt, config(swap)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        steps(gpt, optimizer, 1)
        kept = save_snapshot(wrapped, optimizer, name="kept")
        for bad in (0, -1, True, 1.0):
            with pytest.raises(SwapConfigError, match="keep_last"):
                save_snapshot(wrapped, optimizer, name="zero", keep_last=bad)  # type: ignore[arg-type]
        store = wrapped.manager._ctx.store
        assert store is not None
        assert [s.name for s in store.snapshots()] == [kept.name]


def test_an_optimizer_that_fails_after_adopting_a_resume_leaves_the_state_for_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OffloadAdamW over a resumed model that failed after adopting the state (e.g.
    StepConfig(overlap=True) refused over several ranks, raised once adopt had run) closed
    its pipeline, which deleted the adopted state tensors, with the resume marked taken:
    the next OffloadAdamW started afresh, step 0 and zero moments, silently (fix: a
    failed constructor gives the adopted state back, untouched, for the next one)."""
    swap = tmp_path / "swap"
    gpt = model()
    with (
        swapper.offload(gpt, config(swap, host_fraction=0.1)) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        steps(gpt, optimizer, 2)
        save_snapshot(wrapped, optimizer, name="a")
        expected = final_digest(wrapped, optimizer)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise SwapConfigError("overlap refused (as over several ranks)")

    gpt = model()
    with swapper.offload(gpt, config(swap, host_fraction=0.1), resume=True) as wrapped:
        with monkeypatch.context() as patch:
            patch.setattr(optimizer_module, "DeferredSteps", refuse)
            with pytest.raises(SwapConfigError, match="overlap refused"):
                OffloadAdamW(
                    wrapped.parameters(), lr=1e-2, tiers=wrapped, config=StepConfig(overlap=True)
                )
        with OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped) as optimizer:
            assert (final_digest(wrapped, optimizer), optimizer.step_count) == (expected, 2)


def test_a_replace_whose_rename_may_not_be_durable_keeps_both_versions_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NvmeStore.snapshot(replace=True) whose file was renamed in but whose directory
    fsync failed: either file may be the one a crash leaves, so the extents of both stay
    held (nothing freed or reused) until the store is reopened, which reads the file."""
    kib = 1024
    a0, a1 = (torch.full((64 * kib,), v, dtype=torch.uint8) for v in (1, 2))
    out = torch.empty(64 * kib, dtype=torch.uint8)
    real = snapshotting.replace_file

    def renamed_then_failed(path: Path, data: bytes, what: str, **kw: Any) -> None:
        real(path, data, what, **kw)
        raise SwapIOError(errno.EIO, f"cannot sync the directory of the {what}", str(path))

    with AioEngine(AioConfig(num_threads=2, block_size=64 * kib)) as engine:
        with NvmeStore([tmp_path], engine, stripe_nbytes=64 * kib) as store:
            store.write("a", a0).result()
            store.snapshot("x")
            store.write("a", a1).result()
            with monkeypatch.context() as patch:
                patch.setattr(snapshotting, "replace_file", renamed_then_failed)
                with pytest.raises(SwapIOError, match="sync"):
                    store.snapshot("x", replace=True)
            store.write("a", a0 + 5).result()  # a1 is held by the new file: not reused
            store.write("a", a0 + 6).result()
            store.sync()
            assert store.dir_usage()[0].allocated_nbytes == 192 * kib  # a0, a1, a0 + 6
            store.read_snapshot("x", "a", out).result()  # the listing keeps the old one
            assert torch.equal(out, a0)
        with NvmeStore.open([tmp_path], engine) as store:
            assert store.damaged_snapshots() == {}
            store.read_snapshot("x", "a", out).result()  # the file is the new one
            assert torch.equal(out, a1)
