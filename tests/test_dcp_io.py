"""swapper.zero.checkpoint.dcp_io: the zero-copy DCP writer writes archives a plain
``torch.distributed.checkpoint.load`` reads bitwise, whatever the items' sizes and
addresses (direct bodies at any phase, copied items, held items released once, after
their write); its XXH3 sidecar lets swapper's reader refuse any flipped byte of an item,
naming the file."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swapper.zero.checkpoint import dcp_io
from swapper.zero.checkpoint.dcp_io import SIDECAR_SUFFIX, AioStorageWriter
from swapper.zero.checkpoint.dcp_planners import BoxSource, CheckedReader, StreamingSavePlanner
from swapper.zero.checkpoint.dcp_reshard import DcpCheckpointError, flat_boxes
from swapper.zero.checkpoint.dcp_templates import template as _template

_IGNORED = "torch.distributed is disabled"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("sizes", [(0,), (3,), (5, 7), (2, 3, 4)])
def test_template_around_the_bytes_is_what_torch_load_reads(
    dtype: torch.dtype, sizes: tuple[int, ...]
) -> None:
    tensor = (torch.arange(int(torch.Size(sizes).numel())) * 3 - 7).to(dtype).view(sizes)
    template = _template(dtype, sizes)
    data = tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    assert template.nbytes == len(data)
    blob = template.prefix + data + template.suffix
    assert len(blob) == template.length
    assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), tensor)


def _save(directory: Path, sources: list[BoxSource], meta: dict[str, object]) -> None:
    from torch.distributed.checkpoint.state_dict_saver import save

    writer = AioStorageWriter(directory)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_IGNORED)
            save(dict(meta), storage_writer=writer, planner=StreamingSavePlanner(sources),
                 no_dist=True)  # fmt: skip
    finally:
        writer.close()


def _load(directory: Path, shapes: dict[str, torch.Size], reader: object = None) -> dict:
    from torch.distributed.checkpoint.state_dict_loader import load

    target: dict[str, object] = {k: torch.empty(s) for k, s in shapes.items()}
    target["step"] = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_IGNORED)
        if reader is None:  # torch's own FileSystemReader
            load(target, checkpoint_id=directory, no_dist=True)
        else:
            load(target, storage_reader=reader, no_dist=True)  # type: ignore[arg-type]
    return target


@settings(max_examples=12, deadline=None)
@given(
    numels=st.lists(st.integers(1, 5000), min_size=1, max_size=5),
    phases=st.lists(st.integers(0, 1023), min_size=5, max_size=5),
    how=st.lists(st.sampled_from(["view", "hold", "fill"]), min_size=5, max_size=5),
    flip=st.floats(0, 1, exclude_max=True),
)
def test_export_loads_bitwise_and_a_flipped_byte_is_refused(
    tmp_path_factory: pytest.TempPathFactory,
    numels: list[int],
    phases: list[int],
    how: list[str],
    flip: float,
) -> None:
    mp = pytest.MonkeyPatch()
    mp.setattr(dcp_io, "DIRECT_MIN_NBYTES", 4096)  # small items take the direct path too
    mp.setattr(dcp_io, "HELD_LEASES", 2)
    directory = tmp_path_factory.mktemp("dcp_io")
    released: list[str] = []
    sources, values = [], {}
    memory = torch.randn(sum(numels) + 1024 * len(numels) + 64)  # shared: any address phase
    at = 0
    for i, n in enumerate(numels):
        at += phases[i]
        flat = memory[at : at + n]
        at += n
        name = f"t{i}"
        values[name] = flat.clone()
        box = flat_boxes((n,), 0, n)[0]

        def fill(out: torch.Tensor, flat: torch.Tensor = flat) -> None:
            out.copy_(flat)

        def view(flat: torch.Tensor = flat) -> torch.Tensor:
            return flat

        def hold(flat: torch.Tensor = flat, name: str = name) -> tuple[torch.Tensor, object]:
            return flat, lambda: released.append(name)

        kind = how[i]
        sources.append(BoxSource(name, box, torch.Size([n]), torch.float32, fill,
                                 view if kind == "view" else None,
                                 hold if kind == "hold" else None))  # fmt: skip
    try:
        _save(directory, sources, {"step": 7})
        held = [f"t{i}" for i in range(len(numels)) if how[i] == "hold"]
        assert sorted(released) == sorted(held)  # each once
        shapes = {k: v.shape for k, v in values.items()}
        plain = _load(directory, shapes)
        assert plain["step"] == 7
        for k, v in values.items():
            assert torch.equal(plain[k], v), k  # type: ignore[arg-type]
        checked = _load(directory, shapes, CheckedReader(directory))
        assert all(torch.equal(checked[k], v) for k, v in values.items())  # type: ignore[arg-type]
        # one byte flipped inside an item (the items cover the file but for the gaps)
        victim = directory / "__0_0.distcp"
        assert (directory / ("__0_0.distcp" + SIDECAR_SUFFIX)).exists()
        storage = CheckedReader(directory).read_metadata().storage_data
        spans = sorted((s.offset, s.length) for s in storage.values())
        total = sum(length for _, length in spans)
        pick = int(flip * total)
        k = 0
        while pick >= spans[k][1]:
            pick -= spans[k][1]
            k += 1
        raw = bytearray(victim.read_bytes())
        raw[spans[k][0] + pick] ^= 0x10
        victim.write_bytes(bytes(raw))
        with pytest.raises(BaseException) as info:
            _load(directory, shapes, CheckedReader(directory))
        error = info.value
        inner = [f[0] for f in getattr(error, "failures", {}).values()] or [error]
        assert any(
            isinstance(e, DcpCheckpointError) and e.path == str(victim) and "checksum" in e.reason
            for e in inner
        ), inner
    finally:
        mp.undo()


def test_a_damaged_sidecar_is_named(tmp_path: Path) -> None:
    flat = torch.arange(10.0)
    box = flat_boxes((10,), 0, 10)[0]
    source = BoxSource("t", box, torch.Size([10]), torch.float32, lambda out: out.copy_(flat))
    _save(tmp_path, [source], {"step": 1})
    sidecar = tmp_path / ("__0_0.distcp" + SIDECAR_SUFFIX)
    sidecar.write_text("{not json")
    with pytest.raises(BaseException) as info:
        _load(tmp_path, {"t": torch.Size([10])}, CheckedReader(tmp_path))
    inner = [f[0] for f in getattr(info.value, "failures", {}).values()] or [info.value]
    assert any(isinstance(e, DcpCheckpointError) and e.path == str(sidecar) for e in inner), inner


def test_a_failing_source_ends_the_export_with_every_held_buffer_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dcp_io, "DIRECT_MIN_NBYTES", 4096)
    memory = torch.randn(6 * 4096)
    taken: list[int] = []
    released: list[int] = []
    sources = []
    for i in range(6):
        flat = memory[i * 4096 + 3 : (i + 1) * 4096 - 5]
        box = flat_boxes((flat.numel(),), 0, flat.numel())[0]

        def hold(flat: torch.Tensor = flat, i: int = i) -> tuple[torch.Tensor, object]:
            if i == 4:
                raise RuntimeError("source failed")
            taken.append(i)
            return flat, lambda: released.append(i)

        sources.append(BoxSource(f"t{i}", box, flat.shape, torch.float32,
                                 lambda out: None, None, hold))  # fmt: skip
    with pytest.raises(BaseException, match="source failed"):
        _save(tmp_path, sources, {"step": 1})
    assert taken == [0, 1, 2, 3] and sorted(released) == taken
    assert not (tmp_path / ".metadata").exists()
