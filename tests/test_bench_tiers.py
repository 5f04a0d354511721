"""Tests of ``swapper-bench tiers``: the manager's evict/fetch beside the raw disk figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from swapper.bench import main
from swapper.bench.tiers_command import _draw_sizes

MiB = 1 << 20


def test_tiers_json_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "work"
    work.mkdir()
    out = tmp_path / "tiers.json"
    argv = ["tiers", "--dir", str(work), "--size", "24MiB", "--tensor-min", "1MiB"]
    argv += ["--tensor-max", "5MiB", "--loops", "2", "--warmup", "0", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "evict" in printed and "fetch" in printed and "ratio" in printed
    records = json.loads(out.read_text())["results"]
    assert [r["op"] for r in records] == ["evict", "fetch"]
    for r in records:
        assert len(r["seconds"]) == 2
        assert r["gbps"] > 0 and r["disk_gbps"] > 0
        assert r["ratio"] == pytest.approx(r["gbps"] / r["disk_gbps"])
        assert r["nbytes"] == 24 * MiB
    assert {r["disk_op"] for r in records} == {"write", "read"}
    assert list(work.iterdir()) == []  # everything it made is gone


def test_tiers_two_dirs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    argv = ["tiers", "--dir", str(dirs[0]), "--dir", str(dirs[1]), "--size", "16MiB"]
    argv += ["--tensor-min", "1MiB", "--tensor-max", "4MiB", "--loops", "1", "--warmup", "0"]
    assert main(argv) == 0
    assert "evict" in capsys.readouterr().out
    assert all(list(d.iterdir()) == [] for d in dirs)


@pytest.mark.parametrize(
    "argv",
    [
        ["--tensor-min", "8MiB", "--tensor-max", "4MiB"],
        ["--size", "1MiB", "--tensor-min", "2MiB"],
        ["--loops", "0"],
        ["--backend", "nonsense"],
        ["--block-size", "1000"],
    ],
)
def test_tiers_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    assert main(["tiers", "--dir", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("swapper-bench: error:") and "\n" not in err


def test_drawn_sizes_stay_in_range() -> None:
    import random

    sizes = _draw_sizes(100 * MiB, 4 * MiB, 16 * MiB, random.Random(1))
    assert all(s % 2 == 0 and 0 < s <= 16 * MiB for s in sizes)
    assert 100 * MiB - 4 * MiB < sum(sizes) <= 100 * MiB
