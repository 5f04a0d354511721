"""Frozen parameters under swapper.offload (swapper.zero.model.frozen; issue 27): a frozen base
with small trainable adapters (LoRA written by hand over frozen nn.Linear) trains under a
device budget of a quarter of the model's 16-bit bytes, bit-identical to unlimited
budgets and to plain PyTorch (torch.optim.AdamW over fp32 masters of the trainable
parameters only); frozen parameters get no gradient, no optimizer state, and are never
written back; a trainable set changed after the wrap is refused, naming the parameter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import swapper
from swapper import Kind, OffloadAdamW, OffloadConfig, StepConfig, SwapConfigError, Tier
from swapper.manager import ManagerStats
from swapper.zero.checkpoint.snapshot import save_snapshot
from swapper.zero.model.frozen import TrainableSetChanged

LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 1e-2
IN, D, H, R, BLOCKS, BATCH = 32, 64, 128, 4, 4, 8
SUB_GROUP_NUMEL = 2048
STEPS = 10


class Adapted(nn.Module):
    """A LoRA adapter over a frozen nn.Linear: ``base(x) + B(A(x))``."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.lora_a = nn.Linear(d_in, R, bias=False)
        self.lora_b = nn.Linear(R, d_out, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 adapters (PEFT's way): their input cast up, their output down (no-ops in bf16)
        lora = self.lora_b(self.lora_a(x.to(self.lora_a.weight.dtype)))
        return self.base(x) + lora.to(x.dtype)


class Block(nn.Module):
    """A frozen norm, two adapted projections, and a frozen Linear shared by every block
    (one frozen module used by several modules)."""

    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D).requires_grad_(False)
        self.up = Adapted(D, H)
        self.down = Adapted(H, D)
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(F.gelu(self.up(h))) + self.shared(h)


class Net(nn.Module):
    def __init__(self, ckpt: str) -> None:
        super().__init__()
        shared = nn.Linear(D, D).requires_grad_(False)
        self.inp = Adapted(IN, D)  # trainable adapter first: the blocks' inputs need grad
        self.blocks = nn.ModuleList(Block(shared) for _ in range(BLOCKS))
        self.head = nn.Linear(D, IN).requires_grad_(False)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            if self.ckpt == "none":
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.ckpt == "reentrant")
        return self.head(h)


def _net(ckpt: str = "none", fp32: bool = False) -> Net:
    """The model in bf16; ``fp32``: its adapters in fp32 over the bf16 base (as PEFT's
    default autocast_adapter_dtype=True keeps them)."""
    model = Net(ckpt)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model = model.to(torch.bfloat16)
    if fp32:
        for name, sub in model.named_modules():
            if name.rsplit(".", 1)[-1].startswith("lora_"):
                sub.float()
    return model


def _nbytes(model: nn.Module, *, trainable: bool | None = None) -> int:
    return sum(
        p.numel() * 2
        for p in model.parameters()
        if trainable is None or p.requires_grad is trainable
    )


TOTAL_NBYTES = _nbytes(_net())
DEVICE_NBYTES = TOTAL_NBYTES // 4  # a quarter of the whole model's 16-bit bytes
HOST_NBYTES = TOTAL_NBYTES // 2  # the base does not fit beside the rest: on NVMe


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randn(BATCH, IN, generator=generator).to(torch.bfloat16),
            torch.randn(BATCH, IN, generator=generator),
        )
        for _ in range(STEPS)
    ]


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target).pow(2).mean()


@dataclasses.dataclass
class Run:
    losses: list[float]
    params: dict[str, torch.Tensor]
    stats: ManagerStats | None = None
    state_nbytes: int = 0  # optimizer state in the manager
    grad_keys: set[str] = dataclasses.field(default_factory=set)  # retained after a backward
    written: set[str] = dataclasses.field(default_factory=set)  # released as modified
    #: key -> times its bytes were written to NVMe (at registration or by an eviction)
    nvme_writes: dict[str, int] = dataclasses.field(default_factory=dict)


def _train(config: OffloadConfig, ckpt: str = "none", fp32: bool = False) -> Run:
    model = _net(ckpt, fp32)
    run = Run([], {})
    with swapper.offload(model, config) as wrapped:
        manager = wrapped.manager
        release = manager.release

        def spy(key: str, *, modified: bool = True, cold: bool = False) -> None:
            if modified:
                run.written.add(key)
            release(key, modified=modified, cold=cold)

        manager.release = spy  # type: ignore[method-assign]
        _count_nvme_writes(manager, run.nvme_writes)
        # every parameter given: the frozen ones are left out by the optimizer itself
        with OffloadAdamW(
            wrapped.parameters(),
            lr=LR,
            betas=BETAS,
            eps=EPS,
            weight_decay=WEIGHT_DECAY,
            tiers=wrapped,
        ) as optimizer:
            for x, y in _data():
                loss = _loss(wrapped(x), y)
                loss.backward()
                keys = manager.keys()  # (a TierManager is not iterable)
                run.grad_keys |= {k for k in keys if k.startswith("grad/")}
                optimizer.step()
                optimizer.zero_grad()
                run.losses.append(loss.item())
            keys = manager.keys()
            infos = [manager.info(k) for k in keys]
            run.state_nbytes = sum(i.nbytes for i in infos if i.kind is Kind.OPTIM_STATE)
            run.stats = wrapped.stats()
    run.params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return run


def _count_nvme_writes(manager: Any, counts: dict[str, int]) -> None:
    """Count, per key, the writes ``manager`` issues to NVMe: its mover's two write paths
    (a new entry written straight there; an entry evicted or cleaned). A test's spy on
    the manager's internals: no public counter is kept per key."""
    mover = manager._mover

    def wrap(name: str) -> None:
        original = getattr(mover, name)

        def spy(entry: Any, *args: Any, **kwargs: Any) -> Any:
            counts[entry.key] = counts.get(entry.key, 0) + 1
            return original(entry, *args, **kwargs)

        setattr(mover, name, spy)

    wrap("write_new")
    wrap("write_out")


def plain_steps(model: nn.Module, losses: Iterable[Callable[[], torch.Tensor]]) -> list[float]:
    """The reference: each loss (a call of the bf16 model) backpropagated, fp32 masters of
    the trainable parameters only stepped by torch.optim.AdamW(fused=True) and rounded
    back into the bf16 parameters (an fp32 parameter is its own master: stepped itself);
    the losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in params]
    optimizer = torch.optim.AdamW(
        masters, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True
    )
    out = []
    for compute in losses:
        loss = compute()
        loss.backward()
        for param, master in zip(params, masters, strict=True):
            assert param.grad is not None
            if master is not param:
                master.grad = param.grad.float()
                param.grad = None
        optimizer.step()
        with torch.no_grad():
            for param, master in zip(params, masters, strict=True):
                if master is param:
                    param.grad = None
                else:
                    param.copy_(master)
        out.append(loss.item())
    return out


def _train_plain(ckpt: str = "none", fp32: bool = False) -> Run:
    model = _net(ckpt, fp32)
    steps = [lambda x=x, y=y: _loss(model(x), y) for x, y in _data()]
    losses = plain_steps(model, steps)
    return Run(losses, {k: v.detach().clone() for k, v in model.state_dict().items()})


def _tight(tmp_path: Path, fp32: bool = False) -> OffloadConfig:
    # fp32 adapters: their fp32 gradients stay in host memory (never on NVMe) beside it
    grads32 = 4 * _nbytes(_net(), trainable=True) // 2 if fp32 else 0
    return OffloadConfig.create(
        nvme_dirs=[tmp_path / "nvme"],
        device="cpu",
        device_nbytes=DEVICE_NBYTES,
        host_nbytes=HOST_NBYTES + grads32,
        step=StepConfig(sub_group_numel=SUB_GROUP_NUMEL),
    )


def _unlimited() -> OffloadConfig:
    return OffloadConfig.create(device="cpu", step=StepConfig(sub_group_numel=SUB_GROUP_NUMEL))


def _assert_same(a: Run, b: Run) -> None:
    assert a.losses == b.losses
    assert list(a.params) == list(b.params)
    for name in a.params:
        assert torch.equal(a.params[name], b.params[name]), f"{name} differs"


@pytest.mark.parametrize("fp32", [False, True], ids=["bf16-adapters", "fp32-adapters"])
@pytest.mark.parametrize("ckpt", ["none", "non-reentrant", "reentrant"])
def test_frozen_base_trains_within_a_quarter_budget_bit_identical(
    ckpt: str, fp32: bool, tmp_path: Path
) -> None:
    tight = _train(_tight(tmp_path, fp32), ckpt, fp32)
    free = _train(_unlimited(), ckpt, fp32)
    plain = _train_plain(ckpt, fp32)

    _assert_same(tight, free)
    _assert_same(tight, plain)
    assert len(set(tight.losses)) > 1  # it trains
    initial = _net(fp32=fp32).state_dict()
    for name, value in tight.params.items():
        trainable = "lora_" in name
        assert torch.equal(value, initial[name]) is not trainable, name

    assert tight.stats is not None
    peak = tight.stats.tiers[Tier.DEVICE].peak_nbytes
    assert peak is not None and 0 < peak <= DEVICE_NBYTES
    # the base really went to NVMe, and frozen weights came back from there
    assert tight.stats.kind_nbytes.get((Kind.PARAM16, Tier.HOST, Tier.NVME), 0) > 0
    assert tight.stats.kind_nbytes.get((Kind.PARAM16, Tier.NVME, Tier.HOST), 0) > 0

    model = _net(fp32=fp32)
    trainable_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = {f"param/{n}" for n, p in model.named_parameters() if not p.requires_grad}
    for run in (tight, free):
        # fp32 master + two moments of the trainable parameters (the last sub-group's
        # rows padded), nothing for the frozen (~12x more elements)
        assert 12 * trainable_numel <= run.state_nbytes < 12 * (trainable_numel + 1024)
        # a frozen parameter is only ever read: its NVMe copy stays clean (written once)
        assert not (run.written & frozen)
        assert all(run.nvme_writes.get(key, 0) <= 1 for key in frozen), run.nvme_writes
    # the base went to NVMe (each frozen key once at most; most of them once)
    assert sum(tight.nvme_writes.get(key, 0) for key in frozen) > len(frozen) // 2
    # no retained gradient of a frozen parameter, ever (the unlimited run keeps them by
    # reference, in no manager entry: swapper.zero.local.persist)
    assert tight.grad_keys == {f"grad/{n}" for n, p in model.named_parameters() if p.requires_grad}
    # ... so the 16-bit parameters written to NVMe are at most the frozen ones once and
    # the trainable ones once per step (and the initial write)
    written = tight.stats.kind_nbytes.get((Kind.PARAM16, Tier.HOST, Tier.NVME), 0)
    trainable_nbytes = _nbytes(model, trainable=True) * (2 if fp32 else 1)
    # fp32 adapters: gradients retained in fp32, never written to NVMe
    grads32 = [k for k in tight.stats.kind_nbytes if k[0] is Kind.GRAD32]
    assert not [k for k in grads32 if Tier.NVME in k[1:]]
    assert written <= _nbytes(model, trainable=False) + (STEPS + 1) * trainable_nbytes


def test_frozen_holds_are_released_during_the_backward(tmp_path: Path) -> None:
    """On main the frozen weights piled up until the backward ended: the device tier then
    held every frozen module the backward had passed, past a quarter of the model."""
    model = _net()
    config = _tight(tmp_path)
    with swapper.offload(model, config) as wrapped:
        held: list[int] = []
        # the largest hold seen while the backward runs, after each adapter's gradient
        for param in model.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(
                    lambda _: held.append(wrapped.core.holds.held_nbytes)
                )
        x, y = _data()[0]
        _loss(wrapped(x), y).backward()
        assert held and max(held) <= DEVICE_NBYTES
        assert wrapped.core.holds.held_nbytes == 0


def test_requires_grad_toggled_after_the_wrap_is_refused_naming_it(tmp_path: Path) -> None:
    model = _net()
    with swapper.offload(model, _tight(tmp_path)) as wrapped:
        x, y = _data()[0]
        model.blocks[1].up.base.weight.requires_grad_(True)
        with pytest.raises(TrainableSetChanged, match=r"'blocks\.1\.up\.base\.weight'"):
            wrapped(x)
        model.blocks[1].up.base.weight.requires_grad_(False)
        model.inp.lora_a.weight.requires_grad_(False)  # the other way too
        with pytest.raises(TrainableSetChanged, match=r"'inp\.lora_a\.weight'.*requires_grad=True"):
            wrapped(x)
        model.inp.lora_a.weight.requires_grad_(True)
        _loss(wrapped(x), y).backward()  # set back: it trains again
        assert wrapped.core.holds.held_nbytes == 0


def test_frozen_parameters_given_to_the_optimizer_get_no_state() -> None:
    model = _net()
    with (
        swapper.offload(model, _unlimited()) as wrapped,
        OffloadAdamW(wrapped.parameters(), tiers=wrapped) as optimizer,
    ):
        kept = [p for group in optimizer.param_groups for p in group["params"]]
        assert kept == [p for p in model.parameters() if p.requires_grad]


def test_a_module_wrapped_twice_is_refused_naming_it(tmp_path: Path) -> None:
    """An adapted module inside a wrapped model, or a model around a wrapped adapted
    module, is refused before anything moves (its parameters would be placed twice, the
    second time as empty placeholders)."""
    model = _net()
    inner = r"module 'blocks\.1\.up' of a wrapped Net"
    with swapper.offload(model, _unlimited()), pytest.raises(SwapConfigError, match=inner):
        swapper.offload(model.blocks[1].up, _unlimited())
    model = _net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    outer = r"module 'blocks\.1\.up' \(Adapted\) of this Net"
    with (
        swapper.offload(model.blocks[1].up, _unlimited()),
        pytest.raises(SwapConfigError, match=outer),
    ):
        swapper.offload(model, _unlimited())
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name  # nothing moved, nothing lost


def _train_with_snapshots(swap: Path, *, stop_after: int | None = None) -> dict[str, torch.Tensor]:
    """The fp32-adapter model under the tight budgets, resumed from ``swap``'s newest
    snapshot if there is one, trained to step 6 with a snapshot after every second step;
    ``stop_after``: leave after that step (its work since the snapshot is lost)."""
    model = _net(fp32=True)
    data = _data()
    with (
        swapper.offload(model, _tight(swap, fp32=True), resume=True) as wrapped,
        OffloadAdamW(
            wrapped.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
            tiers=wrapped,
        ) as optimizer,
    ):  # fmt: skip
        for step in range(optimizer.step_count + 1, 7):
            x, y = data[step - 1]
            _loss(wrapped(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % 2 == 0:
                save_snapshot(wrapped, optimizer, keep_last=2)
            if stop_after is not None and step >= stop_after:
                break
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_fp32_adapters_stop_and_resume_bit_identical(tmp_path: Path) -> None:
    """A snapshot after a step leaves the fp32 adapters out (each equals its master) and
    a resume rebuilds them by copy: a run stopped after step 5 and resumed from step 4's
    snapshot ends with the uninterrupted run's weights, bitwise. (Before, the resume
    refused its own snapshot: 'dtype float32 is not bfloat16 or float16'.)"""
    whole = _train_with_snapshots(tmp_path / "whole")
    _train_with_snapshots(tmp_path / "parts", stop_after=5)
    resumed = _train_with_snapshots(tmp_path / "parts")
    assert resumed.keys() == whole.keys()
    for name, value in whole.items():
        assert torch.equal(resumed[name], value), name
    assert any(v.dtype == torch.float32 for v in whole.values())  # (the case under test)
