"""Tests of the store lock (tiers.nvme.lock) and remove_store: one open store per set of
files, whoever tries, and a crashed holder never blocks the next one."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tiers.aio import AioEngine
from tiers.config import AioConfig
from tiers.errors import StoreLockedError, SwapError
from tiers.nvme import ManifestError, NvmeStore, StoreExistsError, remove_store

ROOT = Path(__file__).resolve().parent.parent

_HOLDER = textwrap.dedent(
    """
    import sys, time, torch
    from tiers.aio import AioEngine
    from tiers.nvme import NvmeStore

    dirs, mode = sys.argv[1:-1], sys.argv[-1]
    engine = AioEngine()
    if mode == "create":
        store = NvmeStore(dirs, engine)
        store.write("k", torch.arange(1000.0)).result()
    else:
        store = NvmeStore.open(dirs, engine)
    print("READY", flush=True)
    time.sleep(600)
    """
)


@pytest.fixture(scope="module")
def engine() -> Iterator[AioEngine]:
    with AioEngine(AioConfig(num_threads=1)) as e:
        yield e


def _holder(tmp_path: Path, dirs: list[Path], mode: str) -> subprocess.Popen[str]:
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    proc = subprocess.Popen(
        [sys.executable, str(script), *map(str, dirs), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        raise AssertionError(f"holder did not start: {line!r} {proc.stderr.read()}")  # type: ignore[union-attr]
    return proc


def test_same_process_second_opener_is_refused_every_way(tmp_path: Path, engine: AioEngine) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    store = NvmeStore(dirs, engine)
    store.write("k", torch.ones(10)).result()
    for _ in range(3):
        with pytest.raises(StoreLockedError) as info:
            NvmeStore.open(dirs, engine)
        assert info.value.pid == os.getpid() and info.value.directory == str(dirs[0])
        assert str(dirs[0]) in str(info.value) and f"pid {os.getpid()}" in str(info.value)
        assert "this process" in str(info.value)
        assert isinstance(info.value, SwapError) and isinstance(info.value, RuntimeError)
    # The constructor takes the lock before looking for an existing store.
    with pytest.raises(StoreLockedError):
        NvmeStore(dirs, engine)
    with pytest.raises(StoreLockedError):
        remove_store(dirs)
    # Only the second directory shared: still refused, naming that directory.
    with pytest.raises(StoreLockedError) as info:
        NvmeStore([tmp_path / "c", dirs[1]], engine)
    assert info.value.directory == str(dirs[1])
    assert not (tmp_path / "c" / "swapper-store.lock").exists()  # the refused one undid all
    assert store.keys() == ["k"]  # the holder is untouched
    store.close()
    with NvmeStore.open(dirs, engine) as again:
        assert again.keys() == ["k"]


def test_lock_file_holds_pid_with_mode_0600(tmp_path: Path, engine: AioEngine) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    with NvmeStore(dirs, engine, name="rank3"):
        for d in dirs:
            lock = d / "rank3.lock"
            assert lock.read_text().strip() == str(os.getpid())
            assert stat.S_IMODE(os.stat(lock).st_mode) == 0o600
        # Another name in the same directories is another store: not locked out.
        with NvmeStore(dirs, engine, name="rank4") as other:
            other.close(remove=True)


def test_another_process_holds_it_then_is_killed(tmp_path: Path, engine: AioEngine) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    holder = _holder(tmp_path, dirs, "create")
    try:
        for _ in range(5):  # refused every time, by every call
            with pytest.raises(StoreLockedError) as info:
                NvmeStore.open(dirs, engine)
            assert info.value.pid == holder.pid and f"pid {holder.pid}" in str(info.value)
            with pytest.raises(StoreLockedError):
                NvmeStore(dirs, engine)
            with pytest.raises(StoreLockedError):
                remove_store(dirs)
        assert (dirs[0] / "swapper-store.json").exists()  # nothing was deleted
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    # The kernel released the lock with the process: the store opens, with its tensor.
    with NvmeStore.open(dirs, engine) as store:
        assert torch.equal(_read(store, "k"), torch.arange(1000.0))
    # And a holder that reopened it blocks us in turn, then dies.
    holder = _holder(tmp_path, dirs, "open")
    try:
        with pytest.raises(StoreLockedError, match=f"pid {holder.pid}"):
            NvmeStore.open(dirs, engine)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    removed = remove_store(dirs)
    assert sorted(p.name for p in removed) == sorted(
        ["swapper-store.bin"] * 2
        + ["swapper-store.json", "swapper-store.journal"]
        + ["swapper-store.lock"] * 2
    )
    assert [list(d.iterdir()) for d in dirs] == [[], []]


def _read(store: NvmeStore, key: str) -> torch.Tensor:
    info = store.info(key)
    out = torch.empty(info.shape, dtype=info.dtype)
    store.read(key, out).result(timeout=10)
    return out


def test_remove_store_deletes_only_that_store(tmp_path: Path, engine: AioEngine) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    with NvmeStore(dirs, engine, name="s1") as store:
        store.write("k", torch.ones(10)).result()
    with NvmeStore(dirs, engine, name="s1.x") as other:  # a name that extends s1's
        other.write("k", torch.ones(10)).result()
    (dirs[0] / "notes.txt").write_text("mine")
    (dirs[0] / ".s1.json.abcd1234.tmp").write_text("{")  # an orphan of a killed save
    (dirs[0] / ".s1.journal.0a1b2c3d.tmp").write_text("")
    (dirs[0] / ".s1.json.not-ours.tmp").write_text("")  # not a name the store makes
    removed = remove_store([str(d) for d in dirs], name="s1")
    assert ".s1.json.abcd1234.tmp" in {p.name for p in removed}
    left = sorted(p.name for p in dirs[0].iterdir())
    others = ["s1.x.bin", "s1.x.json", "s1.x.journal", "s1.x.lock"]
    assert left == sorted([".s1.json.not-ours.tmp", "notes.txt", *others])
    assert sorted(p.name for p in dirs[1].iterdir()) == ["s1.x.bin", "s1.x.lock"]
    assert remove_store(dirs, name="s1") == []  # nothing left: fine
    with NvmeStore.open(dirs, engine, name="s1.x") as other:
        assert other.keys() == ["k"]
    assert remove_store([tmp_path / "missing"]) == []


def test_store_left_half_made_can_be_removed_and_made_again(
    tmp_path: Path, engine: AioEngine
) -> None:
    """A crash while the constructor ran leaves files without a manifest: open() says so
    and names remove_store, the constructor's error names it too, and it works."""
    dirs = [tmp_path / "a"]
    with NvmeStore(dirs, engine) as store:
        store.write("k", torch.ones(10)).result()
    (dirs[0] / "swapper-store.json").unlink()  # as if killed before the manifest was written
    with pytest.raises(ManifestError, match=r"remove_store\(") as info:
        NvmeStore.open(dirs, engine)
    assert "no manifest" in str(info.value)
    with pytest.raises(StoreExistsError) as exists:
        NvmeStore(dirs, engine)
    message = str(exists.value)
    assert f"remove_store([{str(dirs[0])!r}], name='swapper-store')" in message
    assert "NvmeStore.open" not in message  # it cannot be reopened: not suggested
    remove_store([str(dirs[0])], name="swapper-store")  # the call the message names
    with NvmeStore(dirs, engine) as store:
        assert len(store) == 0


def test_exists_error_names_calls_that_work(tmp_path: Path, engine: AioEngine) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    NvmeStore(dirs, engine, name="r0").close()
    with pytest.raises(StoreExistsError) as info:
        NvmeStore(dirs, engine, name="r0")
    message = str(info.value)
    dirs_repr = repr([str(d) for d in dirs])
    assert f"NvmeStore.open({dirs_repr}, engine, name='r0')" in message
    assert f"tiers.nvme.remove_store({dirs_repr}, name='r0')" in message
    NvmeStore.open(dirs, engine, name="r0").close()  # the first call works...
    remove_store(dirs, name="r0")  # ...and so does the second
    assert [list(d.iterdir()) for d in dirs] == [[], []]


def test_close_remove_after_close_takes_the_lock_again(tmp_path: Path, engine: AioEngine) -> None:
    dirs = [tmp_path / "a"]
    store = NvmeStore(dirs, engine)
    store.close()
    other = NvmeStore.open(dirs, engine)
    with pytest.raises(StoreLockedError):
        store.close(remove=True)  # someone has it open now: nothing is deleted
    assert (dirs[0] / "swapper-store.bin").exists()
    other.close()
    store.close(remove=True)
    assert not dirs[0].exists()  # made by the store, empty: removed


def test_lock_path_not_a_regular_file(tmp_path: Path, engine: AioEngine) -> None:
    d = tmp_path / "a"
    d.mkdir()
    (d / "swapper-store.lock").mkdir()
    with pytest.raises(SwapError, match="lock"):
        NvmeStore([d], engine)
    (d / "swapper-store.lock").rmdir()
    (d / "swapper-store.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SwapError, match="symbolic link"):
        NvmeStore([d], engine)
    assert not (tmp_path / "elsewhere").exists()
    assert sorted(p.name for p in d.iterdir()) == ["swapper-store.lock"]


def test_lock_is_taken_quickly(tmp_path: Path, engine: AioEngine) -> None:
    dirs = [tmp_path / "a"]
    with NvmeStore(dirs, engine):
        start = time.monotonic()
        with pytest.raises(StoreLockedError):
            NvmeStore.open(dirs, engine)
        assert time.monotonic() - start < 1.0  # refused at once, never waits


def test_remove_store_takes_the_identity_record_and_can_keep_snapshots(
    tmp_path: Path, engine: AioEngine
) -> None:
    """Every file swapper makes for a store goes with it, the identity record a rank's
    store keeps beside it included (issue 28: it stayed, and the next run was refused
    again); with keep_snapshots only the lock and an interrupted save's leftovers go."""
    kept = tmp_path / "kept"
    with NvmeStore([kept], engine, name="s") as store:
        store.write("k", torch.ones(10)).result()
        store.snapshot("a")
    (kept / "s.identity").write_text("{}")
    (kept / ".s.json.abcd1234.tmp").write_text("{")
    removed = {p.name for p in remove_store([kept], name="s", keep_snapshots=True)}
    assert removed == {"s.lock", ".s.json.abcd1234.tmp"}
    assert sorted(p.name for p in kept.iterdir()) == [
        "s.a.snap", "s.bin", "s.identity", "s.journal", "s.json",
    ]  # fmt: skip
    with NvmeStore.open([kept], engine, name="s") as store:
        assert [i.name for i in store.snapshots()] == ["a"]
    removed = {p.name for p in remove_store([kept], name="s")}
    assert {"s.identity", "s.a.snap", "s.bin", "s.json", "s.lock"} <= removed
    assert list(kept.iterdir()) == []


def test_lock_holder_names_a_live_holder_and_nobody_after_close(
    tmp_path: Path, engine: AioEngine
) -> None:
    from tiers.files import lock_holder

    lock = tmp_path / "s.lock"
    assert lock_holder(lock) is None  # nothing there
    store = NvmeStore([tmp_path], engine, name="s")
    try:
        assert lock_holder(lock) == os.getpid()
    finally:
        store.close()
    assert lock_holder(lock) is None  # the file stays, nobody holds it


def test_close_remove_takes_the_identity_record(tmp_path: Path, engine: AioEngine) -> None:
    """A rank's store closed with remove=True (no snapshot to keep) leaves nothing that
    refuses the next run over the directory (issue 28: the identity record stayed)."""
    store = NvmeStore([tmp_path], engine, name="s")
    (tmp_path / "s.identity").write_text("{}")  # what swapper.distributed writes first
    store.write("k", torch.ones(10)).result()
    store.close(remove=True)
    assert list(tmp_path.iterdir()) == []
