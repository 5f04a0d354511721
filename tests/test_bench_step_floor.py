"""Tests of :mod:`swapper.bench.step_floor`: the disk-rate floor's arithmetic (no timing)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swapper.bench.step_floor import DiskRound, floor_record, median_round, step_floor
from tiers.errors import SwapConfigError

GB = 10**9


def test_separate_rates_set_the_floor_when_mixing_is_slower() -> None:
    # 3 GB each way at 2 GB/s read and 4 GB/s write: 1.5 + 0.75 = 2.25 s; both at once
    # at 2.4 GB/s would take 6 / 2.4 = 2.5 s, so the disk's best is 2.25 s
    rates = DiskRound(read_bps=2 * GB, write_bps=4 * GB, mixed_bps=2.4 * GB)
    floor = step_floor(read_nbytes=3 * GB, written_nbytes=3 * GB, rates=rates, compute_seconds=1)
    assert floor.separate_seconds == pytest.approx(2.25)
    assert floor.mixed_seconds == pytest.approx(2.5)
    assert floor.disk_seconds == pytest.approx(2.25)
    assert floor.seconds == pytest.approx(2.25)
    assert floor.bound == "disk-separate"


def test_mixed_rate_sets_the_floor_when_reads_and_writes_overlap() -> None:
    rates = DiskRound(read_bps=2 * GB, write_bps=4 * GB, mixed_bps=4 * GB)
    floor = step_floor(read_nbytes=3 * GB, written_nbytes=3 * GB, rates=rates, compute_seconds=1)
    assert floor.disk_seconds == pytest.approx(1.5)
    assert floor.bound == "disk-mixed"


def test_compute_sets_the_floor_when_slower_than_the_disk() -> None:
    rates = DiskRound(read_bps=2 * GB, write_bps=4 * GB, mixed_bps=4 * GB)
    floor = step_floor(read_nbytes=3 * GB, written_nbytes=3 * GB, rates=rates, compute_seconds=4)
    assert floor.seconds == 4
    assert floor.bound == "compute"


def test_mixed_rate_ignored_when_the_step_is_lopsided() -> None:
    # the probe mixes equal amounts; a step that mostly reads is not what it measured
    rates = DiskRound(read_bps=2 * GB, write_bps=4 * GB, mixed_bps=100 * GB)
    floor = step_floor(read_nbytes=4 * GB, written_nbytes=1 * GB, rates=rates, compute_seconds=0)
    assert floor.mixed_seconds is None
    assert floor.seconds == pytest.approx(2.25)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"read_nbytes": -1}, "read_nbytes=-1"),
        ({"compute_seconds": -0.5}, "compute_seconds=-0.5"),
        ({"rates": DiskRound(read_bps=0, write_bps=1, mixed_bps=1)}, "read_bps=0"),
    ],
)
def test_refuses_what_cannot_judge(kwargs: dict[str, object], words: str) -> None:
    args: dict[str, object] = {
        "read_nbytes": 1,
        "written_nbytes": 1,
        "rates": DiskRound(read_bps=1, write_bps=1, mixed_bps=1),
        "compute_seconds": 0.0,
    }
    args.update(kwargs)
    with pytest.raises(SwapConfigError, match=words):
        step_floor(**args)  # type: ignore[arg-type]


rate = st.floats(min_value=1e6, max_value=1e11)


@given(
    read=st.integers(0, 10**12),
    written=st.integers(0, 10**12),
    r=rate,
    w=rate,
    m=rate,
    compute=st.floats(0, 1e3),
)
def test_floor_is_the_larger_of_compute_and_the_disks_best(
    read: int, written: int, r: float, w: float, m: float, compute: float
) -> None:
    floor = step_floor(
        read_nbytes=read,
        written_nbytes=written,
        rates=DiskRound(read_bps=r, write_bps=w, mixed_bps=m),
        compute_seconds=compute,
    )
    assert floor.seconds >= compute
    assert floor.seconds >= floor.disk_seconds
    assert floor.disk_seconds <= floor.separate_seconds
    assert floor.seconds == max(floor.disk_seconds, compute)
    if floor.mixed_seconds is not None:
        assert floor.disk_seconds == min(floor.separate_seconds, floor.mixed_seconds)


def test_median_round_takes_each_rate_apart() -> None:
    rounds = [
        DiskRound(read_bps=1, write_bps=9, mixed_bps=5),
        DiskRound(read_bps=2, write_bps=8, mixed_bps=4),
        DiskRound(read_bps=3, write_bps=7, mixed_bps=6),
    ]
    assert median_round(rounds) == DiskRound(read_bps=2, write_bps=8, mixed_bps=5)
    with pytest.raises(SwapConfigError, match="no probe rounds"):
        median_round([])


def test_floor_record_pairs_each_round_with_its_own_disk_and_compute() -> None:
    rounds = [
        DiskRound(read_bps=1 * GB, write_bps=1 * GB, mixed_bps=1 * GB),
        DiskRound(read_bps=2 * GB, write_bps=2 * GB, mixed_bps=1 * GB),
        DiskRound(read_bps=4 * GB, write_bps=4 * GB, mixed_bps=1 * GB),
    ]
    doc = floor_record(
        step_seconds=[4.0, 2.0, 3.0],
        read_nbytes=1 * GB,
        written_nbytes=1 * GB,
        compute_seconds=[0.5, 0.5, 2.0],
        disk_rounds=rounds,
    )
    # floors: 2 s (1+1; mixed 2), 1 s (0.5+0.5; mixed 2), max(0.5, compute 2) = 2 s
    assert doc["step_over_floor_per_round"] == pytest.approx([2.0, 2.0, 1.5])
    assert doc["step_over_floor_median_per_round"] == pytest.approx(2.0)
    # of the medians: rates 2 GB/s (floor 1 s), compute 0.5 s; step median 3 s
    assert doc["floor"]["seconds"] == pytest.approx(1.0)
    assert doc["step_over_floor"] == pytest.approx(3.0)
    with pytest.raises(SwapConfigError, match="one of each per round"):
        floor_record(
            step_seconds=[1.0],
            read_nbytes=1,
            written_nbytes=1,
            compute_seconds=[],
            disk_rounds=rounds[:1],
        )
