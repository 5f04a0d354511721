"""tools/plot_results.py draws the results page's plots from the recorded JSON."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "plot_results", ROOT / "tools" / "plot_results.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["plot_results"] = module
    spec.loader.exec_module(module)
    return module


def test_every_plot_is_drawn_from_the_recorded_json(tmp_path: Path) -> None:
    tool = _tool()
    written = tool.draw(RESULTS, tmp_path)
    assert sorted(p.name for p in written) == sorted(f"{n}.png" for n in tool.PLOTS)
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (ROOT / "docs" / "img" / path.name).exists(), f"{path.name} not committed"


def test_a_result_without_its_machine_is_refused(tmp_path: Path) -> None:
    tool = _tool()
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    record = json.loads((results / "disk_vs_fio.json").read_text(encoding="utf-8"))
    del record["machine"]
    (results / "disk_vs_fio.json").write_text(json.dumps(record), encoding="utf-8")
    assert tool.main(["--results", str(results), "--out", str(tmp_path / "img")]) == 2
