"""Rewrite the flat ``swapper.zero`` module paths in files to the rooms' paths (issue 25).

Code written before ``swapper/zero/`` became rooms (another branch, a user's script) runs
unchanged (:mod:`swapper.zero._moved` gives the moved module, with a DeprecationWarning),
but type checkers do not follow that finder. This rewrites, in place, dotted paths
(``swapper.zero.weights`` -> ``swapper.zero.local.weights``, in imports, strings and
docstrings) and file paths (``swapper/zero/weights.py`` -> ``swapper/zero/local/weights.py``).
Running it twice changes nothing more. ``swapper.zero.config``, ``.checkpoint`` and
``.sharded`` are left alone: they are rooms now, which re-export the public names their
old modules had (a private name imported from one must be moved by hand: ``config`` ->
``config.offload``, ``checkpoint`` -> ``checkpoint.snapshot``, ``sharded`` ->
``sharded.model``). ``from swapper.zero import weights`` (a module
named through its package) is reported, not rewritten: say which room it now lives in by
hand (``from swapper.zero.local import weights``).

    python tools/zero_paths.py $(git diff --name-only main -- '*.py' '*.md')
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from swapper.zero._moved import MOVED

#: Every old module -> its new path (under ``swapper.zero.``). The three old modules whose
#: name a room took (``config``, ``checkpoint``, ``sharded``) are not here: the path is a
#: room's now, which re-exports the old module's public names, so it is left as written.
ALL = MOVED

_DOTTED = re.compile(r"swapper\.zero\.(\w+)")
_PATH = re.compile(r"(?<![\w.])((?:swapper/)?zero/)(\w+)\.py")
_FROM_PACKAGE = re.compile(r"from swapper\.zero import ([\w, ]+)")


def rewrite(text: str) -> str:
    """``text`` with every old flat path replaced by its room's path."""

    def dotted(m: re.Match[str]) -> str:
        new = ALL.get(m.group(1))
        return f"swapper.zero.{new}" if new else m.group(0)

    def path(m: re.Match[str]) -> str:
        new = ALL.get(m.group(2))
        return f"{m.group(1)}{new.replace('.', '/')}.py" if new else m.group(0)

    return _PATH.sub(path, _DOTTED.sub(dotted, text))


def by_hand(text: str) -> list[str]:
    """``from swapper.zero import <old module>`` lines: the module's room must be named."""
    out = []
    for m in _FROM_PACKAGE.finditer(text):
        names = [n.strip().split(" as ")[0] for n in m.group(1).split(",")]
        if any(n in ALL for n in names):
            out.append(m.group(0))
    return out


def main(argv: list[str] | None = None) -> int:
    """Rewrite the named files; print what changed and what needs a hand. Returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for name in args.files:
        old = name.read_text(encoding="utf-8")
        new = rewrite(old)
        if new != old:
            name.write_text(new, encoding="utf-8")
            print(f"rewrote {name}")
        for line in by_hand(new):
            print(f"{name}: by hand: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
