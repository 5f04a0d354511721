"""The per-phase timeline of a pressure run: ``swapper-pressure --timeline`` (issue 24).

Where an offloaded iteration's time goes, step by step and phase by phase (forward,
backward, optimizer step), so that what swapper adds over plain PyTorch can be placed:

- ``seconds``: wall time of the phase on the training's thread;
- ``stall``: the part of it spent waiting for bytes (the manager's foreground fetch
  waits, and with ``--overlap`` the waits for the update running beside it);
- ``busy``: ``seconds - stall``: compute, and the hooks' and the pipeline's own work
  (bookkeeping, copies, hashing on this thread);
- ``read`` / ``written``: NVMe bytes moved during the phase (every kind);
- ``I/O floor``: those bytes at the disk's rates measured by the same run
  (read / read rate + written / write rate, seconds), what the phase's I/O needs at least;
- ``plain``: plain PyTorch's seconds for the same phase (median over its steps after the
  first), where the run has a plain reference (not with ``--reference none``).

The figures come from :class:`~swapper.pressure.timing.Phases` (one set per step, taken
at the phase boundaries), so the table costs nothing extra while training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from swapper.pressure.timing import DiskRates, Phases, PlainRun, median_after_first
from tiers.units import format_size

__all__ = ["PHASES", "PhaseRow", "format_timeline", "phase_rows"]

#: The phases of one training step, in order.
PHASES = ("forward", "backward", "step")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PhaseRow:
    """One phase of one step (see the module docstring). Seconds and bytes.

    Attributes:
        step: the step number (1-based, as the run counts them).
        phase: ``"forward"``, ``"backward"`` or ``"step"``.
        seconds: wall time of the phase.
        stall_seconds: time waited for bytes within it.
        read_nbytes, written_nbytes: NVMe bytes moved during it.
        io_floor_seconds: those bytes at the disk's measured rates.
        plain_seconds: plain PyTorch's median for this phase, or None.
    """

    step: int
    phase: str
    seconds: float
    stall_seconds: float
    read_nbytes: int
    written_nbytes: int
    io_floor_seconds: float
    plain_seconds: float | None = None

    @property
    def busy_seconds(self) -> float:
        """``seconds - stall_seconds``: the thread's own work in the phase."""
        return self.seconds - self.stall_seconds

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "phase": self.phase,
            "seconds": self.seconds,
            "stall_seconds": self.stall_seconds,
            "busy_seconds": self.busy_seconds,
            "read_bytes": self.read_nbytes,
            "written_bytes": self.written_nbytes,
            "io_floor_seconds": self.io_floor_seconds,
            "plain_seconds": self.plain_seconds,
        }


def phase_rows(
    phases: Phases,
    disk: DiskRates,
    *,
    first_step: int = 1,
    plain: PlainRun | None = None,
) -> list[PhaseRow]:
    """The timeline of a run: three rows per step it recorded, in order.

    Args:
        phases: what the run recorded (:class:`Phases`).
        disk: the disk's rates measured by the same run.
        first_step: the number of the first recorded step (a resumed run starts later).
        plain: plain PyTorch's run of the same model and data, if there was one.
    """
    plain_s: dict[str, float] = {}
    if plain is not None and plain.forward_s:
        plain_s = {
            "forward": median_after_first(plain.forward_s),
            "backward": median_after_first(plain.backward_s),
            "step": median_after_first(plain.optimizer_s),
        }
    rows: list[PhaseRow] = []
    for i in range(len(phases.optimizer_s)):
        forward, model = phases.forward_s[i], phases.model_s[i]
        stalls = {
            "forward": phases.forward_stall_s[i],
            "backward": phases.model_stall_s[i] - phases.forward_stall_s[i],
            "step": phases.optimizer_stall_s[i],
        }
        seconds = {"forward": forward, "backward": model - forward, "step": phases.optimizer_s[i]}
        moved = phases.phase_nbytes[i]
        for phase in PHASES:
            read, written = moved[phase]
            rows.append(
                PhaseRow(
                    step=first_step + i,
                    phase=phase,
                    seconds=seconds[phase],
                    stall_seconds=stalls[phase],
                    read_nbytes=read,
                    written_nbytes=written,
                    io_floor_seconds=read / disk.read_bytes_per_s
                    + written / disk.write_bytes_per_s,
                    plain_seconds=plain_s.get(phase),
                )
            )
    return rows


def format_timeline(rows: Sequence[PhaseRow]) -> str:
    """The table ``--timeline`` prints, then the medians (steps after the first) of each
    phase against plain PyTorch where the rows have it."""
    has_plain = any(r.plain_seconds is not None for r in rows)
    head = "step  phase      seconds   stall    busy   NVMe read  NVMe written  I/O floor" + (
        "   plain" if has_plain else ""
    )
    lines = [
        "timeline (seconds; stall: waiting for bytes; busy: seconds - stall; I/O floor: "
        "the phase's NVMe bytes at the disk's measured rates)",
        head,
    ]
    for r in rows:
        line = (
            f"{r.step:>4}  {r.phase:<8} {r.seconds:>8.3f} {r.stall_seconds:>7.3f} "
            f"{r.busy_seconds:>7.3f} {format_size(r.read_nbytes):>11} "
            f"{format_size(r.written_nbytes):>13} {r.io_floor_seconds:>10.3f}"
        )
        if has_plain:
            line += f" {r.plain_seconds:>7.3f}" if r.plain_seconds is not None else "       -"
        lines.append(line)
    medians = []
    for phase in PHASES:
        mine = [r for r in rows if r.phase == phase]
        if not mine:
            continue
        seconds = median_after_first([r.seconds for r in mine])
        stall = median_after_first([r.stall_seconds for r in mine])
        text = f"{phase} {seconds:.3f} s (stall {stall:.3f})"
        plain = mine[0].plain_seconds
        if plain is not None:
            text += f", {seconds - plain:+.3f} s over plain"
        medians.append(text)
    if medians:
        lines.append("median after the first step: " + "; ".join(medians))
    return "\n".join(lines)
