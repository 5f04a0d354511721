"""safetensors export (swapper.zero.checkpoint.export): shards and an index, streamed a parameter at
a time, that a plain PyTorch model (no swapper) loads and computes the offloaded model's
logits with, bitwise; read by our own parser, and by ``safetensors`` where installed.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from ckpt_train import CONFIG, config, model

import swapper
from swapper import OffloadAdamW, StateDictError, SwapConfigError
from swapper.pressure.model import GPT
from swapper.zero.checkpoint.export import export_safetensors

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _read_shard(path: Path) -> dict[str, torch.Tensor]:
    """A minimal safetensors reader: header length, JSON header, contiguous data."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    header.pop("__metadata__")
    data = raw[8 + length :]
    out = {}
    end = 0
    for name, item in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        begin, stop = item["data_offsets"]
        assert begin == end  # no gaps, no overlaps
        end = stop
        tensor = torch.frombuffer(bytearray(data[begin:stop]), dtype=_DTYPES[item["dtype"]])
        out[name] = tensor.reshape(item["shape"])
    assert end == len(data)
    return out


def _trained(tmp_path: Path) -> tuple[swapper.OffloadedModel, GPT, OffloadAdamW]:
    gpt = model()
    wrapped = swapper.offload(gpt, config(tmp_path / "swap"))
    optimizer = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
    for _ in range(2):
        gpt.loss(torch.randint(0, 64, (2, 9))).backward()
        optimizer.step()
        optimizer.zero_grad()
    return wrapped, gpt, optimizer


def test_exported_shards_load_into_a_plain_model_with_the_same_logits(tmp_path: Path) -> None:
    wrapped, _, optimizer = _trained(tmp_path)
    seen: list[tuple[int, int]] = []
    with wrapped, optimizer:
        index_path = export_safetensors(
            wrapped, tmp_path / "out", max_shard_nbytes=20_000, progress=lambda *a: seen.append(a)
        )
        tokens = torch.randint(0, 64, (2, 9))
        with torch.no_grad():
            logits = wrapped(tokens)
        expected = wrapped.state_dict()
        with pytest.raises(SwapConfigError, match="exists"):
            export_safetensors(wrapped, tmp_path / "out")
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(_read_shard(index_path.parent / shard))
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in tensors.values())
    assert seen[-1] == (index["metadata"]["total_size"],) * 2
    for name, tensor in tensors.items():
        assert torch.equal(tensor, expected[name]), name
    # a plain model (tied head re-tied by the model itself) computes the same logits
    plain = GPT(CONFIG).to(torch.bfloat16)
    missing, unexpected = plain.load_state_dict(tensors, strict=False)
    assert unexpected == [] and set(missing) <= {"head.weight"}
    with torch.no_grad():
        assert torch.equal(plain(tokens), logits)


def test_safetensors_library_reads_the_export(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    wrapped, _, optimizer = _trained(tmp_path)
    with wrapped, optimizer:
        index_path = export_safetensors(wrapped, tmp_path / "out")
        expected = wrapped.state_dict()
    loaded = st.load_file(str(tmp_path / "out" / "model.safetensors"))
    assert json.loads(index_path.read_text())["weight_map"].keys() == loaded.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_export_loads_per_parameter_into_plain_tensors(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from swapper.step.layout import STATE_ROWS
    from swapper.zero.checkpoint.dcp_export import export_dcp

    wrapped, _, optimizer = _trained(tmp_path)
    with wrapped, optimizer:
        export_dcp(wrapped, tmp_path / "dcp", optimizer)
        tokens = torch.randint(0, 64, (2, 9))
        with torch.no_grad():
            logits = wrapped(tokens)
        expected = wrapped.state_dict()
        # the optimizer's rows, flat in parameter order (one param group)
        rows = [
            torch.cat(
                [optimizer.state_dict()["state"][sg.index][row] for sg in optimizer.sub_groups]
            )
            for row in STATE_ROWS
        ]
        names = [wrapped.core.slots[id(p)].name for p in optimizer.param_groups[0]["params"]]
        with pytest.raises(SwapConfigError, match="exists"):
            export_dcp(wrapped, tmp_path / "dcp")
    plain = GPT(CONFIG).to(torch.bfloat16)
    target: dict[str, object] = {f"model.{n}": torch.empty_like(t) for n, t in expected.items()}
    target = {k: v for k, v in target.items() if k != "model.head.weight"}  # tied: written once
    for row in STATE_ROWS:
        for name in names:
            target[f"optim.{row}.{name}"] = torch.empty(expected[name].shape)
    target["optim.step"] = 0
    dcp.load(target, checkpoint_id=tmp_path / "dcp")
    assert target["optim.step"] == 2
    weights = {k.removeprefix("model."): v for k, v in target.items() if k.startswith("model.")}
    missing, unexpected = plain.load_state_dict(weights, strict=False)  # type: ignore[arg-type]
    assert unexpected == [] and set(missing) <= {"head.weight"}
    with torch.no_grad():
        assert torch.equal(plain(tokens), logits)
    for r, row in enumerate(STATE_ROWS):
        flat = torch.cat([target[f"optim.{row}.{n}"].reshape(-1) for n in names])  # type: ignore[union-attr]
        assert torch.equal(flat, rows[r]), row
    # the 16-bit parameters are the master weights rounded
    for name in names:
        master = target[f"optim.master.{name}"]
        assert torch.equal(master.to(torch.bfloat16), weights[name]), name  # type: ignore[union-attr]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_import_into_another_sub_group_size_continues_identically(tmp_path: Path) -> None:
    from swapper.zero.checkpoint.dcp_export import export_dcp
    from swapper.zero.checkpoint.dcp_import import import_dcp
    from swapper.zero.checkpoint.snapshot import final_digest

    def one_step(gpt: GPT, optimizer: OffloadAdamW) -> None:
        gpt.loss(
            torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(7))
        ).backward()
        optimizer.step()
        optimizer.zero_grad()

    wrapped, gpt, optimizer = _trained(tmp_path)
    with wrapped, optimizer:
        export_dcp(wrapped, tmp_path / "dcp", optimizer)
        one_step(gpt, optimizer)
        expected = final_digest(wrapped, optimizer)
    other = model()  # the same initial weights; the import must overwrite the trained ones
    with (
        swapper.offload(other, config(tmp_path / "swap2", sub_group_numel=4096)) as wrapped2,
        OffloadAdamW(wrapped2.parameters(), lr=1e-2, tiers=wrapped2) as optimizer2,
    ):
        import_dcp(wrapped2, tmp_path / "dcp", optimizer2)
        assert optimizer2.step_count == 2
        one_step(other, optimizer2)
        assert final_digest(wrapped2, optimizer2) == expected
    # another model's shapes: refused, naming the checkpoint
    with (
        swapper.offload(model(d_model=48), config(tmp_path / "swap3")) as wrapped3,
        pytest.raises(StateDictError, match=re.escape(str(tmp_path / "dcp"))),
    ):
        import_dcp(wrapped3, tmp_path / "dcp")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_round_trip_with_frozen_parameters_is_bitwise(tmp_path: Path) -> None:
    """Frozen parameters (requires_grad=False, left out of the optimizer) are exported
    without optimizer rows; the import takes them as weights only, bitwise."""
    from swapper.zero.checkpoint.dcp_export import export_dcp
    from swapper.zero.checkpoint.dcp_import import import_dcp
    from swapper.zero.checkpoint.snapshot import final_digest

    def frozen_model() -> GPT:
        gpt = model()
        for p in (*gpt.blocks[0].parameters(), gpt.pos_emb.weight):
            p.requires_grad_(False)
        return gpt

    def one_step(gpt: GPT, optimizer: OffloadAdamW) -> None:
        gpt.loss(
            torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(7))
        ).backward()
        optimizer.step()
        optimizer.zero_grad()

    def trainable(wrapped: swapper.OffloadedModel) -> list[torch.nn.Parameter]:
        return [p for p in wrapped.parameters() if p.requires_grad]

    gpt = frozen_model()
    with (
        swapper.offload(gpt, config(tmp_path / "swap")) as wrapped,
        OffloadAdamW(trainable(wrapped), lr=1e-2, tiers=wrapped) as optimizer,
    ):
        one_step(gpt, optimizer)
        one_step(gpt, optimizer)
        export_dcp(wrapped, tmp_path / "dcp", optimizer)
        weights = {n: t.clone() for n, t in wrapped.iter_state_dict()}
        expected = final_digest(wrapped, optimizer)
        one_step(gpt, optimizer)
        after = final_digest(wrapped, optimizer)
    other = model(d_model=32)  # the same shapes, other weights for the frozen ones
    for p in other.parameters():
        p.data.add_(1.0)
    for p in (*other.blocks[0].parameters(), other.pos_emb.weight):
        p.requires_grad_(False)
    with (
        swapper.offload(other, config(tmp_path / "swap2", sub_group_numel=4096)) as wrapped2,
        OffloadAdamW(trainable(wrapped2), lr=1e-2, tiers=wrapped2) as optimizer2,
    ):
        import_dcp(wrapped2, tmp_path / "dcp", optimizer2)
        got = dict(wrapped2.iter_state_dict())
        assert got.keys() == weights.keys()
        for name, tensor in weights.items():  # the frozen ones too
            assert torch.equal(got[name], tensor), name
        assert final_digest(wrapped2, optimizer2) == expected
        one_step(other, optimizer2)
        assert final_digest(wrapped2, optimizer2) == after
    # the parameters frozen at export trained here: refused, naming what is missing
    no_state = re.escape("no optimizer state for pos_emb.weight")
    with (
        swapper.offload(model(), config(tmp_path / "swap3")) as wrapped3,
        OffloadAdamW(wrapped3.parameters(), lr=1e-2, tiers=wrapped3) as optimizer3,
        pytest.raises(StateDictError, match=no_state) as info,
    ):
        import_dcp(wrapped3, tmp_path / "dcp", optimizer3)
    assert str(tmp_path / "dcp") in str(info.value)
