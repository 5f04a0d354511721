"""The Distributed Checkpoint planners and reader that stream a rank's chunks (see
:mod:`swapper.zero.dcp_reshard` for what the chunks are, and
:mod:`swapper.zero.dcp_export` for the export and import built on them).

Built on DCP's extension points, not on a format of our own: a ``SavePlanner`` whose
plan adds SHARD write items (as DCP makes for a ``ShardedTensor``'s local shards) and
resolves their data late; a ``LoadPlanner`` whose read items come from DCP's
``create_read_items_for_chunk_list`` (its resharding rule); a ``FileSystemReader``
that checks each item's CRC-32 and names the file at fault.
"""

from __future__ import annotations

import dataclasses
import io
import os
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.futures import Future

from swapper.step.state import StateDictError
from swapper.zero.dcp_reshard import Box, DcpCheckpointError
from tiers.buffers import allocate
from tiers.errors import SwapConfigError

__all__ = ["BoxSource", "CheckedReader", "SliceLoadPlanner", "StreamingSavePlanner"]


def chunk_of(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))


@dataclasses.dataclass(frozen=True)
class BoxSource:
    """One write item of a rank: where its values come from when the writer asks."""

    fqn: str
    box: Box
    shape: torch.Size
    dtype: torch.dtype
    fill: Callable[[torch.Tensor], None]  # writes the box's values into a flat tensor

    def write_item(self) -> WriteItem:
        offsets = torch.Size(self.box.offsets)
        return WriteItem(
            index=MetadataIndex(self.fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=chunk_of(self.box),
                properties=TensorProperties(dtype=self.dtype),
                size=self.shape,
            ),
        )


class _Staging:
    """Two page-aligned host buffers (prefaulted once: a fresh allocation per item costs
    a page fault per 4 KiB, which on a VM is slower than the disk), used in turn: item
    k's tensor lives in buffer k % 2. Safe only under DCP's serial loader, which writes
    item k before it resolves item k + 1 (``FileSystemWriter(thread_count=1,
    per_thread_copy_ahead=0)``, which :func:`~swapper.zero.dcp_export.export_dcp` uses),
    so item k's buffer is free again when item k + 2 is resolved."""

    def __init__(self, nbytes: int) -> None:
        self._buffers = [allocate(nbytes), allocate(nbytes)] if nbytes else []
        self._next = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if not nbytes:
            return torch.empty(numel, dtype=dtype)
        buffer = self._buffers[self._next]
        self._next ^= 1
        view = buffer.tensor.numpy().data.cast("B")[:nbytes]
        # a storage of exactly the item's bytes: DCP clones a view of a larger storage
        return torch.frombuffer(view, dtype=dtype)

    def close(self) -> None:
        for buffer in self._buffers:
            buffer.close()
        self._buffers.clear()


class StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default planner for the non-tensor entries of the state dict, plus one
    SHARD write item per :class:`BoxSource`, resolved (filled) only when written, into
    one of two staging buffers (:class:`_Staging`; needs DCP's serial loader). Call
    :meth:`close` after the save.

    Args:
        sources: this rank's boxes.
        progress: called as ``progress(bytes_resolved, total_bytes)`` (this rank's
            tensor bytes) after each box is handed to the writer.
    """

    def __init__(
        self,
        sources: Sequence[BoxSource],
        progress: Callable[[int, int], None] | None = None,
        position: Callable[[], int | None] | None = None,
    ) -> None:
        super().__init__()
        # bytes the file being written holds (None: not known): a check that DCP wrote
        # the previous item before asking for the next (the staging buffers rely on it)
        self._position = position
        self._last: int | None = None
        self._sources = {MetadataIndex(s.fqn, torch.Size(s.box.offsets)): s for s in sources}
        self._progress = progress
        self._total = sum(s.box.numel * s.dtype.itemsize for s in sources)
        self._done = 0
        largest = max((s.box.numel * s.dtype.itemsize for s in sources), default=0)
        self._staging = _Staging(largest)

    def close(self) -> None:
        """Free the staging buffers (after the save returned or raised)."""
        self._staging.close()

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [*plan.items, *(s.write_item() for s in self._sources.values())]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        source = self._sources.get(write_item.index)
        if source is None:
            return super().resolve_data(write_item)
        if self._position is not None:
            now = self._position()
            if now is not None and self._last is not None and now <= self._last:
                raise SwapConfigError(
                    "export_dcp: DCP asked for an item before writing the previous one; "
                    "the staging buffers need its serial loader (thread_count=1, "
                    "per_thread_copy_ahead=0): a torch change? (nothing was overwritten)"
                )
            self._last = now
        out = self._staging.take(source.box.numel, source.dtype)
        source.fill(out)
        self._done += out.numel() * out.element_size()
        if self._progress is not None:
            self._progress(self._done, self._total)
        return out.view(source.box.sizes)


# -- reading ------------------------------------------------------------------------------


class SliceLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner for the non-tensor entries of the state dict given to
    ``load``, plus read items for ``targets``: ``fqn → [(box, destination)]`` whose
    destinations (shape ``box.sizes``) are filled from whichever saved chunks overlap.
    """

    def __init__(self, targets: dict[str, list[tuple[Box, torch.Tensor]]]) -> None:
        super().__init__(allow_partial_load=True)
        self._targets = targets
        self._dest = {
            (fqn, torch.Size(box.offsets)): dest
            for fqn, boxes in targets.items()
            for box, dest in boxes
        }

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        for fqn, boxes in self._targets.items():
            md = self.metadata.state_dict_metadata[fqn] if self.metadata else None
            if not isinstance(md, TensorStorageMetadata):  # checked before: a bug if seen
                raise StateDictError(f"{fqn} is not a tensor in the checkpoint")
            items += create_read_items_for_chunk_list(fqn, md, [chunk_of(b) for b, _ in boxes])
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        key = (read_item.dest_index.fqn, read_item.dest_index.offset)
        dest = self._dest.get(key)  # type: ignore[arg-type]
        if dest is None:
            return super().resolve_tensor(read_item)
        for dim, (off, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            dest = dest.narrow(dim, off, n)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if (read_item.dest_index.fqn, read_item.dest_index.offset) not in self._dest:
            super().commit_tensor(read_item, tensor)


class CheckedReader(FileSystemReader):
    """DCP's file-system reader whose metadata is read once, and whose failures name
    the file: a missing file, one shorter than the items the metadata places in it, an
    item whose CRC-32 does not match its bytes, one that does not decode
    (:class:`DcpCheckpointError`)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._where = Path(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            try:
                self._metadata = super().read_metadata(*args, **kwargs)
            except FileNotFoundError:
                raise DcpCheckpointError(
                    self._where / ".metadata", "missing: not a Distributed Checkpoint"
                ) from None
            except Exception as exc:  # unpickling garbage raises anything
                raise DcpCheckpointError(
                    self._where / ".metadata", f"unreadable ({type(exc).__name__}: {exc})"
                ) from None
        return self._metadata

    def check_files(self) -> None:
        """Every file the metadata names exists and holds the bytes placed in it.

        Raises:
            DcpCheckpointError: the first file missing (each rank writes its own: a
                missing rank's part) or truncated, named with the bytes expected.
        """
        metadata = self.read_metadata()
        need: dict[str, int] = {}
        storage: dict[Any, Any] = metadata.storage_data or {}
        for info in storage.values():
            end = info.offset + info.length
            need[info.relative_path] = max(need.get(info.relative_path, 0), end)
        for name in sorted(need):
            path = self._where / name
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise DcpCheckpointError(
                    path, "missing (the part one rank wrote): the checkpoint is incomplete"
                ) from None
            if size < need[name]:
                raise DcpCheckpointError(
                    path, f"truncated: {size} bytes, the metadata places {need[name]} in it"
                )

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        """The item's bytes, checked: DCP stores each item as a ``torch.save`` zip
        archive whose records carry a CRC-32, which ``torch.load`` does not check; a
        damaged byte would load as a wrong value. Checked here before it is decoded."""
        data = super()._slice_file(file, sinfo).read()
        path = self._where / sinfo.relative_path
        if len(data) != sinfo.length:
            raise DcpCheckpointError(
                path, f"truncated: {len(data)} of {sinfo.length} bytes at offset {sinfo.offset}"
            )
        if data[:4] == b"PK\x03\x04":  # a zip archive (no stream transform applied)
            try:
                bad = zipfile.ZipFile(io.BytesIO(data)).testzip()
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
                bad = f"the archive ({exc})"
            if bad is not None:
                raise DcpCheckpointError(
                    path,
                    f"corrupt: the item at offset {sinfo.offset} ({sinfo.length} bytes) fails "
                    f"its CRC-32 check in {bad}",
                )
        return io.BytesIO(data)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except DcpCheckpointError:
                raise
            except FileNotFoundError:
                raise DcpCheckpointError(self._where / name, "missing") from None
            except Exception as exc:  # torch.load of a damaged record, a short read
                raise DcpCheckpointError(
                    self._where / name, f"corrupt ({type(exc).__name__}: {exc})"
                ) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done
