"""Tests of the house rules that keep the layers readable (issue 11).

* ``tiers`` never imports ``swapper``: dependencies point down only.
* No import cycle among the modules of ``swapper`` and ``tiers``. The graph is built from
  the source with :mod:`ast` (nothing is imported), from module-level imports outside
  ``if TYPE_CHECKING:``; imports inside functions are deliberate late binding and are
  left out, as are the implicit imports of parent packages.
* No module over 500 lines unless its header (the first 40 lines) states why, with a line
  ``# Size: <reason>``.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("swapper", "tiers")
MAX_LINES = 500
HEADER_LINES = 40


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the packages."""
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is imported: module level, into if/try, not into defs."""
    out: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                stack.extend(node.body)
            stack.extend(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                stack.extend(block)
            for handler in node.handlers:
                stack.extend(handler.body)
        elif isinstance(node, ast.With):
            stack.extend(node.body)
    return out


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The project modules an import statement names (absolute dotted names)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    # `from a import b` names module a.b where that is a module, else a itself.
    return {f"{source}.{alias.name}" for alias in node.names} | {source}


def import_graph(
    statements: Callable[[ast.Module], list[ast.Import | ast.ImportFrom]] | None = None,
) -> dict[str, set[str]]:
    """Module -> the project modules it imports at import time (or, given ``statements``,
    through the import statements that function picks from a module's tree)."""
    pick = _top_level_imports if statements is None else statements
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in pick(tree):
            targets = _targets(name, is_package, node)
            submodules = {t for t in targets if t in modules and t.rsplit(".", 1)[0] in targets}
            # `from pkg import sub` imports pkg.sub; don't also count pkg when pkg is an
            # ancestor of the importer (Python has imported it already, by then, or is
            # importing it: that is a parent, not a dependency).
            for target in targets:
                if target not in modules or target == name:
                    continue
                if submodules and target not in submodules and name.startswith(target + "."):
                    continue
                edges.add(target)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        # Iterative DFS: (node, iterator over its successors).
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(components)


def test_find_cycles_finds_a_cycle_and_accepts_a_dag() -> None:
    # The checker itself, against graphs whose answer is known.
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [
        ["a", "b"],
        ["c", "d"],
    ]


def test_graph_sees_the_known_imports() -> None:
    graph = import_graph()
    # A known edge each way of the layering, so an empty graph cannot pass.
    assert "tiers.aio.engine" in graph["tiers.aio"]
    assert any(target.startswith("tiers") for target in graph["swapper.manager.core"])


def test_tiers_never_imports_swapper() -> None:
    offenders = {
        module: sorted(t for t in targets if t.split(".")[0] == "swapper")
        for module, targets in import_graph().items()
        if module.split(".")[0] == "tiers"
    }
    offenders = {m: t for m, t in offenders.items() if t}
    # Function-level imports count here too: a late import is still an arrow upward.
    for module, path in _modules().items():
        if module.split(".")[0] != "tiers":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                is_package = path.name == "__init__.py"
                up = sorted(
                    t for t in _targets(module, is_package, node) if t.split(".")[0] == "swapper"
                )
                if up:
                    offenders.setdefault(module, []).extend(up)
    assert not offenders, f"tiers must not import swapper: {offenders}"


def test_no_import_cycle() -> None:
    cycles = find_cycles(import_graph())
    assert not cycles, f"import cycles among modules: {cycles}"


def _oversized() -> list[str]:
    out = []
    for _module, path in sorted(_modules().items()):
        lines = path.read_text().splitlines()
        if len(lines) <= MAX_LINES:
            continue
        header = lines[:HEADER_LINES]
        if any(
            line.lstrip().startswith("# Size:") and line.split(":", 1)[1].strip() for line in header
        ):
            continue
        out.append(f"{path.relative_to(ROOT)} ({len(lines)} lines)")
    return out


def test_no_module_over_500_lines_without_a_reason() -> None:
    oversized = _oversized()
    assert not oversized, (
        f"modules over {MAX_LINES} lines with no '# Size: <reason>' line in their first "
        f"{HEADER_LINES} lines: split them or state why not: {oversized}"
    )
