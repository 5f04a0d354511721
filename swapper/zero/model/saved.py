"""Tensors autograd saves that are views of a managed parameter's block
(:mod:`swapper.zero.local.offload`): saved as *where* they are, not as the bytes.

The hazard. A module's forward reads its parameters from the block the tiers fetched
them into, and autograd keeps what the backward needs: often a view of a weight
(``addmm`` saves ``weight.t()``), which references that block. The forward hook then
releases the parameter; with a budget that cannot hold every parameter, the block goes
back to the tier and is given to another entry. In the host tier blocks are carved from
reused arenas, so the backward read another entry's bytes (silent corruption: the final
weights differed from the unlimited run, run to run); in the device tier (or its CPU
stand-in) blocks are separate allocations, so the saved view kept the released block
alive outside the budget (right values, budget silently exceeded).

The fix, as ZeRO-3 systems do it: while a module's forward runs with parameters that
can move (its pre-hook fetched them; only an unlimited use tier keeps the fast path
unhooked: its blocks are never given away. A limited one that holds every parameter
still moves them: a recompute's holds are not kept for its backward, and the tier holds
other kinds too; a reentrant recompute read evicted blocks there), a
``torch.autograd.graph.saved_tensors_hooks`` pair is pushed (:meth:`SavedParams.push`,
popped by the module's forward hook). Its pack hook recognises a tensor whose memory
lies in one of the module's parameter blocks and keeps ``(slot, offset, sizes, strides)``
instead of the tensor; the unpack hook makes the same view of the parameter's data as
it is when the node runs in the backward. The ordering makes that data the parameter's
current block: the hook on the module's outputs fetches the parameters before any node
of the module runs (:func:`~swapper.zero.model.autograd.hook_outputs`, once per backward pass,
so a second backward through a retained graph fetches again), and they are released
only when their gradient has been accumulated (after every node that saved them) or at
the end of the backward. An unpack that finds the parameter not held (a saved view used
outside the module's backward, e.g. a weight the module returned) raises
:class:`SavedParamError` rather than read a block that is not the parameter's.

Why not clone the saved views: correct, but each module's weights would be copied once
more, outside every budget (the device tier's whole point is to bound that).

Composition. torch applies only the innermost pair of saved-tensor hooks: pushing ours
would bypass a user's (``torch.autograd.graph.save_on_cpu``) or non-reentrant activation
checkpointing's. So the pair pushed delegates every tensor that is not a parameter view
to the pair that was on top when it was pushed (kept with the packed value for the
unpack), and only parameter views skip it. Activation checkpointing composes the same
way in both passes: in the first forward ours is above checkpoint's pack (parameter
views are not given to it), and in the recompute the module's pre-hook pushes ours above
checkpoint's recompute hook again, so it sees the same tensors in the same order
(its count of saved tensors matches) and the recomputed parameter views, which the
recompute's forward hook releases at once, are also unpacked from the backward's fetch.
Reentrant checkpointing recomputes under the module hooks likewise. Where saved-tensor
hooks are disabled (``torch.autograd.graph.disable_saved_tensors_hooks``), a limited
budget cannot be made safe: :class:`SavedParamError` says so.

The sharded path (:mod:`swapper.zero.sharded.model`) frees a module's gathered buffer at its
forward hook (a fresh allocation each gather: the saved view kept it alive outside the
device budget, values right). Its forward hooks do not run when a module raises, so a
pair pushed per module could be left on the stack; one pair is pushed around the whole
forward instead (:meth:`SavedParams.around`), recognising the parameters of every module
whose forward runs at the save. Inside a non-reentrant checkpoint's region its hooks are
innermost, above that pair: there a module's pre-hook pushes a pair of its own
(:meth:`SavedParams.push`, when :meth:`SavedParams.ours_on_top` is False; popped by its
forward hook, which runs when the forward raises too), in the first forward and in the
recompute alike, as the one-process path does. Without it the recompute handed
checkpointing the parameters themselves: a frozen one (saved undetached) had its
``.data`` emptied by the module's release before checkpointing compared the recomputed
tensors' shapes ("recomputed metadata: shape [0]", a CheckpointError at 2 ranks), and a
trainable one's detached view kept its freed buffer alive outside the budget.

Not covered: a parameter view saved after its module's forward returned (the module
returned a view of its weight and a later op saved it): the block was released by then;
it is not recognised here. With the hooks, autograd's version check of a saved parameter
(an in-place write between forward and backward) is skipped, as for any packed tensor;
the module hooks and an overlapped optimizer's gate order the writes to parameters.
(Both in docs/architecture.md.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch._C import _autograd

from tiers.errors import SwapError

__all__ = ["SavedParamError", "SavedParams", "SlotLike"]

_push = _autograd._push_saved_tensors_default_hooks
_pop = _autograd._pop_saved_tensors_default_hooks
_top = _autograd._top_saved_tensors_default_hooks

Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


class SlotLike(Protocol):
    """What is read of a parameter's record (:class:`~swapper.zero.local.params.Slot`,
    :class:`~swapper.zero.sharded.state.ShardSlot`)."""

    name: str
    param: nn.Parameter
    dtype: torch.dtype


def _saved_hooks_enabled() -> bool:
    # (no stub for it in torch 2.13's torch/_C/_autograd.pyi)
    return bool(getattr(_autograd, "_saved_tensors_hooks_is_enabled")())  # noqa: B009


class SavedParamError(SwapError, RuntimeError):
    """A saved view of an offloaded parameter cannot be kept or given back safely."""


class _ParamView:
    """What is saved instead of a view of a parameter's block: where it lies in it."""

    __slots__ = ("offset", "size", "slot", "stride")

    def __init__(self, slot: Any, offset: int, size: torch.Size, stride: tuple[int, ...]):
        self.slot = slot
        self.offset = offset  # elements from the start of the parameter's data
        self.size = size
        self.stride = stride


class _Outer:
    """A tensor packed by the hooks that were on top when ours were pushed."""

    __slots__ = ("unpack", "value")

    def __init__(self, unpack: Callable[[Any], torch.Tensor], value: Any):
        self.unpack = unpack
        self.value = value


def _unpack_for(held: Callable[[Any], bool]) -> Callable[[Any], torch.Tensor]:
    def unpack(packed: Any) -> torch.Tensor:
        kind = type(packed)
        if kind is _ParamView:
            slot = packed.slot
            if not held(slot):
                raise SavedParamError(
                    f"offload: the backward needs a view of parameter {slot.name!r} that "
                    "autograd saved in its module's forward, but the parameter is not "
                    "fetched now (used outside that module's backward, e.g. a view of the "
                    "weight the module returned): compute it inside the module, or use "
                    "budgets that hold every parameter"
                )
            data = slot.param.data
            offset = data.storage_offset() + packed.offset
            return data.as_strided(packed.size, packed.stride, offset)
        if kind is _Outer:
            return packed.unpack(packed.value)
        return packed

    return unpack


def _ranges(slots: Iterable[SlotLike]) -> list[tuple[int, int, torch.device, SlotLike]]:
    """(start, end) in bytes of each parameter's block now, its device, the slot."""
    ranges = []
    for slot in slots:
        param = slot.param
        start = param.data_ptr()
        ranges.append((start, start + param.numel() * param.element_size(), param.device, slot))
    return ranges


def _pack_for(
    ranges: Callable[[], list[tuple[int, int, torch.device, SlotLike]]], outer: Hooks | None
) -> Callable[[torch.Tensor], Any]:
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(tensor: torch.Tensor) -> Any:
        if tensor.layout is torch.strided and not tensor.is_meta:
            ptr = tensor.data_ptr()
            for start, end, device, slot in ranges():
                if start <= ptr < end and tensor.device == device:
                    return _locate(tensor, ptr - start, end - start, slot)
        if outer_pack is None:
            return tensor
        return _Outer(outer_unpack, outer_pack(tensor))  # type: ignore[arg-type]

    return pack


def _locate(tensor: torch.Tensor, byte_offset: int, nbytes: int, slot: SlotLike) -> Any:
    """The :class:`_ParamView` of ``tensor`` (its memory starts ``byte_offset`` bytes into
    the slot's block of ``nbytes``); a copy where it cannot be one (another dtype, not
    within the block): right values, outside the budget, never a reference to the block."""
    itemsize = slot.dtype.itemsize
    size, stride = tensor.size(), tensor.stride()
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True) if n > 0)
    offset, rest = divmod(byte_offset, itemsize)
    if (
        tensor.dtype == slot.dtype
        and not rest
        and tensor.numel()
        and (offset + extent) * itemsize <= nbytes
    ):
        return _ParamView(slot, offset, size, stride)
    return tensor.clone()


def _check_enabled() -> None:
    if not _saved_hooks_enabled():
        raise SavedParamError(
            "offload: saved-tensor hooks are disabled here ("
            f"{_autograd._saved_tensors_hooks_get_disabled_error_message()}); "
            "with budgets that cannot hold every parameter the forward needs them to "
            "keep autograd from saving views of parameter blocks that are given to "
            "other tensors before the backward: enable them, or raise the budget of the "
            "tier parameters are used in to hold every parameter"
        )


class SavedParams:
    """The saved-tensor hooks of one wrapped model's module forwards (see the module
    docstring). Used on the thread that runs the forward (the hooks' stack is
    thread-local), by the module hooks of :class:`~swapper.zero.local.offload.OffloadedModel`.
    """

    def __init__(self, held: Callable[[Any], bool]) -> None:
        """``held(slot)``: whether the slot's parameter is fetched now (its ``.data`` the
        block the backward may read)."""
        self._unpack = _unpack_for(held)
        #: (forward depth, pack hook) of each pair pushed and not popped yet, innermost last
        self._pushed: list[tuple[int, Callable[[torch.Tensor], Any]]] = []
        #: the pack hooks of the :meth:`around` pairs in force
        self._around: list[Callable[[torch.Tensor], Any]] = []

    def push(self, depth: int, slots: Sequence[SlotLike]) -> None:
        """Push the hooks for the forward at ``depth`` (its index among the forwards that
        run now), whose pre-hook fetched ``slots`` (their ``.data`` are the blocks now).

        Raises:
            SavedParamError: saved-tensor hooks are disabled (e.g. by
                ``torch.autograd.graph.disable_saved_tensors_hooks``).
        """
        _check_enabled()
        ranges = _ranges(slots)
        pack = _pack_for(lambda: ranges, _top(False))
        _push(pack, self._unpack)
        self._pushed.append((depth, pack))

    def pop_from(self, depth: int) -> None:
        """Pop the hooks pushed for the forwards at ``depth`` and deeper (the forward at
        ``depth`` ends; deeper ones were abandoned). A pair found not on top (hooks pushed
        above it and never popped) is left there: popping would remove another's."""
        pushed = self._pushed
        while pushed and pushed[-1][0] >= depth:
            _, pack = pushed.pop()
            top = _top(False)
            if top is not None and top[0] is pack:
                _pop()

    @contextlib.contextmanager
    def around(self, held_now: Callable[[], Iterable[SlotLike]]) -> Iterator[None]:
        """The hooks around a whole forward, for the parameters ``held_now()`` gives at
        each save (those of the modules whose forward runs then): the sharded path
        (:mod:`swapper.zero.sharded.model`), whose module hooks do not run when a module's
        forward raises, so a pair pushed per module could be left on the stack.

        Raises:
            SavedParamError: as :meth:`push`.
        """
        _check_enabled()
        pack = _pack_for(lambda: _ranges(held_now()), _top(False))
        self._around.append(pack)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
                yield
        finally:
            self._around.remove(pack)

    def ours_on_top(self) -> bool:
        """Whether the saved-tensor hooks on top now are ours (a pair of :meth:`around`
        or :meth:`push`); False inside a non-reentrant checkpoint's region (its pair is
        innermost there, in the forward and in the recompute), or another's."""
        top = _top(False)
        if top is None:
            return False
        pack = top[0]
        return any(pack is p for p in self._around) or any(pack is p for _, p in self._pushed)
