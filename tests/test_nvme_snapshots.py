"""Copy-on-write snapshots of the NVMe store: round trips against a model, space, reopen,
hostile snapshot files, and SIGKILL during write/snapshot/drop/restore loops."""

from __future__ import annotations

import errno
import itertools
import json
import os
import random
import signal
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiers.aio import AioEngine
from tiers.config import AioConfig
from tiers.errors import SwapConfigError, SwapError, SwapIOError
from tiers.nvme import (
    Extent,
    NvmeStore,
    SnapshotExistsError,
    SnapshotNotFoundError,
    content_hash,
    remove_store,
    snapshotting,
)
from tiers.nvme.snapshots import SnapshotDamagedError, parse_snapshot

KiB = 1024


@pytest.fixture(scope="module")
def engine() -> Iterator[AioEngine]:
    with AioEngine(AioConfig(num_threads=2, block_size=64 * KiB)) as e:
        yield e


def _tensor(n: int, fill: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(fill)
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)


def _read(store: NvmeStore, key: str) -> torch.Tensor:
    out = torch.empty(store.info(key).nbytes, dtype=torch.uint8)
    store.read(key, out).result(timeout=30)
    return out


def _read_snap(store: NvmeStore, name: str, key: str) -> torch.Tensor:
    out = torch.empty(store.snapshot_tensor(name, key).nbytes, dtype=torch.uint8)
    store.read_snapshot(name, key, out).result(timeout=30)
    return out


def _held_extents(store: NvmeStore) -> list[Extent]:
    """Distinct extents of every live version and every snapshot's version."""
    found = {e for k in store for e in store.info(k).extents}
    for info in store.snapshots():
        found |= {e for k in info.keys for e in store.snapshot_tensor(info.name, k).extents}
    return sorted(found, key=lambda e: (e.dir_index, e.offset))


def _check_space(store: NvmeStore) -> None:
    """No two held extents overlap, and (after a sync) nothing else is allocated."""
    store.sync()
    extents = _held_extents(store)
    for a, b in itertools.pairwise(extents):
        if a.dir_index == b.dir_index:
            assert a.offset + a.allocated_nbytes <= b.offset, f"{a} overlaps {b}"
    per_dir = [0] * len(store.dirs)
    for e in extents:
        per_dir[e.dir_index] += e.allocated_nbytes
    assert [u.allocated_nbytes for u in store.dir_usage()] == per_dir  # nothing leaked


# -- round trips against a model ----------------------------------------------------------

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.sampled_from("abcd"), st.integers(0, 40_000)),
        st.tuples(st.just("delete"), st.sampled_from("abcd"), st.just(0)),
        st.tuples(st.just("snap"), st.just(""), st.just(0)),
        st.tuples(st.just("drop"), st.just(""), st.integers(0, 5)),
        st.tuples(st.just("restore"), st.just(""), st.integers(0, 5)),
        st.tuples(st.just("reopen"), st.just(""), st.just(0)),
    ),
    min_size=4,
    max_size=30,
)


def _check_model(store: NvmeStore, live: dict[str, int], snaps: dict[str, dict[str, int]]) -> None:
    assert {k: content_hash(_read(store, k)) for k in store} == live
    assert [i.name for i in store.snapshots()] == list(snaps)
    for info in store.snapshots():
        held = {k: content_hash(_read_snap(store, info.name, k)) for k in info.keys}
        assert held == snaps[info.name], info.name
        assert info.extra == {"live": sorted(snaps[info.name])}


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=_ops, n_dirs=st.sampled_from([1, 2]))
def test_random_sequences_match_a_model(
    tmp_path_factory: pytest.TempPathFactory,
    engine: AioEngine,
    ops: list[tuple[str, str, int]],
    n_dirs: int,
) -> None:
    root = tmp_path_factory.mktemp("model")
    dirs = [root / f"d{i}" for i in range(n_dirs)]
    store = NvmeStore(dirs, engine, stripe_nbytes=16 * KiB)
    live: dict[str, int] = {}  # key -> content hash
    snaps: dict[str, dict[str, int]] = {}  # in order taken
    fill = 0
    try:
        for op, key, arg in ops:
            if op == "write":
                fill += 1
                t = _tensor(arg, fill)
                store.write(key, t).result(timeout=30)
                live[key] = content_hash(t)
            elif op == "delete" and key in live:
                store.delete(key)
                del live[key]
            elif op == "snap":
                name = f"s{fill}-{len(snaps)}"
                if name in snaps:
                    with pytest.raises(SnapshotExistsError):
                        store.snapshot(name)
                    continue
                info = store.snapshot(name, extra={"live": sorted(live)})
                assert info.keys == tuple(store.keys())
                snaps[name] = dict(live)
            elif op in ("drop", "restore") and snaps:
                name = list(snaps)[arg % len(snaps)]
                if op == "drop":
                    store.drop_snapshot(name)
                    del snaps[name]
                else:
                    store.restore_snapshot(name)
                    live = dict(snaps[name])
            elif op == "reopen":
                store.close()
                store = NvmeStore.open(dirs, engine)
            _check_model(store, live, snaps)  # after every step: a freed extent shows at once
        for _ in range(2):  # as left, then after a reopen
            _check_model(store, live, snaps)
            _check_space(store)
            store.close()
            store = NvmeStore.open(dirs, engine)
        assert store.damaged_snapshots() == {}
    finally:
        store.close(remove=True)
    assert sorted(p.name for d in dirs for p in d.iterdir()) == []


# -- copy-on-write, cost, space -----------------------------------------------------------


def test_snapshot_keeps_old_bytes_while_key_is_rewritten(tmp_path: Path, engine: AioEngine) -> None:
    with NvmeStore([tmp_path], engine, stripe_nbytes=64 * KiB) as store:
        old = _tensor(100_000, 1)
        store.write("w", old).result()
        before = store.info("w").extents
        store.snapshot("before")
        for i in range(5):  # rewrite many times: the freed space of each is reused
            store.write("w", _tensor(100_000, 10 + i)).result()
            assert not set(store.info("w").extents) & set(before)
            assert torch.equal(_read_snap(store, "before", "w"), old)
        store.delete("w")
        store.sync()
        assert torch.equal(_read_snap(store, "before", "w"), old)
        assert store.snapshot_tensor("before", "w").extents == before
        with pytest.raises(SnapshotNotFoundError, match="holds no key='x'"):
            store.snapshot_tensor("before", "x")
        with pytest.raises(KeyError):
            store.read_snapshot("nope", "w", old)


def test_reopen_keeps_snapshots_and_never_reuses_their_extents(
    tmp_path: Path, engine: AioEngine
) -> None:
    old = {k: _tensor(50_000, i) for i, k in enumerate("abc")}
    with NvmeStore([tmp_path], engine, stripe_nbytes=64 * KiB) as store:
        for k, t in old.items():
            store.write(k, t).result()
        store.snapshot("s", extra={"step": 7})
        for k in "abc":
            store.delete(k)  # the snapshot is now the only holder
    with NvmeStore.open([tmp_path], engine) as store:
        assert store.keys() == []
        (info,) = store.snapshots()
        assert (info.name, info.keys, info.extra) == ("s", ("a", "b", "c"), {"step": 7})
        assert info.exclusive_nbytes == store.dir_usage()[0].allocated_nbytes > 0
        for i in range(6):  # first fit would take the snapshot's space if it were free
            store.write(f"n{i}", _tensor(50_000, 100 + i)).result()
        for k, t in old.items():
            assert torch.equal(_read_snap(store, "s", k), t)
        _check_space(store)
        store.restore_snapshot("s")
        assert store.snapshots()[0].exclusive_nbytes == 0  # now current too
        assert sorted(store.keys()) == ["a", "b", "c"]
        _check_space(store)


def test_snapshot_after_many_writes_writes_only_a_small_file(
    tmp_path: Path, engine: AioEngine
) -> None:
    with NvmeStore([tmp_path], engine, stripe_nbytes=1 << 20) as store:
        data_nbytes = 0
        for i in range(40):
            t = _tensor(256 * KiB, i)
            store.write(f"k{i}", t).result()
            data_nbytes += t.numel()
        file_before = store.dir_usage()[0].file_nbytes
        info = store.snapshot("cheap")
        assert info.file_nbytes == info.path.stat().st_size
        assert info.file_nbytes < data_nbytes / 100  # a manifest, not a copy
        assert store.dir_usage()[0].file_nbytes == file_before  # no data written
        assert info.nbytes == data_nbytes
        assert info.exclusive_nbytes == 0  # every version it holds is also current


def test_drop_frees_what_only_the_snapshot_held(tmp_path: Path, engine: AioEngine) -> None:
    with NvmeStore([tmp_path], engine, stripe_nbytes=64 * KiB) as store:
        store.write("a", _tensor(64 * KiB, 1)).result()
        store.write("b", _tensor(32 * KiB, 2)).result()
        store.snapshot("s1")
        store.snapshot("s2")
        store.write("a", _tensor(64 * KiB, 3)).result()  # old a: held by s1 and s2
        store.sync()
        assert store.dir_usage()[0].allocated_nbytes == 160 * KiB
        infos = {i.name: i for i in store.snapshots()}
        assert infos["s1"].exclusive_nbytes == 0  # shared with s2
        store.drop_snapshot("s1")
        assert store.dir_usage()[0].allocated_nbytes == 160 * KiB
        assert store.snapshots()[0].exclusive_nbytes == 64 * KiB
        store.drop_snapshot("s2")
        assert store.dir_usage()[0].allocated_nbytes == 96 * KiB
        with pytest.raises(SnapshotNotFoundError, match="no snapshot 's2'"):
            store.drop_snapshot("s2")
        _check_space(store)


def test_a_failed_directory_sync_of_a_drop_frees_its_extents_once_a_retry_succeeds(
    tmp_path: Path, engine: AioEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = snapshotting.fsync_dir
    failures = [1]

    def fsync_dir(path: Path) -> None:
        if failures[0]:
            failures[0] -= 1
            raise SwapIOError(errno.EIO, "cannot sync directory: injected", str(path))
        real(path)

    monkeypatch.setattr(snapshotting, "fsync_dir", fsync_dir)
    with NvmeStore([tmp_path], engine, stripe_nbytes=64 * KiB) as store:
        store.write("a", _tensor(64 * KiB, 1)).result()
        store.snapshot("s")
        store.write("a", _tensor(64 * KiB, 2)).result()  # old a: held by s only
        store.sync()
        assert store.dir_usage()[0].allocated_nbytes == 128 * KiB
        with pytest.raises(SwapIOError, match="injected"):
            store.drop_snapshot("s")
        assert store.snapshots() == []
        assert store.dir_usage()[0].allocated_nbytes == 128 * KiB  # the unlink may not last
        store.sync()  # retries the directory sync, which now succeeds
        assert store.dir_usage()[0].allocated_nbytes == 64 * KiB
        _check_space(store)


def test_prune_keeps_last_and_names_are_checked(tmp_path: Path, engine: AioEngine) -> None:
    with NvmeStore([tmp_path], engine) as store:
        for i in range(5):
            store.write("k", _tensor(5000, i)).result()
            store.snapshot(f"step-{i}", keep_last=3)
        assert [i.name for i in store.snapshots()] == ["step-2", "step-3", "step-4"]
        assert [i.seq for i in store.snapshots()] == [2, 3, 4]
        assert store.prune_snapshots(keep_last=1) == ["step-2", "step-3"]
        for bad in ["", "a.b", "../x", "-x", "x" * 65, "a/b", 3, "é"]:
            with pytest.raises(SwapConfigError):
                store.snapshot(bad)  # type: ignore[arg-type]
        with pytest.raises(SwapConfigError):
            store.prune_snapshots(keep_last=-1)
        with pytest.raises(SnapshotExistsError, match="step-4"):
            store.snapshot("step-4")
        with pytest.raises(TypeError):
            store.snapshot("t", extra={"x": (1, 2)})  # would read back as a list
        with pytest.raises(TypeError):
            store.snapshot("t", extra={"x": float("nan")})
        info = store.snapshot("t", extra=b"\x00raw\xff")
        assert info.extra == b"\x00raw\xff"
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    with NvmeStore.open([tmp_path], engine) as store:
        assert [i.name for i in store.snapshots()] == ["step-4", "t"]
        assert store.snapshots()[1].extra == b"\x00raw\xff"


def test_restore_is_durable_and_supersedes_writes(tmp_path: Path, engine: AioEngine) -> None:
    with NvmeStore([tmp_path], engine) as store:
        a, b = _tensor(9000, 1), _tensor(100, 2)
        store.write("a", a).result()
        store.write("b", b).result()
        store.snapshot("s")
        store.write("a", _tensor(9000, 3)).result()
        store.write("c", _tensor(10, 4)).result()
        store.delete("b")
        store.restore_snapshot("s")
        assert store.keys() == ["a", "b"]
        with pytest.raises(SnapshotNotFoundError):
            store.restore_snapshot("missing")
    with NvmeStore.open([tmp_path], engine) as store:
        assert sorted(store.keys()) == ["a", "b"]
        assert torch.equal(_read(store, "a"), a) and torch.equal(_read(store, "b"), b)
        store.drop_snapshot("s")  # the restored versions are current: nothing freed
        assert torch.equal(_read(store, "a"), a)
        _check_space(store)


def test_close_remove_and_remove_store_delete_snapshot_files(
    tmp_path: Path, engine: AioEngine
) -> None:
    other = NvmeStore([tmp_path], engine, name="a.x")  # shares the prefix "a."
    other.write("k", _tensor(10, 1)).result()
    other.snapshot("s")
    other.close()
    store = NvmeStore([tmp_path], engine, name="a")
    store.write("k", _tensor(10, 1)).result()
    store.snapshot("x")
    store.close(remove=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["a.x.bin", "a.x.json", "a.x.journal", "a.x.lock", "a.x.s.snap"]
    )
    with NvmeStore.open([tmp_path], engine, name="a.x") as other:
        assert [i.name for i in other.snapshots()] == ["s"]
    remove_store([tmp_path], name="a.x")
    assert list(tmp_path.iterdir()) == []


def test_snapshot_file_left_from_a_removed_store_blocks_create(
    tmp_path: Path, engine: AioEngine
) -> None:
    (tmp_path / "swapper-store.old.snap").write_text("{}")
    with pytest.raises(SwapError, match="already there"):
        NvmeStore([tmp_path], engine)


# -- hostile snapshot files ---------------------------------------------------------------


def _damage_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-40])


def _damage_garbage(path: Path) -> None:
    path.write_bytes(b"{not json" * 10)


def _damage_symlink(path: Path) -> None:
    target = path.with_name("elsewhere")
    path.rename(target)
    path.symlink_to(target)


def _damage_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _damage_huge(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate((1 << 30) + 1)  # sparse: costs nothing, must not be read


def _damage_extents(path: Path) -> None:
    """A well-formed, digested file whose extent overlaps the live key's (hostile)."""
    body = path.read_bytes().rsplit(b"\n#xxh3=", 1)[0]
    document = json.loads(body)
    document["tensors"]["k"]["extents"][0]["offset"] = 4096
    import xxhash

    body = json.dumps(document, indent=1).encode()
    path.write_bytes(body + b"\n#xxh3=%016x\n" % xxhash.xxh3_64_intdigest(body))


@pytest.mark.parametrize(
    "damage",
    [
        _damage_flip,
        _damage_truncate,
        _damage_garbage,
        _damage_symlink,
        _damage_fifo,
        _damage_huge,
        _damage_extents,
    ],
)
def test_damaged_snapshot_file_is_listed_and_ignored(
    tmp_path: Path, engine: AioEngine, damage
) -> None:
    with NvmeStore([tmp_path], engine) as store:
        store.write("k", _tensor(20 * KiB, 1)).result()
        store.snapshot("good")
        store.write("k", _tensor(20 * KiB, 2)).result()  # "bad" names the current version
        store.snapshot("bad")
        current = _read(store, "k")
    damage(tmp_path / "swapper-store.bad.snap")
    started = time.monotonic()
    with NvmeStore.open([tmp_path], engine) as store:
        assert time.monotonic() - started < 10  # no hang on a FIFO, no read of a huge file
        assert [i.name for i in store.snapshots()] == ["good"]
        damaged = store.damaged_snapshots()
        assert list(damaged) == ["bad"] and "swapper-store.bad.snap" in damaged["bad"]
        assert torch.equal(_read(store, "k"), current)
        assert torch.equal(_read_snap(store, "good", "k"), _tensor(20 * KiB, 1))
        with pytest.raises(SnapshotNotFoundError, match="damaged"):
            store.read_snapshot("bad", "k", current)
        with pytest.raises(SnapshotExistsError):
            store.snapshot("bad")
        store.drop_snapshot("bad")  # deletes the damaged file (not a symlink's target)
        assert not os.path.lexists(tmp_path / "swapper-store.bad.snap")
        store.snapshot("bad")
        _check_space(store)


def test_parse_refuses_another_stores_snapshot(tmp_path: Path, engine: AioEngine) -> None:
    with NvmeStore([tmp_path], engine) as store:
        info = store.snapshot("s")
        data = info.path.read_bytes()
        kwargs = {"dirs": [tmp_path], "stripe_nbytes": store.stripe_nbytes, "checksum": True}
    parse_snapshot(data, info.path, store="swapper-store", name="s", **kwargs)
    with pytest.raises(SnapshotDamagedError, match="store"):
        parse_snapshot(data, info.path, store="other", name="s", **kwargs)
    with pytest.raises(SnapshotDamagedError, match="snapshot"):
        parse_snapshot(data, info.path, store="swapper-store", name="t", **kwargs)


# -- SIGKILL ------------------------------------------------------------------------------

_WORKER = textwrap.dedent(
    """
    import os, random, sys
    import torch
    from tiers.aio import AioEngine
    from tiers.config import AioConfig
    from tiers.nvme import NvmeStore, content_hash

    def say(line):
        os.write(1, (line + "\\n").encode())

    def worker(seed, d):
        rng = random.Random(seed)
        engine = AioEngine(AioConfig(num_threads=1, block_size=64 << 10))
        store = NvmeStore.open([d], engine)
        n = 0
        while True:
            roll = rng.random()
            names = [i.name for i in store.snapshots()]
            if roll < 0.5:
                key = rng.choice("abc")
                t = torch.randint(0, 256, (rng.randint(1, 200_000),), dtype=torch.uint8)
                store.write(key, t).result()
            elif roll < 0.75:
                n += 1
                name = f"p{seed}-{n}"
                state = {k: content_hash(_read(store, k)) for k in store.keys()}
                say(f"INTEND {name}")
                store.snapshot(name)
                say("SNAP " + name + " " + " ".join(f"{k}={v}" for k, v in state.items()))
            elif roll < 0.9 and len(names) > 2:
                name = rng.choice(names)
                say(f"DROPPING {name}")
                store.drop_snapshot(name)
                say(f"DROPPED {name}")
            elif names:
                store.restore_snapshot(rng.choice(names))

    def _read(store, k):
        out = torch.empty(store.info(k).nbytes, dtype=torch.uint8)
        store.read(k, out).result()
        return out

    for line in sys.stdin:
        seed, d = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                worker(int(seed), d)
            finally:
                os._exit(1)
        say(f"CHILD {pid}")
        os.waitpid(pid, 0)
        say(f"EXIT {pid}")
    """
)


def test_sigkill_during_snapshot_loop_keeps_complete_snapshots(
    tmp_path: Path, engine: AioEngine
) -> None:
    from test_nvme_crash import Zygote  # the fork-per-trial helper (imports torch once)

    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    d = tmp_path / "store"
    NvmeStore([d], engine, stripe_nbytes=64 * KiB).close()
    rng = random.Random(13)
    zygote = Zygote(script)
    complete: dict[str, dict[str, int]] = {}
    dropping: set[str] = set()
    made = verified = 0
    try:
        for trial in range(10):
            zygote.send(f"{rng.randrange(1 << 30)} {d}")
            first = zygote.line(30)
            assert first.startswith("CHILD "), first
            pid = int(first.split()[1])
            # Odd trials: killed once the worker has reported a snapshot (then a random
            # few ms more), so that kills land among snapshots however slow a loaded
            # machine makes it; even ones after a random delay.
            wait_snap = trial % 2 == 1
            if not wait_snap:
                time.sleep(rng.uniform(0.05, 0.4))
                os.kill(pid, signal.SIGKILL)
            while True:
                what, *rest = zygote.line(30).split()
                if what == "EXIT":
                    break
                if what == "SNAP":
                    made += 1
                    complete[rest[0]] = {k: int(v) for k, v in (p.split("=") for p in rest[1:])}
                    if wait_snap:
                        wait_snap = False
                        time.sleep(rng.uniform(0.0, 0.1))
                        os.kill(pid, signal.SIGKILL)
                elif what == "DROPPING":
                    dropping.add(rest[0])
                elif what == "DROPPED":
                    dropping.discard(rest[0])
                    del complete[rest[0]]
            with NvmeStore.open([d], engine) as store:
                assert store.damaged_snapshots() == {}, trial
                names = {i.name for i in store.snapshots()}
                # Every snapshot reported complete is there (unless a drop was cut).
                assert set(complete) - dropping <= names, trial
                for name in names & set(complete):
                    info = next(i for i in store.snapshots() if i.name == name)
                    assert set(info.keys) == set(complete[name]), (trial, name)
                    for k in info.keys:
                        got = content_hash(_read_snap(store, name, k))
                        assert got == complete[name][k], (trial, name, k)
                        verified += 1
                for name in dropping - names:  # a drop cut after its file went
                    del complete[name]
                dropping.clear()  # a drop cut before that left it whole (checked above)
                for name in names - set(complete) - dropping:  # made but not reported
                    store.drop_snapshot(name)
                _check_space(store)
                assert not [p for p in d.iterdir() if p.name.endswith(".tmp")], trial
    finally:
        zygote.close()
    assert made >= 5 and verified > 0  # the kills did land among snapshots that count


def test_a_snapshot_file_that_cannot_be_read_fails_the_open_not_listed_damaged(
    tmp_path: Path, engine: AioEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An I/O error reading a snapshot file at open (EIO) proves nothing of its bytes:
    listed as damaged, a resume would pass over it to an older snapshot. The open fails
    naming the file; once it reads again, the snapshot is there."""
    from tiers.nvme import opening
    from tiers.nvme.records import ManifestError

    with NvmeStore([tmp_path], engine) as store:
        store.write("a", _tensor(5000, 1)).result()
        store.snapshot("old")
        store.snapshot("new")
    real = opening.read_metadata

    def eio(path: Path, what: str, **kwargs: object) -> bytes:
        if path.name.endswith(".new.snap"):  # as read_metadata reports an EIO
            cause = OSError(errno.EIO, os.strerror(errno.EIO))
            raise ManifestError(f"cannot read the {what} {path}: {cause.strerror}") from cause
        return real(path, what, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(opening, "read_metadata", eio)
    with pytest.raises(SwapIOError, match="not proof of damage") as info:
        NvmeStore.open([tmp_path], engine)
    assert info.value.errno == errno.EIO and info.value.filename.endswith(".new.snap")
    monkeypatch.setattr(opening, "read_metadata", real)
    with NvmeStore.open([tmp_path], engine) as store:  # the lock was released
        assert [i.name for i in store.snapshots()] == ["old", "new"]
        assert store.damaged_snapshots() == {}
