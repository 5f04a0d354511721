"""Tests of swapper.distributed.identity: per-rank directories and the store identity."""

from __future__ import annotations

import dataclasses
import json
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from swapper.distributed import (
    StoreIdentityError,
    StoreLayoutError,
    claim_store_identity,
    identity_path,
    rank_dirs,
)
from swapper.manager import TierManager
from tiers.errors import SwapConfigError


def test_rank_dirs_one_private_subdirectory_per_nvme_dir(tmp_path: Path) -> None:
    bases = [tmp_path / "a", tmp_path / "b"]
    dirs = rank_dirs(bases, 1, 4)
    assert dirs == (tmp_path / "a" / "rank1of4", tmp_path / "b" / "rank1of4")
    for d in dirs:
        assert d.is_dir() and stat.S_IMODE(d.stat().st_mode) == 0o700
    assert rank_dirs(bases, 0, 4, create=False)[0] == tmp_path / "a" / "rank0of4"
    assert not (tmp_path / "a" / "rank0of4").exists()
    for rank, world in ((4, 4), (-1, 2), (0, 0)):
        with pytest.raises(SwapConfigError, match="rank"):
            rank_dirs(bases, rank, world)
    with pytest.raises(SwapConfigError, match="must be an int"):
        rank_dirs(bases, True, 2)  # type: ignore[arg-type]


def test_claim_writes_a_private_record_and_accepts_the_same_rank_again(tmp_path: Path) -> None:
    bases = [tmp_path / "a", tmp_path / "b"]
    dirs = claim_store_identity(bases, "store", 1, 2)
    path = identity_path(dirs, "store")
    assert path == tmp_path / "a" / "rank1of2" / "store.identity"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {
        "format": 1, "store_name": "store", "rank": 1, "world_size": 2,
    }  # fmt: skip
    before = path.stat().st_mtime_ns
    assert claim_store_identity(bases, "store", 1, 2) == dirs
    assert path.stat().st_mtime_ns == before  # checked, not rewritten
    # the other rank of the same run, and another store name, are fine
    claim_store_identity(bases, "store", 0, 2)
    claim_store_identity(bases, "other", 1, 2)


def test_a_store_opened_as_another_rank_is_refused(tmp_path: Path) -> None:
    bases = [tmp_path / "a"]
    dirs = claim_store_identity(bases, "store", 0, 2)
    # someone points rank 1 at rank 0's files: the record says whose they are
    path = identity_path(dirs, "store")
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "rank": 1}))
    with pytest.raises(StoreIdentityError, match="belongs to rank 1 of 2") as info:
        claim_store_identity(bases, "store", 0, 2)
    assert info.value.expected == (0, 2) and info.value.found == (1, 2)
    assert isinstance(info.value, ValueError)


def _says_what_to_do(message: str, base: Path, stored: int, current: int) -> None:
    """The world-size refusal names the directory, both sizes and the three ways on."""
    assert f"NVMe directory {base} holds store" in message
    assert f"world size {stored}" in message and f"this run has world size {current}" in message
    assert f"run at world size {stored}" in message  # (1) resume where it was made
    assert "export_dcp" in message and "import_dcp" in message  # (2) reshard
    assert "another nvme_dirs or store_name" in message  # (3) afresh
    assert f"rank*of{stored}" in message and "remove_store" in message


def test_world_size_changed_under_an_existing_store_is_refused(tmp_path: Path) -> None:
    bases = [tmp_path / "a", tmp_path / "b"]
    claim_store_identity(bases, "store", 0, 2)
    with pytest.raises(StoreIdentityError, match=r"world size 2.*world size 4") as info:
        claim_store_identity(bases, "store", 0, 4)
    assert info.value.found == (0, 2) and info.value.expected == (0, 4)
    _says_what_to_do(str(info.value), tmp_path / "a", 2, 4)
    assert not (tmp_path / "a" / "rank0of4").exists()  # refused before anything was made
    claim_store_identity(bases, "fresh", 0, 4)  # another store name is fine


def test_store_files_without_a_record_are_refused(tmp_path: Path) -> None:
    d = tmp_path / "a" / "rank0of1"
    d.mkdir(parents=True, mode=0o700)
    (d / "store.bin").write_bytes(b"x")
    with pytest.raises(StoreIdentityError, match="no identity record") as info:
        claim_store_identity([tmp_path / "a"], "store", 0, 1)
    assert info.value.found is None
    assert not identity_path([d], "store").exists()


def test_a_damaged_record_is_refused(tmp_path: Path) -> None:
    dirs = claim_store_identity([tmp_path], "store", 0, 1)
    identity_path(dirs, "store").write_text("{not json")
    with pytest.raises(StoreIdentityError, match="not a store identity record"):
        claim_store_identity([tmp_path], "store", 0, 1)


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(SwapConfigError, match="no nvme_dirs"):
        claim_store_identity([], "store", 0, 1)
    for name in ("", "a/b", ".hidden"):
        with pytest.raises(SwapConfigError, match="store_name"):
            claim_store_identity([tmp_path], name, 0, 1)


def _wrap_without_resume(rank: int, world: int, tmp: str) -> str:
    import torch.distributed as dist
    from dist_ckpt_train import config, model

    import swapper

    with swapper.offload(model(), config(Path(tmp) / "swap"), dist.group.WORLD):
        pass
    return "wrapped"  # (not reached: refused)


@pytest.mark.dist
def test_wrapping_at_a_new_world_size_over_a_store_says_what_to_do(tmp_path: Path) -> None:
    """Two ranks wrap (no resume) over the store four ranks left: every rank is refused
    with a StoreIdentityError naming the directory, 4 against 2, and the ways on."""
    from dist_ckpt_train import spawn

    swap = tmp_path / "swap"
    for r in range(4):  # what four ranks' wrap leaves: a store per rank{r}of4
        claim_store_identity([swap], "swapper-offload", r, 4)
    results = spawn(_wrap_without_resume, 2, tmp_path, join_s=120.0)
    for res in results:
        assert res.get("error") == "StoreIdentityError", res
        _says_what_to_do(res["message"], swap, 4, 2)
    assert not (swap / "rank0of2").exists()  # refused before anything was made


# -- one process and several ranks in one directory ------------------------------------


def _one_process_config(swap: Path) -> Any:
    from swapper import OffloadConfig

    return OffloadConfig.create(device="cpu", host_nbytes=1 << 20, nvme_dirs=[swap])


def _tiny() -> nn.Module:
    return nn.Linear(8, 8).to(torch.bfloat16)


def _names_both_layouts(exc: StoreLayoutError, swap: Path, ranks: int) -> None:
    message = str(exc)
    assert f"NVMe directory {swap} holds store 'swapper-offload'" in message, message
    assert exc.directory == str(swap)
    assert {exc.existing, exc.wanted} == {"one process", f"{ranks} ranks"}, exc
    assert "one process" in message and f"{ranks} ranks" in message
    assert "another nvme_dirs or store_name" in message  # the ways on
    assert "resume=True" in message and "export_dcp" in message and "remove_store" in message


def test_ranks_refused_where_one_process_has_the_store(tmp_path: Path) -> None:
    """A store of one process open in a directory (and then left there on disk): a rank's
    claim of the same store name there is refused before anything is made."""
    import swapper

    swap = tmp_path / "swap"
    config = _one_process_config(swap)
    wrapped = swapper.offload(_tiny(), config)
    try:
        with pytest.raises(StoreLayoutError) as info:
            claim_store_identity([swap], "swapper-offload", 0, 2)
        _names_both_layouts(info.value, swap, 2)
        assert info.value.existing == "one process" and info.value.found == (0, 1)
        assert not (swap / "rank0of2").exists()  # refused before anything was made
    finally:
        wrapped.close()  # no snapshot: its files are deleted
    claim_store_identity([swap], "swapper-offload", 0, 2)  # nothing left: fine now
    # a one-process store left on disk (closed, kept) is refused as well
    other = tmp_path / "kept"
    manager = TierManager(_one_process_config(other).manager)
    manager.register("w", torch.ones(4), "param16")
    manager.close()
    with pytest.raises(StoreLayoutError, match="left on disk"):
        claim_store_identity([other], "swapper-offload", 1, 2)


def test_one_process_refused_where_ranks_have_the_store(tmp_path: Path) -> None:
    """Rank 0 of 2 has its store open in the directory: a one-process offload of the same
    store name there is refused, with or without resume, and makes no file."""
    import swapper

    swap = tmp_path / "swap"
    config = _one_process_config(swap)
    dirs = claim_store_identity([swap], "swapper-offload", 0, 2)
    rank = TierManager(dataclasses.replace(config.manager, nvme_dirs=dirs))
    try:
        rank.register("w", torch.ones(4), "param16")
        for resume in (False, True):
            with pytest.raises(StoreLayoutError) as info:
                swapper.offload(_tiny(), config, resume=resume)
            _names_both_layouts(info.value, swap, 2)
            assert info.value.existing == "2 ranks" and info.value.found == (0, 2)
            assert info.value.wanted == "one process"
            assert sorted(p.name for p in swap.iterdir()) == ["rank0of2"]  # nothing made
    finally:
        rank.close(remove=True)


def test_the_advice_for_a_ranks_store_left_in_the_way_works(tmp_path: Path) -> None:
    """issue 28 item 1: two ranks' store left in ./swap refuses a one-process run there;
    the message gives the shell command first, and the library call it names (each rank
    directory, name= the store's) removes every file, identity records included, so the
    next run is not refused again."""
    from swapper.distributed import refuse_other_layout
    from tiers.nvme import remove_store

    swap = tmp_path / "swap"
    dirs = [claim_store_identity([swap], "swapper-offload", r, 2)[0] for r in range(2)]
    with pytest.raises(StoreLayoutError) as info:
        refuse_other_layout([swap], "swapper-offload", None)
    message = str(info.value)
    shell = f"rm -r {dirs[0]} {dirs[1]}"
    assert shell in message and "left on disk by an earlier run" in message, message
    assert message.index(shell) < message.index("another nvme_dirs")  # the way out first
    assert "name='swapper-offload'" in message
    for d in dirs:
        removed = remove_store([d], name="swapper-offload")
        assert d / "swapper-offload.identity" in removed
    refuse_other_layout([swap], "swapper-offload", None)  # nothing in the way now


def _wrap_and_close(rank: int, world: int, tmp: str) -> str:
    import torch.distributed as dist
    from dist_ckpt_train import config, model

    import swapper

    with swapper.offload(model(), config(Path(tmp) / "swap"), dist.group.WORLD):
        pass  # no snapshot: closing removes the store
    return "closed"


@pytest.mark.dist
def test_two_ranks_then_one_process_in_the_same_directory(tmp_path: Path) -> None:
    """issue 28 item 1: examples/train_dist.py (two ranks) then examples/hf_trainer.py (one
    process) over ./swap: the ranks' stores, closed with nothing to keep, left their
    identity records, and the one process was refused. Now nothing is left."""
    from dist_ckpt_train import spawn

    import swapper

    results = spawn(_wrap_and_close, 2, tmp_path, join_s=120.0)
    assert [r.get("value") for r in results] == ["closed", "closed"], results
    swap = tmp_path / "swap"
    assert [p for p in swap.rglob("*") if p.is_file()] == []
    with swapper.offload(_tiny(), _one_process_config(swap)):
        pass  # not refused
