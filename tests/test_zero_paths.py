"""tools/zero_paths.py: old flat ``swapper.zero`` paths rewritten to the rooms' (issue 25)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

from zero_paths import by_hand, rewrite


def test_old_paths_become_the_rooms_paths() -> None:
    text = (
        "from swapper.zero.weights import restore\n"
        'patch("swapper.zero.shard_state.ShardSlot.x")\n'
        "import swapper.zero.dcp_export as e\n"
        "see swapper/zero/shard_state.py and zero/dcp_io.py\n"
    )
    assert rewrite(text) == (
        "from swapper.zero.local.weights import restore\n"
        'patch("swapper.zero.sharded.state.ShardSlot.x")\n'
        "import swapper.zero.checkpoint.dcp_export as e\n"
        "see swapper/zero/sharded/state.py and zero/checkpoint/dcp_io.py\n"
    )


def test_new_paths_rooms_and_public_names_are_left_alone() -> None:
    text = (
        "from swapper.zero.config.settings import FLAT_KEYS\n"
        "from swapper.zero.checkpoint.snapshot import save_snapshot\n"
        "from swapper.zero.checkpoint import commit, save_snapshot\n"
        "from swapper.zero.config import OffloadConfig\n"
        "from swapper.zero.sharded import ShardedModel\n"
        "swapper.zero.OffloadConfig, swapper.zero.export_dcp, swapper.zero.model.saved\n"
    )
    assert rewrite(text) == text
    once = rewrite("from swapper.zero.export import export_safetensors\n")
    assert (
        rewrite(once) == once == "from swapper.zero.checkpoint.export import export_safetensors\n"
    )


def test_a_module_named_through_its_package_is_reported() -> None:
    assert by_hand("from swapper.zero import weights, offload as o\n") == [
        "from swapper.zero import weights, offload as o"
    ]
    assert by_hand("from swapper.zero import OffloadConfig, final_digest\n") == []
