"""The documents hold together: every relative link in README.md and docs/**/*.md points at
a file or folder of the repository (and, with ``#anchor``, at a heading of that file), no
link leaves the repository, and the two entry pages stay short enough to read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# [text](target) and ![alt](target), outside code; the target has no spaces.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    """``text`` without fenced blocks and inline code, where brackets are not links."""
    return _CODE.sub("", _FENCE.sub("", text))


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page`` (a repeated heading gets -1, -2, ... as on GitHub)."""
    found: set[str] = set()
    for line in _FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match is None:
            continue
        base = name = anchor(match[1])
        n = 0
        while name in found:
            n += 1
            name = f"{base}-{n}"
        found.add(name)
    return found


def links(page: Path) -> list[str]:
    return _LINK.findall(_prose(page.read_text(encoding="utf-8")))


def test_the_pages_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/benchmarks.md", "docs/errors.md"} <= names
    assert sum(len(links(p)) for p in PAGES) > 50


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            broken.append(f"{target}: leaves the repository; link a file of it instead")
            continue
        path_part, _, fragment = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        if not path.exists():
            broken.append(f"{target}: no such file or folder")
        elif not path.resolve().is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path):
            broken.append(f"{target}: {path.name} has no heading with anchor #{fragment}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize(("name", "limit"), [("README.md", 260), ("docs/benchmarks.md", 260)])
def test_entry_pages_stay_short(name: str, limit: int) -> None:
    lines = (ROOT / name).read_text(encoding="utf-8").count("\n")
    assert lines <= limit, f"{name} has {lines} lines (at most {limit}): move detail to docs/"


def test_anchor_matches_github() -> None:
    assert anchor("`OffloadConfig`: the model's configuration tree") == (
        "offloadconfig-the-models-configuration-tree"
    )
    assert anchor("Disk: swapper-bench against fio") == "disk-swapper-bench-against-fio"
    assert anchor("`AioConfig`: I/O settings") == "aioconfig-io-settings"
