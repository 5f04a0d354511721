"""Distributed Checkpoint export at N ranks, import at M
(swapper.zero.checkpoint.dcp_export, issue 13).

One spawn of 2 gloo ranks (the harness of tests/test_dist_train.py: a short process-group
timeout and ``distributed.timeout_s`` on every collective, joined with a deadline) trains
:data:`EXPORT_AT` steps under tight budgets (every rank writes to and reads from NVMe),
exports the state in DCP and safetensors form, and trains :data:`AFTER` more steps: the
uninterrupted run. Spawns at M = 1, 2, 4 then import that checkpoint into a fresh wrap
and train the same :data:`AFTER` steps:

- M = 2 (the exporter's partition): bit-identical to the uninterrupted run;
- M = 1 and 4 (resharded): within the multi-rank parity tolerance of
  tests/test_dist_train.py (``ABS_TOL`` = 4 lr in the max; the M-rank gradient is a mean
  of M per-rank means in bf16, so a step differs by rounding, not by state), and what the
  import wrote is the exported state exactly (consolidated parameters bit-identical).

A plain model (no swapper) loads the checkpoint with ``dcp.load`` and the safetensors
shards, and computes the 2-rank offloaded model's logits bitwise. Bad input (a missing
rank's file, a truncated file, a damaged byte, another model's shapes) is refused with a
:class:`DcpCheckpointError` naming the file and what is wrong.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from test_dist_train import (
    ABS_TOL,
    BATCH,
    HIDDEN,
    LR,
    VOCAB,
    _batches,
    _config,
    _model,
    _spawn,
)

import swapper
from swapper import OffloadAdamW, StateDictError
from swapper.step.layout import STATE_ROWS
from swapper.zero.checkpoint.dcp_export import DcpCheckpointError, export_dcp
from swapper.zero.checkpoint.dcp_import import import_dcp
from swapper.zero.checkpoint.dcp_reshard import flat_boxes
from swapper.zero.checkpoint.export import INDEX_NAME, export_safetensors

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

EXPORT_AT = 3  # steps before the export
AFTER = 2  # steps after it (uninterrupted, and after each import)


# -- flat ranges as DCP chunks ------------------------------------------------------------


@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
)
def test_flat_boxes_tile_the_range_exactly(shape: list[int], cut: tuple[float, float]) -> None:
    numel = 1
    for s in shape:
        numel *= s
    start, end = sorted(int(c * numel) for c in cut)
    boxes = flat_boxes(shape, start, end)
    index = torch.arange(numel).view(shape) if numel else torch.empty(shape)
    seen: list[int] = []
    for box in boxes:
        assert len(box.offsets) == len(box.sizes) == len(shape)
        part = index[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes, strict=True))]
        flat = part.reshape(-1).tolist()
        # contiguous in the flattened tensor, starting where it says
        assert flat == list(range(box.flat_start, box.flat_start + box.numel))
        seen += flat
    assert seen == list(range(start, end))  # in order, no gap, no overlap
    assert len(boxes) <= max(1, 2 * len(shape) - 1)


def test_flat_boxes_refuse_a_range_outside() -> None:
    with pytest.raises(ValueError, match="not within"):
        flat_boxes((2, 3), 4, 7)


# -- the runs -----------------------------------------------------------------------------


def _steps(wrapped: Any, optimizer: OffloadAdamW, rank: int, world: int, data: list) -> None:
    for tokens in data:
        share = tokens[rank * BATCH // world : (rank + 1) * BATCH // world]
        logits = wrapped(share[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, VOCAB), share[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _variant(world: int, name: str) -> dict[str, Any]:
    return {"name": name, "tight": world > 1}  # one process: the whole model in memory


def export_run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """The uninterrupted run, exporting after :data:`EXPORT_AT` steps."""
    data = _batches()[: EXPORT_AT + AFTER]
    config = _config(tmp, _variant(world, "export"))
    out: dict[str, Any] = {}
    with swapper.offload(_model(), config, dist.group.WORLD) as wrapped:
        optimizer = OffloadAdamW(wrapped.parameters(), lr=LR, tiers=wrapped)
        _steps(wrapped, optimizer, rank, world, data[:EXPORT_AT])
        seen: list[tuple[int, int]] = []
        export_dcp(wrapped, Path(tmp, "dcp"), optimizer, progress=lambda *a: seen.append(a))
        export_safetensors(wrapped, Path(tmp, "st"), max_shard_nbytes=20_000)
        with torch.no_grad():
            out["logits"] = wrapped(data[0][:2, :-1]).clone()
        out["at_export"] = wrapped.state_dict()
        out["progress"] = seen[-1] if seen else None
        out["nvme_written"] = wrapped.stats().moved(swapper.Tier.HOST, swapper.Tier.NVME).nbytes
        try:  # a second export into the same directory: refused on every rank
            export_dcp(wrapped, Path(tmp, "dcp"), optimizer)
            out["again"] = "no error"
        except Exception as exc:
            out["again"] = type(exc).__name__
        _steps(wrapped, optimizer, rank, world, data[EXPORT_AT:])
        out["straight"] = wrapped.state_dict()
        optimizer.close()
    return out


def resume_run(rank: int, world: int, tmp: str, source: str, bad: list[str]) -> dict[str, Any]:
    """A fresh wrap at this world size imports ``source`` and trains :data:`AFTER`
    steps; then each of ``bad`` is imported (expected to fail on every rank)."""
    data = _batches()[: EXPORT_AT + AFTER]
    config = _config(tmp, _variant(world, "resume"))
    out: dict[str, Any] = {"errors": {}}
    with swapper.offload(_model(), config, dist.group.WORLD) as wrapped:
        optimizer = OffloadAdamW(wrapped.parameters(), lr=LR, tiers=wrapped)
        import_dcp(wrapped, source, optimizer)
        out["step"] = optimizer.step_count
        out["at_import"] = wrapped.state_dict()
        export_dcp(wrapped, Path(tmp, "again"), optimizer)  # at this world size
        _steps(wrapped, optimizer, rank, world, data[EXPORT_AT:])
        out["resumed"] = wrapped.state_dict()
        for path in bad:
            try:
                import_dcp(wrapped, path, optimizer)
                out["errors"][path] = ("no error", "")
            except Exception as exc:
                out["errors"][path] = (type(exc).__name__, str(exc))
        optimizer.close()
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("export2")
    seen = _spawn(export_run, 2, tmp)
    return tmp, seen[0]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        diff = float((a[name].float() - b[name].float()).abs().max())
        assert diff <= ABS_TOL, f"{name}: max |diff| {diff}"


def test_export_at_two_ranks_writes_each_ranks_part(exported: Any) -> None:
    tmp, run = exported
    files = sorted(os.listdir(tmp / "dcp"))
    assert files == [".metadata", "__0_0.distcp", "__0_0.distcp.xxh3.json", "__1_0.distcp",
                     "__1_0.distcp.xxh3.json"]  # fmt: skip
    assert run["nvme_written"] > 0  # the state really was on NVMe
    done, total = run["progress"]
    assert done == total > 0
    assert run["again"] == "SwapConfigError"
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(tmp / "dcp").read_metadata()
    # fc1.weight (400 x 24) is sharded flat over 2 ranks: chunks from both files
    chunks = metadata.state_dict_metadata["model.fc1.weight"].chunks  # type: ignore[union-attr]
    assert sum(c.sizes.numel() for c in chunks) == 400 * 24 and len(chunks) >= 2
    where = {
        metadata.storage_data[i].relative_path
        for i in metadata.storage_data
        if i.fqn == "model.fc1.weight"
    }
    assert where == {"__0_0.distcp", "__1_0.distcp"}


@pytest.mark.parametrize("world", [2, 1, 4])
def test_import_at_m_ranks_continues_the_two_rank_run(
    exported: Any, world: int, tmp_path: Path
) -> None:
    tmp, run = exported
    bad: list[str] = []
    if world == 2:  # a rank's file missing: refused on every rank, before anything is read
        broken = tmp_path / "missing"
        shutil.copytree(tmp / "dcp", broken)
        (broken / "__1_0.distcp").unlink()
        bad.append(str(broken))
    seen = _spawn(resume_run, world, tmp_path / "run", str(tmp / "dcp"), bad)
    mine = seen[0]
    assert all(s["step"] == EXPORT_AT for s in seen)
    _same(mine["at_import"], run["at_export"])  # what was imported is what was exported
    # ... optimizer state included: exported again at M, every tensor is the same
    again = tmp_path / "run" / "again"
    assert len([f for f in os.listdir(again) if f.endswith(".distcp")]) == world
    _same(_load_all(again), _load_all(tmp / "dcp"))
    if world == 2:
        _same(mine["resumed"], run["straight"])  # same partition: bit-exact
        for s in seen:
            kind, message = s["errors"][bad[0]]
            assert kind == "DcpCheckpointError", message
            assert "__1_0.distcp" in message and "missing" in message
    else:
        _close(mine["resumed"], run["straight"])


def _load_all(directory: Path) -> dict[str, Any]:
    """Every tensor of a checkpoint, whole, through plain ``dcp.load``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(directory).read_metadata()
    target: dict[str, Any] = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    assert any(k.startswith("optim.exp_avg_sq.") for k in target)
    dcp.load(target, checkpoint_id=directory)
    return target


def test_plain_model_loads_the_two_rank_export_with_the_same_logits(exported: Any) -> None:
    import torch.distributed.checkpoint as dcp

    tmp, run = exported
    plain = _model()
    names = [n for n, _ in plain.named_parameters()]  # a tied weight once
    target: dict[str, Any] = {
        f"model.{n}": torch.empty_like(p) for n, p in plain.named_parameters()
    }
    for row in STATE_ROWS:
        target.update(
            {f"optim.{row}.{n}": torch.empty(p.shape) for n, p in plain.named_parameters()}
        )
    target["optim.step"] = 0
    dcp.load(target, checkpoint_id=tmp / "dcp")
    assert target["optim.step"] == EXPORT_AT
    with torch.no_grad():
        for n, p in plain.named_parameters():
            p.copy_(target[f"model.{n}"])
            # the 16-bit parameter is its fp32 master weight rounded
            assert torch.equal(target[f"optim.master.{n}"].to(p.dtype), p), n
        tokens = _batches()[0][:2, :-1]
        assert torch.equal(plain(tokens), run["logits"])
    assert names and all(f"model.{n}" in target for n in names)
    # safetensors shards written by rank 0, one parameter gathered at a time
    index = __import__("json").loads((tmp / "st" / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(names)
    load_file = pytest.importorskip("safetensors.torch").load_file
    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        weights.update(load_file(str(tmp / "st" / shard)))
    other = _model()
    with torch.no_grad():
        for n, p in other.named_parameters():
            p.copy_(weights[n])
        assert torch.equal(other(_batches()[0][:2, :-1]), run["logits"])


# -- bad input (one process: the errors are the same at every world size) ------------------


def _item_in(directory: Path, file_name: str) -> tuple[int, int]:
    """(offset, length) of the largest item the metadata places in ``file_name``."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(directory).read_metadata().storage_data
    items = [(s.length, s.offset) for s in storage.values() if s.relative_path == file_name]
    length, offset = max(items)
    return offset, length


def _import_one(tmp: Path, source: Path, hidden: int = HIDDEN) -> tuple[Exception, bool]:
    """Import ``source`` into a one-process wrap; the error, and whether ``step()`` then
    refuses (a load stopped part-way)."""
    config = _config(str(tmp), {"name": "one"})
    with (
        swapper.offload(_model(hidden), config) as wrapped,
        OffloadAdamW(wrapped.parameters(), lr=LR, tiers=wrapped) as optimizer,
    ):
        with pytest.raises(DcpCheckpointError) as info:
            import_dcp(wrapped, source, optimizer)
        try:
            optimizer.step()
            refused = False
        except StateDictError:
            refused = True
    return info.value, refused


@pytest.mark.parametrize(
    "damage", ["missing", "truncated", "corrupt", "shape", "not_dcp", "metadata_truncated"]
)
def test_bad_checkpoints_are_refused_naming_the_file(
    exported: Any, damage: str, tmp_path: Path
) -> None:
    tmp, _ = exported
    broken = tmp_path / "ckpt"
    shutil.copytree(tmp / "dcp", broken)
    victim = broken / "__1_0.distcp"
    hidden = HIDDEN
    if damage == "missing":
        victim.unlink()
    elif damage == "truncated":
        os.truncate(victim, victim.stat().st_size // 2)
    elif damage == "corrupt":
        offset, length = _item_in(broken, victim.name)
        raw = bytearray(victim.read_bytes())
        raw[offset + length // 2] ^= 0x40  # one bit, inside a tensor's bytes
        victim.write_bytes(bytes(raw))
    elif damage == "shape":
        hidden = HIDDEN + 8
    elif damage == "metadata_truncated":
        os.truncate(broken / ".metadata", (broken / ".metadata").stat().st_size // 2)
    else:
        (broken / ".metadata").unlink()
    error, refused = _import_one(tmp_path, broken, hidden)
    message = str(error)
    assert isinstance(error, StateDictError)
    if damage == "missing":
        assert error.path == str(victim) and "missing" in error.reason
        assert not refused  # refused before anything was written
    elif damage == "truncated":
        assert error.path == str(victim) and "truncated" in error.reason
    elif damage == "corrupt":
        assert error.path == str(victim) and "checksum" in error.reason, message
        assert refused  # found while loading: the optimizer refuses to step
    elif damage == "shape":
        assert error.path == str(broken) and "model.fc1.weight" in message
        assert "another model" in message and not refused
    else:  # missing, or not decodable: named, before anything was written
        assert error.path == str(broken / ".metadata"), message
        assert not refused


def import_bad_run(
    rank: int, world: int, tmp: str, cases: list[tuple[str, str, int]]
) -> dict[str, Any]:
    """For each ``(label, checkpoint, hidden)``: a fresh wrap of ``_model(hidden)``
    at this world size imports it; the error (type, message, ``.path``), and whether
    ``step()`` then refuses."""
    out: dict[str, Any] = {}
    for label, source, hidden in cases:
        # (another model's shape: in memory, its gathers are over the tight device floor)
        config = _config(tmp, {"name": f"bad-{label}", "tight": hidden == HIDDEN})
        with swapper.offload(_model(hidden), config, dist.group.WORLD) as wrapped:
            optimizer = OffloadAdamW(wrapped.parameters(), lr=LR, tiers=wrapped)
            try:
                import_dcp(wrapped, source, optimizer)
                got: tuple[str, str, str | None] = ("no error", "", None)
            except Exception as exc:
                got = (type(exc).__name__, str(exc), getattr(exc, "path", None))
            try:
                optimizer.step()  # no gradients: a plain step, unless refused
                refused = False
            except StateDictError:
                refused = True
            out[label] = (*got, refused)
            optimizer.close()
    return out


def test_bad_checkpoints_are_refused_on_every_rank_at_two_ranks(
    exported: Any, tmp_path: Path
) -> None:
    """The bad inputs of the one-process test, imported at 2 ranks: a typed error on every
    rank (the rank that found it: DcpCheckpointError naming the file; the other its own
    or PeerFailedError), no hang, and no partial state used."""
    tmp, _ = exported
    cases: list[tuple[str, str, int]] = []
    for damage in ("truncated", "corrupt", "shape"):
        broken = tmp_path / damage
        shutil.copytree(tmp / "dcp", broken)
        victim = broken / "__1_0.distcp"
        if damage == "truncated":
            os.truncate(victim, victim.stat().st_size // 2)
        elif damage == "corrupt":
            offset, length = _item_in(broken, victim.name)
            raw = bytearray(victim.read_bytes())
            raw[offset + length // 2] ^= 0x40
            victim.write_bytes(bytes(raw))
        cases.append((damage, str(broken), HIDDEN + 8 if damage == "shape" else HIDDEN))
    seen = _spawn(import_bad_run, 2, tmp_path / "run", cases)
    for rank, out in enumerate(seen):
        kind, message, path, refused = out["truncated"]
        assert kind == "DcpCheckpointError", (rank, message)  # checked on every rank alike
        assert path == str(tmp_path / "truncated" / "__1_0.distcp") and "truncated" in message
        assert not refused  # refused before anything was written
        kind, message, path, refused = out["shape"]
        assert kind == "DcpCheckpointError" and path == str(tmp_path / "shape"), (rank, message)
        assert "model.fc1.weight" in message and "another model" in message
        assert not refused
        kind, message, path, refused = out["corrupt"]
        # found while loading, by the rank(s) whose slices cover the damaged bytes
        assert kind in ("DcpCheckpointError", "PeerFailedError"), (rank, kind, message)
        if kind == "DcpCheckpointError":
            assert path == str(tmp_path / "corrupt" / "__1_0.distcp") and "checksum" in message
        assert refused  # part old, part new: the optimizer refuses to step until a load
    assert any(out["corrupt"][0] == "DcpCheckpointError" for out in seen)


def frozen_run(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Frozen fc1 and pos (left out of the optimizer): train 2 steps, export, train 1;
    then a fresh wrap of other weights (the same frozen set) imports and trains the 1."""
    from swapper.zero.checkpoint.snapshot import final_digest

    def frozen(bump: float) -> torch.nn.Module:
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(bump)  # other weights: the import must bring the frozen ones too
        for p in (*model.fc1.parameters(), model.pos.weight):  # type: ignore[union-attr]
            p.requires_grad_(False)
        return model

    data = _batches()[:3]
    out: dict[str, Any] = {}
    for label, bump in (("export", 0.0), ("import", 1.0)):
        config = _config(tmp, _variant(world, f"frozen-{label}"))
        with swapper.offload(frozen(bump), config, dist.group.WORLD) as wrapped:
            trainable = [p for p in wrapped.parameters() if p.requires_grad]
            optimizer = OffloadAdamW(trainable, lr=LR, tiers=wrapped)
            if label == "export":
                _steps(wrapped, optimizer, rank, world, data[:2])
                export_dcp(wrapped, Path(tmp, "frozen-dcp"), optimizer)
            else:
                import_dcp(wrapped, Path(tmp, "frozen-dcp"), optimizer)
            out[f"{label}_state"] = wrapped.state_dict()
            out[f"{label}_digest"] = final_digest(wrapped, optimizer)
            _steps(wrapped, optimizer, rank, world, data[2:])
            out[f"{label}_after"] = final_digest(wrapped, optimizer)
            optimizer.close()
    return out


def test_frozen_parameters_round_trip_bitwise_at_two_ranks(tmp_path: Path) -> None:
    for out in _spawn(frozen_run, 2, tmp_path):
        _same(out["import_state"], out["export_state"])  # frozen and trained alike
        assert out["import_digest"] == out["export_digest"]
        assert out["import_after"] == out["export_after"]  # and training goes on the same
