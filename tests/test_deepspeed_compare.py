"""tools/deepspeed_compare.py: which sides it runs. DeepSpeed itself lives in another venv
(/work/dsvenv) whose async_io op does not load under pytest's isolated environment; the
runs against it, with the tool's own check that the ZeRO-3 side's parameters equal the
pipelined side's bit for bit, are in docs/notes/2026-11-29-speed-5.md."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "deepspeed_compare", ROOT / "tools" / "deepspeed_compare.py"
    )
    if spec is None or spec.loader is None:
        raise RuntimeError("tools/deepspeed_compare.py cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    sys.modules["deepspeed_compare"] = module
    spec.loader.exec_module(module)
    return module


def test_sides_name_swapper_and_a_deepspeed_side() -> None:
    tool = _tool()
    assert tool._sides_arg("deepspeed,deepspeed-zero3,swapper") == [
        "deepspeed",
        "deepspeed-zero3",
        "swapper",
    ]
    assert tool._sides_arg(" swapper , deepspeed-zero3") == ["swapper", "deepspeed-zero3"]
    for bad in ("swapper", "deepspeed,deepspeed-zero3", "deepspeed,swapper,swapper", "x,swapper"):
        with pytest.raises(argparse.ArgumentTypeError, match="--sides"):
            tool._sides_arg(bad)
