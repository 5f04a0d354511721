"""A wait hook for interrupt tests: a real SIGINT at the main thread's ``at``-th wait point
(``tiers.signals`` calls the hook at each one), shared by the single-process and the
several-rank close tests."""

from __future__ import annotations

import signal
import threading


class SigintAt:
    """Counts the main thread's wait points, sends SIGINT at the ``at``-th (from 1; None:
    never); ``passed`` names them in order, ``hit`` the one cut."""

    def __init__(self, at: int | None) -> None:
        self.at = at
        self.passed: list[str] = []
        self.hit: str | None = None

    def __call__(self, name: str) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self.passed.append(name)
        if len(self.passed) == self.at:
            self.hit = name
            signal.raise_signal(signal.SIGINT)
