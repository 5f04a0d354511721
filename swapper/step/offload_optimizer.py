# Size: ~520 lines: the class, its state dict in the class's format (ParamStates) and the
# named table the tools size budgets from share the discovery of the state layout.
"""``OffloadOptimizer(torch.optim.X, params, tiers=...)``: any PyTorch optimizer over
16-bit parameters whose fp32 master weights and state stream from the tiers.

The streaming (sub-groups, read-ahead, write-behind, fp32 gradients built from the
retained 16-bit ones, clipping, fp16 loss scaling, the overlapped step) is
:class:`~swapper.step.optimizer.StreamedOptimizer`'s, as for ``OffloadAdamW``; the update
of a sub-group is ``X.step`` itself on fp32 views (:mod:`swapper.step.rules.torch_optim`).

State dicts are ``X``'s format (``{"state": {param index: {name: tensor}},
"param_groups": [...]}``), the state streamed a parameter at a time when looked up: one
saved here loads into ``X`` over the same parameters' fp32 masters, and back, bit-exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from swapper.manager import ManagerConfig, TierManager
from swapper.step.config import StepConfig
from swapper.step.layout import SubGroup
from swapper.step.optimizer import StreamedOptimizer
from swapper.step.pipeline import PipelineClosedError
from swapper.step.rules.base import UpdateRule
from swapper.step.rules.torch_optim import (
    NOT_ELEMENTWISE,
    ParamSpec,
    TorchRule,
    UnsupportedOptimizerError,
    check_optimizer_class,
    discover,
    init_kwargs,
)
from swapper.step.scaler import DynamicLossScaler
from swapper.step.sources import SharedStep, TieredModel, WholeSource
from swapper.step.state import StateDictError, load_groups, saved_groups
from tiers.errors import SwapConfigError

__all__ = [
    "NAMED",
    "OffloadOptimizer",
    "ParamStates",
    "make_optimizer",
    "plan_named",
    "state_nbytes_per_element",
]

#: ``--optimizer NAME`` of the command-line tools and DeepSpeed's ``optimizer.type``:
#: name → (``torch.optim`` class, its settings besides ``lr``). ``adamw`` is
#: :class:`~swapper.step.OffloadAdamW` (the fused kernel), not in this table.
NAMED: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"momentum": 0.9}),
    # fused: PyTorch's one-pass CPU kernel; the default (single-tensor) Adam makes five
    # passes over the state with temporaries, ~4x the CPU time, which on a small
    # machine the I/O threads then lack (docs/notes/2026-11-28-optim-3.md)
    "adam": (torch.optim.Adam, {"fused": True}),
    "nadam": (torch.optim.NAdam, {}),
    "radam": (torch.optim.RAdam, {}),
    "adamax": (torch.optim.Adamax, {}),
    "adagrad": (torch.optim.Adagrad, {}),
    "rmsprop": (torch.optim.RMSprop, {}),
    "asgd": (torch.optim.ASGD, {}),
    "adafactor": (torch.optim.Adafactor, {}),
}

_NOT_SAVED = ("params", "param_names", "step")


class OffloadOptimizer(StreamedOptimizer):
    """``optimizer_class`` over 16-bit parameters, its fp32 master weights and state in
    the tiers; bit-identical to ``optimizer_class`` over fp32 master copies in memory.

    Use it as ``optimizer_class``: ``loss.backward()``, ``step()``, ``zero_grad()``; lr
    schedulers change ``param_groups`` as usual. A parameter whose ``.grad`` is None at
    a step is skipped, as ``optimizer_class`` skips it (no update, no state made or
    advanced; :class:`~swapper.step.OffloadAdamW` steps it with a zero gradient).

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` subclass with per-parameter tensor
            state (``torch.optim.SGD``, ``Adam``, ``Adagrad``, ``Adafactor``, a
            third-party one).
        params: 16-bit contiguous tensors or param groups, as for ``optimizer_class``.
        tiers, config, loss_scaler: as :class:`~swapper.step.OffloadAdamW`'s
            (``config.moments`` must stay fp32).
        elementwise: whether ``optimizer_class``'s update treats every element on its own
            (a parameter may then be split across sub-groups). ``None``: yes, except for
            Adafactor and Muon; a state tensor of another shape than its parameter's
            needs ``False``.
        optimizer_kwargs: ``optimizer_class``'s hyper-parameters (``lr=...``,
            ``momentum=...``), its defaults for every group.

    Raises:
        UnsupportedOptimizerError: ``optimizer_class`` is not an Optimizer subclass, needs
            a closure (LBFGS) or sparse gradients (SparseAdam), or keeps non-tensor,
            non-fp32 or shape-changing state (class and key named); raised before anything
            is stored.
        SwapConfigError: a hyper-parameter ``optimizer_class`` refuses (its message), or
            what :class:`~swapper.step.OffloadAdamW` refuses.
    """

    def __init__(
        self,
        optimizer_class: type[torch.optim.Optimizer],
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        tiers: TierManager | ManagerConfig | TieredModel,
        config: StepConfig | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        elementwise: bool | None = None,
        **optimizer_kwargs: Any,
    ) -> None:
        cls = check_optimizer_class(optimizer_class)
        try:
            defaults = dict(cls([torch.zeros(1)], **optimizer_kwargs).defaults)
        except (TypeError, ValueError) as exc:
            raise SwapConfigError(f"{cls.__name__}({optimizer_kwargs}): {exc}") from None
        self.optimizer_class = cls
        self.elementwise = (
            cls.__name__ not in NOT_ELEMENTWISE if elementwise is None else elementwise
        )
        super().__init__(
            params, defaults, rule=None, tiers=tiers, config=config, loss_scaler=loss_scaler
        )

    def _check_group(self, group: dict[str, Any]) -> None:
        try:
            self.optimizer_class([torch.zeros(1)], **init_kwargs(self.optimizer_class, group))
        except (TypeError, ValueError) as exc:
            name = self.optimizer_class.__name__
            raise SwapConfigError(
                f"param group {self.param_groups.index(group)}: {name}: {exc}"
            ) from None

    def _make_rule(self) -> UpdateRule:
        specs: list[list[ParamSpec]] = []
        shapes: list[list[torch.Size]] = []
        hypers: list[dict[str, Any]] = []
        for g, group in enumerate(self.param_groups):
            hyper = {k: v for k, v in group.items() if k not in _NOT_SAVED}
            known: dict[torch.Size, ParamSpec] = {}
            if not self.elementwise:  # a parameter another rank owns whole: no state here
                known[torch.Size([0])] = ParamSpec((), (), ())
            group_shapes = [self._shape(g, i, p) for i, p in enumerate(group["params"])]
            for shape in group_shapes:
                if shape not in known:
                    known[shape] = discover(
                        self.optimizer_class, hyper, shape, elementwise=self.elementwise
                    )
            specs.append([known[s] for s in group_shapes])
            shapes.append(group_shapes)
            hypers.append(hyper)
        return TorchRule(
            self.optimizer_class,
            elementwise=self.elementwise,
            specs=specs,
            shapes=shapes,
            hypers=hypers,
        )

    def _shape(self, g: int, i: int, param: torch.Tensor) -> torch.Size:
        """The shape the update sees of parameter ``i`` of group ``g``: its local part (a
        flat shard over ranks) for an element-wise optimizer; else the whole parameter,
        which over ranks this rank must own whole.

        Raises:
            UnsupportedOptimizerError: not element-wise, over ranks, and the parameter is
                sharded (the setting that avoids it is named).
        """
        if self.elementwise or not isinstance(self._source, SharedStep):
            return self._source.shape(param)
        whole = self._source.whole_shape(param) if isinstance(self._source, WholeSource) else None
        if whole is None:
            raise UnsupportedOptimizerError(
                f"{self.optimizer_class.__name__} is not element-wise (it needs each "
                f"parameter whole, in its shape) and parameter {i} of param group {g} "
                f"({list(self._source.shape(param))} elements here) is sharded over the "
                "ranks: wrap the model with OffloadConfig(distributed=DistributedConfig("
                "ownership='contiguous')), which gives every parameter to one rank whole"
            )
        return whole

    def _grown_rule(self, rule: UpdateRule) -> UpdateRule:
        """A rule over every group (the new one's shapes discovered), with a copy of what
        the old one holds in memory (the pieces' scalars: the sub-groups before keep
        their numbers). A copy: if the new group's set-up fails, the old rule is put
        back as it was, without the new pieces' scalars."""
        grown = self._make_rule()
        if isinstance(rule, TorchRule) and isinstance(grown, TorchRule):
            grown.scalars.values = dict(rule.scalars.values)
            grown.scalars.started = set(rule.scalars.started)
        return grown

    @property
    def torch_rule(self) -> TorchRule:
        """The update rule (discovered state layout, scalars in memory)."""
        rule = self.rule
        if not isinstance(rule, TorchRule):  # pragma: no cover - set by _make_rule
            raise TypeError("OffloadOptimizer's rule is a TorchRule")
        return rule

    # -- state dicts in optimizer_class's format -------------------------------------------

    def _pieces_of(self) -> dict[tuple[int, int], list[tuple[SubGroup, int]]]:
        """(group, param index) → its (sub-group, piece position)s, in flat order."""
        where: dict[tuple[int, int], list[tuple[SubGroup, int]]] = {}
        for sg in self.sub_groups:
            for position, piece in enumerate(sg.pieces):
                where.setdefault((sg.group_index, piece.param_index), []).append((sg, position))
        return where

    def state_dict(self) -> dict[str, Any]:
        """``optimizer_class``'s state dict: ``"state"`` maps a parameter's index (over
        all groups, in order) to its state, read from the tiers on each lookup (a
        parameter never stepped has none); ``"param_groups"`` its groups' settings.

        It reflects the optimizer at this call; a lookup after a later ``step()`` raises
        :class:`StateDictError`.
        """
        self.wait_pending()
        groups = saved_groups(self.param_groups, skip=("step",))
        return {"state": ParamStates(self), "param_groups": groups}

    def _flat_index(self) -> list[tuple[int, int]]:
        return [
            (g, i) for g, group in enumerate(self.param_groups) for i in range(len(group["params"]))
        ]

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load ``optimizer_class``'s state dict (from this class or from
        ``optimizer_class`` itself over the same parameters), one sub-group at a time,
        each durable before the next. Every tensor is checked before anything is written.

        Raises:
            StateDictError: not such a state dict, other parameters or groups, or a state
                entry missing, unknown, or of another shape or dtype (named).
            SwapIOError: writing a sub-group failed; ``step()`` refuses until a load succeeds.
        """
        if not isinstance(state_dict, Mapping) or not {"state", "param_groups"} <= set(state_dict):
            raise StateDictError("not an optimizer state dict (needs 'state' and 'param_groups')")
        groups = state_dict["param_groups"]
        states = state_dict["state"]
        if not isinstance(groups, (list, tuple)) or len(groups) != len(self.param_groups):
            raise StateDictError(
                f"state dict has {len(groups) if isinstance(groups, (list, tuple)) else '?'} "
                f"param group(s), this optimizer {len(self.param_groups)}"
            )
        for g, (saved, group) in enumerate(zip(groups, self.param_groups, strict=True)):
            if not isinstance(saved, Mapping) or len(saved.get("params", ())) != len(
                group["params"]
            ):
                raise StateDictError(
                    f"state dict: param group {g} has another number of parameters than "
                    f"this optimizer's ({len(group['params'])})"
                )
        if not isinstance(states, Mapping):
            raise StateDictError("state dict: 'state' must map parameter index to its state")
        flat = self._flat_index()
        rule = self.torch_rule
        checked: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        for index, entry in states.items():
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(flat):
                raise StateDictError(f"state dict: state key {index!r} is not a parameter index")
            g, i = flat[index]
            checked[(g, i)] = _checked_entry(
                entry, rule.specs[g][i], rule.shapes[g][i], index, rule.optimizer_class.__name__
            )
        if self._closed:
            raise PipelineClosedError("the optimizer is closed")
        self.wait_pending()
        if self._deferred is not None:
            self._deferred.forget_failed()  # the load replaces what it would finish
        self._load_incomplete = True  # from the first write until the last
        for sg in self.sub_groups:

            def fill(state: torch.Tensor, sg: SubGroup = sg) -> None:
                for position, tensors in rule.entries(sg, state):
                    piece = sg.pieces[position]
                    entry = checked.get((sg.group_index, piece.param_index))
                    key = (sg.index, position)
                    if entry is None:
                        for name, view in tensors.items():
                            if name != "master":
                                view.zero_()
                        rule.scalars.clear(key)
                        continue
                    spec = rule.specs[sg.group_index][piece.param_index]
                    for name in spec.element:
                        source = entry[name].reshape(-1)[
                            piece.param_offset : piece.param_offset + piece.numel
                        ]
                        tensors[name].copy_(source.view(tensors[name].shape))
                    for name, _ in spec.sections:
                        tensors[name].copy_(entry[name])
                    rule.scalars.values[key] = {n: entry[n].clone() for n in spec.scalars}
                    rule.scalars.started.add(key)

            self.stored_state.write(sg.index, fill, self._step_count)
        load_groups(self.param_groups, groups)
        self._pending = None
        self._load_incomplete = False


def _checked_entry(
    entry: object, spec: ParamSpec, shape: torch.Size, index: int, name: str
) -> dict[str, torch.Tensor]:
    """One parameter's saved state, checked against its layout (fp32 tensors)."""
    if not isinstance(entry, Mapping):
        raise StateDictError(f"state dict: the state of parameter {index} is not a mapping")
    expected: dict[str, tuple[int, ...]] = {n: tuple(shape) for n in spec.element}
    expected.update({n: s for n, s in spec.sections})
    expected.update({n: () for n in spec.scalars})
    if set(entry) != set(expected):
        raise StateDictError(
            f"state dict: parameter {index} has state {sorted(map(str, entry))}; {name} keeps "
            f"{sorted(expected)} for it here"
        )
    out: dict[str, torch.Tensor] = {}
    for key, want in expected.items():
        value = entry[key]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != want:
            got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise StateDictError(
                f"state dict: parameter {index}: {key!r} is {got}; expected shape {list(want)}"
            )
        if not value.is_floating_point():
            raise StateDictError(
                f"state dict: parameter {index}: {key!r} is {value.dtype}, not floating point"
            )
        out[key] = value if value.dim() == 0 else value.to(torch.float32)
    return out


class ParamStates(Mapping[int, dict[str, torch.Tensor]]):
    """The ``"state"`` of :meth:`OffloadOptimizer.state_dict`: parameter index → its
    state in ``optimizer_class``'s names and shapes, read from the tiers on each lookup
    (a copy). Only parameters the optimizer has stepped (or initialised) have one."""

    def __init__(self, optimizer: OffloadOptimizer) -> None:
        self._optimizer = optimizer
        self._step = optimizer.step_count
        self._where = optimizer._pieces_of()
        #: the sub-group read last (lookups in parameter order read each sub-group once)
        self._cached: tuple[int, torch.Tensor] | None = None
        self._flat = optimizer._flat_index()
        rule = optimizer.torch_rule
        self._keys = [
            i
            for i, at in enumerate(self._flat)
            if all((sg.index, pos) in rule.scalars.started for sg, pos in self._where.get(at, []))
            and at in self._where
        ]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        optimizer = self._optimizer
        if optimizer.step_count != self._step or optimizer._pending is not None:
            raise StateDictError(
                f"this state dict was taken at step {self._step}; the optimizer has moved "
                f"on (step {optimizer.step_count}): take a new one"
            )
        if index not in self._keys:
            raise KeyError(index)
        g, i = self._flat[index]
        rule = optimizer.torch_rule
        spec = rule.specs[g][i]
        shape = rule.shapes[g][i]
        out: dict[str, torch.Tensor] = {}
        element = {n: torch.empty(shape, dtype=torch.float32) for n in spec.element}
        for sg, position in self._where[(g, i)]:
            if self._cached is None or self._cached[0] != sg.index:
                self._cached = None  # (the old copy goes before the new one is read)
                self._cached = (sg.index, optimizer.stored_state.read(sg.index))
            state = self._cached[1]
            piece = sg.pieces[position]
            tensors = dict(rule.entries(sg, state))[position]
            for n in spec.element:
                element[n].view(-1)[piece.param_offset : piece.param_offset + piece.numel].copy_(
                    tensors[n].reshape(-1)
                )
            for n, _ in spec.sections:
                out[n] = tensors[n].clone()
            if position == self._where[(g, i)][0][1] and sg is self._where[(g, i)][0][0]:
                scalars = rule.scalars.values.get((sg.index, position), {})
                out.update({n: v.clone() for n, v in scalars.items()})
        out.update(element)
        return out

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __reduce__(self) -> tuple[Any, ...]:
        return (dict, (list(self.items()),))


__all__ += ["UnsupportedOptimizerError"]


def _named(name: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    entry = NAMED.get(name)
    if entry is None:
        raise SwapConfigError(
            f"optimizer {name!r} is not one of adamw, {', '.join(NAMED)} (lower case)"
        )
    return entry


def make_optimizer(
    name: str,
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    *,
    lr: float,
    tiers: TierManager | ManagerConfig | TieredModel,
    config: StepConfig | None = None,
    loss_scaler: DynamicLossScaler | None = None,
    **settings: Any,
) -> StreamedOptimizer:
    """The optimizer ``name`` (``adamw``: :class:`~swapper.step.OffloadAdamW`; else
    :data:`NAMED`'s class under :class:`OffloadOptimizer`, ``settings`` over its defaults).

    Raises:
        SwapConfigError: an unknown name (the known ones listed), or what the optimizer
            raises.
    """
    if name == "adamw":
        from swapper.step.optimizer import OffloadAdamW

        return OffloadAdamW(
            params, lr=lr, tiers=tiers, config=config, loss_scaler=loss_scaler, **settings
        )
    cls, defaults = _named(name)
    return OffloadOptimizer(
        cls, params, tiers=tiers, config=config, loss_scaler=loss_scaler,
        lr=lr, **{**defaults, **settings},
    )  # fmt: skip


def plan_named(
    name: str,
    shapes: list[int] | list[tuple[int, ...]],
    sub_group_numel: int,
    *,
    lr: float = 1e-4,
) -> list[SubGroup]:
    """The sub-groups ``make_optimizer(name, ...)`` lays one group of parameters of
    ``shapes`` (an int: a 1-D parameter of that many elements) out in (its state
    discovered; nothing stored): for sizing budgets before any optimizer is made.

    Raises:
        SwapConfigError: an unknown name.
    """
    sizes = [torch.Size([s]) if isinstance(s, int) else torch.Size(s) for s in shapes]
    numels = [s.numel() for s in sizes]
    if name == "adamw":
        from swapper.step.layout import plan_sub_groups

        return plan_sub_groups([numels], sub_group_numel)
    cls, defaults = _named(name)
    hyper = {"lr": lr, **defaults}
    elementwise = cls.__name__ not in NOT_ELEMENTWISE
    specs = {s: discover(cls, hyper, s, elementwise=elementwise) for s in set(sizes)}
    rule = TorchRule(
        cls,
        elementwise=elementwise,
        specs=[[specs[s] for s in sizes]],
        shapes=[sizes],
        hypers=[hyper],
    )
    return rule.plan([numels], sub_group_numel, "fp32")


#: The probe :func:`state_nbytes_per_element` discovers a class's state on (1-D, so that
#: per-parameter state such as Adafactor's is counted as its 1-D form: a full row).
_PROBE_NUMEL = 1024


def state_nbytes_per_element(
    optimizer: str | type[torch.optim.Optimizer] | None,
    *,
    moments: str = "fp32",
    **settings: Any,
) -> float:
    """Bytes of optimizer state the tiers hold per parameter element, master weights
    included: for sizing budgets and sub-groups before any optimizer is made.

    Args:
        optimizer: ``"adamw"`` or None (:class:`~swapper.step.OffloadAdamW`: 12, 8 with
            bf16 ``moments``, 6 with int8), a name of :data:`NAMED`, or a
            ``torch.optim.Optimizer`` class (4 B of master plus 4 B per state tensor of
            a parameter's shape it keeps, discovered on a 1-D probe; a class whose update
            is not element-wise counts its state on that probe too, an upper bound of
            the factored rows it keeps for 2-D parameters).
        moments: ``StepConfig.moments`` (OffloadAdamW's only).
        settings: the class's hyper-parameters besides its defaults (``momentum=0.9``
            makes SGD keep a momentum buffer).

    Raises:
        SwapConfigError: an unknown name; UnsupportedOptimizerError: a class that cannot
            stream (named).
    """
    if optimizer is None or optimizer == "adamw":
        from swapper.step.rules.adamw import AdamWRule

        return AdamWRule().bytes_per_element(moments)
    if isinstance(optimizer, str):
        cls, defaults = _named(optimizer)
        settings = {**defaults, **settings}
    else:
        cls = check_optimizer_class(optimizer)
    hyper = {"lr": 1e-3, **settings}
    elementwise = cls.__name__ not in NOT_ELEMENTWISE
    spec = discover(cls, hyper, torch.Size([_PROBE_NUMEL]), elementwise=elementwise)
    return 4.0 * (1 + len(spec.element)) + 4.0 * spec.section_numel / _PROBE_NUMEL
