"""The collectives of ZeRO-3: fetch a module's parameters, reduce-scatter its gradients,
reduce the gradient norm and the overflow flag.

Every tensor is on the parameters' device (CPU for gloo, CUDA for NCCL); nothing here
assumes a CPU. Every collective is started with ``async_op=True`` and waited on by
:func:`~swapper.distributed.groups.wait_work` with the group's timeout, so a dead or stalled peer
is a :class:`~swapper.distributed.errors.CollectiveError` naming the collective, the module and
the rank, never a hang.

Fetch (:func:`start_fetch`), one collective per module and dtype, into one param-major
buffer whose views are made before the collective (:mod:`swapper.distributed.layout`):

- ``"all_gather"``: each rank copies its pieces into its segment of a rank-major staging
  buffer (``N * segment_numel``), ``all_gather`` in place, then every piece is copied from
  the staging buffer into its view: ``bytes_copied_after`` = the module's bytes.
- ``"all_reduce"``: the buffer is filled with ``-0.0``, each rank writes its pieces in
  place, and a SUM fills the rest: ``bytes_copied_after`` = 0. ``-0.0`` because it is the
  additive identity of IEEE floats: ``x + (-0.0) == x`` bitwise for every x, ``+0.0`` and
  ``-0.0`` included (a ``+0.0`` fill would turn a parameter's ``-0.0`` into ``+0.0``), so
  both methods deliver bit-identical parameters whatever the reduction order. (NaN
  payloads may be quietened by the sum.) It moves about twice the bytes of all_gather
  (a ring all_reduce is a reduce-scatter plus an all_gather over the whole buffer).
- Parameters owned whole by one rank travel in the same collective: in its owner's
  segment (all_gather; segments are padded to the largest rank's need), or written in
  place by their owner (all_reduce). No separate broadcast, so one handle per module.

The handle (:class:`PendingFetch`) is waited on only when the module runs (read-ahead
overlaps the collective with compute); :meth:`PendingFetch.wait` does the copy of the
all_gather method.

Gradients (:func:`reduce_scatter_grads`): each rank copies its full gradients into a
zeroed rank-major buffer (segment r = rank r's pieces), in ``reduce_dtype`` (default: the
gradients' dtype; ``torch.float32`` reduces 16-bit gradients in fp32 at twice the bytes on
the wire and one rounding instead of one per addition); ``reduce_scatter`` SUMs segment r
onto rank r; rank r divides by N (averages) and copies its pieces into its shard tensors
(cast to their dtype). The rank-major input buffer is one transient copy of the module's
gradients (in ``reduce_dtype``): the caller frees the full gradients right after, so no
second full-size copy outlives the call; letting autograd write the gradients straight
into such a buffer (``.grad`` as views of it) would save that copy and is left for later.
Backends:

- NCCL: reduce_scatter for fp32/fp16/bf16 natively (bf16 needs NCCL >= 2.10).
- gloo (PyTorch 2.13): reduce_scatter for fp32/fp64/fp16/bf16 (probed in the tests).
- a backend or dtype without reduce_scatter (raising NotImplementedError or "not
  supported"): the same buffer is ``all_reduce``-d and rank r keeps its segment. Cost:
  about twice the bytes on the wire (``2 (N-1)/N`` of the buffer instead of ``(N-1)/N``)
  and no memory saved (the whole buffer is reduced in place). Chosen once per
  (backend, dtype, device type), logged once; ``fallback=True`` forces it.

World size 1: no collective at all (fetch copies the shards into the buffer, gradients
are copied into the shards, the norm is the local one), bit-identical to both methods and
to one process without distribution.

Small reductions (:func:`reduce_norm_and_overflow`): the squared gradient norm of each
rank's shards and its overflow flag go in one float64 ``all_reduce`` of two elements; the
result, equal on every rank, decides clipping and skipped steps on every rank alike.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from swapper.distributed.groups import (
    DistGroup,
    _raise_if_failed,
    all_gather_single,
    reduce_scatter_single,
    start_collective,
    wait_work,
)
from swapper.distributed.layout import ModuleLayout
from tiers.errors import InvalidArgumentError

__all__ = [
    "FETCH_METHODS",
    "FetchMethod",
    "PendingFetch",
    "ReduceScatterStats",
    "reduce_norm_and_overflow",
    "reduce_scatter_grads",
    "start_fetch",
]

log = logging.getLogger(__name__)

FetchMethod = Literal["all_gather", "all_reduce"]
FETCH_METHODS: tuple[str, ...] = ("all_gather", "all_reduce")

#: (backend, dtype, device type) → True when reduce_scatter works, False when it does not.
_REDUCE_SCATTER_WORKS: dict[tuple[str, str, str], bool] = {}


def _check_shards(
    layout: ModuleLayout,
    shards: Mapping[int, torch.Tensor],
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    what: str,
) -> None:
    for piece in layout.rank_pieces(rank):
        t = shards.get(piece.index)
        name = layout.plan.params[piece.index].info.name
        if t is None:
            raise InvalidArgumentError(f"{what}: rank {rank} has no shard of {name!r}")
        if t.dim() != 1 or t.numel() != piece.stored_numel or t.dtype != dtype:
            raise InvalidArgumentError(
                f"{what}: the shard of {name!r} on rank {rank} is {tuple(t.shape)} "
                f"{t.dtype}; need ({piece.stored_numel},) {dtype}"
            )
        if t.device != device:
            raise InvalidArgumentError(
                f"{what}: the shard of {name!r} is on {t.device}, the fetch on {device}"
            )


@dataclass
class PendingFetch:
    """A module's fetch in flight; :meth:`wait` before the module runs.

    Attributes:
        layout: the module's layout.
        method: ``"all_gather"`` or ``"all_reduce"``.
        buffer: the param-major buffer (``layout.buffer_numel`` elements).
        views: parameter index → 1-D view of ``numel`` elements in ``buffer`` (reshape
            with ``.view(shape)``); filled once :meth:`wait` returns.
        bytes_copied_after: bytes copied after the collective (0 for all_reduce).
        what: the module's name, for errors.
    """

    layout: ModuleLayout
    method: str
    buffer: torch.Tensor
    views: dict[int, torch.Tensor]
    what: str
    _dg: DistGroup
    _work: dist.Work | None
    _staging: torch.Tensor | None
    bytes_copied_after: int = 0
    _done: bool = field(default=False)

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` has returned."""
        return self._done

    def settle(self) -> None:
        """Wait (at most the group's timeout) until the backend is done with the buffers,
        whatever the outcome, so they may be freed: a :meth:`wait` that raised left the
        collective unwaited (a failed group raises at once). Errors are swallowed (the
        failure was, or will be, raised by :meth:`wait`); an interrupt propagates and
        leaves it to call again."""
        if self._work is None:
            return
        # failed or timed out: the backend gave up on it too
        with contextlib.suppress(RuntimeError, ValueError):
            self._work.wait(timeout=self._dg.timeout)
        self._work = None
        self._staging = None

    def wait(self) -> dict[int, torch.Tensor]:
        """Wait for the collective (at most the group's timeout) and fill the views.

        Idempotent. Raises:
            CollectiveError: the collective failed or timed out on this rank.
        """
        if self._done:
            return self.views
        try:
            wait_work(self._dg, self._work, self.method, self.what)
        except BaseException:
            # The buffer's contents are undefined: drop the staging copy now (the backend's
            # work object keeps what it still uses alive) so a failed read-ahead queue does
            # not pin twice the module's bytes; the group is marked failed, so a second
            # wait raises at once.
            self._staging = None
            raise
        self._work = None
        if self._staging is not None:
            seg = self.layout.segment_numel
            copied = 0
            for piece in self.layout.pieces:
                n = piece.real_numel
                if n == 0:
                    continue
                src = piece.rank * seg + piece.segment_offset
                self.buffer[piece.buffer_offset : piece.buffer_offset + n].copy_(
                    self._staging[src : src + n]
                )
                copied += n
            self.bytes_copied_after = copied * self.layout.itemsize
            self._staging = None  # freed: only the buffer stays alive
        self._done = True
        return self.views


def start_fetch(
    layout: ModuleLayout,
    shards: Mapping[int, torch.Tensor],
    dg: DistGroup,
    *,
    dtype: torch.dtype,
    device: torch.device,
    method: str = "all_gather",
    what: str = "a module",
    async_op: bool = True,
    out: torch.Tensor | None = None,
    staging_out: torch.Tensor | None = None,
) -> PendingFetch:
    """Start gathering the parameters of ``layout`` from every rank's shards.

    Args:
        layout: the module's layout (same on every rank).
        shards: parameter index → this rank's 1-D shard (``stored_numel`` elements,
            padding included, ``dtype`` on ``device``) for every piece this rank stores.
        dg: the group.
        dtype, device: of the buffer (the parameters' dtype and compute device).
        method: ``"all_gather"`` or ``"all_reduce"`` (see the module docstring).
        what: the module's name, for errors.
        async_op: False waits before returning.
        out: memory for the param-major buffer (``layout.buffer_numel`` elements of
            ``dtype`` on ``device``, e.g. a view of a block charged to a budget); None
            allocates it.
        staging_out: likewise for the rank-major staging buffer of ``"all_gather"``
            (``segment_numel * world_size`` elements; unused otherwise).

    Raises:
        InvalidArgumentError: an unknown method, ``out`` or ``staging_out`` of the wrong
            size, dtype or device, or a shard missing or of the wrong
            size, dtype or device (raised before any collective starts).
        CollectiveError: the collective failed to start (or, with ``async_op=False``,
            failed or timed out).
    """
    if method not in FETCH_METHODS:
        raise InvalidArgumentError(
            f"fetch_collective={method!r} is not one of {', '.join(FETCH_METHODS)}"
        )
    device = torch.device(device)
    _check_shards(layout, shards, dg.rank, dtype, device, what)
    _check_out(out, layout.buffer_numel, dtype, device, f"{what}: out")
    _check_out(staging_out, layout.segment_numel * dg.world_size, dtype, device, f"{what}: staging")
    views: dict[int, torch.Tensor] = {}
    staging: torch.Tensor | None = None
    if dg.world_size == 1:
        # One rank holds every piece: no collective, no staging buffer, one copy per
        # parameter (bit for bit the shards), whatever the method.
        buffer = _filled(out, layout.buffer_numel, dtype, device)
        for piece in layout.rank_pieces(0):
            n = piece.real_numel
            buffer[piece.buffer_offset : piece.buffer_offset + n].copy_(shards[piece.index][:n])
        for i, offset in zip(layout.indices, layout.region_offsets, strict=True):
            views[i] = buffer[offset : offset + layout.plan.params[i].numel]
        pending = PendingFetch(layout, method, buffer, views, what, dg, None, None)
        pending.wait()
        return pending
    if method == "all_reduce":
        buffer = _filled(out, layout.buffer_numel, dtype, device)
        for piece in layout.rank_pieces(dg.rank):
            n = piece.real_numel
            buffer[piece.buffer_offset : piece.buffer_offset + n].copy_(shards[piece.index][:n])
        start = lambda: dist.all_reduce(  # noqa: E731
            buffer, op=dist.ReduceOp.SUM, group=dg.group, async_op=True
        )
    else:
        buffer = (
            torch.empty(layout.buffer_numel, dtype=dtype, device=device) if out is None else out
        )
        seg = layout.segment_numel
        staging = gathered = (
            torch.empty(seg * dg.world_size, dtype=dtype, device=device)
            if staging_out is None
            else staging_out
        )
        # In place: this rank's segment of the output is the input (NCCL and gloo allow it).
        mine = gathered[dg.rank * seg : (dg.rank + 1) * seg]
        for piece in layout.rank_pieces(dg.rank):
            n = piece.stored_numel
            mine[piece.segment_offset : piece.segment_offset + n].copy_(shards[piece.index])
        start = lambda: all_gather_single(gathered, mine, group=dg.group, async_op=True)  # noqa: E731
    for i, offset in zip(layout.indices, layout.region_offsets, strict=True):
        views[i] = buffer[offset : offset + layout.plan.params[i].numel]
    work = start_collective(dg, method, what, start)
    pending = PendingFetch(layout, method, buffer, views, what, dg, work, staging)
    if not async_op:
        pending.wait()
    return pending


def _check_out(
    out: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device, what: str
) -> None:
    if out is None:
        return
    if out.dim() != 1 or out.numel() != numel or out.dtype != dtype or out.device != device:
        raise InvalidArgumentError(
            f"{what} buffer is {tuple(out.shape)} {out.dtype} on {out.device}; need "
            f"({numel},) {dtype} on {device}"
        )


def _filled(
    out: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The param-major buffer filled with ``-0.0`` (see the module docstring)."""
    if out is None:
        return torch.full((numel,), -0.0, dtype=dtype, device=device)
    return out.fill_(-0.0)


@dataclass(frozen=True)
class ReduceScatterStats:
    """What one :func:`reduce_scatter_grads` did.

    Attributes:
        collective: ``"reduce_scatter"``, ``"all_reduce"`` (the fallback), or ``"none"``
            (world size 1: no collective).
        reduce_dtype: the dtype the sum was computed in.
        input_nbytes: bytes of the rank-major buffer each rank contributed.
    """

    collective: str
    reduce_dtype: torch.dtype
    input_nbytes: int


def reduce_scatter_grads(
    layout: ModuleLayout,
    grads: Mapping[int, torch.Tensor],
    out: Mapping[int, torch.Tensor],
    dg: DistGroup,
    *,
    reduce_dtype: torch.dtype | None = None,
    what: str = "a module",
    fallback: bool | None = None,
) -> ReduceScatterStats:
    """Average the module's full gradients over the ranks into this rank's shards.

    Args:
        layout: the module's layout (the parameters whose gradients are complete).
        grads: parameter index → this rank's full gradient (any shape, ``numel``
            elements) for every parameter of ``layout``, all of one dtype and device.
        out: parameter index → this rank's 1-D gradient shard (``stored_numel``
            elements, padding included) for every piece this rank stores; written in
            place (cast to its dtype); its padding is set to zero.
        dg: the group.
        reduce_dtype: dtype of the sum (None: the gradients' dtype).
        what: the module's name, for errors.
        fallback: True forces all_reduce-then-slice, False forbids it, None (default)
            uses it where reduce_scatter is unsupported.

    Raises:
        InvalidArgumentError: a gradient or shard missing, or of the wrong size, dtype
            or device (before any collective starts).
        CollectiveError: the collective failed or timed out.
    """
    missing = [layout.plan.params[i].info.name for i in layout.indices if i not in grads]
    if missing:
        raise InvalidArgumentError(f"{what}: no gradient given for {missing}")
    first = grads[layout.indices[0]] if layout.indices else None
    if first is None:
        return ReduceScatterStats("reduce_scatter", reduce_dtype or torch.float32, 0)
    device = first.device
    rdtype = reduce_dtype or first.dtype
    for i in layout.indices:
        g = grads[i]
        name = layout.plan.params[i].info.name
        if g.numel() != layout.plan.params[i].numel or g.dtype != first.dtype or g.device != device:
            raise InvalidArgumentError(
                f"{what}: the gradient of {name!r} is {tuple(g.shape)} {g.dtype} on "
                f"{g.device}; need {layout.plan.params[i].numel} elements of {first.dtype} "
                f"on {device}"
            )
    held = [out[p.index].dtype for p in layout.rank_pieces(dg.rank) if p.index in out]
    out_dtype = held[0] if held else rdtype
    _check_shards(layout, out, dg.rank, out_dtype, device, what)

    n = dg.world_size
    if n == 1:
        # Nothing to reduce or divide by, no rank-major copy: each gradient, cast to the
        # shard's dtype (via reduce_dtype, which is exact for a single value), is the shard.
        for piece in layout.rank_pieces(0):
            dst, k = out[piece.index], piece.real_numel
            flat = grads[piece.index].reshape(-1)[piece.start : piece.end]
            dst[:k].copy_(flat.to(rdtype))
            dst[k:].zero_()
        return ReduceScatterStats("none", rdtype, 0)
    seg = layout.segment_numel
    buffer = torch.zeros(seg * n, dtype=rdtype, device=device)
    for piece in layout.pieces:
        k = piece.real_numel
        if k:
            dst = piece.rank * seg + piece.segment_offset
            flat = grads[piece.index].reshape(-1)
            buffer[dst : dst + k].copy_(flat[piece.start : piece.end])
    mine = buffer[dg.rank * seg : (dg.rank + 1) * seg]

    key = (dg.backend, str(rdtype), device.type)
    use_fallback = fallback if fallback is not None else not _REDUCE_SCATTER_WORKS.get(key, True)
    collective = "all_reduce" if use_fallback else "reduce_scatter"
    result = mine  # the fallback reduces the whole buffer in place and keeps this slice
    if not use_fallback:
        result = torch.empty(seg, dtype=rdtype, device=device)
        _raise_if_failed(dg, "reduce_scatter", what)
        try:
            work = reduce_scatter_single(
                result, buffer, op=dist.ReduceOp.SUM, group=dg.group, async_op=True
            )
        except (NotImplementedError, RuntimeError) as exc:
            unsupported = isinstance(exc, NotImplementedError) or "support" in str(exc).lower()
            if not unsupported or fallback is False:
                raise dg.error("reduce_scatter", what, str(exc), timed_out=False) from exc
            _REDUCE_SCATTER_WORKS[key] = False
            log.warning(
                "reduce_scatter unsupported for %s %s on %s (%s); using all_reduce then a "
                "slice (about twice the bytes)", dg.backend, rdtype, device.type, exc,
            )  # fmt: skip
            use_fallback, collective = True, "all_reduce"
        else:
            _REDUCE_SCATTER_WORKS[key] = True
            wait_work(dg, work, collective, what)
    if use_fallback:
        work = start_collective(
            dg, collective, what,
            lambda: dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=dg.group, async_op=True),
        )  # fmt: skip
        wait_work(dg, work, collective, what)
        result = mine
    result.div_(n)
    for piece in layout.rank_pieces(dg.rank):
        dst = out[piece.index]
        dst.copy_(result[piece.segment_offset : piece.segment_offset + piece.stored_numel])
        if piece.real_numel < piece.stored_numel:
            dst[piece.real_numel :].zero_()  # padding: zero whatever the sum left there
    return ReduceScatterStats(collective, rdtype, buffer.numel() * buffer.element_size())


def reduce_norm_and_overflow(
    dg: DistGroup, local_sq_sum: float, local_overflow: bool, *, what: str = "the step"
) -> tuple[float, bool]:
    """The global gradient norm and overflow flag, equal on every rank.

    Args:
        local_sq_sum: sum of squares of this rank's gradient shards (each element once:
            padding is zero and whole-owned parameters count on their owner only).
        local_overflow: this rank found an inf/NaN gradient.

    Returns:
        ``(norm, overflow)``: ``sqrt`` of the summed squares, and whether any rank
        overflowed or the sum is not finite.

    Raises:
        CollectiveError: the all_reduce failed or timed out.
    """
    if dg.world_size == 1:  # nothing to agree with: no collective
        sq = float(local_sq_sum)
        overflow = bool(local_overflow) or not math.isfinite(sq)
        return (math.sqrt(sq) if math.isfinite(sq) and sq >= 0 else math.inf), overflow
    t = torch.tensor(
        [float(local_sq_sum), 1.0 if local_overflow else 0.0],
        dtype=torch.float64,
        device=dg.control_device,
    )
    work = start_collective(
        dg, "all_reduce", f"gradient norm of {what}",
        lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=dg.group, async_op=True),
    )  # fmt: skip
    wait_work(dg, work, "all_reduce", f"gradient norm of {what}")
    sq, flag = t.tolist()
    overflow = flag > 0 or not math.isfinite(sq)
    return (math.sqrt(sq) if math.isfinite(sq) and sq >= 0 else math.inf), overflow
