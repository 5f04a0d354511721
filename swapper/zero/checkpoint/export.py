"""Export an offloaded model's 16-bit weights as safetensors shards with an index.

Job: :func:`export_safetensors`, the portable form of the weights that Hugging Face
``from_pretrained`` and ``safetensors.torch.load_file`` read. Streamed: the shards are
planned from the parameters' shapes first (a safetensors header must name every tensor's
offsets before its data), then each parameter is fetched from the tiers, written and
dropped, one at a time; the model is never whole in memory.

Layout (Hugging Face's sharded form)::

    DIR/model-00001-of-00003.safetensors   8-byte little-endian header length, the JSON
    ...                                    header {name: {dtype, shape, data_offsets},
                                           "__metadata__": {"format": "pt"}} padded with
                                           spaces to 8 bytes, then the tensors' bytes
    DIR/model.safetensors.index.json       {"metadata": {"total_size": N},
                                            "weight_map": {name: shard file}}

Several ranks (a sharded model): call it on every rank alike. Each parameter is gathered
in turn (one collective each, :meth:`~swapper.zero.sharded.model.ShardedModel.iter_state_dict`),
rank 0 writes it and drops it; the other ranks take part in the gathers and write
nothing. If rank 0's write fails, it still takes part in the remaining gathers (so no
rank waits out a timeout), and every rank then raises (an agreement at the end).

A tied parameter is written once, under the name the model registered it by (safetensors
refuses shared tensors; ``from_pretrained`` re-ties from the model's config). Each file is
written to a temporary name, fsync'd and renamed, the index last: an export cut off
leaves no index, never a partial shard under its final name.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

from tiers.errors import SwapConfigError, SwapIOError

if TYPE_CHECKING:
    from swapper.zero.local.offload import OffloadedModel
    from swapper.zero.sharded.model import ShardedModel

__all__ = ["INDEX_NAME", "export_safetensors"]

INDEX_NAME = "model.safetensors.index.json"
_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def _plan(
    params: list[tuple[str, torch.Size, torch.dtype]], max_shard_nbytes: int
) -> list[list[tuple[str, torch.Size, torch.dtype]]]:
    shards: list[list[tuple[str, torch.Size, torch.dtype]]] = [[]]
    used = 0
    for name, shape, dtype in params:
        nbytes = shape.numel() * dtype.itemsize
        if shards[-1] and used + nbytes > max_shard_nbytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape, dtype))
        used += nbytes
    return shards


def _header(shard: list[tuple[str, torch.Size, torch.dtype]]) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in shard:
        nbytes = shape.numel() * dtype.itemsize
        entries[name] = {
            "dtype": _DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def _write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SwapIOError(exc.errno, f"cannot write {path}: {exc.strerror}", str(path)) from exc


def export_safetensors(
    model: OffloadedModel | ShardedModel,
    directory: str | os.PathLike[str],
    *,
    max_shard_nbytes: int = 5 << 30,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write the model's 16-bit parameters as safetensors shards and an index in
    ``directory`` (made if missing), one parameter in memory at a time. With a sharded
    model, call it on every rank alike (module docstring).

    Args:
        max_shard_nbytes: tensor bytes per shard at most (a larger parameter gets a shard
            of its own).
        progress: called as ``progress(bytes_written, total_bytes)`` after each parameter
            (on rank 0).

    Returns:
        The index file's path (on every rank; only rank 0 writes).

    Raises:
        SwapConfigError: ``max_shard_nbytes`` is not a positive int, or ``directory``
            already holds an index (choose another, or delete it); on every rank.
        SwapIOError: a file could not be written (named); the index is not written.
        PeerFailedError: (several ranks) rank 0's write failed, on the other ranks.
        CollectiveError: (several ranks) a gather failed or timed out.
        and what fetching a parameter from the tiers raises.
    """
    from swapper.zero.sharded.model import ShardedModel

    if isinstance(max_shard_nbytes, bool) or not isinstance(max_shard_nbytes, int):
        raise SwapConfigError(f"max_shard_nbytes={max_shard_nbytes!r} must be an int > 0")
    if max_shard_nbytes <= 0:
        raise SwapConfigError(f"max_shard_nbytes={max_shard_nbytes!r} must be an int > 0")
    out = Path(directory)
    index_path = out / INDEX_NAME
    exists = SwapConfigError(
        f"{index_path} exists: export into an empty directory (or delete that export)"
    )
    if isinstance(model, ShardedModel):
        return _export_ranks(model, out, max_shard_nbytes, progress, exists)
    if index_path.exists():
        raise exists
    params = list(model.named_offloaded())
    _write_all(out, params, model.iter_state_dict(), max_shard_nbytes, progress)
    return index_path


def _write_all(
    out: Path,
    params: list[tuple[str, torch.Size, torch.dtype]],
    stream: Iterator[tuple[str, torch.Tensor]],
    max_shard_nbytes: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    """The shards and the index, ``stream`` yielding ``params``' values in order."""
    out.mkdir(parents=True, exist_ok=True)
    shards = _plan(params, max_shard_nbytes)
    total = sum(shape.numel() * dtype.itemsize for _, shape, dtype in params)
    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    if len(shards) == 1:
        names = ["model.safetensors"]
    written = 0
    weight_map: dict[str, str] = {}
    for shard, file_name in zip(shards, names, strict=True):

        def write(f: BinaryIO, shard: list[tuple[str, torch.Size, torch.dtype]] = shard) -> None:
            nonlocal written
            f.write(_header(shard))
            for name, shape, dtype in shard:
                got, tensor = next(stream)
                if got != name or tensor.shape != shape or tensor.dtype != dtype:
                    raise SwapConfigError(f"export: {got!r} changed while being exported")
                data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
                f.write(data.tobytes())
                written += data.nbytes
                if progress is not None:
                    progress(written, total)

        _write_atomic(out / file_name, write)
        weight_map.update({name: file_name for name, _, _ in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    text = json.dumps(index, indent=2).encode()
    _write_atomic(out / INDEX_NAME, lambda f: f.write(text))


def _export_ranks(
    model: ShardedModel,
    out: Path,
    max_shard_nbytes: int,
    progress: Callable[[int, int], None] | None,
    exists: SwapConfigError,
) -> Path:
    """:func:`export_safetensors` over the ranks of a sharded model (module docstring)."""
    from swapper.distributed import agree

    group = model.group
    index_path = out / INDEX_NAME
    found = index_path.exists()  # (the same directory on every rank)
    try:
        agree(group, not found, "export_safetensors: checking the directory")
    except BaseException:
        if found:
            raise exists from None
        raise
    stream = model.iter_state_dict()  # the gathers: one per parameter, on every rank
    error: BaseException | None = None
    try:
        if group.rank == 0:
            params = [(s.name, s.shape, s.dtype) for s in model.slots]
            _write_all(out, params, stream, max_shard_nbytes, progress)
    except BaseException as exc:
        error = exc
    try:
        for _ in stream:  # the other ranks, or rank 0 after a failure: pair the gathers
            pass
    except BaseException as exc:
        error = error or exc
    try:
        agree(group, error is None, "export_safetensors")
    except BaseException:
        if error is not None:
            raise error from None
        raise
    if error is not None:
        raise error
    return index_path
