"""tiers.files: SwapFile (two descriptors, O_DIRECT fallback, space reservation) and
make_private_dir."""

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
from tiers.errors import SwapError, SwapIOError, SwapNoSpaceError
from tiers.files import SwapFile, direct_refused, make_private_dir

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
def fresh_direct_refusals(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """An empty process-wide 'O_DIRECT refused here' registry for this test only."""
    refused: set[str] = set()
    monkeypatch.setattr(files, "_direct_refused", refused)
    return refused


def refuse_o_direct_at_open(monkeypatch: pytest.MonkeyPatch, code: int = errno.EINVAL) -> list:
    """Make every open with O_DIRECT fail with ``code``; returns the list of refused paths."""
    real_open = os.open
    refused: list = []

    def fake_open(path, flags, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
        if flags & O_DIRECT:
            refused.append(os.fspath(path))
            raise OSError(code, os.strerror(code), os.fspath(path))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(files.os, "open", fake_open)
    return refused


# -- make_private_dir ----------------------------------------------------------------------


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o077])
def test_make_private_dir_is_0700(tmp_path: Path, mask: int) -> None:
    target = tmp_path / "a" / "b" / "swap"
    with umask(mask):
        got = make_private_dir(target)
    assert got == target
    assert isinstance(got, Path)
    assert target.is_dir()
    assert mode_of(target) == 0o700


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


def test_direct_refused_at_open_falls_back_and_warns_once_per_dir(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fresh_direct_refusals: set[str],
) -> None:
    caplog.set_level(logging.WARNING, logger="swapper.tiers.files")
    refused = refuse_o_direct_at_open(monkeypatch)
    d1, d2 = tmp_path / "d1", tmp_path / "d2"
    d1.mkdir()
    d2.mkdir()
    for path in (d1 / "a.bin", d1 / "b.bin", d2 / "c.bin", d1 / "d.bin"):
        with SwapFile.open(path, create=True, direct=True) as f:
            assert f.direct_fd is None
    warnings = [r for r in caplog.records if "O_DIRECT refused" in r.getMessage()]
    assert len(warnings) == 2
    assert str(d1) in warnings[0].getMessage()
    assert str(d2) in warnings[1].getMessage()
    assert all(r.levelno == logging.WARNING for r in warnings)
    assert direct_refused(d1)
    assert direct_refused(d2)
    assert not direct_refused(tmp_path)
    # After the first refusal a directory is not asked again.
    assert refused == [str(d1 / "a.bin"), str(d2 / "c.bin")]


def test_direct_open_failing_otherwise_is_an_error(
    swap_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    fd_count: Callable[[], int],
    fresh_direct_refusals: set[str],
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
    swap_dir: Path, caplog: pytest.LogCaptureFixture, fresh_direct_refusals: set[str]
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
    warnings = [r for r in caplog.records if "O_DIRECT refused" in r.getMessage()]
    assert len(warnings) == 1
    assert "EINVAL from an aligned write" in warnings[0].getMessage()
    with SwapFile.open(swap_dir / "y.bin", create=True, direct=True) as g:
        assert g.direct_fd is None  # the whole directory is buffered from now on
    f.close()
    assert not fd_is_open(old_direct)
    assert not fd_is_open(f.fd)


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
