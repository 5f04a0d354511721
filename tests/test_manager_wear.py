"""The wear budget (issue 29): the most a run may write to NVMe per day.

Over it, one warning naming the rate, the budget and what would lower it; with the strict
form a typed error at the step that crosses it, the step complete and every tensor
durable; under it, nothing. Also the ``--write-budget`` rate parser and the settings'
checks.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from swapper import OffloadAdamW, StepConfig
from swapper.cli_args import rate_per_day_arg
from swapper.manager import (
    EntryState,
    ManagerConfig,
    TierManager,
    WriteBudgetExceededError,
    WriteBudgetWarning,
)
from swapper.manager.wear import WearMonitor, WearVerdict
from tiers.errors import SwapConfigError

KiB = 1024


def _config(tmp_path: Path, **budget: object) -> ManagerConfig:
    return ManagerConfig(
        device_nbytes=0,
        host_nbytes=3 * 12 * 4096,  # most of the state lives on NVMe: written each step
        nvme_dirs=[tmp_path / "nvme"],
        timeout_s=20.0,
        close_timeout_s=20.0,
        device="cpu",
        **budget,  # type: ignore[arg-type]
    )


def _train(opt: OffloadAdamW, model: nn.Module, steps: int) -> None:
    for step in range(steps):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.01 * (step + 1))
        opt.step()
        opt.zero_grad()


def _budget_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, WriteBudgetWarning)]


def _run_with_budget(tmp_path: Path, budget: float) -> tuple[list[str], object]:
    """Four steps under ``budget`` bytes a day: the budget warnings' messages, and the
    verdict of one more check at the end."""
    model = nn.Linear(64, 64).to(torch.bfloat16)
    with (
        OffloadAdamW(
            model.parameters(),
            tiers=_config(tmp_path, write_budget_bytes_per_day=budget),
            config=StepConfig(sub_group_numel=1024),
        ) as opt,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        _train(opt, model, 4)
        verdict = opt.manager.check_write_budget()
    return _budget_warnings(caught), verdict


def test_a_run_over_a_tiny_budget_warns_once_naming_rate_budget_and_remedies(
    tmp_path: Path,
) -> None:
    found, _ = _run_with_budget(tmp_path, 1000.0)
    assert len(found) == 1, found  # (the extra check at the end warns no more either)
    message = found[0]
    assert "a day to NVMe" in message and "budget of 1000 B a day" in message
    assert "write_budget_bytes_per_day" in message
    assert "moments='int8'" in message and "host_nbytes" in message and "snapshots" in message


def test_a_run_under_its_budget_says_nothing(tmp_path: Path) -> None:
    found, verdict = _run_with_budget(tmp_path, 1e18)
    assert found == []
    assert isinstance(verdict, WearVerdict) and not verdict.over and verdict.written_nbytes > 0


def test_strict_raises_at_the_crossing_step_with_everything_durable(tmp_path: Path) -> None:
    model = nn.Linear(64, 64).to(torch.bfloat16)
    config = _config(tmp_path, write_budget_bytes_per_day=1000.0, write_budget_strict=True)
    with OffloadAdamW(
        model.parameters(), tiers=config, config=StepConfig(sub_group_numel=1024)
    ) as opt:
        _train(opt, model, 1)  # the baseline
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.02)
        with pytest.raises(WriteBudgetExceededError) as info:
            opt.step()
        error = info.value
        assert error.budget_bytes_per_day == 1000.0
        assert error.rate_bytes_per_day > 1000.0 and error.written_nbytes > 0
        assert "durable" in str(error) and "moments='int8'" in str(error)
        assert opt.step_count == 2  # the step that crossed it is complete
        manager: TierManager = opt.manager
        for info_ in map(manager.info, manager.keys()):  # nothing newer than its NVMe copy
            assert info_.on_nvme and (info_.clean or info_.state is EntryState.ON_NVME), info_
        opt.zero_grad()
        with pytest.raises(WriteBudgetExceededError):  # still over: every step says so
            _train(opt, model, 1)
        assert opt.step_count == 3


def test_monitor_projects_the_rate_since_its_baseline() -> None:
    monitor = WearMonitor(1e6, strict=False)
    assert monitor.check(5_000_000, now=100.0) is None  # the baseline: setup not counted
    verdict = monitor.check(5_000_000 + 10, now=100.0 + 86.4)
    assert verdict is not None and verdict.rate_bytes_per_day == pytest.approx(10_000)
    assert not verdict.over
    verdict = monitor.check(5_000_000 + 20_000, now=100.0 + 864.0)
    assert verdict is not None and verdict.over and verdict.rate_bytes_per_day == 2e6


@pytest.mark.parametrize(
    ("text", "per_day"),
    [
        ("1TB/day", 1e12),
        ("1TB", 1e12),
        ("20GB/h", 20e9 * 24),
        ("1MiB/s", 2**20 * 86400),
        ("500GB/d", 500e9),
    ],
)
def test_write_budget_rates_parse(text: str, per_day: float) -> None:
    assert rate_per_day_arg(text) == pytest.approx(per_day)


@pytest.mark.parametrize("text", ["1TB/week", "lots/day", "0B/day", "-1GB/day", "/day"])
def test_bad_write_budget_rates_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        rate_per_day_arg(text)


@pytest.mark.parametrize(
    ("budget", "named"),
    [
        ({"write_budget_bytes_per_day": -1.0}, "write_budget_bytes_per_day"),
        ({"write_budget_bytes_per_day": float("inf")}, "write_budget_bytes_per_day"),
        ({"write_budget_strict": True}, "needs write_budget_bytes_per_day"),
    ],
)
def test_bad_budget_settings_are_refused(tmp_path: Path, budget: dict, named: str) -> None:
    with pytest.raises(SwapConfigError, match=named):
        _config(tmp_path, **budget)
