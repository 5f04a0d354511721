"""Tests of tiers.buffers: host buffers (alignment, backing, lifetime)."""

from __future__ import annotations

import ctypes
import errno
import gc
import logging
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiers import EngineClosedError, SwapConfigError, hostmap
from tiers import buffers as B
from tiers.buffers import BufferClosedError, allocate, hugepage_bytes

MiB = 1 << 20
HUGE = B.HUGE_PAGE_NBYTES
LINUX = sys.platform.startswith("linux")
THP_USABLE = LINUX and B.thp_mode() in ("always", "madvise")

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_linux = pytest.mark.skipif(not LINUX, reason="Linux memory mappings only")
needs_thp = pytest.mark.skipif(not THP_USABLE, reason="transparent huge pages are not usable")

# Allocations are real mmaps: keep examples few and without deadlines.
fast = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def _fresh_log_once() -> None:
    """Each test sees the log-once messages again."""
    hostmap._logged.clear()


def mapped(address: int) -> bool:
    """Whether ``address`` lies in some mapping of this process (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split(None, 1)[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def free_hugetlb_pages() -> int:
    info = hostmap._meminfo()
    return info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0)


# -- allocate: shape, alignment, sizes -----------------------------------------------


@fast
@given(
    nbytes=st.integers(min_value=1, max_value=5 * MiB),
    huge=st.sampled_from([None, False, True, "thp"]),
)
def test_tensor_shape_and_alignment(nbytes: int, huge: B.HugeMode) -> None:
    with allocate(nbytes, huge=huge, lock=False) as buf:
        t = buf.tensor
        assert t.dtype == torch.uint8
        assert t.device.type == "cpu"
        assert t.is_contiguous()
        assert t.numel() == buf.nbytes == nbytes
        assert buf.address == t.data_ptr()
        assert buf.address % 4096 == 0
        assert buf.region_nbytes >= nbytes and buf.region_nbytes % 4096 == 0
        assert buf.backing in ("hugetlb", "thp", "pages")
        if buf.backing != "pages":
            assert buf.address % HUGE == 0
            assert buf.region_nbytes % HUGE == 0
        if huge is False:
            assert buf.backing == "pages"


def test_small_auto_buffers_stay_on_plain_pages() -> None:
    # Auto mode does not round a small buffer up to a whole huge page.
    with allocate(HUGE - 4096) as buf:
        assert buf.backing == "pages"
        assert buf.region_nbytes == HUGE - 4096


def test_zero_bytes_gives_an_empty_buffer() -> None:
    buf = allocate(0)
    assert buf.nbytes == 0 and buf.tensor.numel() == 0
    assert buf.address == 0 and buf.backing == "pages"
    assert not buf.locked and not buf.pinned
    assert buf.view(torch.float32).shape == (0,)
    buf.close()
    buf.close()


@pytest.mark.parametrize("bad", [-1, -4096])
def test_negative_size_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match=f"nbytes={bad}"):
        allocate(bad)


@pytest.mark.parametrize("bad", [1.5, "4096", True, None])
def test_non_int_size_is_refused(bad: object) -> None:
    with pytest.raises(TypeError, match="nbytes must be an int"):
        allocate(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"huge": "yes"}, "huge"),
        ({"huge": 1}, "huge"),
        ({"lock": "no"}, "lock"),
        ({"pin": 0}, "pin"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(SwapConfigError, match=name):
        allocate(4096, **kwargs)  # type: ignore[arg-type]


# -- data round trip and views --------------------------------------------------------


@fast
@given(data=st.binary(min_size=1, max_size=64 * 1024), huge=st.sampled_from([None, False]))
def test_round_trip_through_the_tensor(data: bytes, huge: bool | None) -> None:
    with allocate(len(data), huge=huge, lock=False) as buf:
        buf.tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        # What the tensor holds is at `address`: what the AIO engine will read and write.
        assert ctypes.string_at(buf.address, len(data)) == data
        assert bytes(buf.tensor.numpy()) == data


def test_huge_buffer_round_trip_across_huge_pages() -> None:
    with allocate(2 * HUGE + 12345, huge=True, lock=False) as buf:
        pattern = torch.arange(buf.nbytes, dtype=torch.int64).remainder_(251).to(torch.uint8)
        buf.tensor.copy_(pattern)
        assert torch.equal(buf.tensor, pattern)


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(torch.float32, (4, 8)), (torch.bfloat16, (3,)), (torch.int64, ()), (torch.uint8, (0,))],
)
def test_view_has_dtype_and_shape_and_shares_memory(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    with allocate(4096, lock=False) as buf:
        v = buf.view(dtype, shape)
        assert v.dtype == dtype and tuple(v.shape) == shape
        assert v.numel() == 0 or v.data_ptr() == buf.address
        buf.tensor.fill_(0)
        if v.numel():
            v.view(-1)[0] = 1
            assert buf.tensor[: dtype.itemsize].any()


def test_view_default_shape_uses_whole_elements() -> None:
    with allocate(4099, lock=False) as buf:
        v = buf.view(torch.float32)
        assert v.shape == (1024,)


def test_view_errors() -> None:
    buf = allocate(4096, lock=False)
    with pytest.raises(ValueError, match=r"needs 4100 bytes.*holds 4096"):
        buf.view(torch.uint8, (4100,))
    with pytest.raises(ValueError, match="needs 8192 bytes"):
        buf.view(torch.float64, (1024,))
    with pytest.raises(ValueError, match="negative"):
        buf.view(torch.float32, (-1,))
    with pytest.raises(TypeError, match="dtype"):
        buf.view("float32")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tuple of ints"):
        buf.view(torch.float32, 16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tuple of ints"):
        buf.view(torch.float32, (2.0, 2))  # type: ignore[arg-type]
    buf.close()
    with pytest.raises(BufferClosedError):
        buf.view(torch.float32)


# -- lifetime -------------------------------------------------------------------------


def test_close_is_idempotent_and_blocks_further_use() -> None:
    buf = allocate(8192)
    with buf:
        pass
    assert buf.closed and not buf.locked and not buf.pinned
    buf.close()
    with pytest.raises(BufferClosedError, match="closed"):
        _ = buf.tensor
    with pytest.raises(EngineClosedError):  # BufferClosedError is one
        hugepage_bytes(buf)


@needs_linux
def test_close_unmaps_at_once_without_views() -> None:
    buf = allocate(64 * 1024, lock=False)
    address = buf.address
    assert mapped(address)
    buf.close()
    assert not mapped(address)


@needs_linux
@pytest.mark.parametrize("huge", [False, True])
def test_views_outlive_close_and_keep_the_memory_mapped(huge: bool) -> None:
    buf = allocate(HUGE, huge=huge)
    address = buf.address
    typed = buf.view(torch.int32)
    tail = buf.tensor[-16:]
    typed.fill_(7)
    buf.close()
    # The memory is still there (unpinned and unlocked): using it must not crash.
    assert mapped(address)
    assert int(typed.sum()) == 7 * typed.numel()
    tail.fill_(1)
    del typed
    gc.collect()
    assert mapped(address)
    del tail
    gc.collect()
    assert not mapped(address)


# -- fallbacks ------------------------------------------------------------------------


def test_mlock_refused_falls_back_quietly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(address: int, nbytes: int) -> None:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(B, "_mlock", refuse)
    with caplog.at_level(logging.DEBUG, logger="swapper.tiers.buffers"):
        with allocate(64 * 1024) as buf:
            assert not buf.locked
        with allocate(64 * 1024) as buf:
            assert not buf.locked
    refusals = [r for r in caplog.records if "mlock" in r.getMessage()]
    assert len(refusals) == 1  # logged once
    assert refusals[0].levelno == logging.DEBUG


def test_mlock_refused_when_asked_for_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(address: int, nbytes: int) -> None:
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(B, "_mlock", refuse)
    with (
        caplog.at_level(logging.WARNING, logger="swapper.tiers.buffers"),
        allocate(64 * 1024, lock=True) as buf,
    ):
        assert not buf.locked
    assert any("RLIMIT_MEMLOCK" in r.getMessage() for r in caplog.records)


def test_lock_false_does_not_call_mlock(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(address: int, nbytes: int) -> None:
        raise AssertionError("mlock called")

    monkeypatch.setattr(B, "_mlock", boom)
    with allocate(64 * 1024, lock=False) as buf:
        assert not buf.locked


@needs_linux
def test_mlock_where_permitted_locks_the_region() -> None:
    with allocate(64 * 1024, lock=True) as buf:
        if not buf.locked:
            pytest.skip("mlock is not permitted here (RLIMIT_MEMLOCK)")
        with open("/proc/self/smaps") as f:
            text = f.read()
        assert f"{buf.address:x}-" in text  # its own VMA: mlock splits it out
        assert "Locked:" in text


def _no_hugetlb(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine whose hugetlb pool is empty."""
    monkeypatch.setattr(hostmap, "_hugetlb_room", lambda nbytes: (HUGE, "0 hugetlb pages free"))
    real_anonymous = hostmap._anonymous

    def anonymous(length: int, extra_flags: int = 0):  # type: ignore[no-untyped-def]
        if extra_flags & hostmap._MAP_HUGETLB:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real_anonymous(length, extra_flags)

    monkeypatch.setattr(hostmap, "_anonymous", anonymous)


@needs_linux
def test_hugetlb_unavailable_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _no_hugetlb(monkeypatch)
    with caplog.at_level(logging.DEBUG, logger="swapper.tiers.buffers"):
        with allocate(2 * HUGE, lock=False) as buf:
            assert buf.backing == ("thp" if THP_USABLE else "pages")
            assert not any(r.levelno >= logging.WARNING for r in caplog.records)
        with allocate(2 * HUGE, huge="hugetlb", lock=False) as buf:
            assert buf.backing == "pages"
            assert buf.address % 4096 == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("huge='hugetlb'" in w and "MAP_HUGETLB" in w for w in warnings)


@needs_linux
def test_no_huge_pages_at_all_falls_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _no_hugetlb(monkeypatch)
    monkeypatch.setattr(hostmap, "thp_mode", lambda: "never")
    with caplog.at_level(logging.WARNING, logger="swapper.tiers.buffers"):
        with allocate(2 * HUGE, lock=False) as buf:
            assert buf.backing == "pages"
        assert not caplog.records
        with allocate(2 * HUGE, huge=True, lock=False) as buf:
            assert buf.backing == "pages"
    assert any("'never'" in r.getMessage() for r in caplog.records)


def test_prefault_without_populate_write_touches_pages(monkeypatch: pytest.MonkeyPatch) -> None:
    # Kernels before 5.14 answer MADV_POPULATE_WRITE with EINVAL.
    monkeypatch.setattr(hostmap, "_MADV_POPULATE_WRITE", -1)
    with allocate(2 * HUGE, huge=True, lock=False) as buf:
        buf.tensor.fill_(3)
        assert int(buf.tensor[-1]) == 3


@needs_thp
def test_thp_backing_really_gets_huge_pages() -> None:
    with allocate(4 * HUGE, huge="thp", lock=False) as buf:
        assert buf.backing == "thp", "the kernel gave no huge pages (fragmented memory?)"
        assert buf.address % HUGE == 0
        assert hugepage_bytes(buf) > 0


@needs_linux
@pytest.mark.skipif(free_hugetlb_pages() < 4, reason="no free hugetlb pages reserved")
def test_hugetlb_backing_when_pages_are_reserved() -> None:
    with allocate(2 * HUGE, huge="hugetlb", lock=False) as buf:
        assert buf.backing == "hugetlb"
        assert buf.address % HUGE == 0
        buf.tensor.fill_(1)
        assert hugepage_bytes(buf) == 2 * HUGE


def test_pin_on_a_cpu_machine(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(B, "_cuda_available", lambda: False)
    with allocate(4096) as buf:  # auto: no CUDA, no pinning, no noise
        assert not buf.pinned
    with (
        caplog.at_level(logging.WARNING, logger="swapper.tiers.buffers"),
        allocate(4096, pin=True) as buf,
    ):
        assert not buf.pinned
    assert any("CUDA is not available" in r.getMessage() for r in caplog.records)


def test_pin_failure_is_reported_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(B, "_cuda_available", lambda: True)
    monkeypatch.setattr(B, "_cuda_register", lambda a, n: "cudaHostRegister returned 2")
    with allocate(4096, pin=True) as buf:
        assert not buf.pinned


@gpu
@needs_cuda
def test_pinned_buffer_copies_to_the_device() -> None:
    with allocate(4 * MiB) as buf:
        assert buf.pinned
        assert buf.tensor.is_pinned()
        buf.view(torch.float32).fill_(2.0)
        on_device = buf.view(torch.float32).to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert float(on_device.sum()) == 2.0 * MiB
        del on_device
    with allocate(4 * MiB, pin=False) as buf:
        assert not buf.pinned


@gpu
@needs_cuda
def test_close_unpins() -> None:
    buf = allocate(4 * MiB, pin=True)
    view = buf.tensor[:16]
    buf.close()
    assert not view.is_pinned()


def test_failed_prefault_raises_memory_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(region: B._Region) -> None:
        raise MemoryError("cannot fault in 4MiB of thp memory: Cannot allocate memory")

    monkeypatch.setattr(B, "_prefault", no_memory)
    if not B._huge_planned(True, 2 * HUGE)[0]:
        pytest.skip("no huge pages here, so nothing is prefaulted")
    with pytest.raises(MemoryError, match="4MiB"):
        allocate(2 * HUGE, huge=True, lock=False)


@pytest.mark.parametrize("huge", [False, True])
def test_direct_io_round_trip_through_the_engine(tmp_path: Path, huge: bool) -> None:
    from tiers import AioConfig, AioEngine

    path = tmp_path / "buf.bin"
    nbytes = 2 * HUGE + 8192
    with (
        allocate(nbytes, huge=huge) as src,
        allocate(nbytes, huge=huge) as dst,
        AioEngine(AioConfig(block_size=1 << 20, queue_depth=8)) as engine,
    ):
        src.tensor.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        assert engine.pwrite(src.tensor, path).result() == nbytes
        dst.tensor.zero_()
        assert engine.pread(dst.tensor[:nbytes], path).result() == nbytes
        assert torch.equal(dst.tensor[:nbytes], src.tensor)
