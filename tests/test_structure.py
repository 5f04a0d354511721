"""Measurements of the library's structure, held as ratchets (issue 25).

:mod:`test_layering` checks the import-time rules (``tiers`` never imports ``swapper``, no
cycle among the imports that run when a module is imported, the ``# Size:`` line). This file
counts what those rules leave out, so that the targets of issue 25 stay visible and can
only get closer:

* **Knots.** The import graph of ``swapper`` and ``tiers`` counting *every* import: at
  module level, inside functions and under ``if TYPE_CHECKING:``. A strongly connected
  component of more than one module is a set of modules that cannot be read (or moved)
  one without the others. Target: none. Today's components are written out in
  :data:`ALLOWED_KNOTS`; a component found must lie inside one of them.
* **Reaches.** ``x._name`` where ``x`` is not ``self``/``cls``/``super()`` and ``_name`` is
  defined by the project but not in the module that reads it: one module using another's
  private state. Target: <= 40 in all. Today's are counted in :data:`ALLOWED_REACHES` per
  (module, name); no count may grow and no new pair may appear.
* **Rooms.** No folder of the packages with more than :data:`MAX_MODULES` modules.

A ratchet that finds *fewer* than its list says fails too, with the line to change, so an
improvement is written down the moment it is made.
"""

from __future__ import annotations

import ast
from collections import Counter

from test_layering import ROOT, _is_type_checking, _modules, _targets, find_cycles, import_graph

MAX_MODULES = 20
MAX_REACHES = 40
SELF_NAMES = frozenset({"self", "cls"})


def _every_import(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]


def full_import_graph() -> dict[str, set[str]]:
    """Module -> every project module it imports, wherever the import statement stands
    (module level, function body, ``TYPE_CHECKING`` block). Parent packages a module's own
    dotted name implies are not edges (Python imports them first, whatever the module
    says)."""
    return import_graph(_every_import)


def _defined_private_names(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions, classes, attributes it assigns on any
    object (``self._x = ``, ``obj._x = ``), class and module level assignments."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            if isinstance(node.value, ast.Name) and node.value.id in SELF_NAMES:
                out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.alias) and node.asname:
            out.add(node.asname)
    return {name for name in out if _is_private(name)}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_self(value: ast.expr) -> bool:
    if isinstance(value, ast.Name):
        return value.id in SELF_NAMES
    # super()._x reads the module's own class hierarchy.
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "super"
    )


def private_reaches() -> Counter[tuple[str, str]]:
    """(module file, private name) -> how many times the module reads or writes
    ``x._name`` of a private name some *other* module of the packages defines."""
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in _modules().values()}
    defined = {path: _defined_private_names(tree) for path, tree in trees.items()}
    project_names = set().union(*defined.values())
    out: Counter[tuple[str, str]] = Counter()
    for path, tree in trees.items():
        own = defined[path]
        where = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
                continue
            if _is_self(node.value) or node.attr in own or node.attr not in project_names:
                continue
            out[(where, node.attr)] += 1
    return out


def folder_sizes() -> dict[str, int]:
    """Folder (relative path) -> how many modules (``.py`` files, ``__init__`` included)
    it holds directly."""
    sizes: Counter[str] = Counter()
    for path in _modules().values():
        sizes[str(path.parent.relative_to(ROOT))] += 1
    return dict(sizes)


# ---- the ratchets: today's figures, written out so they can only shrink -------------------

#: Strongly connected components of the full import graph. Target (issue 25): none.
ALLOWED_KNOTS: list[list[str]] = [
    [
        "swapper.step.deferred",
        "swapper.step.optimizer",
        "swapper.step.resume",
        "swapper.step.state",
        "swapper.step.update",
    ],
    [
        "swapper.zero.checkpoint.digest",
        "swapper.zero.checkpoint.shard_resume",
        "swapper.zero.checkpoint.shard_snapshot",
        "swapper.zero.checkpoint.snapshot",
        "swapper.zero.local.offload",
        "swapper.zero.local.offload_hooks",
        "swapper.zero.local.params",
        "swapper.zero.local.persist",
        "swapper.zero.local.placing",
        "swapper.zero.local.resident",
        "swapper.zero.local.weights",
        "swapper.zero.sharded.gathers",
        "swapper.zero.sharded.grads",
        "swapper.zero.sharded.model",
        "swapper.zero.sharded.overlap",
        "swapper.zero.sharded.setup",
        "swapper.zero.sharded.state",
        "swapper.zero.sharded.state_dicts",
        "swapper.zero.sharded.writes",
    ],
]

#: Cross-module private reaches, per (module file, private name). Target (issue 25): <= 40
#: in all, each one inside its own package with a reason.
ALLOWED_REACHES: dict[tuple[str, str], int] = {
    ("swapper/manager/snapshot.py", "_ctx"): 3,
    ("swapper/manager/snapshot.py", "_jobs"): 1,
    ("swapper/step/deferred.py", "_check_open"): 2,
    ("swapper/step/deferred.py", "_frozen_groups"): 2,
    ("swapper/step/deferred.py", "_grad_factor"): 1,
    ("swapper/step/deferred.py", "_grad_norm"): 1,
    ("swapper/step/deferred.py", "_param"): 1,
    ("swapper/step/deferred.py", "_pending"): 2,
    ("swapper/step/deferred.py", "_pipeline"): 5,
    ("swapper/step/deferred.py", "_run_order"): 2,
    ("swapper/step/deferred.py", "_run_pipeline"): 1,
    ("swapper/step/deferred.py", "_step_count"): 1,
    ("swapper/step/deferred.py", "_zero_grad_now"): 1,
    ("swapper/step/resume.py", "_held"): 3,
    ("swapper/step/resume.py", "_numels"): 2,
    ("swapper/step/resume.py", "_pipeline"): 2,
    ("swapper/step/resume.py", "_registered"): 2,
    ("swapper/step/resume.py", "_step_count"): 1,
    ("swapper/step/state.py", "_closed"): 1,
    ("swapper/step/state.py", "_load_incomplete"): 2,
    ("swapper/step/state.py", "_numels"): 2,
    ("swapper/step/state.py", "_pending"): 2,
    ("swapper/step/state.py", "_pipeline"): 3,
    ("swapper/step/state.py", "_step_count"): 2,
    ("swapper/zero/checkpoint/dcp_export.py", "_by_name"): 1,
    ("swapper/zero/checkpoint/dcp_export.py", "_closed"): 1,
    ("swapper/zero/checkpoint/dcp_export.py", "_param_gate"): 2,
    ("swapper/zero/checkpoint/shard_snapshot.py", "_ctx"): 2,
    ("swapper/zero/checkpoint/snapshot.py", "_ctx"): 1,
    ("swapper/zero/local/params.py", "_drop_grads"): 1,
    ("swapper/zero/local/params.py", "_keep_held"): 1,
    ("swapper/zero/local/params.py", "_lazy_norms"): 1,
    ("swapper/zero/local/params.py", "_param_gate"): 1,
    ("swapper/zero/local/params.py", "_persist"): 2,
    ("swapper/zero/local/params.py", "_room_limit"): 1,
    ("swapper/zero/local/params.py", "_slots"): 1,
    ("swapper/zero/local/persist.py", "_by_name"): 7,
    ("swapper/zero/local/persist.py", "_forward_holds"): 1,
    ("swapper/zero/local/persist.py", "_grad_hook"): 1,
    ("swapper/zero/local/persist.py", "_holds"): 2,
    ("swapper/zero/local/persist.py", "_lazy_norms"): 3,
    ("swapper/zero/local/persist.py", "_lock"): 10,
    ("swapper/zero/local/persist.py", "_manager"): 5,
    ("swapper/zero/local/persist.py", "_param_gate"): 1,
    ("swapper/zero/local/persist.py", "_persist"): 11,
    ("swapper/zero/local/persist.py", "_post_forward_hook"): 1,
    ("swapper/zero/local/persist.py", "_pre_forward_hook"): 1,
    ("swapper/zero/local/persist.py", "_room_limit"): 1,
    ("swapper/zero/local/persist.py", "_use_tier"): 1,
    ("swapper/zero/local/resident.py", "_holds"): 1,
    ("swapper/zero/local/resident.py", "_keep_held"): 1,
    ("swapper/zero/local/resident.py", "_lock"): 1,
    ("swapper/zero/local/resident.py", "_manager"): 1,
    ("swapper/zero/local/resident.py", "_param_gate"): 1,
    ("swapper/zero/local/resident.py", "_plan"): 1,
    ("swapper/zero/local/resident.py", "_use_tier"): 1,
    ("swapper/zero/local/weights.py", "_by_name"): 1,
    ("swapper/zero/local/weights.py", "_closed"): 3,
    ("swapper/zero/local/weights.py", "_lock"): 1,
    ("swapper/zero/local/weights.py", "_param_gate"): 2,
    ("swapper/zero/local/weights.py", "_persist"): 1,
    ("swapper/zero/local/weights.py", "_slots"): 1,
    ("swapper/zero/local/weights.py", "_weights"): 2,
    ("swapper/zero/model/model_buffers.py", "_buffers"): 4,
    ("swapper/zero/model/module_apply.py", "_buffers"): 2,
    ("tiers/nvme/core.py", "_attach"): 2,
    ("tiers/nvme/core.py", "_complete"): 1,
    ("tiers/nvme/core.py", "_expect"): 1,
    ("tiers/nvme/core.py", "_issued"): 1,
    ("tiers/nvme/core.py", "_part_done"): 1,
    ("tiers/nvme/core.py", "_parts"): 2,
    ("tiers/nvme/core.py", "_resolve"): 3,
    ("tiers/nvme/store.py", "_expect"): 1,
    ("tiers/nvme/store.py", "_part_done"): 2,
    ("tiers/nvme/store.py", "_setup"): 1,
}

#: Folders allowed more than MAX_MODULES modules. Target (issue 25): none.
ALLOWED_BIG_FOLDERS: dict[str, int] = {}


# ---- the checkers themselves ---------------------------------------------------------------


def test_full_graph_counts_late_and_type_checking_imports() -> None:
    # A known late import and a known TYPE_CHECKING import, so a graph that only saw
    # module-level imports cannot pass.
    graph = full_import_graph()
    late = [
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if module.startswith("swapper.") and target.startswith("swapper.")
    ]
    assert len(late) > 100
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import b\n"
        "def f():\n    import c\n"
    )
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= _targets("a", False, node)
    assert found == {"b", "c"}
    assert _is_type_checking(ast.parse("TYPE_CHECKING", mode="eval").body)


def test_reach_counter_tells_own_from_others() -> None:
    tree = ast.parse(
        "class A:\n"
        "    def f(self, other):\n"
        "        self._a = 1\n"
        "        return other._a, other._b\n"
    )
    assert _defined_private_names(tree) == {"_a"}
    assert _is_self(ast.parse("super()", mode="eval").body)
    assert not _is_self(ast.parse("model", mode="eval").body)


def test_import_knots_only_shrink() -> None:
    knots = find_cycles(full_import_graph())
    allowed = [set(knot) for knot in ALLOWED_KNOTS]
    new = [knot for knot in knots if not any(set(knot) <= room for room in allowed)]
    assert not new, (
        "import knots (strongly connected components counting late and TYPE_CHECKING "
        f"imports) not in ALLOWED_KNOTS; the target is none: {new}"
    )
    assert sorted(map(sorted, knots)) == sorted(map(sorted, ALLOWED_KNOTS)), (
        f"the knots shrank: write ALLOWED_KNOTS = {knots!r}"
    )


def test_private_reaches_only_shrink() -> None:
    found = private_reaches()
    grown = {key: n for key, n in found.items() if n > ALLOWED_REACHES.get(key, 0)}
    assert not grown, (
        f"private reaches x._name into another module's state beyond ALLOWED_REACHES "
        f"(target <= {MAX_REACHES} in all): give the owner a named method or protocol: {grown}"
    )
    stale = {key: n for key, n in ALLOWED_REACHES.items() if found.get(key, 0) < n}
    assert not stale, (
        "fewer private reaches than ALLOWED_REACHES allows (well done): lower these entries "
        f"to { ({key: found.get(key, 0) for key in stale}) } (0: delete the line)"
    )


def test_no_folder_over_twenty_modules() -> None:
    sizes = folder_sizes()
    big = {folder: n for folder, n in sizes.items() if n > MAX_MODULES}
    over = {f: n for f, n in big.items() if n > ALLOWED_BIG_FOLDERS.get(f, MAX_MODULES)}
    assert not over, f"folders over {MAX_MODULES} modules: split them into rooms: {over}"
    assert big == ALLOWED_BIG_FOLDERS, f"the big folders shrank: write ALLOWED_BIG_FOLDERS = {big}"
