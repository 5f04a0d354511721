"""The error table (docs/errors.md, linked from the README) is true and complete.

Every error it lists imports from where it says, derives from ``SwapError`` and from the
builtin in brackets; every public ``SwapError`` subclass of swapper and tiers is listed.
"""

from __future__ import annotations

import builtins
import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import swapper
import tiers
from tiers.errors import SwapError

ERRORS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "errors.md"

# A table row: | `A` [`Base`], `B` (`module`; ...) | when | what to do |
_ROW = re.compile(r"^\| (?P<names>[^|]*?) \| [^|]+ \| [^|]+ \|$")


def _rows() -> list[tuple[list[tuple[str, str | None]], list[str]]]:
    """([(name, bracketed base or None)], modules) for each row of the Errors table."""
    text = ERRORS_PAGE.read_text(encoding="utf-8")
    section = text.split("\n## Every error\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        match = _ROW.match(line)
        if match is None or line.startswith("| error") or line.startswith("|---"):
            continue
        head, _, where = match["names"].partition(" (")
        names = [(n, b or None) for n, b in re.findall(r"`(\w+)`(?: \[`(\w+)`\])?", head)]
        modules = re.findall(r"`([\w.]+)`", where.split(";")[0])
        rows.append((names, modules))
    return rows


def test_the_table_is_found() -> None:
    assert len(_rows()) >= 20


@pytest.mark.parametrize(("names", "modules"), _rows(), ids=lambda v: str(v))
def test_each_listed_error_imports_from_where_the_table_says(
    names: list[tuple[str, str | None]], modules: list[str]
) -> None:
    assert modules, f"{names}: no module named"
    module = importlib.import_module(modules[0])
    for name, base in names:
        cls = getattr(module, name, None)
        assert isinstance(cls, type), f"{name} is not importable from {modules[0]}"
        assert issubclass(cls, SwapError), name
        if base is not None:
            expected = next(
                (c for c in (getattr(m, base, None) for m in (builtins, module, tiers)) if c), None
            )
            assert isinstance(expected, type), f"{name}: unknown base {base}"
            assert issubclass(cls, expected), f"{name} is not a {base}"


def _public_errors() -> set[str]:
    """Every SwapError subclass defined in a public module of swapper or tiers."""
    for package in (swapper, tiers):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if any(part.startswith("_") for part in info.name.split(".")):
                continue
            importlib.import_module(info.name)
    found: set[str] = set()
    todo = [SwapError]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            module = sub.__module__
            public = not any(p.startswith("_") for p in [*module.split("."), sub.__name__])
            if public and module.split(".")[0] in ("swapper", "tiers"):
                found.add(sub.__name__)
    return found


def test_every_public_error_is_in_the_table() -> None:
    listed = {name for names, _ in _rows() for name, _ in names}
    listed.add("SwapError")
    missing = sorted(_public_errors() - listed)
    assert not missing, f"errors a user can meet that docs/errors.md leaves out: {missing}"
