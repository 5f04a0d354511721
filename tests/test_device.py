"""Tests of tiers.device: the CPU stand-in everywhere, CUDA streams and events where present."""

from __future__ import annotations

import threading

import pytest
import torch

from tiers.budget import BudgetExceededError, BudgetTimeout
from tiers.device import DeviceTier, resolve_device
from tiers.errors import SwapConfigError
from tiers.host import HostTier

KiB = 1024


def test_cpu_stand_in_budget_and_blocks() -> None:
    tier = DeviceTier(8 * KiB, device="cpu")
    assert not tier.is_cuda and tier.device == torch.device("cpu")
    a = tier.try_alloc(6 * KiB, what="a")
    assert a is not None and a.nbytes == a.charged_nbytes == 6 * KiB
    assert tier.try_alloc(4 * KiB, what="b") is None
    view = a.view(torch.bfloat16, (3, 1024))
    assert view.dtype == torch.bfloat16 and view.device.type == "cpu"
    a.release()
    a.release()
    assert a.released and tier.budget.used_nbytes == 0 and tier.budget.peak_nbytes == 6 * KiB
    with pytest.raises(RuntimeError, match="released"):
        _ = a.tensor
    tier.close()


def test_too_large_names_the_tensor() -> None:
    tier = DeviceTier(1 * KiB, device="cpu", name="device")
    with pytest.raises(BudgetExceededError, match=r"key='w'.*'device'"):
        tier.try_alloc(2 * KiB, what="key='w'")


def test_alloc_waits_and_times_out() -> None:
    tier = DeviceTier(4 * KiB, device="cpu")
    held = tier.alloc(4 * KiB, what="held")
    with pytest.raises(BudgetTimeout):
        tier.alloc(1, what="late", timeout_s=0.02)
    threading.Timer(0.05, held.release).start()
    tier.alloc(4 * KiB, what="later", timeout_s=5).release()


def test_cpu_copy_round_trip_is_done_at_once() -> None:
    tier = DeviceTier(None, device="cpu")
    src = torch.randn(100, dtype=torch.float32)
    block = tier.try_alloc(400, what="x")
    copy = tier.copy(block.view(torch.float32, (100,)), src)
    assert copy.done()
    copy.wait()
    back = torch.empty(100)
    tier.copy(back, block.view(torch.float32, (100,))).wait()
    assert torch.equal(back, src)


def test_cpu_mark_ready_is_none() -> None:
    assert DeviceTier(None, device="cpu").mark_ready() is None


def test_resolve_device() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(SwapConfigError, match="device='nonsense'"):
        resolve_device("nonsense")
    with pytest.raises(SwapConfigError, match="only 'cuda' and 'cpu'"):
        resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(SwapConfigError, match="CUDA is not available"):
            resolve_device("cuda")
    with pytest.raises(SwapConfigError, match="limit_nbytes"):
        DeviceTier(-5, device="cpu")


# -- CUDA ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_blocks_and_side_stream_round_trip() -> None:
    tier = DeviceTier(1 << 20, device="cuda")
    assert tier.is_cuda and tier.device.index is not None
    with HostTier(1 << 20, arena_nbytes=1 << 20) as host:
        src = host.try_alloc(64 * KiB, what="src")
        src.view(torch.float16, (32 * KiB,)).copy_(torch.randn(32 * KiB).half())
        block = tier.try_alloc(64 * KiB, what="dev")
        assert block.tensor.is_cuda
        copy = tier.copy(block.tensor, src.tensor)
        copy.wait()
        assert copy.done()
        # Work queued on the caller's stream must be seen by the side stream's copy back.
        block.view(torch.float16, (32 * KiB,)).mul_(2)
        dst = host.try_alloc(64 * KiB, what="dst")
        tier.copy(dst.tensor, block.tensor).wait()
        expected = src.view(torch.float16, (32 * KiB,)) * 2
        assert torch.equal(dst.view(torch.float16, (32 * KiB,)), expected)
        block.release()
        for b in (src, dst):
            b.release()
    tier.close()
    assert tier.budget.used_nbytes == 0


@pytest.mark.gpu
def test_cuda_copy_runs_on_the_side_stream() -> None:
    tier = DeviceTier(None, device="cuda")
    src = torch.ones(1 << 20, dtype=torch.uint8).pin_memory()
    block = tier.try_alloc(1 << 20, what="x")
    copy = tier.copy(block.tensor, src)
    assert tier._stream is not None and tier._stream != torch.cuda.current_stream()
    copy.wait()
    assert int(block.tensor.sum()) == 1 << 20
    block.release()
    tier.close()


@pytest.mark.gpu
def test_cuda_copy_from_another_thread_waits_for_the_users_stream() -> None:
    tier = DeviceTier(None, device="cuda")
    block = tier.try_alloc(16 << 20, what="x")
    user = torch.cuda.Stream()
    with torch.cuda.stream(user):
        torch.cuda._sleep(100_000_000)  # keep the user's stream busy for a while
        block.tensor.fill_(7)
        ready = tier.mark_ready()
    out = torch.zeros(16 << 20, dtype=torch.uint8).pin_memory()
    done = threading.Event()

    def copy_out() -> None:  # another thread: its current stream is the default one
        tier.copy(out, block.tensor, after=ready).wait()
        done.set()

    thread = threading.Thread(target=copy_out)
    thread.start()
    thread.join(timeout=60)
    assert done.is_set() and bool((out == 7).all())
    block.release()
    tier.close()
