"""Progress of the command-line tools: a run longer than a few seconds shows it is alive.

One rule for every tool: each finished item (a measurement, a step) is a plain line on
stdout as it finishes, so a log or a pipe sees it at once; and where stdout is a terminal
(and the run writes no ``--json``, whose users read files, not screens) a ``tqdm`` bar on
stderr counts the items, the lines printed above it. This module imports no torch.
"""

from __future__ import annotations

import sys
from types import TracebackType

from tqdm import tqdm

__all__ = ["Progress"]


class Progress:
    """Lines per finished item, and a bar on a terminal; a context manager.

    Args:
        total: the items the run will finish.
        desc: the bar's label (the tool's name).
        unit: what an item is (``"measurement"``).
        bar: ``None``: a bar when stdout is a terminal; ``False``: never (``--json``).
    """

    def __init__(self, total: int, desc: str, unit: str, *, bar: bool | None = None) -> None:
        show = sys.stdout.isatty() if bar is None else bar
        self._bar: tqdm | None = (
            tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False)
            if show and total > 1
            else None
        )

    @property
    def has_bar(self) -> bool:
        return self._bar is not None

    def done(self, line: str) -> None:
        """Say ``line`` (one finished item) on stdout, now, and move the bar on."""
        if self._bar is None:
            print(line, flush=True)
            return
        self._bar.write(line, file=sys.stdout)
        sys.stdout.flush()
        self._bar.update(1)

    def close(self) -> None:
        """Take the bar off the screen (idempotent)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
