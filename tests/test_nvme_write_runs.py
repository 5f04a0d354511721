"""A write's extents go to the engine as runs: contiguous in the tensor and in the file."""

from __future__ import annotations

import itertools

import torch
from hypothesis import given
from hypothesis import strategies as st

from tiers.aio import AioEngine
from tiers.config import DIRECT_ALIGNMENT, AioConfig
from tiers.extents import pad
from tiers.nvme import NvmeStore
from tiers.nvme.core import write_runs
from tiers.nvme.records import Extent


@st.composite
def extent_lists(draw: st.DrawFn) -> tuple[Extent, ...]:
    """Extents in tensor order, sometimes back to back in one file, sometimes not."""
    extents: list[Extent] = []
    offsets = [0, 0]
    for _ in range(draw(st.integers(0, 12))):
        d = draw(st.integers(0, 1))
        nbytes = draw(st.sampled_from([1, 2, 4094, DIRECT_ALIGNMENT, 3 * DIRECT_ALIGNMENT, 5000]))
        offsets[d] += draw(st.sampled_from([0, 0, DIRECT_ALIGNMENT]))  # a gap, or none
        extents.append(Extent(d, offsets[d], nbytes))
        offsets[d] += pad(nbytes)
    return tuple(extents)


@given(extent_lists())
def test_runs_cover_every_byte_once_in_order(extents: tuple[Extent, ...]) -> None:
    runs = write_runs(extents)
    # Each tensor byte maps to the same (file, offset) through the runs as through the extents.
    by_extent = []
    start = 0
    for e in extents:
        by_extent += [(e.dir_index, e.offset + i, start + i) for i in range(e.nbytes)]
        start += e.nbytes
    by_run = [(d, off + i, s + i) for d, off, s, n in runs for i in range(n)]
    assert by_run == by_extent
    # Runs are maximal: two neighbours only stay apart when a merge would be wrong.
    for (d1, o1, _, n1), (d2, o2, _, _) in itertools.pairwise(runs):
        assert d1 != d2 or o1 + n1 != o2 or n1 % DIRECT_ALIGNMENT


def test_one_request_per_contiguous_tensor(tmp_path, monkeypatch) -> None:
    """A 40 MiB tensor (ten 4 MiB chunks, one file) is one engine request, read back intact."""
    with AioEngine(AioConfig()) as engine:
        calls: list[int] = []
        pwrite = engine.pwrite

        def counting(buf, file, offset):
            calls.append(buf.numel())
            return pwrite(buf, file, offset)

        monkeypatch.setattr(engine, "pwrite", counting)
        with NvmeStore([tmp_path], engine) as store:
            t = torch.randint(0, 255, (40 << 20,), dtype=torch.uint8)
            store.write("w", t).result()
            assert len(store.info("w").extents) == 10
            assert calls == [40 << 20]
            out = torch.empty_like(t)
            store.read("w", out).result()  # verified chunk by chunk against the digests
            assert torch.equal(out, t)
