"""``model.to(...)`` and the like on a wrapped model (swapper.zero.model.module_apply): a move to
the device the parameters are used on is accepted and changes nothing; any other
conversion of a parameter is refused before anything changes; leaving the block gives the
modules their own ``_apply`` back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_ckpt_train import spawn, values
from torch import nn

import swapper
from swapper import OffloadConfig, SwapConfigError


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale.to(x.dtype)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(WithBuffer(), nn.GELU(), nn.Linear(8, 4)).to(torch.bfloat16)


def _x() -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def test_a_move_to_the_use_device_is_accepted_and_changes_nothing() -> None:
    model = _model()
    expected = model(_x())
    with swapper.offload(model, OffloadConfig.create(device="cpu")) as wrapped:
        assert model.to("cpu") is model  # as the HF Trainer's model.to(args.device)
        assert model.cpu() is model
        assert torch.equal(wrapped(_x()), expected)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m.to(torch.float32),
        lambda m: m.float(),
        lambda m: m.half(),
        lambda m: m.to("meta"),
        lambda m: m[2].to(torch.float32),  # a submodule's own call
    ],
    ids=["to_fp32", "float", "half", "to_meta", "submodule"],
)
def test_other_conversions_are_refused_before_anything_changes(convert: object) -> None:
    model = _model()
    expected = model(_x())
    scale = model[0].scale
    with swapper.offload(model, OffloadConfig.create(device="cpu")) as wrapped:
        with pytest.raises(SwapConfigError, match=r"parameter '.*weight'.*Convert the model"):
            convert(model)  # type: ignore[operator]
        assert model[0].scale is scale and scale.dtype == torch.bfloat16  # untouched
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        assert torch.equal(wrapped(_x()), expected)  # and it still trains as before


def test_leaving_the_block_gives_each_module_its_own_apply_back() -> None:
    model = _model()
    with swapper.offload(model, OffloadConfig.create(device="cpu")):
        assert all("_apply" in m.__dict__ for m in model.modules())
    assert not any("_apply" in m.__dict__ for m in model.modules())
    model.to(torch.float32)  # an ordinary model again: converted
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model[0].scale.dtype == torch.float32


def _sharded_rank(rank: int, world: int, tmp: str) -> dict[str, object]:
    import torch.distributed as dist

    from swapper.zero.config.distributed import DistributedConfig

    model = _model()
    expected = model(_x())
    config = OffloadConfig.create(device="cpu", distributed=DistributedConfig(timeout_s=20.0))
    out: dict[str, object] = {}
    with swapper.offload(model, config, dist.group.WORLD) as wrapped:
        out["guarded"] = all("_apply" in m.__dict__ for m in model.modules())
        out["to_cpu"] = model.to("cpu") is model
        try:
            model.to(torch.float32)
            out["refused"] = None
        except SwapConfigError as exc:
            out["refused"] = str(exc)
        out["same"] = torch.equal(wrapped(_x()), expected)
    out["unguarded"] = not any("_apply" in m.__dict__ for m in model.modules())
    return out


@pytest.mark.dist
def test_several_ranks_guard_apply_too(tmp_path: Path) -> None:
    for result in values(spawn(_sharded_rank, 2, tmp_path)):
        assert result["guarded"] and result["to_cpu"] and result["same"]
        assert result["unguarded"]
        assert isinstance(result["refused"], str) and "Convert the model" in result["refused"]
