"""An element-wise single-tensor update is cut into cache-sized parts
(``swapper.step.rules.torch_optim.CHUNK_NUMEL``): the parts are what the class steps, the
result is bit-identical to the class over whole fp32 masters in memory, and a 0-dim state
that differs between the parts of one parameter (an update that is not element-wise) is
refused by name."""

from __future__ import annotations

from collections.abc import Callable
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
    with OffloadOptimizer(
        spy, params, tiers=_unlimited(), config=StepConfig(sub_group_numel=SG_NUMEL), **kwargs
    ) as opt:
        for p in params:
            p.grad = torch.full_like(p, 0.01)
        seen.clear()  # (the discovery's probe steps)
        opt.step()
    assert seen
    if parts:  # (the update ran on every thread: no NVMe here)
        assert max(seen) <= small_parts * torch.get_num_threads()
        assert sum(seen) == sum(p.numel() for p in params)
    else:
        assert max(seen) > small_parts * torch.get_num_threads()


@pytest.mark.parametrize(
    "name", ["sgd", "adam", "nadam", "radam", "adamax", "adagrad", "rmsprop", "asgd", "lion"]
)
def test_parts_are_bit_identical_to_x_in_memory(
    small_parts: int, tmp_path: Path, name: str
) -> None:
    """The matrix's element-wise single-tensor optimizers, each piece stepped in parts of
    ``PART_NUMEL``: every step, every state tensor bit-identical to X over whole fp32
    masters (tight budgets and unlimited ones, fp16 with a skipped step, clipping on)."""
    del small_parts
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
    with OffloadOptimizer(GradNorm, model.parameters(), tiers=_unlimited(), lr=0.1) as opt:
        for p in model.parameters():
            p.grad = torch.randn(p.shape).to(torch.bfloat16)
        with pytest.raises(StateLayoutError, match=r"GradNorm.*'norm'.*elementwise=False"):
            opt.step()
