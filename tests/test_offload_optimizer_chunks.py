"""An element-wise single-tensor update is cut into cache-sized parts
(``swapper.step.rules.torch_optim.CHUNK_NUMEL``): the parts are what the class steps, the
result is bit-identical to the class over whole fp32 masters in memory, and a 0-dim state
that differs between the parts of one parameter (an update that is not element-wise) is
refused by name."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from swapper import OffloadOptimizer, StepConfig
from swapper.step import StateLayoutError
from swapper.step.rules import torch_optim
from tests.test_offload_optimizer import SG_NUMEL, _gpt, _tight, _train, _unlimited

#: parts of a few hundred elements, with a tail: pieces of up to 2048 elements cut in 3-20
PART_NUMEL = 300


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(torch_optim, "CHUNK_NUMEL", PART_NUMEL)
    return PART_NUMEL


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _numels_stepped(
    cls: type[torch.optim.Optimizer],
) -> tuple[type[torch.optim.Optimizer], list[int]]:
    """A subclass of ``cls`` recording the element count of every tensor it steps."""
    seen: list[int] = []

    class Spy(cls):  # type: ignore[valid-type, misc]
        @torch.no_grad()
        def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
            seen.extend(p.numel() for g in self.param_groups for p in g["params"])
            return super().step(closure)

    Spy.__name__ = cls.__name__
    return Spy, seen


@pytest.mark.parametrize(
    ("cls", "kwargs", "parts"),
    [
        (torch.optim.NAdam, {"lr": 1e-2}, True),
        (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}, True),
        (torch.optim.Adam, {"lr": 1e-2, "fused": True}, False),  # one pass already
        (torch.optim.AdamW, {"lr": 1e-2, "foreach": True}, False),  # op by op over the list
    ],
    ids=["nadam", "sgd", "adam-fused", "adamw-foreach"],
)
def test_single_tensor_updates_step_cache_sized_parts(
    small_parts: int, cls: type[torch.optim.Optimizer], kwargs: dict[str, Any], parts: bool
) -> None:
    model = _gpt(torch.bfloat16)
    params = list(model.parameters())
    spy, seen = _numels_stepped(cls)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # (the step's update on a 2-core machine; parts only on one)
    try:
        with OffloadOptimizer(
            spy, params, tiers=_unlimited(), config=StepConfig(sub_group_numel=SG_NUMEL), **kwargs
        ) as opt:
            for p in params:
                p.grad = torch.full_like(p, 0.01)
            seen.clear()  # (the discovery's probe steps)
            opt.step()
            whole = list(seen)
            if before > 1:  # on more threads, whole pieces
                torch.set_num_threads(before)
                seen.clear()
                opt.step()
                assert max(seen) > small_parts
    finally:
        torch.set_num_threads(before)
    assert whole
    if parts:
        assert max(whole) <= small_parts
        assert sum(whole) == sum(p.numel() for p in params)
    else:
        assert max(whole) > small_parts


@pytest.mark.parametrize(
    "name", ["sgd", "adam", "nadam", "radam", "adamax", "adagrad", "rmsprop", "asgd", "lion"]
)
def test_parts_are_bit_identical_to_x_in_memory(
    small_parts: int, tmp_path: Path, name: str
) -> None:
    """The matrix's element-wise single-tensor optimizers, each piece stepped in parts of
    ``PART_NUMEL`` where the update runs on one thread (tight budgets, on a 2-core
    machine; unlimited ones keep every thread and whole pieces): every step, every state
    tensor bit-identical to X over whole fp32 masters (fp16, a skipped step, clipping)."""
    del small_parts
    with intra_op_threads(2):  # the tight step's update on 1 (parts), unlimited's on 2
        _train(name, torch.float16, _tight(tmp_path, "tight"), steps=6)


def test_scalar_state_that_differs_between_parts_is_refused(small_parts: int) -> None:
    class GradNorm(torch.optim.SGD):
        """Keeps a 0-dim state read from the whole tensor: not element-wise."""

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            super().step()
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["norm"] = p.grad.norm()

    del small_parts
    model = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    with (
        intra_op_threads(1),
        OffloadOptimizer(GradNorm, model.parameters(), tiers=_unlimited(), lr=0.1) as opt,
    ):
        for p in model.parameters():
            p.grad = torch.randn(p.shape).to(torch.bfloat16)
        with pytest.raises(StateLayoutError, match=r"GradNorm.*'norm'.*elementwise=False"):
            opt.step()
