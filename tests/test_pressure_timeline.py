"""``swapper-pressure --timeline``: each step's phases with stall, busy, NVMe bytes, their
I/O floor and plain PyTorch's seconds (swapper/pressure/timeline.py, issue 24)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swapper.pressure.cli import main
from swapper.pressure.timeline import PHASES, PhaseRow, format_timeline, phase_rows
from swapper.pressure.timing import DiskRates, Phases, PlainRun, Timing, spin_wait_warning

DISK = DiskRates(write_bytes_per_s=2e9, read_bytes_per_s=1e9, nbytes=1 << 20, direct=True)


def _phases(steps: list[tuple[float, float, float, int, int, int]]) -> Phases:
    """Phases as the runner records them: per step forward, backward and step seconds
    and the NVMe bytes read in each phase (written: twice as many)."""
    p = Phases()
    for forward, backward, step, r_f, r_b, r_s in steps:
        p.forward_s.append(forward)
        p.forward_stall_s.append(forward / 4)
        p.model_s.append(forward + backward)
        p.model_stall_s.append(forward / 4 + backward / 2)
        p.optimizer_s.append(step)
        p.optimizer_stall_s.append(step / 3)
        p.phase_nbytes.append(
            {"forward": (r_f, 2 * r_f), "backward": (r_b, 2 * r_b), "step": (r_s, 2 * r_s)}
        )
    return p


_seconds = st.floats(0.001, 100.0)
_nbytes = st.integers(0, 1 << 40)


@given(st.lists(st.tuples(_seconds, _seconds, _seconds, _nbytes, _nbytes, _nbytes), max_size=6))
def test_rows_split_each_step_into_its_phases(
    steps: list[tuple[float, float, float, int, int, int]],
) -> None:
    rows = phase_rows(_phases(steps), DISK, first_step=3)
    assert [r.phase for r in rows] == list(PHASES) * len(steps)
    for i, (forward, backward, step, r_f, r_b, r_s) in enumerate(steps):
        f, b, s = rows[3 * i : 3 * i + 3]
        assert f.step == b.step == s.step == 3 + i
        # the phases add up to the step; the stalls to the runner's per-step stalls
        assert f.seconds + b.seconds + s.seconds == pytest.approx(forward + backward + step)
        assert b.stall_seconds == pytest.approx(backward / 2)
        assert s.busy_seconds == pytest.approx(step - step / 3)
        for row, read in ((f, r_f), (b, r_b), (s, r_s)):
            assert (row.read_nbytes, row.written_nbytes) == (read, 2 * read)
            # read at 1 GB/s, written (twice as much) at 2 GB/s: 2 * read / 1e9 seconds
            assert row.io_floor_seconds == pytest.approx(2 * read / 1e9)
            assert row.plain_seconds is None


def test_plain_column_is_plain_pytorchs_median_after_the_first_step() -> None:
    plain = PlainRun(
        losses=[1.0, 1.0, 1.0],
        step_s=[9.0, 6.0, 8.0],
        forward_s=[5.0, 1.0, 3.0],
        backward_s=[3.0, 2.0, 4.0],
        optimizer_s=[1.0, 3.0, 1.0],
    )
    rows = phase_rows(_phases([(1.0, 2.0, 3.0, 0, 0, 10)] * 2), DISK, plain=plain)
    assert {r.phase: r.plain_seconds for r in rows} == {
        "forward": 2.0,  # median of 1 and 3 (the first step, 5, left out)
        "backward": 3.0,
        "step": 2.0,
    }
    text = format_timeline(rows)
    assert "plain" in text.splitlines()[1]
    # the medians line says what each phase adds over plain PyTorch
    assert "forward 1.000 s (stall 0.250), -1.000 s over plain" in text
    assert "step 3.000 s (stall 1.000), +1.000 s over plain" in text
    assert [r.to_json()["busy_seconds"] for r in rows[:3]] == pytest.approx([0.75, 1.0, 2.0])


def test_rows_of_an_empty_run_and_its_table() -> None:
    assert phase_rows(Phases(), DISK) == []
    text = format_timeline([])
    assert "plain" not in text and "median" not in text


def test_phases_record_each_phases_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """End to end: the budgeted run's bytes per phase add up to its bytes per step, and the
    table and the JSON carry every phase of every step (--reference none and the default)."""
    swap = tmp_path / "swap"
    swap.mkdir()
    base = ["--params", "300K", "--steps", "2", "--batch", "2", "--seq", "16", "--timeline"]
    for extra in (["--reference", "none"], []):
        out = tmp_path / "r.json"
        assert main([*base, *extra, "--dir", str(swap), "--json", str(out)]) == 0
        text = capsys.readouterr().out
        assert "timeline (seconds; stall" in text
        data = json.loads(out.read_text())
        timeline = data["timeline"]
        assert [(r["step"], r["phase"]) for r in timeline] == [
            (s, p) for s in (1, 2) for p in PHASES
        ]
        # the optimizer step moves its state through NVMe: its floor is real
        assert all(r["read_bytes"] > 0 for r in timeline if r["phase"] == "step")
        if extra:
            assert all(r["plain_seconds"] is None for r in timeline)
        else:
            assert all(r["plain_seconds"] > 0 for r in timeline)
            assert sum(r["read_bytes"] + r["written_bytes"] for r in timeline) == sum(
                data["steps_detail"]["nvme_bytes"]
            )
        for r in timeline:
            row = PhaseRow(
                step=r["step"],
                phase=r["phase"],
                seconds=r["seconds"],
                stall_seconds=r["stall_seconds"],
                read_nbytes=r["read_bytes"],
                written_nbytes=r["written_bytes"],
                io_floor_seconds=r["io_floor_seconds"],
                plain_seconds=r["plain_seconds"],
            )
            assert row.to_json() == r
            assert 0 <= r["stall_seconds"] <= r["seconds"] + 1e-9
    assert list(swap.iterdir()) == []


@pytest.mark.parametrize(
    ("load", "cpus", "threads", "policy", "warns"),
    [
        (12.0, 2, 2, None, True),  # busier than the cores, spinning: plain's seconds suspect
        (12.0, 2, 2, "active", True),
        (12.0, 2, 2, "PASSIVE", False),  # the fix: no spinning
        (12.0, 2, 2, " passive ", False),
        (1.5, 2, 2, None, False),  # a quiet machine
        (12.0, 2, 1, None, False),  # one thread: no team to wait for
    ],
)
def test_spin_wait_warning(
    load: float, cpus: int, threads: int, policy: str | None, warns: bool
) -> None:
    env = {} if policy is None else {"OMP_WAIT_POLICY": policy}
    got = spin_wait_warning(load=load, cpus=cpus, threads=threads, environ=env)
    if warns:
        assert got is not None and "OMP_WAIT_POLICY=PASSIVE" in got and f"{load:.1f}" in got
    else:
        assert got is None


def test_timing_summary_carries_the_warning() -> None:
    phases = _phases([(1.0, 2.0, 3.0, 0, 0, 10)] * 2)
    plain = PlainRun(losses=[1.0, 1.0], step_s=[1.0, 1.0])
    timing = dataclasses.replace(Timing.of(phases, phases, plain, DISK), warning="spinning")
    assert timing.summary().endswith("\nnote: spinning")
    assert timing.to_json()["timing_warning"] == "spinning"
    quiet = dataclasses.replace(timing, warning=None)
    assert "note:" not in quiet.summary() and quiet.to_json()["timing_warning"] is None
