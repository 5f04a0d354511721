"""The module paths :mod:`swapper.zero` had before it became rooms (issue 25), kept importing.

``swapper/zero/`` was one flat folder of 43 modules; they now live in rooms
(``model``, ``local``, ``sharded``, ``checkpoint``, ``config``). Code written against the
old paths (``from swapper.zero.weights import ...``, ``import swapper.zero.dcp_export``,
``monkeypatch.setattr("swapper.zero.params.X", ...)``, the README's table of errors) keeps
working: importing an old path gives the moved module itself (the same object, so a
patch through either name patches both) and warns once with :class:`DeprecationWarning`
naming the new path. Three old modules share their name with a room (``config``,
``checkpoint``, ``sharded``): those rooms' ``__init__`` re-export the old module's public
names instead.

The finder is appended to :data:`sys.meta_path` (consulted only after the normal finders
found nothing, so it never hides a real module) when :mod:`swapper.zero` is imported.
It imports nothing until an old path is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

#: Old module (under ``swapper.zero.``) -> its path now (under ``swapper.zero.``).
MOVED: dict[str, str] = {
    "autograd": "model.autograd",
    "saved": "model.saved",
    "recompute": "model.recompute",
    "readahead": "model.readahead",
    "model_buffers": "model.model_buffers",
    "module_apply": "model.module_apply",
    "offload": "local.offload",
    "offload_hooks": "local.offload_hooks",
    "params": "local.params",
    "persist": "local.persist",
    "resident": "local.resident",
    "placing": "local.placing",
    "weights": "local.weights",
    "shard_gathers": "sharded.gathers",
    "shard_grads": "sharded.grads",
    "shard_overlap": "sharded.overlap",
    "shard_setup": "sharded.setup",
    "shard_state": "sharded.state",
    "shard_writes": "sharded.writes",
    "shard_checkpoint": "sharded.state_dicts",
    "gather_budget": "sharded.gather_budget",
    "snapshot_rng": "checkpoint.rng",
    "snapshot_commit": "checkpoint.commit",
    "shard_snapshot": "checkpoint.shard_snapshot",
    "shard_resume": "checkpoint.shard_resume",
    "rebuild": "checkpoint.rebuild",
    "digest": "checkpoint.digest",
    "export": "checkpoint.export",
    "dcp_export": "checkpoint.dcp_export",
    "dcp_import": "checkpoint.dcp_import",
    "dcp_io": "checkpoint.dcp_io",
    "dcp_planners": "checkpoint.dcp_planners",
    "dcp_reshard": "checkpoint.dcp_reshard",
    "dcp_templates": "checkpoint.dcp_templates",
    "settings": "config.settings",
    "dist_config": "config.distributed",
    "deepspeed": "config.deepspeed",
    "deepspeed_training": "config.deepspeed_training",
}

#: Names that left their module when the knots were cut: (old module, name) -> the module
#: (under ``swapper.zero.``) that defines it now. Importing the old module's path puts the
#: name back on the module for that code (``from swapper.zero.dcp_export import
#: import_dcp``); the new paths do not import each other for it.
MOVED_NAMES: dict[tuple[str, str], str] = {
    ("dcp_export", "import_dcp"): "checkpoint.dcp_import",
    ("deepspeed", "load_deepspeed"): "config.offload",
}

_PREFIX = "swapper.zero."


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module now at ``target`` (imported on first use)."""

    def __init__(self, old: str, target: str) -> None:
        self._old = old
        self._target = target
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self._target} (issue 25): import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(self._target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module ran under its own name); put back its own
        ``__spec__``, which the import system has just set to the old path's; give it
        back the names that moved out of it (:data:`MOVED_NAMES`)."""
        module.__spec__ = self._spec
        for (old, name), home in MOVED_NAMES.items():
            if old == self._old and not hasattr(module, name):
                setattr(module, name, getattr(importlib.import_module(_PREFIX + home), name))


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED` and nothing else."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_PREFIX):
            return None
        new = MOVED.get(fullname[len(_PREFIX) :])
        if new is None:
            return None
        return importlib.util.spec_from_loader(
            fullname, _Alias(fullname[len(_PREFIX) :], _PREFIX + new)
        )


def install() -> None:
    """Append the finder to :data:`sys.meta_path`, once per process."""
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedFinder())
