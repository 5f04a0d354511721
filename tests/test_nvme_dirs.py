"""A swap directory that cannot work is named at once (tiers.config.check_swap_dirs, run
when a TierManager creates its store): not a directory, not writable, or impossible to
make; a missing one (parents included) is made."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import swapper
import tiers.config as tiers_config
from swapper.manager import ManagerConfig, TierManager
from swapper.zero.config.offload import OffloadConfig
from tiers.config import check_swap_dirs
from tiers.errors import SwapConfigError


def _manager(path: Path) -> TierManager:
    return TierManager(
        ManagerConfig(device_nbytes=0, host_nbytes=1 << 20, nvme_dirs=[path], device="cpu")
    )


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda tmp: tmp / "a-file", ["exists and is not a directory"]),
        (lambda tmp: tmp / "a-file" / "swap", ["cannot be made", "is not a directory"]),
    ],
)
def test_a_bad_path_is_named_as_nvme_dirs_at_open(
    tmp_path: Path, make: Any, words: list[str]
) -> None:
    (tmp_path / "a-file").write_text("x")
    path = make(tmp_path)
    start = time.monotonic()
    with pytest.raises(SwapConfigError) as info:
        _manager(path)
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert message.startswith("nvme_dirs: ") and str(path) in message
    for word in words:
        assert word in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize("missing", [False, True])
def test_an_unwritable_directory_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: bool
) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access

    # root may write anywhere: the check asks os.access, answered here as for a user
    def access(path: Any, mode: int, **kwargs: Any) -> bool:
        if Path(path) == locked and mode & os.W_OK:
            return False
        return real_access(path, mode, **kwargs)

    monkeypatch.setattr(tiers_config.os, "access", access)
    path = locked / "a" / "swap" if missing else locked
    with pytest.raises(SwapConfigError) as info:
        _manager(path)
    message = str(info.value)
    assert message.startswith("nvme_dirs: ") and str(path) in message
    assert "not writable" in message
    assert list(locked.iterdir()) == []


def test_missing_parents_are_made(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "swap"
    check_swap_dirs([path])
    with _manager(path) as manager:
        manager.register("t", torch.arange(1024, dtype=torch.float32), "param16")
        manager.evict("t", "nvme")
        assert torch.equal(manager.fetch("t", "host"), torch.arange(1024, dtype=torch.float32))
        manager.release("t", modified=False)
    assert path.is_dir()


def test_offload_names_nvme_dirs_before_any_work(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("x")
    config = OffloadConfig.create(
        device_nbytes=1 << 16, host_nbytes=1 << 20, nvme_dirs=[tmp_path / "a-file" / "swap"]
    )
    model = torch.nn.Linear(16, 16).to(torch.bfloat16)
    start = time.monotonic()
    with pytest.raises(SwapConfigError, match=r"^nvme_dirs: .*a-file/swap"):
        swapper.offload(model, config)
    assert time.monotonic() - start < 5


def test_check_swap_dirs_names_the_setting_it_is_given(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(SwapConfigError, match=r"^--dir: "):
        check_swap_dirs([tmp_path, tmp_path / "f"], setting="--dir")
    check_swap_dirs([tmp_path, tmp_path / "new"])  # fine: exists / can be made
    assert not (tmp_path / "new").exists()  # a check makes nothing
