"""Who owns which elements of every 16-bit parameter across the N ranks of a group.

Pure: no process group, no tensors; every rank computes the same plan from the same
input (same input → same plan, bit for bit: no hashing of sets, no dict-order games), and
:meth:`PartitionPlan.digest` lets the ranks check that they did.

Two kinds of ownership:

- **sharded**: the parameter is flattened and cut into N shards of ``shard_numel``
  elements each, ``shard_numel = round_up(ceil(numel / N), align_numel)``; rank r owns
  elements ``[r * shard_numel, (r + 1) * shard_numel)``, clipped to ``numel``. The last
  shards carry the padding (always zero, never computed on); a rank may hold padding only.
- **whole**: a parameter with fewer than ``whole_below_numel`` elements is owned whole by
  one rank (cutting it N ways would be mostly padding: below ``align_numel * N`` elements
  at least one shard is padding only). Default threshold: ``align_numel * N``.

Alignment: :data:`ALIGN_NUMEL` = 128 elements, 256 bytes of a 16-bit dtype. Each shard
starts and ends on it, and so does every parameter's region in a module's fetch buffer
(:mod:`swapper.distributed.layout`): views of the gathered buffer are 256-byte aligned (enough for
vectorised kernels and NCCL's 16-byte requirement), while the padding stays at most 127
elements per parameter per rank. It is smaller than the optimizer's
:data:`swapper.step.layout.ALIGN_NUMEL` (1024) on purpose: the optimizer lays a rank's
shards end to end itself, so its alignment does not need to be the shards'.

Balance: the gradients of backward arrive in reverse forward order, a module at a time,
and each rank offloads (to host/NVMe) the bytes it owns. A sharded parameter gives every
rank the same bytes; whole-owned parameters are assigned, module window by module window
in backward order, largest first, to the rank with the fewest bytes in this window so far,
ties to the rank with the fewest bytes over all windows so far, then to the lowest rank.
So at every point of backward the offload is spread over all ranks (DeepSpeed PR #1067's
idea), and each rank's total is ``total / N`` plus padding plus at most one small tensor.
A parameter used by several modules (tied weights) appears once, in the window of its
first use in forward: its gradient is complete only after that module's backward.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from tiers.errors import SwapConfigError

__all__ = [
    "ALIGN_NUMEL",
    "ParamInfo",
    "ParamPlacement",
    "PartitionPlan",
    "describe_modules",
    "plan_contiguous",
    "plan_partition",
    "round_up",
]

#: Shard lengths and fetch-buffer regions are multiples of this many elements.
ALIGN_NUMEL = 128


def round_up(numel: int, multiple: int) -> int:
    """``numel`` rounded up to a multiple of ``multiple`` (both >= 0 / > 0)."""
    return -(-numel // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class ParamInfo:
    """What the plan needs of one parameter.

    Attributes:
        name: the parameter's name (unique in the model).
        numel: elements (>= 0).
        itemsize: bytes per element (2 for bf16/fp16).
        module_index: position, in forward order, of the first module that uses it.
        shape: its shape (for the cross-rank model check and for views; numel must match).
        dtype: its dtype as text, e.g. ``"torch.bfloat16"``.
    """

    name: str
    numel: int
    itemsize: int
    module_index: int
    shape: tuple[int, ...] = ()
    dtype: str = ""


@dataclass(frozen=True, kw_only=True)
class ParamPlacement:
    """One parameter's ownership.

    Attributes:
        index: position in the plan's parameter list (forward order).
        info: the input it was planned from.
        owner: the rank holding it whole, or None when it is sharded over every rank.
        shard_numel: sharded: elements per rank, padding included (a multiple of the
            alignment); whole: ``numel``.
        world_size: N.
    """

    index: int
    info: ParamInfo
    owner: int | None
    shard_numel: int
    world_size: int

    @property
    def sharded(self) -> bool:
        return self.owner is None

    @property
    def numel(self) -> int:
        return self.info.numel

    def local_numel(self, rank: int) -> int:
        """Elements rank ``rank`` stores for this parameter, padding included."""
        if self.owner is None:
            return self.shard_numel
        return self.info.numel if rank == self.owner else 0

    def real_range(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` of the flattened parameter held by ``rank`` (empty if none)."""
        if self.owner is None:
            start = min(rank * self.shard_numel, self.info.numel)
            return start, min(start + self.shard_numel, self.info.numel)
        return (0, self.info.numel) if rank == self.owner else (0, 0)

    def holds(self, rank: int) -> bool:
        """Whether ``rank`` stores anything for this parameter (padding-only shards count)."""
        return self.local_numel(rank) > 0


@dataclass(frozen=True)
class PartitionPlan:
    """The ownership of every parameter; see the module docstring."""

    world_size: int
    align_numel: int
    whole_below_numel: int
    params: tuple[ParamPlacement, ...]

    def local_numel(self, rank: int) -> int:
        """Elements rank ``rank`` stores over all parameters, padding included."""
        return sum(p.local_numel(rank) for p in self.params)

    def local_nbytes(self, rank: int) -> int:
        """Bytes rank ``rank`` stores over all parameters (16-bit copies), padding included."""
        return sum(p.local_numel(rank) * p.info.itemsize for p in self.params)

    def total_nbytes(self) -> int:
        """Bytes of the unpartitioned parameters (no padding)."""
        return sum(p.info.numel * p.info.itemsize for p in self.params)

    def padding_nbytes(self, rank: int) -> int:
        """Bytes of padding rank ``rank`` stores (zeros that are no parameter's)."""
        total = 0
        for p in self.params:
            start, end = p.real_range(rank)
            total += (p.local_numel(rank) - (end - start)) * p.info.itemsize
        return total

    def held_by(self, rank: int) -> tuple[int, ...]:
        """Indices of the parameters rank ``rank`` stores something of."""
        return tuple(p.index for p in self.params if p.holds(rank))

    def by_name(self, name: str) -> ParamPlacement:
        """The placement of the parameter called ``name``.

        Raises:
            KeyError: no such parameter in the plan.
        """
        for p in self.params:
            if p.info.name == name:
                return p
        raise KeyError(f"parameter {name!r} is not in the partition plan")

    def digest(self) -> str:
        """SHA-256 (hex) of the plan's canonical text: equal on ranks that agree."""
        rows = [
            [p.info.name, p.info.numel, p.info.itemsize, p.info.module_index,
             list(p.info.shape), p.info.dtype, p.owner, p.shard_numel]
            for p in self.params
        ]  # fmt: skip
        text = json.dumps([self.world_size, self.align_numel, self.whole_below_numel, rows])
        return hashlib.sha256(text.encode()).hexdigest()


def _check(params: Sequence[ParamInfo], world_size: int, align_numel: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise SwapConfigError(f"world_size={world_size!r} must be an int >= 1")
    if isinstance(align_numel, bool) or not isinstance(align_numel, int) or align_numel < 1:
        raise SwapConfigError(f"align_numel={align_numel!r} must be an int >= 1")
    seen: set[str] = set()
    for i, p in enumerate(params):
        if p.name in seen:
            raise SwapConfigError(
                f"parameter {p.name!r} appears twice; list a shared (tied) parameter once, "
                "at the first module that uses it"
            )
        seen.add(p.name)
        if p.numel < 0 or p.itemsize < 1 or p.module_index < 0:
            raise SwapConfigError(
                f"parameter {i} ({p.name!r}): numel={p.numel}, itemsize={p.itemsize}, "
                f"module_index={p.module_index}; need numel >= 0, itemsize >= 1, "
                "module_index >= 0"
            )
        if p.shape and _prod(p.shape) != p.numel:
            raise SwapConfigError(
                f"parameter {p.name!r}: shape {p.shape} has {_prod(p.shape)} elements, "
                f"not numel={p.numel}"
            )


def _prod(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def plan_partition(
    params: Sequence[ParamInfo],
    world_size: int,
    *,
    align_numel: int = ALIGN_NUMEL,
    whole_below_numel: int | None = None,
) -> PartitionPlan:
    """Plan the ownership of ``params`` (in forward order) over ``world_size`` ranks.

    Args:
        params: every 16-bit parameter once, in forward order of first use.
        world_size: N >= 1.
        align_numel: shard lengths are multiples of this many elements.
        whole_below_numel: parameters with fewer elements are owned whole by one rank;
            None for ``align_numel * world_size``; 0 shards everything.

    Raises:
        SwapConfigError: a duplicate name, a negative size, a shape that does not match
            numel, or a bad world_size / align_numel / threshold; the message names it.
    """
    _check(params, world_size, align_numel)
    if whole_below_numel is None:
        whole_below_numel = align_numel * world_size
    if isinstance(whole_below_numel, bool) or whole_below_numel < 0:
        raise SwapConfigError(f"whole_below_numel={whole_below_numel!r} must be an int >= 0")

    owners: dict[int, int] = {}
    total = [0] * world_size
    # Backward order: module windows from the last forward module to the first.
    windows: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        if p.numel < whole_below_numel:
            windows.setdefault(p.module_index, []).append(i)
    for module_index in sorted(windows, reverse=True):
        window = [0] * world_size
        # Largest first (ties: forward order) so the greedy fill ends balanced.
        for i in sorted(windows[module_index], key=lambda j: (-_nbytes(params[j]), j)):
            r = min(range(world_size), key=lambda k: (window[k], total[k], k))
            owners[i] = r
            window[r] += _nbytes(params[i])
            total[r] += _nbytes(params[i])

    placements = []
    for i, p in enumerate(params):
        owner = owners.get(i)
        shard = round_up(-(-p.numel // world_size), align_numel) if owner is None else p.numel
        placements.append(
            ParamPlacement(index=i, info=p, owner=owner, shard_numel=shard, world_size=world_size)
        )
    return PartitionPlan(world_size, align_numel, whole_below_numel, tuple(placements))


def plan_contiguous(params: Sequence[ParamInfo], world_size: int) -> PartitionPlan:
    """The contiguous layout, for comparison with :func:`plan_partition` (never better):
    the parameters laid end to end in forward order, the flat vector cut into N equal
    ranges, and each parameter owned whole by the rank whose range holds its middle
    element. It is the flat partitioning of ZeRO-1/2 at the granularity of whole
    parameters: during backward the gradients arriving belong to one rank at a time.

    Raises:
        SwapConfigError: as :func:`plan_partition`.
    """
    _check(params, world_size, 1)
    total = sum(p.numel for p in params)
    part = max(1, -(-total // world_size))
    placements = []
    offset = 0
    for i, p in enumerate(params):
        owner = min(world_size - 1, (offset + p.numel // 2) // part)
        offset += p.numel
        placements.append(
            ParamPlacement(index=i, info=p, owner=owner, shard_numel=p.numel, world_size=world_size)
        )
    # every parameter is owned whole: the threshold is above the largest
    whole_below = max((p.numel for p in params), default=0) + 1
    return PartitionPlan(world_size, ALIGN_NUMEL, whole_below, tuple(placements))


def _nbytes(p: ParamInfo) -> int:
    return p.numel * p.itemsize


def describe_modules(modules: Sequence[tuple[str, nn.Module]]) -> list[ParamInfo]:
    """The :class:`ParamInfo` list of the modules' own parameters, in the given order.

    ``modules`` is (name, module) in forward order (e.g. as recorded by the fetch hooks,
    or ``named_modules()`` where that is the forward order). Each module contributes its
    ``parameters(recurse=False)``; a parameter already seen (tied weights) is skipped, so
    it belongs to the first module that uses it. Names are ``f"{module}.{param}"``.
    """
    seen: set[int] = set()  # id() only to spot the same Parameter twice; never a key kept
    out: list[ParamInfo] = []
    for module_index, (mod_name, module) in enumerate(modules):
        for pname, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            out.append(
                ParamInfo(
                    name=f"{mod_name}.{pname}" if mod_name else pname,
                    numel=param.numel(),
                    itemsize=param.element_size(),
                    module_index=module_index,
                    shape=tuple(param.shape),
                    dtype=str(param.dtype),
                )
            )
    return out
