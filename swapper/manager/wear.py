"""A wear budget: the most a run may write to NVMe per day, and what happens past it.

Why
---
Offloaded training writes the optimizer state every step (12 B per parameter with fp32
moments): a 7B model writes ~84 GB a step, and a consumer SSD rated for 600 TB written is
spent in about 7,000 steps. ``ManagerConfig.write_budget_bytes_per_day`` states what the
drive can take; :class:`WearMonitor` compares the rate the run actually writes at with it.

How
---
The first check (the end of the first optimizer step) sets the baseline: the bytes
written so far (materialising the model, registering the state) and the time. Each later
check projects the bytes written since over a day at the measured rate
(``ManagerStats.nvme_written_nbytes``: tensors and the store's metadata). Over the budget:
one :class:`WriteBudgetWarning` per manager, or with
``write_budget_strict`` a :class:`WriteBudgetExceededError` at that check, raised by
``TierManager.check_write_budget`` once it has made every tensor durable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tiers.errors import SwapError
from tiers.units import format_size

__all__ = ["WearMonitor", "WearVerdict", "WriteBudgetExceededError", "WriteBudgetWarning"]

DAY_S = 86400.0

#: What lowers the bytes written a step, named in the warning and the error.
REMEDIES = (
    "8-bit or bf16 optimizer moments (StepConfig(moments='int8') or 'bf16': 6 or 8 B per "
    "parameter a step instead of 12), a larger host budget (host_nbytes: state that stays "
    "in memory is not written), or fewer snapshots (more steps between them)"
)


class WriteBudgetWarning(UserWarning):
    """The run writes to NVMe faster than ``write_budget_bytes_per_day`` allows."""


class WriteBudgetExceededError(SwapError, RuntimeError):
    """The run's write rate projects over ``write_budget_bytes_per_day`` and
    ``write_budget_strict`` is set. Raised at the end of the step that crossed it, with
    that step complete and every tensor durable: training can go on (raise the budget)
    or resume from there.

    Attributes:
        rate_bytes_per_day: the measured rate, projected over a day.
        budget_bytes_per_day: the budget.
        written_nbytes: bytes written since the first step.
        seconds: over how long.
    """

    def __init__(
        self,
        message: str,
        *,
        rate_bytes_per_day: float,
        budget_bytes_per_day: float,
        written_nbytes: int,
        seconds: float,
    ) -> None:
        super().__init__(message)
        self.rate_bytes_per_day = rate_bytes_per_day
        self.budget_bytes_per_day = budget_bytes_per_day
        self.written_nbytes = written_nbytes
        self.seconds = seconds


@dataclass(frozen=True)
class WearVerdict:
    """One check's finding: the projected rate and whether it is over the budget."""

    rate_bytes_per_day: float
    written_nbytes: int
    seconds: float
    over: bool
    message: str


class WearMonitor:
    """Compares the write rate with a budget (see the module docstring). Not
    thread-safe: one caller (the optimizer's step) checks."""

    def __init__(self, budget_bytes_per_day: float, *, strict: bool) -> None:
        self.budget_bytes_per_day = budget_bytes_per_day
        self.strict = strict
        self.warned = False
        self._base: tuple[int, float] | None = None  # (bytes written, monotonic seconds)

    def check(self, written_nbytes: int, now: float | None = None) -> WearVerdict | None:
        """Judge the rate given the bytes written so far; None at the first call (the
        baseline) or when no time has passed."""
        now = time.monotonic() if now is None else now
        if self._base is None:
            self._base = (written_nbytes, now)
            return None
        written = written_nbytes - self._base[0]
        seconds = now - self._base[1]
        if seconds <= 0:
            return None
        rate = written / seconds * DAY_S
        message = (
            f"swapper: this run writes {format_size(int(rate))} a day to NVMe at its measured "
            f"rate ({format_size(written)} in {seconds:.3g} s), over the write budget of "
            f"{format_size(int(self.budget_bytes_per_day))} a day "
            f"(write_budget_bytes_per_day). To write less: {REMEDIES}"
        )
        return WearVerdict(rate, written, seconds, rate > self.budget_bytes_per_day, message)

    def error(self, verdict: WearVerdict) -> WriteBudgetExceededError:
        """The strict form's error for a verdict over the budget."""
        return WriteBudgetExceededError(
            verdict.message + ". Every tensor is durable and the step is complete: raise "
            "the budget to go on, or resume from here",
            rate_bytes_per_day=verdict.rate_bytes_per_day,
            budget_bytes_per_day=self.budget_bytes_per_day,
            written_nbytes=verdict.written_nbytes,
            seconds=verdict.seconds,
        )
