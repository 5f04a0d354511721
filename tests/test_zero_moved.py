"""swapper.zero._moved: the module paths zero/ had before its rooms (issue 25) still import.

Code written against the flat paths (other branches, users, the README's error table) must
keep working: the old path is the moved module itself (a patch through either name
patches both), it warns once naming the new path, and the moved module keeps its own
name and spec. The three old modules whose name a room took re-export their public names.
"""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

import swapper.zero
from swapper.zero import _moved

#: Every module zero/ held before the rooms (git show df60e5b:swapper/zero), but __init__.
FLAT = [
    "autograd",
    "checkpoint",
    "config",
    "dcp_export",
    "dcp_import",
    "dcp_io",
    "dcp_planners",
    "dcp_reshard",
    "dcp_templates",
    "deepspeed",
    "deepspeed_training",
    "digest",
    "dist_config",
    "export",
    "gather_budget",
    "model_buffers",
    "module_apply",
    "offload",
    "offload_hooks",
    "params",
    "persist",
    "placing",
    "readahead",
    "rebuild",
    "recompute",
    "resident",
    "saved",
    "settings",
    "shard_checkpoint",
    "shard_gathers",
    "shard_grads",
    "shard_overlap",
    "shard_resume",
    "shard_setup",
    "shard_snapshot",
    "shard_state",
    "shard_writes",
    "sharded",
    "snapshot_commit",
    "snapshot_rng",
    "weights",
    "wrap",
]
#: Old modules whose name is now a room's: the room re-exports their public names.
ROOMS = {
    "config": ("swapper.zero.config.offload", ["OffloadConfig"]),
    "checkpoint": ("swapper.zero.checkpoint.snapshot", ["save_snapshot", "final_digest"]),
    "sharded": ("swapper.zero.sharded.model", ["ShardedModel"]),
}


def test_every_flat_module_has_a_way_in() -> None:
    assert sorted([*_moved.MOVED, *ROOMS, "wrap"]) == sorted(FLAT)
    for new in _moved.MOVED.values():
        importlib.import_module(f"swapper.zero.{new}")


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_path_is_the_moved_module_and_warns(old: str) -> None:
    name = f"swapper.zero.{old}"
    new = importlib.import_module(f"swapper.zero.{_moved.MOVED[old]}")
    sys.modules.pop(name, None)  # (another test may have imported it already)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = importlib.import_module(name)
    assert got is new
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        f"{name} moved to {new.__name__} (issue 25): import it from there"
    ]
    assert new.__name__ == new.__spec__.name == f"swapper.zero.{_moved.MOVED[old]}"


def test_a_patch_through_the_old_path_reaches_the_moved_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from swapper.zero.local import weights

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        monkeypatch.setattr("swapper.zero.weights.log", "patched")
    assert weights.log == "patched"


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_a_room_named_as_an_old_module_offers_its_public_names(room: str) -> None:
    module, names = ROOMS[room]
    package = importlib.import_module(f"swapper.zero.{room}")
    real = importlib.import_module(module)
    for name in names:
        assert getattr(package, name) is getattr(real, name)


def test_names_that_left_an_old_module_are_found_through_its_old_path() -> None:
    from swapper.zero.checkpoint import dcp_import
    from swapper.zero.config import offload

    for name in ("swapper.zero.dcp_export", "swapper.zero.deepspeed"):
        sys.modules.pop(name, None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from swapper.zero.dcp_export import import_dcp
        from swapper.zero.deepspeed import load_deepspeed
    assert import_dcp is dcp_import.import_dcp
    assert load_deepspeed is offload.load_deepspeed


def test_names_never_moved_are_still_missing() -> None:
    assert any(isinstance(f, _moved.MovedFinder) for f in sys.meta_path)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("swapper.zero.no_such_module")
    assert not hasattr(swapper.zero, "no_such_module")
