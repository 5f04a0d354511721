"""The Distributed Checkpoint planners and reader that stream a rank's chunks (see
:mod:`swapper.zero.checkpoint.dcp_reshard` for what the chunks are, and
:mod:`swapper.zero.checkpoint.dcp_export` for the export and import built on them).

Built on DCP's extension points, not on a format of our own: a ``SavePlanner`` whose
plan adds SHARD write items (as DCP makes for a ``ShardedTensor``'s local shards) and
resolves their data late (lent to :class:`~swapper.zero.checkpoint.dcp_io.AioStorageWriter`
without a copy where the source allows); a ``LoadPlanner`` whose read items come from
DCP's ``create_read_items_for_chunk_list`` (its resharding rule); a
``FileSystemReader`` that checks each item's checksum (the writer's XXH3-64 sidecar, or
the zip CRC-32 without one) and names the file at fault.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, cast

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
from swapper.zero.checkpoint.dcp_reshard import Box, DcpCheckpointError

__all__ = ["BoxSource", "CheckedReader", "SliceLoadPlanner", "StreamingSavePlanner"]


def chunk_of(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))


@dataclasses.dataclass(frozen=True)
class BoxSource:
    """One write item of a rank: where its values come from when the writer asks.

    ``fill(dest)`` writes the box's values into a flat tensor (a copy); ``view()``, when
    given, is preferred by writers that can use it: the box's values in the memory they
    live in (flat, contiguous), valid until the writes in flight complete (whoever owns
    that memory lets it go through the writer's ``after_writes``); ``hold()``, when given
    and it returns something, likewise but held until the call returned with it (the
    writer calls it once it is done with the memory)."""

    fqn: str
    box: Box
    shape: torch.Size
    dtype: torch.dtype
    fill: Callable[[torch.Tensor], None]
    view: Callable[[], torch.Tensor] | None = None
    hold: Callable[[], tuple[torch.Tensor, Callable[[], None]] | None] | None = None

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


class StreamingSavePlanner(DefaultSavePlanner):
    """DCP's default planner for the non-tensor entries of the state dict, plus one
    SHARD write item per :class:`BoxSource`, resolved only when written: by
    :meth:`lease` for :class:`~swapper.zero.checkpoint.dcp_io.AioStorageWriter` (no copy where the
    source has a view), by :meth:`resolve_data` (a fresh tensor) for any other writer.

    Args:
        sources: this rank's boxes.
        progress: called as ``progress(bytes_resolved, total_bytes)`` (this rank's
            tensor bytes) after each box is handed to the writer.
    """

    def __init__(
        self,
        sources: Sequence[BoxSource],
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        super().__init__()
        self._sources = {MetadataIndex(s.fqn, torch.Size(s.box.offsets)): s for s in sources}
        self._progress = progress
        self._total = sum(s.box.numel * s.dtype.itemsize for s in sources)
        self._done = 0

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = [*plan.items, *(s.write_item() for s in self._sources.values())]
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def _handed(self, source: BoxSource) -> None:
        self._done += source.box.numel * source.dtype.itemsize
        if self._progress is not None:
            self._progress(self._done, self._total)

    def lease(
        self, write_item: WriteItem, stage: Callable[[int, torch.dtype], torch.Tensor]
    ) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """The item's values, flat: the source's own memory where it has a view, else
        filled into ``stage(numel, dtype)`` (a writer's buffer); and what to call once
        they are written (a held source's release; nothing for a view, whose memory is
        its owner's, see :class:`BoxSource`)."""
        source = self._sources.get(write_item.index)
        if source is None:
            return cast(torch.Tensor, super().resolve_data(write_item)).contiguous().view(-1), None
        held = source.hold() if source.hold is not None and source.box.numel else None
        if held is not None:
            self._handed(source)
            return held
        if source.view is not None and source.box.numel:
            out = source.view()
        else:
            out = stage(source.box.numel, source.dtype)
            source.fill(out)
        self._handed(source)
        return out, None

    def resolve_data(self, write_item: WriteItem) -> Any:
        source = self._sources.get(write_item.index)
        if source is None:
            return super().resolve_data(write_item)
        out = torch.empty(source.box.numel, dtype=source.dtype)
        source.fill(out)
        self._handed(source)
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
    item whose checksum does not match its bytes, one that does not decode
    (:class:`DcpCheckpointError`)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._where = Path(path)
        self._metadata: Metadata | None = None
        self._sidecars: dict[str, dict[str, str] | None] = {}

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

    def _digests(self, name: str) -> dict[str, str] | None:
        """The sidecar's digests of the items of data file ``name`` (by offset), or None
        when it has none (a checkpoint written by another writer)."""
        if name not in self._sidecars:
            from swapper.zero.checkpoint.dcp_io import SIDECAR_SUFFIX

            path = self._where / (name + SIDECAR_SUFFIX)
            try:
                loaded = json.loads(path.read_bytes())
                digests = loaded["items"] if loaded.get("algorithm") == "xxh3_64" else None
                if not isinstance(digests, dict):
                    raise ValueError(f"algorithm {loaded.get('algorithm')!r} or no items")
            except FileNotFoundError:
                digests = None
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise DcpCheckpointError(path, f"unreadable checksum file ({exc})") from None
            self._sidecars[name] = digests
        return self._sidecars[name]

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        """The item's bytes, checked before they are decoded (``torch.load`` checks
        nothing: a damaged byte would load as a wrong value): against the XXH3-64
        digest in the data file's checksum sidecar (:mod:`swapper.zero.checkpoint.dcp_io`), or,
        without one, the CRC-32 of its ``torch.save`` zip records."""
        from swapper.zero.checkpoint.dcp_io import SIDECAR_SUFFIX, item_digest

        data = super()._slice_file(file, sinfo).read()
        path = self._where / sinfo.relative_path
        if len(data) != sinfo.length:
            raise DcpCheckpointError(
                path, f"truncated: {len(data)} of {sinfo.length} bytes at offset {sinfo.offset}"
            )
        where = f"the item at offset {sinfo.offset} ({sinfo.length} bytes)"
        digests = self._digests(sinfo.relative_path)
        if digests is not None:
            expected = digests.get(str(sinfo.offset))
            if expected is None:
                raise DcpCheckpointError(
                    path, f"corrupt: {where} has no checksum in {path.name + SIDECAR_SUFFIX}"
                )
            if item_digest(data) != expected:
                raise DcpCheckpointError(
                    path,
                    f"corrupt: {where} fails its checksum (XXH3-64, in "
                    f"{path.name + SIDECAR_SUFFIX})",
                )
        elif data[:4] == b"PK\x03\x04":  # a zip archive (no stream transform applied)
            try:
                bad = zipfile.ZipFile(io.BytesIO(data)).testzip()
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
                bad = f"the archive ({exc})"
            if bad is not None:
                raise DcpCheckpointError(
                    path,
                    f"corrupt: {where} fails its checksum (CRC-32, in {bad}; no "
                    f"{path.name + SIDECAR_SUFFIX} beside it)",
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
