"""swapper.zero.dcp_io: DCP's write streams on the AIO engine write exactly the bytes given,
whatever the sizes of the pieces (block boundaries, a partial last block), and
``fileno()`` (DCP's ``fsync``) has everything on disk first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swapper.zero import dcp_io
from swapper.zero.dcp_io import AioFileSystem


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 3 * dcp_io.BLOCK_NBYTES // 2), min_size=0, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_stream_writes_exactly_the_bytes_given(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[int], seed: int
) -> None:
    path = tmp_path_factory.mktemp("dcp_io") / "file.distcp"
    pieces = [os.urandom(n) if n < 4096 else (bytes([seed % 251]) * n) for n in sizes]
    fs = AioFileSystem()
    try:
        with fs.create_stream(path, "wb") as stream:
            for piece in pieces:
                assert stream.write(memoryview(piece)) == len(piece)
            assert stream.tell() == sum(sizes)
            fd = stream.fileno()  # what DCP fsyncs: everything written by then
            os.fsync(fd)
            assert os.path.getsize(path) == sum(sizes)
        assert path.read_bytes() == b"".join(pieces)
        with fs.create_stream(path, "rb") as stream:  # reads: torch's own stream
            assert stream.read(4) == b"".join(pieces)[:4]
    finally:
        fs.close()
        path.unlink(missing_ok=True)


def test_a_second_stream_open_at_once_is_torchs_own(tmp_path: Path) -> None:
    fs = AioFileSystem()
    try:
        with (
            fs.create_stream(tmp_path / "a", "wb") as a,
            fs.create_stream(tmp_path / "b", "wb") as b,
        ):
            assert type(a).__name__ == "_AioWriter" and type(b).__name__ != "_AioWriter"
            a.write(b"x" * 5000)
            b.write(b"y" * 3)
        assert (tmp_path / "a").read_bytes() == b"x" * 5000
        assert (tmp_path / "b").read_bytes() == b"yyy"
    finally:
        fs.close()


def test_planner_refuses_an_item_asked_before_the_previous_was_written() -> None:
    """The staging buffers are reused two items later: a loader that resolved ahead
    (DCP's overlapping one) would be refused, not given overwritten bytes."""
    import torch

    from swapper.zero.dcp_planners import BoxSource, StreamingSavePlanner
    from swapper.zero.dcp_reshard import flat_boxes
    from tiers.errors import SwapConfigError

    def fill(out: torch.Tensor) -> None:
        out.fill_(1.0)

    sources = [
        BoxSource(f"t{i}", box, torch.Size([4, 4]), torch.float32, fill)
        for i, box in enumerate(flat_boxes((4, 4), 0, 16))
    ] + [BoxSource("u", flat_boxes((4,), 0, 4)[0], torch.Size([4]), torch.float32, fill)]
    written = [0]
    planner = StreamingSavePlanner(sources, position=lambda: written[0])
    try:
        items = [s.write_item() for s in sources]
        assert torch.equal(planner.resolve_data(items[0]), torch.ones(4, 4))
        written[0] += 100  # the writer took item 0
        planner.resolve_data(items[1])
        with pytest.raises(SwapConfigError, match="serial loader"):
            planner.resolve_data(items[1])  # nothing written since: refused
    finally:
        planner.close()
