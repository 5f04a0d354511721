"""What the disk pays (issue 29): the manager's count of bytes written to NVMe, by kind.

``stats().nvme_written()`` splits every byte written into the tensor kinds (param16,
grad16, optim_state, grad32) and the store's own metadata (journal, manifest, snapshot
files). These tests check it against the store's own counts and against the writes the
test made, and check the rule "never write what did not change": a clean copy already on
NVMe is not written again by an eviction, a snapshot, a flush or a dropped read-ahead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swapper.manager import Kind, ManagerConfig, NotDurableError, Tier, TierManager
from swapper.manager.snapshot import snapshot_manager
from swapper.manager.stats import METADATA_KINDS

KiB = 1024


def _config(root: Path) -> ManagerConfig:
    return ManagerConfig(
        device_nbytes=0,
        host_nbytes=512 * KiB,
        nvme_dirs=[root / "nvme"],
        host_arena_nbytes=64 * KiB,
        timeout_s=20.0,
        close_timeout_s=20.0,
        device="cpu",
    )


@pytest.fixture
def manager(tmp_path: Path) -> Iterator[TierManager]:
    m = TierManager(_config(tmp_path))
    try:
        yield m
    finally:
        with contextlib.suppress(NotDurableError):
            m.close()


def _written(manager: TierManager) -> dict[str, int]:
    return manager.stats().nvme_written()


def _store_agrees(manager: TierManager) -> None:
    """The manager's figures are the store's own counts: tensor kinds sum to the data
    bytes the store wrote, the metadata kinds are its metadata files' bytes."""
    stats = manager.stats()
    by_kind = stats.nvme_written()
    store = manager._ctx.nvme().written()
    assert sum(by_kind[k.value] for k in Kind) == store.data_nbytes
    assert by_kind["journal"] == store.journal_nbytes
    assert by_kind["manifest"] == store.manifest_nbytes
    assert by_kind["snapshot"] == store.snapshot_nbytes
    assert stats.nvme_written_nbytes == store.total_nbytes == sum(by_kind.values())


def test_every_kind_is_counted_and_matches_the_store(manager: TierManager) -> None:
    sizes = {Kind.PARAM16: 2048, Kind.GRAD16: 4096, Kind.OPTIM_STATE: 12 * 1024}
    for kind, nbytes in sizes.items():
        manager.register(f"{kind.value}/x", torch.ones(nbytes // 4), kind)
    assert set(_written(manager)) == {k.value for k in Kind} | set(METADATA_KINDS)
    for kind in sizes:
        manager.evict(f"{kind.value}/x", Tier.NVME).result(timeout=20)
    written = _written(manager)
    for kind, nbytes in sizes.items():
        assert written[kind.value] == nbytes
    assert written[Kind.GRAD32.value] == 0
    assert written["journal"] > 0  # one record per write, made durable
    _store_agrees(manager)
    manager.flush()  # nothing dirty: only the manifest is saved
    after = _written(manager)
    assert after["manifest"] > 0
    assert {k: after[k] for k in sizes} == {k: written[k] for k in sizes}
    snapshot_manager(manager, "s1")
    snap = _written(manager)
    assert snap["snapshot"] > 0
    assert all(snap[k.value] == written[k.value] for k in Kind)  # nothing rewritten
    _store_agrees(manager)


def test_a_clean_copy_is_never_written_again(manager: TierManager) -> None:
    """Eviction of an unmodified tensor, a snapshot or flush of clean state, and a
    read-ahead that is dropped again write no tensor bytes."""
    manager.register("w", torch.arange(4096.0), Kind.OPTIM_STATE)
    manager.evict("w", Tier.NVME).result(timeout=20)
    base = _written(manager)["optim_state"]
    for _ in range(3):
        manager.fetch("w", Tier.HOST)
        manager.release("w", modified=False)
        manager.evict("w", Tier.NVME).result(timeout=20)
    assert _written(manager)["optim_state"] == base
    assert manager.prefetch(["w"], Tier.HOST) == 1  # read ahead, never used: dropped
    manager.evict("w", Tier.NVME).result(timeout=20)
    manager.flush()
    snapshot_manager(manager, "clean")
    assert _written(manager)["optim_state"] == base
    # A modification is written once, at the next eviction.
    t = manager.fetch("w", Tier.HOST)
    t.add_(1)
    manager.release("w")
    manager.evict("w", Tier.NVME).result(timeout=20)
    assert _written(manager)["optim_state"] == 2 * base
    _store_agrees(manager)


@settings(max_examples=15, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([Kind.PARAM16, Kind.GRAD16, Kind.OPTIM_STATE]),
            st.integers(1, 3000),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_accounting_property(tmp_path_factory: pytest.TempPathFactory, plan: list) -> None:
    """For any registrations, modified or not before eviction, each kind's count is the
    bytes of the writes that had to happen, and the store agrees."""
    root = tmp_path_factory.mktemp("acct")
    expected = {k.value: 0 for k in Kind}
    with TierManager(_config(root)) as manager:
        for i, (kind, numel, modify) in enumerate(plan):
            key = f"k{i}"
            manager.register(key, torch.ones(numel), kind)
            manager.evict(key, Tier.NVME).result(timeout=20)
            expected[kind.value] += 4 * numel
            t = manager.fetch(key, Tier.HOST)
            if modify:
                t.mul_(2)
                expected[kind.value] += 4 * numel
            manager.release(key, modified=modify)
            manager.evict(key, Tier.NVME).result(timeout=20)
        written = _written(manager)
        assert {k.value: written[k.value] for k in Kind} == expected
        _store_agrees(manager)


def test_snapshot_names_do_not_grow_the_write_accounting(manager: TierManager) -> None:
    """Many snapshots, each under a new name and dropped after: the process-wide table of
    metadata bytes holds one counter for all of a store's snapshot files (not one per name,
    which a long run naming each snapshot anew would grow for ever), and counts them all."""
    from tiers.nvme import metafiles

    manager.register("x", torch.ones(1024), Kind.OPTIM_STATE)
    store = manager._ctx.nvme()
    root = store._files.dirs[0]  # pyright: ignore[reportPrivateUsage]
    mine = lambda: [p for p in metafiles._written if p.parent == root]  # noqa: E731
    snapshot_manager(manager, "first")
    keys = len(mine())
    before = _written(manager)["snapshot"]
    for i in range(30):
        snapshot_manager(manager, f"step-{i}")
        store.drop_snapshot(f"step-{i}")
    assert len(mine()) == keys
    assert _written(manager)["snapshot"] > before + 30 * 100  # each file counted
    _store_agrees(manager)
