"""``torch.save`` archives without the data: the bytes ``torch.save`` writes around a
tensor of one dtype and shape, so that a DCP export can write each item's records itself
and the tensor's bytes straight from tier memory (:mod:`swapper.zero.checkpoint.dcp_io`)."""

from __future__ import annotations

import dataclasses
import functools
import io
from typing import Any, BinaryIO, cast

import torch

__all__ = ["Template", "template"]


@dataclasses.dataclass(frozen=True)
class Template:
    """``torch.save`` of a tensor of one dtype and shape: its bytes before the data
    (``prefix``, whose length is the data's offset in the archive) and after it."""

    prefix: bytes
    suffix: bytes
    nbytes: int  # the data's

    @property
    def length(self) -> int:
        return len(self.prefix) + self.nbytes + len(self.suffix)


class _Recorder(io.RawIOBase):
    """A seekable sink that keeps what ``torch.save`` writes (it seeks over the data
    under ``skip_data``)."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: dict[int, bytes] = {}
        self.pos = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(memoryview(b).cast("B"))
        self.parts[self.pos] = data
        self.pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else -1
        if self.pos < 0:
            raise OSError("unsupported seek")
        return self.pos

    def tell(self) -> int:
        return self.pos


@functools.lru_cache(maxsize=512)
def template(dtype: torch.dtype, sizes: tuple[int, ...]) -> Template:
    """The archive ``torch.save`` writes for a tensor of ``dtype`` and ``sizes``, its
    data left out (written without reading a byte of it: ``skip_data``).

    Raises:
        RuntimeError: torch wrote something other than one data region between
            contiguous records (a torch change: nothing of the export was written).
    """
    tensor = torch.empty(sizes, dtype=dtype)  # (its memory is never touched)
    nbytes = tensor.numel() * tensor.element_size()
    sink = _Recorder()
    with torch.serialization.skip_data():
        torch.save(tensor, cast(BinaryIO, sink))
    runs = sorted(sink.parts.items())
    blob = bytearray()
    hole_at = -1
    for at, data in runs:
        if at != len(blob) + (nbytes if hole_at >= 0 else 0):
            if hole_at < 0 and at == len(blob) + nbytes:
                hole_at = len(blob)
            else:
                raise RuntimeError(f"torch.save wrote an unexpected layout (a record at {at})")
        blob += data
    if hole_at < 0:  # no record after the data (or no data): the data is at the end
        if nbytes:
            raise RuntimeError("torch.save wrote no records after the data")
        hole_at = len(blob)
    return Template(bytes(blob[:hole_at]), bytes(blob[hole_at:]), nbytes)
