# Size: ~640 lines: discovery (the probe), the layout, the update (in cache-sized parts) and
# the per-piece memory of one rule share its spec types and refusals; split, each half would
# import the other.
"""Any ``torch.optim.Optimizer`` as an :class:`~swapper.step.rules.base.UpdateRule`: the update
of a sub-group is the optimizer class's own ``step`` (its ``foreach``/``fused`` code
where it has one) run on fp32 views of the sub-group's master weights, gradient and state.

Discovery, not declaration by hand (:func:`discover`): before anything is written, one
parameter of each distinct shape of each param group is stepped twice by a throw-away
instance of the class (fp32 zeros, a gradient of ones), and its ``state`` inspected:

- a 0-dim tensor (``step``, NAdam's ``mu_product``, ASGD's ``eta``) is *scalar* state,
  kept in memory per parameter piece (:class:`ScalarStates`);
- an fp32 tensor of the parameter's shape is an *element* row (element-wise optimizers:
  a row of the sub-group's state, split with the parameter);
- any other fp32 tensor (Adafactor's ``row_var``/``col_var``), or any tensor at all when
  the optimizer is not element-wise, is *per-parameter* state, laid after the rows in
  the shape the optimizer made;
- anything else (a float, None, another dtype, a shape that changes from the first
  step to the second, a sparse gradient demanded, a closure demanded) is refused with
  :class:`UnsupportedOptimizerError`, naming the class and the key.

The probe costs one parameter of each distinct shape in fp32 with its state, once.

A step of a sub-group (:meth:`TorchRule.update`): a private instance of the class per
param group (made once) gets, as its one param group, the sub-group's pieces as fp32
views of the master row (a split piece flat, a whole parameter in its shape; an
element-wise single-tensor update on one thread gets each piece in flat parts of
:data:`CHUNK_NUMEL` elements, each with a copy of the piece's 0-dim state, checked equal
after) with their ``.grad`` views of the fp32 gradient, the group's hyper-parameters of
this step, and as ``state`` the views of the stored rows plus the scalars from memory;
``step()`` updates them in place. An entry the optimizer replaced instead of updating is
copied back; an entry whose shape or dtype changed is refused (:class:`StateLayoutError`).
A piece never stepped gets no state, so that the class initialises it as it would (SGD's
momentum buffer is the first gradient, not zeros); one the class initialises at
construction (Adagrad's ``sum``) is initialised so at set-up (:meth:`TorchRule.initial`).

Parity: the reference is the same class over fp32 master copies in memory. PyTorch's
element-wise CPU kernels give each element the same bits whatever tensor it is in, so a
parameter split across two sub-groups steps bit-identically (tests/test_offload_optimizer.py
checks every optimizer of the matrix); a non-element-wise update gets each parameter whole.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from swapper.step.compress import MomentCodec
from swapper.step.layout import Piece, SubGroup, plan_sub_groups, plan_whole_sub_groups
from swapper.step.rules.base import StateRow, UpdateRule
from tiers.errors import SwapConfigError

__all__ = [
    "NOT_ELEMENTWISE",
    "ParamSpec",
    "ScalarStates",
    "StateLayoutError",
    "TorchRule",
    "UnsupportedOptimizerError",
    "check_optimizer_class",
    "discover",
    "init_kwargs",
]

#: Classes whose update reads a whole parameter at once (their state is kept per
#: parameter, each parameter whole in one sub-group), by name.
NOT_ELEMENTWISE = frozenset({"Adafactor", "Muon"})

#: Elements per part an element-wise single-tensor update on one intra-op thread is cut
#: into (1 MiB of fp32 a row). Such an update (NAdam, RAdam, RMSprop, ...) makes
#: several passes over the state with temporaries; over a whole 8M-element piece each pass
#: streams 32 MB a row from memory, over a 256K part the passes after the first read from
#: the cache. Measured on one thread, 8M elements (docs/notes/2026-11-29-optim-5.md, two
#: sittings under load 8 and 14): NAdam 161-169 -> 28-61 ms, RAdam 51-208 -> 34-59,
#: RMSprop 31-34 -> 12-23; SGD, Adagrad, ASGD, Adamax within the noise. The bits are the
#: same: each element's update reads only that element (a piece is already cut anywhere
#: across sub-groups), and the parts' 0-dim state is checked equal.
CHUNK_NUMEL = 1 << 18

#: Refused outright, with the reason.
_REFUSED = {
    "LBFGS": "it needs a closure that re-evaluates the model several times per step",
    "SparseAdam": "it needs sparse gradients; the tiers stream dense fp32 gradients",
}

#: Group keys that are the wrapper's, not the optimizer's hyper-parameters.
_NOT_HYPER = ("params", "param_names", "step")


class UnsupportedOptimizerError(SwapConfigError, TypeError):
    """An optimizer class (or its state) that cannot stream through the tiers."""


class StateLayoutError(TypeError):
    """The optimizer changed the shape or dtype of a state entry between steps (not an
    I/O failure: ``step()`` again would fail the same way, so not a SwapError)."""


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What the optimizer keeps for parameters of one shape in one param group.

    Attributes:
        element: names of state tensors of the parameter's shape, stored as rows.
        sections: ``(name, shape)`` of per-parameter state, in order.
        scalars: names of 0-dim state, kept in memory.
    """

    element: tuple[str, ...]
    sections: tuple[tuple[str, tuple[int, ...]], ...]
    scalars: tuple[str, ...]

    @property
    def section_numel(self) -> int:
        """fp32 elements of the per-parameter state."""
        return sum(_numel(shape) for _, shape in self.sections)


def _chunks(numel: int, chunk: int) -> Iterator[tuple[int, int]]:
    """``[start, stop)`` element ranges of ``numel`` elements in parts of ``chunk`` (one
    range when ``chunk`` is 0 or not smaller than ``numel``)."""
    if chunk <= 0 or numel <= chunk:
        yield 0, numel
        return
    for start in range(0, numel, chunk):
        yield start, min(start + chunk, numel)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_optimizer_class(optimizer_class: object) -> type[torch.optim.Optimizer]:
    """``optimizer_class`` if it is a ``torch.optim.Optimizer`` subclass that can stream.

    Raises:
        UnsupportedOptimizerError: not an Optimizer subclass, a swapper optimizer, or one
            of the classes refused by name (LBFGS: closure; SparseAdam: sparse gradients).
    """
    if not isinstance(optimizer_class, type) or not issubclass(
        optimizer_class, torch.optim.Optimizer
    ):
        raise UnsupportedOptimizerError(
            f"optimizer_class={optimizer_class!r} must be a torch.optim.Optimizer subclass "
            "(e.g. torch.optim.SGD), not an instance or another object"
        )
    from swapper.step.optimizer import StreamedOptimizer  # (a cycle at import time)

    if issubclass(optimizer_class, StreamedOptimizer):
        raise UnsupportedOptimizerError(
            f"{optimizer_class.__name__} already streams its state: use it directly"
        )
    reason = _REFUSED.get(optimizer_class.__name__)
    if reason is not None:
        raise UnsupportedOptimizerError(
            f"{optimizer_class.__name__} cannot stream its state through the tiers: {reason}"
        )
    return optimizer_class


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


def init_kwargs(
    optimizer_class: type[torch.optim.Optimizer], group: dict[str, Any]
) -> dict[str, Any]:
    """The hyper-parameters of ``group`` that ``optimizer_class``'s constructor takes (a
    group holds defaults some constructors do not take, e.g. AdamW's
    ``decoupled_weight_decay``); all of them if it takes ``**kwargs``."""
    parameters = inspect.signature(optimizer_class.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return _hyper(group)
    return {k: v for k, v in _hyper(group).items() if k in parameters}


def discover(
    optimizer_class: type[torch.optim.Optimizer],
    hyper: dict[str, Any],
    shape: torch.Size,
    *,
    elementwise: bool,
) -> ParamSpec:
    """The state ``optimizer_class`` keeps for one parameter of ``shape`` under the
    hyper-parameters ``hyper`` (module docstring: two probe steps).

    Raises:
        UnsupportedOptimizerError: the class needs a closure or sparse gradients, keeps
            non-tensor or non-fp32 state, changes a state entry's shape, or (element-wise)
            keeps a tensor of another shape than the parameter's; the class and the key
            are named.
    """
    name = optimizer_class.__name__
    probe = torch.zeros(shape, dtype=torch.float32)
    probe.grad = torch.ones_like(probe)
    try:
        instance = optimizer_class([probe], **init_kwargs(optimizer_class, hyper))
    except (TypeError, ValueError) as exc:
        raise UnsupportedOptimizerError(f"{name}({hyper}): {exc}") from None
    seen: list[dict[str, tuple[torch.dtype, tuple[int, ...]] | None]] = []
    for _ in range(2):
        try:
            with torch.no_grad():
                instance.step()
        except TypeError as exc:  # LBFGS-like: closure() called on None
            raise UnsupportedOptimizerError(
                f"{name}.step() failed without a closure ({exc}): an optimizer that "
                "needs a closure cannot stream its state"
            ) from None
        except RuntimeError as exc:
            if "sparse" in str(exc).lower():
                raise UnsupportedOptimizerError(
                    f"{name} needs sparse gradients ({exc}); the tiers stream dense ones"
                ) from None
            raise
        state = instance.state.get(probe, {})
        now: dict[str, tuple[torch.dtype, tuple[int, ...]] | None] = {}
        for key, value in state.items():
            if not isinstance(key, str):
                raise UnsupportedOptimizerError(f"{name}: state key {key!r} is not a string")
            if not isinstance(value, torch.Tensor):
                raise UnsupportedOptimizerError(
                    f"{name}: state {key!r} is a {type(value).__name__}, not a tensor: "
                    "only tensor state can stream through the tiers"
                )
            if value.is_sparse or value.dtype != torch.float32:
                raise UnsupportedOptimizerError(
                    f"{name}: state {key!r} is {value.dtype}"
                    f"{' (sparse)' if value.is_sparse else ''}; only dense torch.float32 "
                    "state (and 0-dim scalars) can stream through the tiers"
                )
            now[key] = None if value.dim() == 0 else (value.dtype, tuple(value.shape))
        seen.append(now)
    first, second = seen
    for key in set(first) | set(second):
        if first.get(key, "absent") != second.get(key, "absent"):
            raise UnsupportedOptimizerError(
                f"{name}: state {key!r} changed from {first.get(key, 'absent')} at the "
                f"first step to {second.get(key, 'absent')} at the second: state must "
                "keep its shape to be laid out in the tiers"
            )
    element: list[str] = []
    sections: list[tuple[str, tuple[int, ...]]] = []
    scalars: list[str] = []
    for key, spec in second.items():
        if spec is None:
            scalars.append(key)
        elif elementwise and spec[1] == tuple(shape):
            element.append(key)
        elif elementwise:
            raise UnsupportedOptimizerError(
                f"{name}: state {key!r} has shape {list(spec[1])}, the parameter "
                f"{list(shape)}: an optimizer with such state is not element-wise; pass "
                "elementwise=False"
            )
        else:
            sections.append((key, spec[1]))
    return ParamSpec(tuple(element), tuple(sections), tuple(scalars))


def _scalar(name: str, entry: str, item: object) -> torch.Tensor:
    """A 0-dim tensor from ``[value, dtype name]``.

    Raises:
        ValueError: ``item`` is not that (the optimizer and the entry named)."""
    value: object = None
    dtype: object = None
    if isinstance(item, (list, tuple)) and len(item) == 2:
        value, dtype_name = item[0], item[1]
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
    if (
        not isinstance(dtype, torch.dtype)
        or isinstance(value, bool)
        or not isinstance(value, (int, float))
    ):
        raise ValueError(f"{name}: scalar state {entry!r} = {item!r} is not [value, dtype]")
    return torch.tensor(value, dtype=dtype)


class ScalarStates:
    """0-dim state per parameter piece, in memory: ``(sub-group, piece position) →
    {name: tensor}``; a piece is *started* once the optimizer has made its state."""

    def __init__(self) -> None:
        self.values: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.started: set[tuple[int, int]] = set()

    def clear(self, key: tuple[int, int]) -> None:
        """Forget ``key``'s state (never stepped again)."""
        self.values.pop(key, None)
        self.started.discard(key)


class TorchRule(UpdateRule):
    """The update rule of ``optimizer_class`` (module docstring).

    Args:
        optimizer_class: a checked class (:func:`check_optimizer_class`).
        elementwise: whether the update treats each element on its own (then a parameter
            may be split across sub-groups and same-shape state is stored as rows).
        specs: per param group, per parameter, what its state is (:func:`discover`).
        shapes: per param group, per parameter, its shape.
        hypers: per param group, the hyper-parameters to make the private instance with.
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        *,
        elementwise: bool,
        specs: Sequence[Sequence[ParamSpec]],
        shapes: Sequence[Sequence[torch.Size]],
        hypers: Sequence[dict[str, Any]],
    ) -> None:
        self.optimizer_class = optimizer_class
        self.name = optimizer_class.__name__.lower()
        self.elementwise = elementwise
        self.specs = [list(s) for s in specs]
        self.shapes = [list(s) for s in shapes]
        self.scalars = ScalarStates()
        self.element = self._element_rows()
        self._instances = [self._instance(h) for h in hypers]

    def _element_rows(self) -> tuple[str, ...]:
        """The element rows, alike for every parameter (element-wise); else none."""
        names: tuple[str, ...] | None = None
        for group in self.specs:
            for spec in group:
                if names is None:
                    names = spec.element
                elif spec.element != names:
                    raise UnsupportedOptimizerError(
                        f"{self.optimizer_class.__name__}: parameters keep different "
                        f"element-wise state ({list(names)} and {list(spec.element)}); "
                        "pass elementwise=False"
                    )
        return names or ()

    def _instance(self, hyper: dict[str, Any]) -> torch.optim.Optimizer:
        placeholder = torch.zeros(1)
        instance = self.optimizer_class([placeholder], **init_kwargs(self.optimizer_class, hyper))
        instance.state = collections.defaultdict(dict)
        instance.param_groups[0]["params"] = []
        return instance

    # -- the rule ------------------------------------------------------------------------

    def state_rows(self) -> tuple[StateRow, ...]:
        rows = [StateRow("master")] + [StateRow(n) for n in self.element]
        seen = set(self.element)
        for group in self.specs:
            for spec in group:
                for key, _ in spec.sections:
                    if key not in seen:
                        seen.add(key)
                        rows.append(StateRow(key, per="parameter"))
        return tuple(rows)

    def plan(
        self, group_numels: Sequence[Sequence[int]], sub_group_numel: int, moments: str
    ) -> list[SubGroup]:
        if moments != "fp32":
            raise SwapConfigError(
                f"StepConfig.moments={moments!r} applies to OffloadAdamW only; "
                f"{self.optimizer_class.__name__}'s state is stored in fp32"
            )
        rows = 1 + len(self.element)
        if self.elementwise:
            return plan_sub_groups(group_numels, sub_group_numel, rows=rows)
        extras = [[spec.section_numel for spec in group] for group in self.specs]
        return plan_whole_sub_groups(group_numels, sub_group_numel, rows=rows, extra_numels=extras)

    def _views(
        self, sg: SubGroup, state: torch.Tensor, position: int, piece: Piece
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the piece's master as a parameter, its tensor state by name), fp32 views."""
        flat = state.view(-1)
        p = sg.padded_numel
        shape = self.shapes[sg.group_index][piece.param_index]
        whole = piece.param_offset == 0 and piece.numel == _numel(shape)
        view_shape = tuple(shape) if whole else (piece.numel,)
        span = slice(piece.offset, piece.offset + piece.numel)
        master = flat[:p][span].view(view_shape)
        tensors = {
            name: flat[(i + 1) * p : (i + 2) * p][span].view(view_shape)
            for i, name in enumerate(self.element)
        }
        if sg.extra_numel:
            cursor = sg.rows * p + sum(
                self.specs[sg.group_index][q.param_index].section_numel
                for q in sg.pieces[:position]
            )
            for name, section in self.specs[sg.group_index][piece.param_index].sections:
                n = _numel(section)
                tensors[name] = flat[cursor : cursor + n].view(section)
                cursor += n
        return master, tensors

    def initial(self, sg: SubGroup, state: torch.Tensor, groups: Sequence[dict[str, Any]]) -> None:
        """What the class initialises at construction (Adagrad's ``sum``), per piece."""
        hyper = init_kwargs(self.optimizer_class, groups[sg.group_index])
        for position, piece in enumerate(sg.pieces):
            self.scalars.clear((sg.index, position))
            master, tensors = self._views(sg, state, position, piece)
            instance = self.optimizer_class([master], **hyper)
            made = instance.state.get(master)
            if made:
                self._keep(sg, position, tensors, made)

    def update(
        self,
        sg: SubGroup,
        state: torch.Tensor,
        grad: torch.Tensor,
        group: dict[str, Any],
        step: int,
        codec: MomentCodec,
        *,
        absent: frozenset[int] = frozenset(),
    ) -> None:
        del step, codec  # (the class counts its own steps; its state is fp32)
        instance = self._instances[sg.group_index]
        own = instance.param_groups[0]
        own.update(_hyper(group))
        chunk = self._chunk_numel(own)
        units: list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]] = []
        state_of = collections.defaultdict(dict)
        for position, piece in enumerate(sg.pieces):
            if position in absent:
                continue  # no gradient: torch.optim skips the parameter (state, step)
            master, tensors = self._views(sg, state, position, piece)
            piece_grad = grad[piece.offset : piece.offset + piece.numel]
            key = (sg.index, position)
            started = key in self.scalars.started
            scalars = self.scalars.values.get(key, {})
            spec = self.specs[sg.group_index][piece.param_index]
            for start, stop in _chunks(piece.numel, chunk if not spec.sections else 0):
                if stop - start == piece.numel:  # whole: in its shape, the stored scalars
                    part, part_tensors, part_scalars = master, tensors, scalars
                    part.grad = piece_grad.view(master.shape)
                else:  # a cache-sized part: flat views, a copy of the scalars each
                    part = master.view(-1)[start:stop]
                    part_tensors = {k: v.view(-1)[start:stop] for k, v in tensors.items()}
                    part_scalars = {k: v.clone() for k, v in scalars.items()}
                    part.grad = piece_grad[start:stop]
                units.append((position, part, part_tensors))
                if started:
                    state_of[part] = {**part_tensors, **part_scalars}
        if not units:
            return
        own["params"] = [part for _, part, _ in units]
        instance.state = state_of
        try:
            instance.step()
            first: dict[int, dict[str, torch.Tensor]] = {}
            for position, part, tensors in units:
                made = instance.state.get(part, {})
                self._keep(sg, position, tensors, made)
                scalars = self.scalars.values[(sg.index, position)]
                if position not in first:
                    first[position] = scalars
                else:
                    self._same_scalars(first[position], scalars)
                    self.scalars.values[(sg.index, position)] = first[position]
        finally:
            for _, part, _ in units:
                part.grad = None
            own["params"] = []
            instance.state = collections.defaultdict(dict)

    def _chunk_numel(self, group: dict[str, Any]) -> int:
        """Elements per part a piece's update is cut into, or 0 for none (see
        :data:`CHUNK_NUMEL`): element-wise updates of the single-tensor kind only (a fused
        kernel is one pass already; a ``foreach`` update runs op by op over all the parts,
        so parts would only add calls), on one intra-op thread only. On more, every op of
        every part ends with the threads joining, and on a busy machine a descheduled
        thread makes each join wait: NAdam's compute at 64M on 2 threads took 6.4-10.9 s
        in parts against 1.8-2.9 s whole and 0.42 s in parts on one thread
        (docs/notes/2026-11-29-optim-5.md). The step's update runs on one thread on a
        2-core machine (:meth:`~swapper.step.update.SubGroupMath.update_threads`)."""
        if not self.elementwise or group.get("fused") or group.get("foreach"):
            return 0
        return CHUNK_NUMEL if torch.get_num_threads() == 1 else 0

    def _same_scalars(self, first: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> None:
        """The parts of one piece must leave the same 0-dim state (element-wise).

        Raises:
            StateLayoutError: they differ (the update reads more than each element).
        """
        for entry, value in first.items():
            if not torch.equal(value, other[entry]):
                raise StateLayoutError(
                    f"{self.optimizer_class.__name__}: scalar state {entry!r} differs between "
                    "parts of one parameter stepped apart; its update is not element-wise: "
                    "construct OffloadOptimizer(..., elementwise=False)"
                )

    def _keep(
        self,
        sg: SubGroup,
        position: int,
        tensors: dict[str, torch.Tensor],
        made: dict[str, Any],
    ) -> None:
        """Check what the class left in a piece's state against the layout; copy what it
        replaced into the stored views; keep the scalars.

        Raises:
            StateLayoutError: an entry is missing, new, or changed shape or dtype.
        """
        name = self.optimizer_class.__name__
        key = (sg.index, position)
        scalars: dict[str, torch.Tensor] = {}
        spec = self.specs[sg.group_index][sg.pieces[position].param_index]
        expected = set(tensors) | set(spec.scalars)
        if set(made) != expected:
            raise StateLayoutError(
                f"{name}: the state of a parameter has entries {sorted(made)}, laid out as "
                f"{sorted(expected)} at the first step: state must keep its entries"
            )
        for entry, value in made.items():
            if not isinstance(value, torch.Tensor):
                raise StateLayoutError(f"{name}: state {entry!r} became a {type(value).__name__}")
            if entry in spec.scalars:
                if value.dim() != 0:
                    raise StateLayoutError(
                        f"{name}: state {entry!r} changed from a 0-dim scalar to shape "
                        f"{list(value.shape)}"
                    )
                scalars[entry] = value
                continue
            view = tensors[entry]
            if value.shape != view.shape or value.dtype != view.dtype:
                raise StateLayoutError(
                    f"{name}: state {entry!r} is {value.dtype} of shape {list(value.shape)}; "
                    f"it was laid out as {view.dtype} of shape {list(view.shape)}"
                )
            if value.data_ptr() != view.data_ptr():  # replaced, not updated in place
                view.copy_(value)
        self.scalars.values[key] = scalars
        self.scalars.started.add(key)

    def entries(
        self, sg: SubGroup, state: torch.Tensor
    ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        for position, piece in enumerate(sg.pieces):
            master, tensors = self._views(sg, state, position, piece)
            yield position, {"master": master, **tensors}

    def bytes_per_element(self, moments: str) -> float:
        del moments
        return 4.0 * (1 + len(self.element))

    def parameter_shapes(self, sg: SubGroup, position: int) -> dict[str, tuple[int, ...]]:
        spec = self.specs[sg.group_index][sg.pieces[position].param_index]
        return dict(spec.sections)

    def piece_entries(
        self, sg: SubGroup, state: torch.Tensor, position: int
    ) -> dict[str, torch.Tensor]:
        master, tensors = self._views(sg, state, position, sg.pieces[position])
        return {"master": master, **tensors}

    #: the pieces' scalars and whether each was stepped (module docstring)
    keeps_piece_memory = True

    def piece_memory(self, sg: SubGroup, position: int) -> dict[str, Any]:
        """``{}`` for a piece never stepped; else ``{"scalars": {name: [value, dtype]}}``
        (a 0-dim tensor's value as a Python float: exact for fp32 and fp64)."""
        key = (sg.index, position)
        if key not in self.scalars.started:
            return {}
        entries = self.scalars.values.get(key, {})
        return {
            "scalars": {
                name: [float(value.item()), str(value.dtype).removeprefix("torch.")]
                for name, value in entries.items()
            }
        }

    def set_piece_memory(self, sg: SubGroup, position: int, memory: dict[str, Any]) -> None:
        name = self.optimizer_class.__name__
        key = (sg.index, position)
        if not memory:
            self.scalars.clear(key)
            return
        scalars = memory.get("scalars") if isinstance(memory, dict) else None
        if set(memory) != {"scalars"} or not isinstance(scalars, dict):
            raise ValueError(f"{name}: piece state {memory!r} is not {{'scalars': {{...}}}}")
        spec = self.specs[sg.group_index][sg.pieces[position].param_index]
        if set(scalars) != set(spec.scalars):
            raise ValueError(
                f"{name}: scalar state {sorted(scalars)} given, this optimizer keeps "
                f"{sorted(spec.scalars)} (another optimizer's checkpoint?)"
            )
        values = {entry: _scalar(name, entry, item) for entry, item in scalars.items()}
        self.scalars.values[key] = values
        self.scalars.started.add(key)

    def saved(self) -> object | None:
        """The pieces stepped and their scalars: ``{"started": [[sub-group, piece], ...],
        "scalars": [[sub-group, piece, name, value, dtype], ...]}`` (a 0-dim tensor's value
        as a Python float: exact for fp32 and fp64)."""
        scalars = [
            [sg, pos, name, float(value.item()), str(value.dtype).removeprefix("torch.")]
            for (sg, pos), entries in sorted(self.scalars.values.items())
            for name, value in entries.items()
        ]
        return {
            "started": sorted([sg, pos] for sg, pos in self.scalars.started),
            "scalars": scalars,
        }

    def restore(self, saved: object | None) -> Callable[[], None]:
        name = self.optimizer_class.__name__
        if not isinstance(saved, dict) or set(saved) != {"started", "scalars"}:
            raise ValueError(f"{name}: the snapshot records {saved!r}, not this rule's state")
        started: set[tuple[int, int]] = set()
        for item in saved["started"]:
            if not (
                isinstance(item, list) and len(item) == 2 and all(type(x) is int for x in item)
            ):
                raise ValueError(f"{name}: started piece {item!r} is not [sub-group, piece]")
            started.add((item[0], item[1]))
        values: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for item in saved["scalars"]:
            ok = isinstance(item, list) and len(item) == 5
            dtype = getattr(torch, item[4], None) if ok and isinstance(item[4], str) else None
            if (
                not ok
                or not isinstance(dtype, torch.dtype)
                or not isinstance(item[3], (int, float))
            ):
                raise ValueError(
                    f"{name}: scalar state {item!r} is not [sg, piece, name, value, dtype]"
                )
            values.setdefault((item[0], item[1]), {})[item[2]] = torch.tensor(item[3], dtype=dtype)

        def apply() -> None:
            self.scalars.values = values
            self.scalars.started = started

        return apply
