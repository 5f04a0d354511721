"""Tests of swapper.step.deferred: ``StepConfig(overlap=True)`` runs each step's sub-group
updates in a thread while the next forward runs, and stays bit-identical to the ordinary
step and to an in-memory reference (fused AdamW over one flat fp32 vector).

Budgets are tight (the optimizer state spills to NVMe). A "slow" update (each sub-group's
AdamW delayed) makes the next forward catch up with it, so the hooks really wait: a hook
that fetched a parameter before its update would read the old value and the losses would
differ from the reference.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import swapper
from swapper import (
    DeferredStepError,
    DynamicLossScaler,
    Kind,
    OffloadAdamW,
    OffloadConfig,
    StepConfig,
    StepPendingError,
    SwapConfigError,
    SwapIOError,
    Tier,
)
from swapper.zero import final_digest
from tiers import signals

ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
LR_DECAY = 0.8  # the lr changes right after every step(): the step taken keeps its lr
IN, HIDDEN = 64, 128
STEPS = 4


def _mlp(dtype: torch.dtype = torch.bfloat16) -> nn.Sequential:
    """50 112 parameters: 13 sub-groups of 4096 elements."""
    model = nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.GELU(),
        nn.LayerNorm(HIDDEN),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.LayerNorm(HIDDEN),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, IN),
    )
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.to(dtype)


def _data(micro: int, dtype: torch.dtype) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [
        [
            (torch.randn(8, IN, generator=g).to(dtype), torch.randn(8, IN, generator=g))
            for _ in range(micro)
        ]
        for _ in range(STEPS)
    ]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()


def _config(tmp_path: Path, name: str, **step: Any) -> OffloadConfig:
    return OffloadConfig.create(
        nvme_dirs=[tmp_path / name],
        device="cpu",
        device_nbytes=40_000,  # about the largest module's parameters (33 024 B)
        host_nbytes=200_000,  # < params + grads + 12 B/param of state: spills to NVMe
        step=StepConfig(sub_group_numel=4096, **step),
    )


@dataclasses.dataclass
class Run:
    losses: list[float]
    skipped: list[bool]
    params: dict[str, torch.Tensor]
    #: master / exp_avg / exp_avg_sq, every parameter's, flat, end to end
    state: dict[str, torch.Tensor]
    scaler: dict[str, Any] | None = None
    digest: str = ""


def _flat_state(optimizer: OffloadAdamW) -> dict[str, torch.Tensor]:
    saved = optimizer.state_dict()["state"]
    parts = [saved[sg.index] for sg in optimizer.sub_groups]
    return {row: torch.cat([p[row] for p in parts]) for row in ("master", "exp_avg", "exp_avg_sq")}


@pytest.fixture
def slow_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sub-group's AdamW takes 5 ms longer: the next forward catches up with it."""
    real = OffloadAdamW._update

    def slow(self: OffloadAdamW, *args: Any, **kwargs: Any) -> None:
        time.sleep(0.005)
        real(self, *args, **kwargs)

    monkeypatch.setattr(OffloadAdamW, "_update", slow)


def _train(
    tmp_path: Path,
    name: str,
    data: list[list[tuple[torch.Tensor, torch.Tensor]]],
    *,
    dtype: torch.dtype = torch.bfloat16,
    scale: float | None = None,
    **step: Any,
) -> Run:
    """The usual loop (forward, backward, step, zero_grad) over an offloaded model; the
    results are read right after the last step() (its update may still be running)."""
    config = _config(tmp_path, name, **step)
    scaler = None if scale is None else DynamicLossScaler(scale)
    losses: list[float] = []
    skipped: list[bool] = []
    with (
        swapper.offload(_mlp(dtype), config) as wrapped,
        OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped, loss_scaler=scaler) as opt,
    ):
        for micro_batches in data:
            for x, y in micro_batches:
                loss = _loss(wrapped, x, y)
                (loss if scaler is None else scaler.scale(loss)).backward()
                losses.append(loss.item())
            opt.step()
            assert opt.last_step is not None
            skipped.append(opt.last_step.skipped)
            for group in opt.param_groups:
                group["lr"] *= LR_DECAY
            opt.zero_grad()
        digest = final_digest(wrapped, opt)
        state = _flat_state(opt)
        params = wrapped.state_dict()
        stats = wrapped.stats()
        # the state really lived on NVMe: written there and read back
        assert stats.moved_nbytes(Kind.OPTIM_STATE, Tier.NVME, Tier.HOST) > 0
        assert stats.moved_nbytes(Kind.OPTIM_STATE, Tier.HOST, Tier.NVME) > 0
        return Run(
            losses, skipped, params, state, None if scaler is None else scaler.state_dict(), digest
        )


def _reference(
    data: list[list[tuple[torch.Tensor, torch.Tensor]]],
    *,
    dtype: torch.dtype = torch.bfloat16,
    scale: float | None = None,
    max_grad_norm: float | None = None,
) -> Run:
    """In memory, no swapper: a plain 16-bit model, one flat fp32 master vector stepped by
    ``torch._fused_adamw_``; the norm as ``clip_grad_norm_`` takes it, unscaled by the loss
    scale (a power of two: exact); a step with inf/NaN gradients skipped."""
    model = _mlp(dtype)
    params = list(model.parameters())
    master = torch.cat([p.detach().float().reshape(-1) for p in params])
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    scaler = None if scale is None else DynamicLossScaler(scale)
    losses: list[float] = []
    skipped: list[bool] = []
    lr, steps = float(ADAM["lr"]), 0  # type: ignore[arg-type]
    for micro_batches in data:
        for x, y in micro_batches:
            loss = _loss(model, x, y)
            (loss if scaler is None else scaler.scale(loss)).backward()
            losses.append(loss.item())
        grads = [p.grad for p in params]
        assert all(g is not None for g in grads)
        factor = 1.0
        if scaler is not None or max_grad_norm is not None:
            total = torch.nn.utils.get_total_norm([g.float() for g in grads if g is not None])
            if scaler is not None and not torch.isfinite(total):
                scaler.update(True)
                skipped.append(True)
                model.zero_grad()
                lr *= LR_DECAY
                continue
            if scaler is not None:
                total = total / scaler.loss_scale
                factor = 1.0 / scaler.loss_scale
            if max_grad_norm is not None:
                factor *= float(torch.clamp(max_grad_norm / (total + 1e-6), max=1.0))
        grad = torch.cat([g.float().reshape(-1) for g in grads if g is not None])
        if factor != 1.0:
            grad.mul_(factor)
        steps += 1
        torch._fused_adamw_(
            [master],
            [grad],
            [exp_avg],
            [exp_avg_sq],
            [],
            [torch.tensor(float(steps))],
            lr=lr,
            beta1=0.9,
            beta2=0.999,
            weight_decay=float(ADAM["weight_decay"]),  # type: ignore[arg-type]
            eps=float(ADAM["eps"]),  # type: ignore[arg-type]
            amsgrad=False,
            maximize=False,
        )
        offset = 0
        with torch.no_grad():
            for p in params:
                p.view(-1).copy_(master[offset : offset + p.numel()])
                offset += p.numel()
        if scaler is not None:
            scaler.update(False)
        skipped.append(False)
        model.zero_grad()
        lr *= LR_DECAY
    return Run(
        losses,
        skipped,
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        {"master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
        None if scaler is None else scaler.state_dict(),
    )


def _assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for name, value in expected.items():
        assert actual[name].dtype == value.dtype, name
        differing = int((actual[name] != value).sum())
        assert differing == 0, f"{name}: {differing} of {value.numel()} elements differ"


def _assert_same(a: Run, b: Run, *, digest: bool = True) -> None:
    assert a.losses == b.losses
    assert a.skipped == b.skipped
    assert a.scaler == b.scaler
    _assert_bitwise(a.params, b.params)
    _assert_bitwise(a.state, b.state)
    if digest:
        assert a.digest == b.digest


# -- parity -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("micro", "max_grad_norm", "slow"),
    [(1, None, False), (2, 0.05, True), (1, 0.05, True)],
    ids=["plain", "accumulate-2-clip-slow", "clip-slow"],
)
def test_bf16_overlap_bit_identical_to_ordinary_step_and_reference(
    tmp_path: Path,
    request: pytest.FixtureRequest,
    micro: int,
    max_grad_norm: float | None,
    slow: bool,
) -> None:
    data = _data(micro, torch.bfloat16)
    ordinary = _train(tmp_path, "ordinary", data, max_grad_norm=max_grad_norm)
    if slow:
        request.getfixturevalue("slow_update")
    overlapped = _train(tmp_path, "overlap", data, max_grad_norm=max_grad_norm, overlap=True)
    reference = _reference(data, max_grad_norm=max_grad_norm)
    assert len(set(reference.losses)) > 1  # it trains
    _assert_same(overlapped, ordinary)
    _assert_same(overlapped, reference, digest=False)


def test_fp16_overlap_with_skipped_steps_bit_identical(tmp_path: Path, slow_update: None) -> None:
    # 2**21 overflows the first step's fp16 gradients: skipped, the scale halved; the
    # other steps train (both paths of the scaler, overlapped)
    data = _data(1, torch.float16)
    kwargs: dict[str, Any] = {"dtype": torch.float16, "scale": 2.0**21}
    ordinary = _train(tmp_path, "ordinary", data, **kwargs)
    overlapped = _train(tmp_path, "overlap", data, overlap=True, **kwargs)
    reference = _reference(data, **kwargs)
    assert reference.skipped[0] and not all(reference.skipped)
    _assert_same(overlapped, ordinary)
    _assert_same(overlapped, reference, digest=False)


# -- scheduling -----------------------------------------------------------------------------


class Backwards(nn.Module):
    """Registered head first, run body first: index order is not the forward order."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(HIDDEN, IN)
        self.body = nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_sub_groups_run_in_forward_order_and_step_returns_before_they_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    model = Backwards().to(torch.bfloat16)
    order: list[int] = []
    gate_open = threading.Event()
    real = OffloadAdamW._publish

    def publish(self: OffloadAdamW, sg: Any, state: torch.Tensor) -> None:
        assert gate_open.wait(10.0)
        order.append(sg.index)
        real(self, sg, state)

    monkeypatch.setattr(OffloadAdamW, "_publish", publish)
    x = torch.randn(4, IN).bfloat16()
    with (
        swapper.offload(model, _config(tmp_path, "nvme", overlap=True)) as wrapped,
        OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as opt,
    ):
        wrapped(x).float().sum().backward()
        opt.step()  # returns while no sub-group is published yet
        assert opt.step_count == 1 and order == []
        opt.zero_grad()  # deferred: the update still reads the gradients
        gate_open.set()
        opt.wait_pending()
        # parameters in forward order: body.0 (indices 2, 3), body.2 (4, 5), head (0, 1);
        # a sub-group goes by the first of its parameters the forward fetches
        rank = {2: 0, 3: 1, 4: 2, 5: 3, 0: 4, 1: 5}
        expected = sorted(
            range(len(opt.sub_groups)),
            key=lambda i: (min(rank[p.param_index] for p in opt.sub_groups[i].pieces), i),
        )
        assert order == expected and order != sorted(order)
        assert not [k for k in list(wrapped.manager.keys()) if k.startswith("grad/")]


# -- failures and interrupts ---------------------------------------------------------------


class ReadFault:
    """The store's read of sub-group ``index``'s state fails (EIO in the future)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, manager: Any, index: int) -> None:
        self.store = manager._ctx.store
        self.real = self.store.read
        self.index = index
        self.armed = True
        monkeypatch.setattr(self.store, "read", self._read)

    def _read(self, key: str, tensor: torch.Tensor) -> concurrent.futures.Future[int]:
        if self.armed and key.endswith(f"/state/{self.index}"):
            future: concurrent.futures.Future[int] = concurrent.futures.Future()
            future.set_exception(SwapIOError(errno.EIO, f"read {key!r}: injected", "store"))
            return future
        return self.real(key, tensor)


def test_failed_update_surfaces_at_the_forward_naming_its_step_and_retry_applies_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _data(1, torch.bfloat16)
    clean = _train(tmp_path, "clean", data, overlap=True)
    losses: list[float] = []
    with (
        swapper.offload(_mlp(), _config(tmp_path, "faulty", overlap=True)) as wrapped,
        OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as opt,
    ):
        fault: ReadFault | None = None
        for i, ((x, y),) in enumerate(data):
            if fault is not None and fault.armed:
                # step 2's update failed reading sub-group 5, which this forward needs
                with pytest.raises(DeferredStepError, match="step 2") as info:
                    _loss(wrapped, x, y)
                assert info.value.step == 2 and 5 in info.value.undone
                chain, cause = [], info.value.__cause__
                while cause is not None:
                    chain.append(cause)
                    cause = cause.__cause__
                assert any(isinstance(c, SwapIOError) for c in chain), chain
                assert all(not s.users for s in wrapped.core.by_name.values())  # nothing held
                with pytest.raises(DeferredStepError, match="step 2"):
                    opt.state_dict()
                with pytest.raises(StepPendingError, match="step 2"):
                    opt.zero_grad()
                fault.armed = False
                opt.step()  # finishes step 2 (its gradients kept), starts nothing
                assert opt.step_count == 2
                opt.wait_pending()
                opt.zero_grad()
            loss = _loss(wrapped, x, y)
            loss.backward()
            losses.append(loss.item())
            if i == 1:
                fault = ReadFault(monkeypatch, opt.manager, 5)
            opt.step()
            for group in opt.param_groups:
                group["lr"] *= LR_DECAY
            # (step 2's update may have failed already: then zero_grad refuses, as after
            # an ordinary step that failed; the retry above zeroes them either way)
            with contextlib.suppress(StepPendingError):
                opt.zero_grad()
        assert fault is not None and not fault.armed
        assert opt.step_count == STEPS
        params = wrapped.state_dict()
        state = _flat_state(opt)
    assert losses == clean.losses
    _assert_bitwise(params, clean.params)
    _assert_bitwise(state, clean.state)


@pytest.fixture
def cut_at_overlap_wait() -> Iterator[list[str]]:
    """KeyboardInterrupt at the first wait of the main thread for an update."""
    cut: list[str] = []

    def hook(name: str) -> None:
        if (
            name == "step.overlap"
            and not cut
            and threading.current_thread() is threading.main_thread()
        ):
            cut.append(name)
            raise KeyboardInterrupt

    previous = signals.set_wait_hook(hook)
    try:
        yield cut
    finally:
        signals.set_wait_hook(previous)


def test_ctrl_c_while_the_forward_waits_leaves_state_consistent(
    tmp_path: Path, slow_update: None, cut_at_overlap_wait: list[str]
) -> None:
    data = _data(1, torch.bfloat16)
    losses: list[float] = []
    with (
        swapper.offload(_mlp(), _config(tmp_path, "cut", overlap=True)) as wrapped,
        OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as opt,
    ):
        for i, ((x, y),) in enumerate(data):
            if i == 1:
                with pytest.raises(KeyboardInterrupt):
                    _loss(wrapped, x, y)
                assert cut_at_overlap_wait == ["step.overlap"]
                assert all(not s.users for s in wrapped.core.by_name.values())
            loss = _loss(wrapped, x, y)
            loss.backward()
            losses.append(loss.item())
            opt.step()
            for group in opt.param_groups:
                group["lr"] *= LR_DECAY
            opt.zero_grad()
        params = wrapped.state_dict()
        state = _flat_state(opt)
    reference = _reference(data)
    assert losses == reference.losses
    _assert_bitwise(params, reference.params)
    _assert_bitwise(state, reference.state)


# -- settings -------------------------------------------------------------------------------


def test_overlap_settings(tmp_path: Path) -> None:
    with pytest.raises(SwapConfigError, match="overlap"):
        StepConfig(overlap="yes")  # type: ignore[arg-type]
    # plain tensors have no hooks to wait in
    with pytest.raises(SwapConfigError, match=r"overlap=True\) needs tiers"):
        OffloadAdamW(
            _mlp().parameters(),
            tiers=swapper.ManagerConfig(device_nbytes=0, host_nbytes=None),
            config=StepConfig(overlap=True),
        )
    # from the model's config (a dict, as JSON gives it), and one per model
    config = OffloadConfig.from_dict(
        {"device": "cpu", "step": {"sub_group_numel": 4096, "overlap": True}}
    )
    with swapper.offload(_mlp(), config) as wrapped:
        with OffloadAdamW(wrapped.parameters(), tiers=wrapped) as opt:
            assert opt.config.overlap is True and opt._deferred is not None
            with pytest.raises(SwapConfigError, match="one overlapped optimizer"):
                OffloadAdamW(wrapped.parameters(), tiers=wrapped, config=StepConfig(name="b"))
        with OffloadAdamW(
            wrapped.parameters(), tiers=wrapped, config=StepConfig(overlap=False)
        ) as opt:
            assert opt._deferred is None


def _host_use_config(tmp_path: Path, name: str, host: int | None, **step: Any) -> OffloadConfig:
    """Parameters used in the host tier (no device tier): the forward holds them there,
    beside the overlapped update's state."""
    return OffloadConfig.create(
        nvme_dirs=[tmp_path / name],
        device="cpu",
        param_tiers=("host", "nvme"),
        host_nbytes=host,
        timeout_s=20.0,
        step=StepConfig(sub_group_numel=4096, **step),
    )


# the forward holds at most the largest Linear's 33 024 B; the update one streamed
# sub-group's state (4096 x 12 B) and one parameter or gradient (the largest, 32 768 B)
OVERLAP_HOST_NEED = 33_024 + 4096 * 12 + 32_768


def _train_steps(wrapped: Any, opt: OffloadAdamW, steps: int) -> None:
    for ((x, y),) in _data(1, torch.bfloat16)[:steps]:
        _loss(wrapped, x, y).backward()
        opt.step()
        opt.zero_grad()


def test_host_budget_too_small_for_forward_and_update_is_refused_at_setup(
    tmp_path: Path,
) -> None:
    """Where the forward holds parameters in the host tier, a host budget that cannot
    hold them and the update's memory at once is refused when the optimizer is made
    (before, the update waited for room that only the forward frees while the forward
    waited for the update, until the manager's timeout); at the budget it names, the
    overlapped steps run (and a forward keeps its holds for the backward only if every
    parameter fits beside the update: kept, they starved it, 150 000 B timed out)."""
    budget = OVERLAP_HOST_NEED - 1
    with swapper.offload(_mlp(), _host_use_config(tmp_path, "small", budget)) as wrapped:
        message = rf"host_nbytes={budget} cannot hold both.*at least {OVERLAP_HOST_NEED},"
        with pytest.raises(SwapConfigError, match=message):
            OffloadAdamW(
                wrapped.parameters(), **ADAM, tiers=wrapped, config=StepConfig(overlap=True)
            )
        # nothing was left installed: the model takes another optimizer
        with OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as opt:
            assert opt._deferred is None
    for host in (OVERLAP_HOST_NEED, 150_000):
        config = _host_use_config(tmp_path, f"h{host}", host, overlap=True)
        with (
            swapper.offload(_mlp(), config) as wrapped,
            OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as opt,
        ):
            assert wrapped.core.keep_held is False
            _train_steps(wrapped, opt, 3)
            opt.wait_pending()  # (no BudgetTimeout, in the update or in the forward)
            assert opt.step_count == 3


def test_backward_waits_for_the_update_when_the_forward_holds_are_carried(
    tmp_path: Path, slow_update: None
) -> None:
    """Budgets that hold every parameter: the forward's holds are carried over to the
    backward, which then fetches nothing, so no fetch waited for the running update and
    the backward's new gradients were dropped by the update's deferred ``zero_grad``
    (the third step's loss differed). The backward now waits for the update first."""
    digests = []
    for overlap in (True, False):
        config = _host_use_config(tmp_path, f"o{overlap}", None, overlap=overlap)
        with (
            swapper.offload(_mlp(), config) as wrapped,
            OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as opt,
        ):
            assert wrapped.core.keep_held
            _train_steps(wrapped, opt, 3)
            digests.append(final_digest(wrapped, opt))
    assert digests[0] == digests[1]


def test_eviction_order_is_recorded_over_a_whole_overlapped_cycle(tmp_path: Path) -> None:
    """The manager's eviction order holds the update's fetches (every sub-group's state
    and the gradients it reads), not only the forward's and backward's: recorded over
    the first forward and backward, it held one state of 13, and the others ranked as
    never used again (evicted first, never read ahead)."""
    with (
        swapper.offload(_mlp(), _config(tmp_path, "nvme", overlap=True)) as wrapped,
        OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as opt,
    ):
        _train_steps(wrapped, opt, STEPS)
        order = wrapped.manager._ctx.order
        assert order is not None
        keys = set(order.keys)
        states = {k for k in list(wrapped.manager.keys()) if "/state/" in k}
        assert len(states) == len(opt.sub_groups) and states <= keys
        assert {f"grad/{name}" for name, _, _ in wrapped.named_offloaded()} <= keys


def test_pressure_run_overlapped_is_identical_to_the_unlimited_one(tmp_path: Path) -> None:
    """``swapper-pressure --overlap``: the budgeted GPT (tied weights, clipping) overlaps
    its steps, the unlimited reference does not; losses, weights and digest agree."""
    from swapper.pressure.model import GPTConfig
    from swapper.pressure.runner import PressureSettings, run_pressure

    num_params = GPTConfig.for_params(300_000).num_params()
    swap = tmp_path / "swap"
    swap.mkdir()
    settings = PressureSettings(
        params=300_000,
        steps=3,
        device_nbytes=2 * num_params // 4,
        host_nbytes=12 * num_params // 4,
        dirs=(swap,),
        overlap=True,
    )
    result = run_pressure(settings)
    assert result.identical and result.within_budgets
    assert result.losses == result.reference_losses
    assert result.to_json()["overlap"] is True


def test_snapshots_and_resume_with_overlap_end_bit_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slow_update: None
) -> None:
    """tests/ckpt_train.py's run (tiny GPT, tied weights, clipping; a snapshot taken right
    after ``zero_grad()``, while the update runs): overlapped, stopped and resumed, it
    ends with the digest of the ordinary uninterrupted run."""
    import ckpt_train

    ordinary = ckpt_train.train(tmp_path / "ordinary", steps=4, every=2)

    def overlapped(swap: Path, *, host_fraction: float = 0.0, sub_group_numel: int = 1024) -> Any:
        return OffloadConfig.create(
            device_nbytes=ckpt_train.DEVICE_NBYTES,
            host_nbytes=ckpt_train.HOST_NBYTES,
            nvme_dirs=[swap],
            device="cpu",
            step=StepConfig(
                sub_group_numel=sub_group_numel, host_fraction=host_fraction, overlap=True
            ),
        )

    monkeypatch.setattr(ckpt_train, "config", overlapped)
    assert ckpt_train.train(tmp_path / "whole", steps=4, every=2) == ordinary
    ckpt_train.train(tmp_path / "cut", steps=4, every=2, stop_after=3)  # 3 is lost
    assert ckpt_train.train(tmp_path / "cut", steps=4, every=2) == ordinary


@pytest.mark.parametrize("at", [1, 4, 9, 17])
def test_update_cut_at_any_wait_is_finished_once_by_step(tmp_path: Path, at: int) -> None:
    """KeyboardInterrupt raised in the update's thread at its ``at``-th wait point (a
    fetch, a budget wait, a write): the failure surfaces where the update is needed (a
    forward, a backward, a wait), ``step()`` finishes it, and training ends bit-identical
    to the in-memory reference: nothing lost, nothing applied twice."""
    data = _data(1, torch.bfloat16)
    cut: list[str] = []
    waits = 0

    def hook(name: str) -> None:
        nonlocal waits
        if threading.current_thread().name.startswith("swapper-step-") and not cut:
            waits += 1
            if waits == at:
                cut.append(name)
                raise KeyboardInterrupt

    surfaced: list[int] = []
    losses: list[float] = []
    previous = signals.set_wait_hook(hook)
    try:
        with (
            swapper.offload(_mlp(), _config(tmp_path, "cut", overlap=True)) as wrapped,
            OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as opt,
        ):
            for ((x, y),) in data:
                while True:
                    try:
                        loss = _loss(wrapped, x, y)
                        loss.backward()
                        break
                    except DeferredStepError as failed:
                        surfaced.append(failed.step)
                        opt.step()  # finishes that step; starts none
                        opt.zero_grad()
                losses.append(loss.item())
                opt.step()
                for group in opt.param_groups:
                    group["lr"] *= LR_DECAY
                with contextlib.suppress(StepPendingError):
                    opt.zero_grad()
            while True:
                try:
                    opt.wait_pending()
                    break
                except DeferredStepError as failed:
                    surfaced.append(failed.step)
                    opt.step()
            assert opt.step_count == STEPS
            params = wrapped.state_dict()
            state = _flat_state(opt)
    finally:
        signals.set_wait_hook(previous)
    assert cut, f"the update passed fewer than {at} wait points"
    assert len(surfaced) == 1 and 1 <= surfaced[0] <= STEPS
    reference = _reference(data)
    assert losses == reference.losses
    _assert_bitwise(params, reference.params)
    _assert_bitwise(state, reference.state)


@pytest.mark.dist
def test_pressure_cli_overlap_over_ranks_is_bit_identical(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``--overlap`` with ``--nproc 2``: the budgeted ranks overlap, the unlimited ones
    do not, and the runner finds them bit-identical (tests/test_dist_overlap.py proves
    the parity in detail)."""
    from swapper.pressure.cli import main

    report = tmp_path / "r.json"
    argv = ["--overlap", "--nproc", "2", "--batch", "4", "--params", "300000", "--steps", "2"]
    assert main([*argv, "--seq", "16", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "bit-identical to the unlimited ranks" in out, out
