"""``OffloadOptimizer(torch.optim.X, ...)``: any optimizer over NVMe-resident state,
bit-identical to X over fp32 master copies in memory (issue 26).

The recipe is the AdamW parity tests' (tests/test_step.py): the reference keeps fp32
master copies of the 16-bit parameters, builds its fp32 gradients from the 16-bit ones
(times 1/scale and the clip coefficient, computed as torch does) and runs X on them; the
16-bit parameters must equal the masters rounded, and every state tensor must be equal.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from swapper import DynamicLossScaler, ManagerConfig, OffloadOptimizer, StepConfig
from swapper.step import StateLayoutError, UnsupportedOptimizerError
from swapper.step.offload_optimizer import ParamStates
from tiers.errors import SwapConfigError

#: elements per sub-group (rounded up to 2048): several sub-groups over the model, with
#: boundaries inside parameters.
SG_NUMEL = 2000


class Lion(torch.optim.Optimizer):
    """A third-party optimizer written in a few lines (Chen et al., 2023)."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)


#: name → (class, hyper-parameters): the matrix of issue 26.
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw-foreach": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2}),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.05, "initial_accumulator_value": 0.1}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-3, "centered": True, "momentum": 0.9}),
    "adafactor": (torch.optim.Adafactor, {"lr": 1e-2}),
    "asgd": (torch.optim.ASGD, {"lr": 1e-2, "t0": 3.0}),
    "lion": (Lion, {"lr": 1e-3, "weight_decay": 0.1}),
}


class TinyGPT(nn.Module):
    """Token and position embeddings, one pre-norm block, a final norm and an output head
    tied to the token embedding: 11 000 parameters in 16 tensors."""

    vocab, width, context = 48, 32, 8

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocab, self.width)
        self.pos = nn.Parameter(torch.randn(self.context, self.width) * 0.02)
        self.block = nn.TransformerEncoderLayer(
            self.width, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(self.width)
        self.head = nn.Linear(self.width, self.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        x = self.embed(tokens) + self.pos[:n].to(self.embed.weight.dtype)
        return self.head(self.norm(self.block(x, src_mask=mask, is_causal=True)))


def _gpt(dtype: torch.dtype) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return TinyGPT().to(dtype)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, TinyGPT.vocab, (4, TinyGPT.context + 1), generator=g)
    logits = model(tokens[:, :-1]).float()
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _tight(tmp_path: Path, name: str) -> ManagerConfig:
    """State on NVMe; a host budget of a few sub-groups' state (4 fp32 rows + slack)."""
    return ManagerConfig(
        device_nbytes=0,
        host_nbytes=3 * 5 * 2048 * 4,
        nvme_dirs=[tmp_path / name],
        timeout_s=20.0,
        close_timeout_s=20.0,
    )


def _tight_optimizer(
    cls: type[torch.optim.Optimizer],
    params: list[torch.Tensor],
    tmp_path: Path,
    kwargs: dict[str, Any],
    name: str = "a",
) -> OffloadOptimizer:
    """``cls`` over ``params`` with :func:`_tight` budgets and sub-groups of SG_NUMEL."""
    return OffloadOptimizer(
        cls, params, tiers=_tight(tmp_path, name), config=StepConfig(sub_group_numel=SG_NUMEL),
        **kwargs,
    )  # fmt: skip


def _unlimited() -> ManagerConfig:
    return ManagerConfig(device_nbytes=0, host_nbytes=None, nvme_dirs=[])


class Reference:
    """X over fp32 master copies in memory, fed as OffloadOptimizer feeds it."""

    def __init__(
        self, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], params: list[torch.Tensor]
    ) -> None:
        self.params = params
        self.masters = [p.detach().float().clone() for p in params]
        self.opt = cls(self.masters, **kwargs)

    def step(self, factor: float) -> None:
        for m, p in zip(self.masters, self.params, strict=True):
            if p.grad is None:  # X skips it
                m.grad = None
                continue
            grad = p.grad.float()  # (a new tensor)
            if factor != 1.0:
                grad.mul_(factor)
            m.grad = grad
        self.opt.step()

    def expected16(self) -> list[torch.Tensor]:
        return [m.to(p.dtype) for m, p in zip(self.masters, self.params, strict=True)]


def _factor(
    params: list[torch.Tensor], max_norm: float | None, scale: float | None
) -> tuple[float, bool]:
    """As torch: the unscaled global norm, its fp32 clip coefficient; (factor, overflow)."""
    total = torch.nn.utils.get_total_norm([p.grad.float() for p in params if p.grad is not None])
    if not math.isfinite(float(total)):
        return 1.0, True
    factor = 1.0
    if scale is not None:
        total = total / scale
        factor = 1.0 / scale
    if max_norm is not None:
        factor *= float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return factor, False


def _assert_states_equal(ours: Any, theirs: dict[int, dict[str, torch.Tensor]], what: str) -> None:
    assert sorted(ours) == sorted(theirs), what
    for index, entry in theirs.items():
        mine = ours[index]
        assert sorted(mine) == sorted(entry), f"{what}: param {index}"
        for key, value in entry.items():
            assert mine[key].shape == value.shape, f"{what}: param {index} {key}"
            assert torch.equal(mine[key], value), f"{what}: param {index} {key} differs"


def _train(
    name: str,
    dtype: torch.dtype,
    tight: ManagerConfig,
    *,
    steps: int = 10,
    drop: Callable[[int], set[int]] | None = None,
) -> None:
    """``steps`` steps of the tiny GPT under two OffloadOptimizers, one with ``tight``
    budgets, one with unlimited ones, and the reference beside them, all compared at every
    step: clipping on; fp16 with a loss scaler and a skipped step. Tight and unlimited
    params are equal at every step (checked), so one forward and backward serves both:
    the gradients are copied. ``drop(step)``: the indices of the parameters whose
    ``.grad`` is set to None before that step."""
    cls, kwargs = OPTIMIZERS[name]
    models = [_gpt(dtype), _gpt(dtype)]
    params = [list(m.parameters()) for m in models]
    ref = Reference(cls, kwargs, params[0])
    scalers = [
        DynamicLossScaler(1024.0, growth_interval=3) if dtype == torch.float16 else None
        for _ in models
    ]
    max_norm = 0.5
    config = StepConfig(sub_group_numel=SG_NUMEL, max_grad_norm=max_norm)
    with (
        OffloadOptimizer(
            cls, params[0], tiers=tight, config=config, loss_scaler=scalers[0], **kwargs
        ) as opt,
        OffloadOptimizer(
            cls, params[1], tiers=_unlimited(), config=config, loss_scaler=scalers[1], **kwargs
        ) as free,
    ):
        assert len(opt.sub_groups) >= 4
        read = 0
        for step in range(1, steps + 1):
            scaler = scalers[0]
            loss = _loss(models[0], step)
            scale = None if scaler is None else scaler.loss_scale
            (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is not None and step == 4:
                params[0][3].grad.view(-1)[7] = math.inf  # overflow: the step is skipped
            for i in drop(step) if drop is not None else ():
                params[0][i].grad = None
            for a, b in zip(params[0], params[1], strict=True):
                b.grad = None if a.grad is None else a.grad.clone()
            factor, overflow = _factor(params[0], max_norm, scale)
            opt.step()
            free.step()
            for o in (opt, free):
                assert o.last_step is not None and o.last_step.skipped == overflow
            read += opt.last_step.traffic.total_read_nbytes
            if not overflow:
                ref.step(factor)
            for i, (a, b, e) in enumerate(zip(*params, ref.expected16(), strict=True)):
                assert torch.equal(a.detach(), e), f"{name} step {step}: param {i} differs"
                assert torch.equal(b.detach(), e), f"{name} step {step}: param {i} (unlimited)"
            opt.zero_grad()
            free.zero_grad()
        assert read > 0  # the state streamed from NVMe
        theirs = ref.opt.state_dict()["state"]
        _assert_states_equal(dict(opt.state_dict()["state"].items()), theirs, name)
        _assert_states_equal(dict(free.state_dict()["state"].items()), theirs, f"{name} unlimited")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_parity_with_the_optimizer_in_memory(tmp_path: Path, name: str, dtype: torch.dtype) -> None:
    """Tight budgets (state on NVMe, a parameter split across sub-groups where element-wise)
    bit-identical to X in memory at every step, and to unlimited budgets."""
    _train(name, dtype, _tight(tmp_path, "tight"))


def _split_params(sub_groups: Any) -> set[int]:
    """Indices of the parameters (one group) cut across two or more sub-groups."""
    seen = [p.param_index for sg in sub_groups for p in sg.pieces]
    return {i for i in seen if seen.count(i) > 1}


@pytest.mark.parametrize("name", ["sgd", "adam", "adagrad", "adafactor", "lion"])
def test_a_parameter_without_gradient_is_skipped_as_x_does(tmp_path: Path, name: str) -> None:
    """A parameter whose ``.grad`` is None at a step (some of them split across two
    sub-groups, some alone in one) is left as X leaves it: no update, no weight decay,
    no state made or advanced (Adam's per-parameter ``step`` lags), bitwise."""
    model = _gpt(torch.bfloat16)
    with OffloadOptimizer(
        torch.optim.SGD,
        list(model.parameters()),
        tiers=_unlimited(),
        config=StepConfig(sub_group_numel=SG_NUMEL),
        lr=0.1,
    ) as probe:
        split = _split_params(probe.sub_groups)
    assert split  # the case that matters: a piece of a parameter skipped, the other not
    count = len(list(model.parameters()))

    def drop(step: int) -> set[int]:
        if step == 1:
            return {0, count - 1}  # never stepped at the first step: no state until later
        if step in (3, 4, 7):
            return split | {2, 5}
        return set()

    _train(name, torch.bfloat16, _tight(tmp_path, "tight"), drop=drop)


@pytest.mark.parametrize("name", ["sgd", "adam", "adagrad", "adafactor"])
def test_add_param_group_after_steps_matches_x(tmp_path: Path, name: str) -> None:
    """``add_param_group`` after three steps: the new group (its own lr and weight decay)
    gets new sub-groups after the others, and the run stays bit-identical to X given the
    same group at the same step; the state dict numbers the new parameters after the
    others'."""
    cls, kwargs = OPTIMIZERS[name]
    model = _gpt(torch.bfloat16)
    params = list(model.parameters())
    first, later = params[:-4], params[-4:]  # (the block's last layers and the final norm)
    masters = {id(p): p.detach().float().clone() for p in params}
    ref = cls([masters[id(p)] for p in first], **kwargs)
    extra = {"lr": kwargs["lr"] / 2, "weight_decay": 0.05}
    with OffloadOptimizer(
        cls, first, tiers=_tight(tmp_path, "a"), config=StepConfig(sub_group_numel=SG_NUMEL),
        **kwargs,
    ) as opt:  # fmt: skip
        before = len(opt.sub_groups)
        for step in range(1, 8):
            if step == 4:
                ref.add_param_group({"params": [masters[id(p)] for p in later], **extra})
                opt.add_param_group({"params": later, **extra})
                assert len(opt.sub_groups) > before
                assert all(sg.group_index == 1 for sg in opt.sub_groups[before:])
            _loss(model, step).backward()
            stepped = first if step < 4 else params
            for p in params:
                if p.grad is not None and not any(p is q for q in stepped):
                    p.grad = None  # (X's parameters only)
                masters[id(p)].grad = None if p.grad is None else p.grad.float()
            opt.step()
            ref.step()
            for i, p in enumerate(params):
                assert torch.equal(p.detach(), masters[id(p)].to(p.dtype)), f"step {step} p{i}"
            opt.zero_grad()
            for p in params:
                p.grad = None
        ours = opt.state_dict()
        assert ours["param_groups"][1]["params"] == list(range(len(first), len(params)))
        assert ours["param_groups"][1]["lr"] == extra["lr"]
        _assert_states_equal(dict(ours["state"].items()), ref.state_dict()["state"], name)


def test_add_param_group_refusals_change_nothing(tmp_path: Path) -> None:
    """A parameter already in a group, a bad hyper-parameter, a sub-group the host
    budget cannot hold, compressed moments (OffloadAdamW): refused with the reason, the
    groups and state as they were, nothing written."""
    from swapper import OffloadAdamW

    model = _gpt(torch.bfloat16)
    params = list(model.parameters())
    with OffloadOptimizer(
        torch.optim.SGD,
        params[:-2],
        tiers=_tight(tmp_path, "a"),
        config=StepConfig(sub_group_numel=SG_NUMEL),
        lr=0.1,
        momentum=0.9,
    ) as opt:
        count = len(opt.sub_groups)
        with pytest.raises(SwapConfigError, match="param group 1"):
            opt.add_param_group({"params": params[-3:]})  # params[-3] is in group 0
        with pytest.raises(SwapConfigError, match=r"SGD.*learning rate"):
            opt.add_param_group({"params": params[-2:], "lr": -1.0})
        assert len(opt.param_groups) == 1 and len(opt.sub_groups) == count
        opt.add_param_group({"params": params[-2:]})  # and then it works
        assert len(opt.param_groups) == 2 and len(opt.sub_groups) > count
    big = nn.Parameter(torch.zeros(64, 1024, dtype=torch.bfloat16))  # 256 KiB of masters
    with OffloadOptimizer(
        torch.optim.Adafactor, params, tiers=_tight(tmp_path, "b"),
        config=StepConfig(sub_group_numel=SG_NUMEL),
    ) as ada:  # fmt: skip
        count = len(ada.sub_groups)
        files = sorted(p.name for p in (tmp_path / "b").rglob("*"))
        with pytest.raises(SwapConfigError, match="host_nbytes"):
            ada.add_param_group({"params": [big]})  # a whole parameter: no room for it
        assert len(ada.param_groups) == 1 and len(ada.sub_groups) == count
        assert sorted(p.name for p in (tmp_path / "b").rglob("*")) == files
    with OffloadAdamW(
        params[:-2],
        tiers=_unlimited(),
        config=StepConfig(sub_group_numel=SG_NUMEL, moments="bf16"),
    ) as adamw:
        with pytest.raises(SwapConfigError, match="compressed moments"):
            adamw.add_param_group({"params": params[-2:]})
        assert len(adamw.param_groups) == 1


def test_elementwise_split_and_whole_parameters(tmp_path: Path) -> None:
    """Element-wise: a parameter is split across two sub-groups; Adafactor: each whole,
    its state in the shapes it makes, a parameter larger than a sub-group alone."""
    model = _gpt(torch.bfloat16)
    params = list(model.parameters())
    with OffloadOptimizer(
        torch.optim.SGD,
        params,
        tiers=_unlimited(),
        config=StepConfig(sub_group_numel=SG_NUMEL),
        lr=0.1,
        momentum=0.9,
    ) as sgd:
        pieces = [(sg.group_index, p.param_index) for sg in sgd.sub_groups for p in sg.pieces]
        assert len(pieces) > len(set(pieces))  # some parameter in two sub-groups
        assert [r.name for r in sgd.rule.state_rows()] == ["master", "momentum_buffer"]
        assert sgd.sub_groups[0].state_shape == (2, 2048)
    with OffloadOptimizer(
        torch.optim.Adafactor,
        params,
        tiers=_unlimited(),
        config=StepConfig(sub_group_numel=SG_NUMEL),
    ) as ada:
        pieces = [(sg.group_index, p.param_index) for sg in ada.sub_groups for p in sg.pieces]
        assert len(pieces) == len(set(pieces)) == len(params)
        assert all(p.param_offset == 0 for sg in ada.sub_groups for p in sg.pieces)
        big = [sg for sg in ada.sub_groups if sg.numel > SG_NUMEL]
        assert big and all(len(sg.pieces) == 1 for sg in big)  # the embedding, alone
        rows = {r.name: r.per for r in ada.rule.state_rows()}
        assert rows == {
            "master": "element",
            "row_var": "parameter",
            "col_var": "parameter",
            "variance": "parameter",
        }
        # 4 B per element of master weights plus the factored rows, not 8
        total = sum(sg.state_nbytes for sg in ada.sub_groups)
        numel = sum(p.numel() for p in params)
        assert total < 4 * numel + 4 * 2048 * len(ada.sub_groups) + numel


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adafactor"])
def test_state_dict_round_trip_both_ways(tmp_path: Path, name: str) -> None:
    """Saved here → loads into X over the fp32 masters; saved by X → loads here; both then
    continue bit-identically."""
    cls, kwargs = OPTIMIZERS[name]
    model = _gpt(torch.bfloat16)
    params = list(model.parameters())
    ref = Reference(cls, kwargs, params)
    with _tight_optimizer(cls, params, tmp_path, kwargs) as opt:
        for step in range(1, 4):
            _loss(model, step).backward()
            opt.step()
            ref.step(1.0)
            opt.zero_grad()
        saved = opt.state_dict()
        assert isinstance(saved["state"], ParamStates)
        # ours → X: a fresh X over the same masters continues as the reference does
        masters = [m.clone() for m in ref.masters]
        other = cls(masters, **kwargs)
        other.load_state_dict(saved)
        _assert_states_equal(other.state_dict()["state"], ref.opt.state_dict()["state"], "ours→X")
        # X → ours: perturb our state, load the reference's, continue both
        opt.load_state_dict(ref.opt.state_dict())
        _assert_states_equal(
            dict(opt.state_dict()["state"].items()), ref.opt.state_dict()["state"], "X→ours"
        )
        for step in range(4, 7):
            _loss(model, step).backward()
            opt.step()
            ref.step(1.0)
            opt.zero_grad()
            for a, e in zip(params, ref.expected16(), strict=True):
                assert torch.equal(a.detach(), e)
        _assert_states_equal(
            dict(opt.state_dict()["state"].items()), ref.opt.state_dict()["state"], "after"
        )


def test_load_state_dict_refuses_before_writing(tmp_path: Path) -> None:
    model = _gpt(torch.bfloat16)
    params = list(model.parameters())
    with OffloadOptimizer(
        torch.optim.SGD,
        params,
        tiers=_tight(tmp_path, "a"),
        config=StepConfig(sub_group_numel=SG_NUMEL),
        lr=0.1,
        momentum=0.9,
    ) as opt:
        _loss(model, 1).backward()
        opt.step()
        before = dict(opt.state_dict()["state"].items())
        good = {i: dict(v) for i, v in before.items()}
        bad = {i: dict(v) for i, v in good.items()}
        bad[len(bad) - 1]["momentum_buffer"] = torch.zeros(3)  # the last one: all checked first
        with pytest.raises(Exception, match="momentum_buffer"):
            opt.load_state_dict({"state": bad, "param_groups": opt.state_dict()["param_groups"]})
        renamed = {i: {"exp_avg": v["momentum_buffer"]} for i, v in good.items()}
        with pytest.raises(Exception, match="exp_avg"):
            opt.load_state_dict(
                {"state": renamed, "param_groups": opt.state_dict()["param_groups"]}
            )
        _assert_states_equal(dict(opt.state_dict()["state"].items()), before, "unchanged")


class _ShapeShifter(torch.optim.Optimizer):
    """Keeps a state tensor whose shape grows every step."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                n = state["history"].numel() + 1 if state else 1
                state["history"] = torch.zeros(n)


class _FloatState(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["count"] = 1.0


@pytest.mark.parametrize(
    ("cls", "match"),
    [
        (torch.optim.LBFGS, r"LBFGS.*closure"),
        (torch.optim.SparseAdam, r"SparseAdam.*sparse"),
        (_ShapeShifter, r"_ShapeShifter.*'history'"),
        (_FloatState, r"_FloatState.*'count'.*float"),
        (torch.nn.Linear, "torch.optim.Optimizer subclass"),
        (torch.optim.SGD([torch.zeros(1)], lr=0.1), "torch.optim.Optimizer subclass"),
    ],
    ids=["lbfgs", "sparse", "shape", "float", "not-optimizer", "instance"],
)
def test_bad_optimizers_are_refused_before_anything_is_written(
    tmp_path: Path, cls: Any, match: str
) -> None:
    model = _gpt(torch.bfloat16)
    with pytest.raises(UnsupportedOptimizerError, match=match):
        OffloadOptimizer(cls, model.parameters(), tiers=_tight(tmp_path, "bad"))
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").rglob("*"))


def test_state_that_changes_shape_at_a_later_step_is_refused(tmp_path: Path) -> None:
    class Late(torch.optim.SGD):
        calls = 0

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            super().step()
            Late.calls += 1
            if Late.calls > 4:  # after the probe (2 steps per shape) and the first real one
                for state in self.state.values():
                    state["momentum_buffer"] = torch.zeros(2)

    model = nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    with OffloadOptimizer(
        Late, model.parameters(), tiers=_unlimited(), lr=0.1, momentum=0.9
    ) as opt:
        for _ in range(3):
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            try:
                opt.step()
            except StateLayoutError as exc:
                assert "Late" in str(exc) and "momentum_buffer" in str(exc)
                return
    pytest.fail("the shape change was not refused")


def test_bad_hyper_parameters_are_refused_with_the_class_message(tmp_path: Path) -> None:
    model = _gpt(torch.bfloat16)
    with pytest.raises(SwapConfigError, match=r"SGD.*lr"):
        OffloadOptimizer(torch.optim.SGD, model.parameters(), tiers=_unlimited(), lr=-1.0)
    with pytest.raises(SwapConfigError, match="moments"):
        OffloadOptimizer(
            torch.optim.SGD,
            model.parameters(),
            tiers=_unlimited(),
            config=StepConfig(moments="bf16"),
            lr=0.1,
        )
