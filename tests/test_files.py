"""tiers.files: SwapFile (two descriptors, O_DIRECT fallback per file, space reservation),
make_private_dir and check_private_dir."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tiers import files
from tiers.errors import (
    SwapConfigError,
    SwapError,
    SwapIOError,
    SwapNoSpaceError,
    UnsafeSwapDirError,
)
from tiers.files import SwapFile, check_private_dir, direct_refused, make_private_dir

O_DIRECT = getattr(os, "O_DIRECT", 0)


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def fd_is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError as exc:
        assert exc.errno == errno.EBADF
        return False
    return True


@pytest.fixture
def fresh_direct_refusals(monkeypatch: pytest.MonkeyPatch) -> set[tuple[str, str]]:
    """An empty process-wide 'O_DIRECT refused here' record for this test only."""
    refused: set[tuple[str, str]] = set()
    monkeypatch.setattr(files, "_direct_refused", refused)
    return refused


def refuse_o_direct_at_open(
    monkeypatch: pytest.MonkeyPatch, code: int = errno.EINVAL, only: str | None = None
) -> list:
    """Make opens with O_DIRECT fail with ``code`` (of files named ``only``, if given);
    returns the list of refused paths."""
    real_open = os.open
    refused: list = []

    def fake_open(path, flags, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
        if flags & O_DIRECT and (only is None or os.path.basename(path) == only):
            refused.append(os.fspath(path))
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(files.os, "open", fake_open)
    return refused


# -- make_private_dir ----------------------------------------------------------------------


@pytest.mark.parametrize("mask", [0o000, 0o002, 0o022, 0o077, 0o700, 0o777])
def test_make_private_dir_is_0700(tmp_path: Path, mask: int) -> None:
    """The leaf and every parent it creates: exactly 0700 whatever the umask (parents used
    to be 0777 & ~umask: world-writable under umask 000)."""
    tmp_path.chmod(0o755)
    target = tmp_path / "a" / "b" / "swap"
    with umask(mask):
        got = make_private_dir(target)
    assert got == target
    assert isinstance(got, Path)
    assert target.is_dir()
    for d in (tmp_path / "a", tmp_path / "a" / "b", target):
        assert mode_of(d) == 0o700, (d, oct(mode_of(d)))
    assert mode_of(tmp_path) == 0o755, "an existing parent is left as it is"


def test_make_private_dir_in_a_sticky_world_writable_parent(tmp_path: Path) -> None:
    """Only the swap directory is checked: one under /tmp (mode 1777) is fine."""
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    with umask(0):
        make_private_dir(shared / "me" / "swap")
    assert mode_of(shared / "me") == 0o700
    assert mode_of(shared / "me" / "swap") == 0o700
    assert mode_of(shared) == 0o1777
    check_private_dir(shared / "me" / "swap")


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o775, 0o720, 0o702, 0o1777, 0o1770])
def test_swap_dir_writable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    target = tmp_path / "swap"
    target.mkdir()
    target.chmod(mode)
    (target / "keep.bin").write_bytes(b"x")
    for call in (make_private_dir, check_private_dir):
        with pytest.raises(UnsafeSwapDirError) as info:
            call(target)
        exc = info.value
        message = str(exc)
        assert str(target) in message
        assert f"mode {mode:04o}" in message
        assert "writable by" in message
        if mode & 0o020:
            assert "group" in message
        if mode & 0o002:
            assert "others" in message
        assert f"chmod go-w {target}" in message
        assert "a new directory of your own (swapper creates it" in message
        if mode & 0o1000:  # sticky, like /tmp: a subdirectory there is safe
            assert f"e.g. {target}/swapper-" in message
        else:
            assert "e.g." not in message
        assert (exc.path, exc.owner_uid, exc.mode) == (str(target), os.geteuid(), mode)
        assert isinstance(exc, SwapConfigError)
        assert isinstance(exc, ValueError)
    assert mode_of(target) == mode, "a refused directory is left as it was"
    assert (target / "keep.bin").read_bytes() == b"x"


@pytest.mark.parametrize("mode", [0o700, 0o750, 0o755, 0o711, 0o500])
def test_swap_dir_private_enough_is_accepted(tmp_path: Path, mode: int) -> None:
    target = tmp_path / "swap"
    target.mkdir()
    target.chmod(mode)
    assert make_private_dir(target) == target
    check_private_dir(target)
    assert mode_of(target) == mode


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_swap_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    import pwd

    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' here")
    target = tmp_path / "swap"
    target.mkdir(mode=0o700)
    os.chown(target, nobody.pw_uid, nobody.pw_gid)
    for call in (make_private_dir, check_private_dir):
        with pytest.raises(UnsafeSwapDirError) as info:
            call(target)
        message = str(info.value)
        assert str(target) in message
        assert f"owned by nobody (uid {nobody.pw_uid}, mode 0700)" in message
        assert "root (uid 0)" in message
        assert "a new directory of your own" in message  # what to do instead
        assert info.value.owner_uid == nobody.pw_uid
    assert os.stat(target).st_uid == nobody.pw_uid, "a refused directory is left as it was"


def test_swap_dir_owned_by_another_user_is_refused_without_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same, for any user: this process pretends to be someone else."""
    target = tmp_path / "swap"
    target.mkdir(mode=0o700)
    owner = os.stat(target).st_uid
    other = owner + 12345
    monkeypatch.setattr(files.os, "geteuid", lambda: other)
    with pytest.raises(UnsafeSwapDirError) as info:
        make_private_dir(target)
    message = str(info.value)
    assert f"(uid {owner}, mode 0700)" in message
    assert f"(uid {other})" in message
    assert info.value.owner_uid == owner


def test_created_swap_dir_passes_its_own_check(tmp_path: Path) -> None:
    with umask(0):
        target = make_private_dir(tmp_path / "x" / "swap")
    check_private_dir(target)
    check_private_dir(tmp_path / "x")


def test_check_private_dir_missing(tmp_path: Path) -> None:
    with pytest.raises(SwapIOError) as info:
        check_private_dir(tmp_path / "missing")
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(tmp_path / "missing")


def test_make_private_dir_accepts_str_and_keeps_existing_dir_as_is(tmp_path: Path) -> None:
    target = tmp_path / "existing"
    target.mkdir()
    target.chmod(0o755)
    (target / "keep.bin").write_bytes(b"x")
    assert make_private_dir(str(target)) == target
    assert mode_of(target) == 0o755  # the owner's choice is respected
    assert (target / "keep.bin").read_bytes() == b"x"  # and nothing is deleted


def test_make_private_dir_twice(tmp_path: Path) -> None:
    target = tmp_path / "swap"
    make_private_dir(target)
    make_private_dir(target)
    assert mode_of(target) == 0o700


def test_make_private_dir_refuses_symlink_to_dir(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(SwapIOError) as info:
        make_private_dir(link)
    assert info.value.errno == errno.ELOOP
    assert info.value.filename == str(link)
    assert "symbolic link" in str(info.value)


def test_make_private_dir_refuses_dangling_symlink(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(SwapIOError) as info:
        make_private_dir(link)
    assert info.value.errno == errno.ELOOP
    assert not (tmp_path / "nowhere").exists()


def test_make_private_dir_refuses_regular_file(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_bytes(b"data")
    with pytest.raises(SwapIOError) as info:
        make_private_dir(target)
    assert info.value.errno == errno.ENOTDIR
    assert info.value.filename == str(target)
    assert target.read_bytes() == b"data"


def test_make_private_dir_under_a_regular_file(tmp_path: Path) -> None:
    parent = tmp_path / "file"
    parent.write_bytes(b"data")
    with pytest.raises(SwapIOError) as info:
        make_private_dir(parent / "sub")
    assert info.value.errno == errno.ENOTDIR


def test_make_private_dir_on_readonly_fs(
    mount_tmpfs: Callable[..., Path | None], remount_readonly: Callable[[Path], bool]
) -> None:
    mnt = mount_tmpfs("ro")
    if mnt is None or not remount_readonly(mnt):
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    with pytest.raises(SwapIOError) as info:
        make_private_dir(mnt / "swap")
    assert info.value.errno == errno.EROFS
    assert info.value.filename == str(mnt / "swap")


# -- SwapFile.open -------------------------------------------------------------------------


@pytest.mark.parametrize("mask", [0o000, 0o022])
def test_created_file_is_0600(swap_dir: Path, mask: int) -> None:
    path = swap_dir / "x.bin"
    with umask(mask), SwapFile.open(path, create=True) as f:
        assert f.path == path
        assert f.size() == 0
    assert mode_of(path) == 0o600


def test_open_existing_keeps_content_and_mode(swap_dir: Path) -> None:
    path = swap_dir / "x.bin"
    path.write_bytes(b"hello")
    path.chmod(0o640)
    with SwapFile.open(path, create=True) as f:
        assert f.size() == 5
    assert path.read_bytes() == b"hello"
    assert mode_of(path) == 0o640


def test_open_missing_file(swap_dir: Path) -> None:
    with pytest.raises(FileNotFoundError):
        SwapFile.open(swap_dir / "missing.bin")
    assert not (swap_dir / "missing.bin").exists()


def test_create_in_missing_dir(swap_dir: Path) -> None:
    with pytest.raises(FileNotFoundError):
        SwapFile.open(swap_dir / "no" / "x.bin", create=True)


def test_descriptors(swap_dir: Path) -> None:
    path = swap_dir / "x.bin"
    with SwapFile.open(path, create=True, direct=True) as f:
        assert f.direct_fd is not None, "ext4 under tmp_path accepts O_DIRECT"
        assert f.direct_fd != f.fd
        buffered_flags = fcntl.fcntl(f.fd, fcntl.F_GETFL)
        direct_flags = fcntl.fcntl(f.direct_fd, fcntl.F_GETFL)
        assert not buffered_flags & O_DIRECT
        assert direct_flags & O_DIRECT
        for fd in (f.fd, f.direct_fd):
            assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
        a, b = os.fstat(f.fd), os.fstat(f.direct_fd)
        assert (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
        assert "direct=True" in repr(f)
        fds = (f.fd, f.direct_fd)
    assert not any(fd_is_open(fd) for fd in fds)


def test_direct_off(swap_dir: Path) -> None:
    with SwapFile.open(swap_dir / "x.bin", create=True, direct=False) as f:
        assert f.direct_fd is None
        assert "direct=False" in repr(f)


def test_close_is_idempotent(swap_dir: Path) -> None:
    f = SwapFile.open(swap_dir / "x.bin", create=True)
    fd = f.fd
    f.close()
    f.close()
    assert not fd_is_open(fd)


@pytest.mark.parametrize("create", [False, True])
def test_symlink_to_file_refused(swap_dir: Path, create: bool, fd_count: Callable[[], int]) -> None:
    target = swap_dir / "target.bin"
    target.write_bytes(b"precious")
    link = swap_dir / "link.bin"
    link.symlink_to(target)
    before = fd_count()
    with pytest.raises(SwapIOError) as info:
        SwapFile.open(link, create=create)
    assert info.value.errno == errno.ELOOP
    assert info.value.filename == str(link)
    assert "symbolic link" in str(info.value)
    assert target.read_bytes() == b"precious"
    assert fd_count() == before


def test_dangling_symlink_not_followed_on_create(swap_dir: Path) -> None:
    target = swap_dir / "created-through-link.bin"
    link = swap_dir / "link.bin"
    link.symlink_to(target)
    with pytest.raises(SwapIOError) as info:
        SwapFile.open(link, create=True)
    assert info.value.errno == errno.ELOOP
    assert not target.exists()


def test_directory_refused(swap_dir: Path, fd_count: Callable[[], int]) -> None:
    before = fd_count()
    with pytest.raises(SwapIOError) as info:
        SwapFile.open(swap_dir, create=True)
    assert info.value.errno == errno.EISDIR
    assert info.value.filename == str(swap_dir)
    assert fd_count() == before


def test_fifo_refused(swap_dir: Path, fd_count: Callable[[], int]) -> None:
    fifo = swap_dir / "fifo"
    os.mkfifo(fifo, 0o600)
    before = fd_count()
    with pytest.raises(SwapIOError) as info:
        SwapFile.open(fifo)
    assert info.value.errno == errno.EINVAL
    assert "not a regular file" in str(info.value)
    assert fd_count() == before  # the descriptor opened to find out is closed again


def test_swap_errors_are_oserrors(swap_dir: Path) -> None:
    with pytest.raises(OSError):
        SwapFile.open(swap_dir, create=True)
    with pytest.raises(SwapError):
        SwapFile.open(swap_dir, create=True)


# -- O_DIRECT refused ----------------------------------------------------------------------


def _fallback_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if "O_DIRECT refused" in r.getMessage() and r.levelno >= logging.WARNING
    ]


def test_direct_refused_at_open_falls_back_and_warns_once_per_dir(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_direct_refusals: set[tuple[str, str]],
) -> None:
    caplog.set_level(logging.DEBUG, logger="swapper.tiers.files")
    refused = refuse_o_direct_at_open(monkeypatch)
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    d1.mkdir()
    d2.mkdir()
    paths = [d1 / "a.bin", d1 / "b.bin", d2 / "c.bin", d1 / "d.bin"]
    for path in paths:
        with SwapFile.open(path, create=True, direct=True) as f:
            assert f.direct_fd is None
    warnings = _fallback_warnings(caplog)
    assert len(warnings) == 2, warnings  # a warning per directory and reason
    assert str(d1 / "a.bin") in warnings[0]
    assert str(d2 / "c.bin") in warnings[1]
    assert all("EINVAL at open" in w for w in warnings)
    # the other files are still said, at DEBUG
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any(str(d1 / "b.bin") in m for m in debug)
    assert direct_refused(d1)
    assert direct_refused(d2)
    assert not direct_refused(tmp_path)
    # Every file asks for itself: a refusal is never extended to its directory.
    assert refused == [str(p) for p in paths]


def test_direct_refused_at_open_for_one_file_only(
    swap_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_direct_refusals: set[tuple[str, str]],
) -> None:
    """A file that cannot be opened O_DIRECT is buffered; its neighbours are not."""
    caplog.set_level(logging.WARNING, logger="swapper.tiers.files")
    refuse_o_direct_at_open(monkeypatch, only="odd.bin")
    with SwapFile.open(swap_dir / "odd.bin", create=True) as odd:
        assert odd.direct_fd is None
        with SwapFile.open(swap_dir / "fine.bin", create=True) as fine:
            assert fine.direct_fd is not None
    with SwapFile.open(swap_dir / "later.bin", create=True) as later:
        assert later.direct_fd is not None
    warnings = _fallback_warnings(caplog)
    assert len(warnings) == 1
    assert str(swap_dir / "odd.bin") in warnings[0]


def test_direct_open_failing_otherwise_is_an_error(
    swap_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    fd_count: Callable[[], int],
    fresh_direct_refusals: set[tuple[str, str]],
) -> None:
    before = fd_count()
    refuse_o_direct_at_open(monkeypatch, errno.EACCES)
    with pytest.raises(SwapIOError) as info:
        SwapFile.open(swap_dir / "x.bin", create=True, direct=True)
    assert info.value.errno == errno.EACCES
    assert info.value.filename == str(swap_dir / "x.bin")
    assert fd_count() == before  # the buffered descriptor is closed again
    assert not direct_refused(swap_dir)


def test_refuse_direct_later(
    swap_dir: Path, caplog: pytest.LogCaptureFixture, fresh_direct_refusals: set[tuple[str, str]]
) -> None:
    caplog.set_level(logging.WARNING, logger="swapper.tiers.files")
    f = SwapFile.open(swap_dir / "x.bin", create=True, direct=True)
    old_direct = f.direct_fd
    assert old_direct is not None
    f.refuse_direct("EINVAL from an aligned write")
    f.refuse_direct("again")
    assert f.direct_fd is None
    assert fd_is_open(old_direct), "pieces may still be in flight on it"
    assert direct_refused(swap_dir)
    warnings = _fallback_warnings(caplog)
    assert len(warnings) == 1
    assert "EINVAL from an aligned write" in warnings[0]
    with SwapFile.open(swap_dir / "y.bin", create=True, direct=True) as g:
        assert g.direct_fd is not None  # one file's refusal is that file's only
    f.close()
    assert not fd_is_open(old_direct)
    assert not fd_is_open(f.fd)


def test_direct_failed_before_and_after_o_direct_worked(
    swap_dir: Path, caplog: pytest.LogCaptureFixture, fresh_direct_refusals: set[tuple[str, str]]
) -> None:
    """EINVAL before any O_DIRECT transfer worked: the file cannot use it. After one did:
    that request's cause, and the file keeps O_DIRECT."""
    caplog.set_level(logging.WARNING, logger="swapper.tiers.files")
    with SwapFile.open(swap_dir / "worked.bin", create=True) as worked:
        worked.direct_worked = True
        assert worked.direct_failed("EINVAL from aligned I/O") is False
        assert worked.direct_fd is not None
    assert _fallback_warnings(caplog) == []
    with SwapFile.open(swap_dir / "never.bin", create=True) as never:
        assert never.direct_failed("EINVAL from aligned I/O") is True
        assert never.direct_fd is None
        assert never.direct_failed("EINVAL from aligned I/O") is False  # already buffered
    warnings = _fallback_warnings(caplog)
    assert len(warnings) == 1
    assert "EINVAL from aligned I/O, before any O_DIRECT transfer on it worked" in warnings[0]
    with SwapFile.open(swap_dir / "never.bin") as again:
        assert again.direct_fd is not None, "a new open of the file tries O_DIRECT again"


def test_close_waits_for_requests_using_the_file(swap_dir: Path) -> None:
    f = SwapFile.open(swap_dir / "x.bin", create=True)
    fds = [f.fd, f.direct_fd]
    f.begin_request()
    f.begin_request()
    f.close()
    f.close()  # idempotent
    assert all(fd_is_open(fd) for fd in fds if fd is not None)
    f.reserve(8192)  # still usable by the requests holding it
    assert f.size() == 8192
    with pytest.raises(SwapIOError) as info:
        f.begin_request()  # but no new request
    assert info.value.errno == errno.EBADF
    assert info.value.filename == str(swap_dir / "x.bin")
    f.end_request()
    assert all(fd_is_open(fd) for fd in fds if fd is not None)
    f.end_request()
    assert not any(fd_is_open(fd) for fd in fds if fd is not None)
    for call in (f.size, lambda: f.reserve(1 << 20)):
        with pytest.raises(SwapIOError, match="closed"):
            call()


def test_close_closes_every_descriptor_even_if_one_fails(
    swap_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = SwapFile.open(swap_dir / "x.bin", create=True)
    assert f.direct_fd is not None
    fds = [f.fd, f.direct_fd]
    real_close = os.close
    closed: list[int] = []

    def failing_close(fd: int) -> None:
        real_close(fd)
        closed.append(fd)
        if len(closed) == 1:
            raise OSError(errno.EIO, "injected")

    monkeypatch.setattr(files.os, "close", failing_close)
    with pytest.raises(OSError, match="injected"):
        f.close()
    assert closed == fds
    f.close()  # once is enough: nothing is closed twice
    assert closed == fds


# -- reserve ---------------------------------------------------------------------------------


def test_reserve_allocates_and_grows(swap_dir: Path) -> None:
    with SwapFile.open(swap_dir / "x.bin", create=True) as f:
        f.reserve(10_000)
        assert f.size() == 10_000
        st = os.fstat(f.fd)
        assert st.st_blocks * 512 >= 10_000
        f.reserve(5_000)  # already there: no-op, never shrinks
        assert f.size() == 10_000
        f.reserve(0)
        assert f.size() == 10_000
        f.reserve(20_000)
        assert f.size() == 20_000


def test_reserve_on_existing_larger_file_is_noop(swap_dir: Path) -> None:
    path = swap_dir / "x.bin"
    path.write_bytes(b"\x01" * 8192)
    with SwapFile.open(path) as f:
        f.reserve(4096)
        assert f.size() == 8192
    assert path.read_bytes() == b"\x01" * 8192


def test_reserve_enospc_on_small_tmpfs(
    mount_tmpfs: Callable[..., Path | None], monkeypatch: pytest.MonkeyPatch
) -> None:
    mnt = mount_tmpfs("small", "1m")
    if mnt is None:
        pytest.skip("cannot mount a tmpfs here (needs root): see the fault-injected variant")
    path = mnt / "x.bin"
    with SwapFile.open(path, create=True) as f:
        f.reserve(256 << 10)
        size, blocks = f.size(), os.fstat(f.fd).st_blocks
        with pytest.raises(SwapNoSpaceError) as info:
            f.reserve(4 << 20)
        exc = info.value
        assert exc.errno == errno.ENOSPC
        assert exc.filename == str(path)
        assert str(path) in str(exc)
        assert f"{(4 << 20) - (256 << 10)} bytes" in str(exc)
        assert str(4 << 20) in str(exc)
        assert f.size() == size, "the file must not be left grown"
        assert os.fstat(f.fd).st_blocks == blocks
        f.reserve(512 << 10)  # what fits still works afterwards
        assert f.size() == 512 << 10


def test_reserve_enospc_fault_injected(swap_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    path = swap_dir / "x.bin"
    with SwapFile.open(path, create=True) as f:
        f.reserve(4096)
        monkeypatch.setattr(files.os, "posix_fallocate", no_space)
        with pytest.raises(SwapNoSpaceError) as info:
            f.reserve(1 << 20)
        assert info.value.filename == str(path)
        assert f"{(1 << 20) - 4096} bytes at offset 4096" in str(info.value)
        assert f.size() == 4096


def test_reserve_partial_allocation_is_given_back(
    swap_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fallocate that grew the file before running out of space is undone."""
    real = os.posix_fallocate

    def half_then_enospc(fd: int, offset: int, length: int) -> None:
        real(fd, offset, length // 2)
        raise OSError(errno.ENOSPC, "No space left on device")

    path = swap_dir / "x.bin"
    path.write_bytes(b"\x07" * 3000)
    with SwapFile.open(path) as f:
        monkeypatch.setattr(files.os, "posix_fallocate", half_then_enospc)
        with pytest.raises(SwapNoSpaceError):
            f.reserve(1 << 20)
        assert f.size() == 3000
    assert path.read_bytes() == b"\x07" * 3000


@pytest.mark.parametrize("code", [errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL])
def test_reserve_without_fallocate_support_lets_writes_through(
    swap_dir: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    calls = []

    def unsupported(fd: int, offset: int, length: int) -> None:
        calls.append((offset, length))
        raise OSError(code, os.strerror(code))

    with SwapFile.open(swap_dir / "x.bin", create=True) as f:
        monkeypatch.setattr(files.os, "posix_fallocate", unsupported)
        f.reserve(1 << 20)  # no error
        f.reserve(1 << 19)  # remembered as reserved: not asked again
        assert calls == [(0, 1 << 20)]


def test_reserve_other_error(swap_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def eio(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    path = swap_dir / "x.bin"
    with SwapFile.open(path, create=True) as f:
        monkeypatch.setattr(files.os, "posix_fallocate", eio)
        with pytest.raises(SwapIOError) as info:
            f.reserve(4096)
        assert not isinstance(info.value, SwapNoSpaceError)
        assert info.value.errno == errno.EIO
        assert info.value.filename == str(path)
        assert "posix_fallocate" in str(info.value)
