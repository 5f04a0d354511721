"""``swapper.offload`` with budgets that hold everything (issue 14): the fast paths that make
it cost what plain PyTorch costs, and that they change no number.

- a forward's holds are kept for its backward (one fetch per parameter and step);
- nothing moves between tiers once every parameter is in the use tier (the optimizer
  writes the parameters where they are; no read-ahead is asked for);
- the gradients' norms are taken by the step, in batches, rounded as one at a time;
- a kept hold is never relied on: a second backward through a retained graph, a forward
  without a backward, a step after such a forward all see the parameters' real bytes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig, Tier
from swapper.step.clip import grad_norm32


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Linear(16, 4)).to(
        torch.bfloat16
    )


def _unlimited() -> OffloadConfig:
    return OffloadConfig.create(device="cpu", step=StepConfig(sub_group_numel=256))


def _tight(tmp_path: object) -> OffloadConfig:
    return OffloadConfig.create(
        device="cpu",
        device_nbytes=700,  # < every parameter (1 160 B): holds are not kept
        host_nbytes=64_000,
        nvme_dirs=[tmp_path / "nvme"],  # type: ignore[operator]
        step=StepConfig(sub_group_numel=256),
    )


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return model(x).float().pow(2).mean()


def _param_keys(wrapped: swapper.OffloadedModel) -> list[str]:
    return [f"param/{name}" for name, _, _ in wrapped.named_offloaded()]


def test_one_fetch_per_parameter_and_nothing_moves_between_tiers() -> None:
    with swapper.offload(_model(), _unlimited()) as wrapped:
        wrapped.set_persistent(False)  # the hooks' path (persistent: test_persistent_*)
        optimizer = OffloadAdamW(wrapped.parameters(), tiers=wrapped)
        for step in range(2):  # the first records the order
            _loss(wrapped, step).backward()
            optimizer.step()
            optimizer.zero_grad()
        keys = _param_keys(wrapped)
        before = wrapped.stats()
        _loss(wrapped, 2).backward()
        during = wrapped.stats()
        optimizer.step()
        optimizer.zero_grad()
        after = wrapped.stats()
        # forward + backward: each parameter fetched once (kept for its backward), and
        # each gradient entry once (kept by zero_grad, the gradient copied into it)
        assert during.fetches - before.fetches == 2 * len(keys)
        # the step: each parameter and gradient fetched once, each sub-group's state once
        # (fetched per piece, the gradients again for their norms: 3 per parameter)
        assert after.fetches - during.fetches == 2 * len(keys) + len(optimizer.sub_groups)
        # ... and converts the gradients to fp32 once, into one flat vector (their norms
        # and the sub-groups' gradients are views of it)
        flat = optimizer._flat._buffers
        assert [t.numel() for t in flat] == [sum(p.numel() for p in _model().parameters())]
        assert during.prefetch_misses == before.prefetch_misses
        # the step writes every parameter where it is: no copy between tiers
        for src, dst in ((Tier.DEVICE, Tier.HOST), (Tier.HOST, Tier.DEVICE)):
            assert after.moved(src, dst).nbytes == before.moved(src, dst).nbytes
        assert all(wrapped.manager.info(k).tier is Tier.DEVICE for k in keys)
        assert all(wrapped.manager.info(k).users == 0 for k in keys)  # nothing left held
        assert [p.data.numel() for p in wrapped.module.parameters()] == [0] * len(keys)


def test_holds_are_not_kept_under_a_budget_that_cannot_hold_every_parameter(
    tmp_path: object,
) -> None:
    with swapper.offload(_model(), _tight(tmp_path)) as wrapped:
        _loss(wrapped, 0).backward()
        wrapped.zero_grad()  # (the next gradients are registered, not fetched and added to)
        before = wrapped.stats()
        loss = _loss(wrapped, 1)
        # after the forward nothing is held: each module released what it fetched
        assert all(wrapped.manager.info(k).users == 0 for k in _param_keys(wrapped))
        loss.backward()
        assert wrapped.stats().fetches - before.fetches == 2 * len(_param_keys(wrapped))


@pytest.mark.parametrize("budgets", ["unlimited", "tight"])
def test_second_backward_through_a_retained_graph(budgets: str, tmp_path: object) -> None:
    """The first backward releases the kept holds; the second fetches again (its module
    hooks run once per backward) and adds the same gradients: 2 g, as plain PyTorch."""
    plain = _model()
    offloaded = copy.deepcopy(plain)
    loss = _loss(plain, 0)
    loss.backward(retain_graph=True)
    loss.backward()
    config = _unlimited() if budgets == "unlimited" else _tight(tmp_path)
    with swapper.offload(offloaded, config) as wrapped:
        loss = _loss(wrapped, 0)
        loss.backward(retain_graph=True)
        loss.backward()
        source = wrapped.param_source()
        for (name, param), offloaded_param in zip(
            plain.named_parameters(), wrapped.parameters(), strict=True
        ):
            assert param.grad is not None
            retained = torch.empty_like(param.grad)
            assert source.read_grad(offloaded_param, 0, retained.view(-1))
            assert torch.equal(retained, param.grad), name


@pytest.mark.parametrize("persistent", [True, False])
def test_forward_without_backward_then_a_step_and_training_goes_on(persistent: bool) -> None:
    """Holds kept from a forward whose backward never runs are released before the step
    writes the parameters (no 'in use' error) and by the next forward; a backward of an
    older graph after a newer forward still sees real bytes. Persistent parameters hold
    one fetch each throughout (swapper.zero.local.persist)."""
    with swapper.offload(_model(), _unlimited()) as wrapped:
        wrapped.set_persistent(persistent)
        optimizer = OffloadAdamW(wrapped.parameters(), tiers=wrapped)
        _loss(wrapped, 0)  # no backward
        optimizer.step()  # steps with zero gradients: nothing held blocks the writes
        keys = _param_keys(wrapped)
        assert wrapped.persistent is persistent
        assert all(wrapped.manager.info(k).users == int(persistent) for k in keys)
        first = _loss(wrapped, 1)
        _loss(wrapped, 2)  # a second forward (forward() releases the first's kept holds)
        first.backward()  # its modules fetch again
        optimizer.step()
        optimizer.zero_grad()
        assert all(wrapped.manager.info(k).users == int(persistent) for k in keys)
        assert all(torch.isfinite(p).all() for _, p in wrapped.iter_state_dict())


def test_norms_left_to_the_step_equal_those_taken_in_the_backward(tmp_path: object) -> None:
    """Unlimited budgets: the backward takes no norm, the step's batched norms equal
    ``grad_norm32`` of each gradient alone (what a tight run takes in the backward)."""
    with swapper.offload(_model(), _unlimited()) as wrapped:
        wrapped.set_persistent(False)  # (persistent: autograd's own fields until read)
        _loss(wrapped, 0).backward()
        _loss(wrapped, 1).backward()  # accumulated
        slots = list(wrapped.core.by_name.values())
        assert all(slot.has_grad and slot.grad_norm is None for slot in slots)
        source = wrapped.param_source()
        params = list(wrapped.parameters())
        norms = source.grad_norms(params)
        for slot, param, norm in zip(slots, params, norms, strict=True):
            grad = torch.empty(slot.shape, dtype=slot.dtype)
            assert source.read_grad(param, 0, grad.view(-1))
            assert torch.equal(norm, grad_norm32([grad])[0]), slot.name
        assert all(slot.grad_norm is not None for slot in slots)  # taken once
    with swapper.offload(_model(), _tight(tmp_path)) as wrapped:
        _loss(wrapped, 0).backward()
        assert all(slot.grad_norm is not None for slot in wrapped.core.by_name.values())


@pytest.mark.parametrize(("max_grad_norm", "micro"), [(None, 1), (1e-3, 1), (1e-3, 2)])
def test_unlimited_training_equals_tight_training(
    max_grad_norm: float | None, micro: int, tmp_path: object
) -> None:
    """Bit-identical losses and parameters with and without the fast paths (clipping
    makes the batched norms count; ``micro`` backwards per step add into gradient entries
    that ``zero_grad`` kept, with unlimited budgets)."""

    def train(config: OffloadConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
        losses = []
        with swapper.offload(_model(), config) as wrapped:
            step = StepConfig(max_grad_norm=max_grad_norm)
            with OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped, config=step) as opt:
                for i in range(4):
                    for m in range(1, micro):
                        _loss(wrapped, 100 * i + m).backward()
                    loss = _loss(wrapped, i)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
            return losses, dict(wrapped.iter_state_dict())

    free_losses, free_params = train(_unlimited())
    tight_losses, tight_params = train(_tight(tmp_path))
    assert free_losses == tight_losses
    assert list(free_params) == list(tight_params)
    for name, value in free_params.items():
        assert torch.equal(value, tight_params[name]), name


def test_unlimited_fp16_with_overflow_skips_equals_tight(tmp_path: object) -> None:
    """fp16 with a dynamic loss scale that overflows at first (those steps skipped, the
    scale halved): the flat fp32 gradients are unscaled and clipped in place, and a
    skipped step leaves them to be refilled. Bit-identical to tight budgets."""
    from swapper.step.scaler import DynamicLossScaler

    def train(config: OffloadConfig) -> tuple[list[bool], dict[str, torch.Tensor]]:
        skipped = []
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).to(torch.float16)
        with swapper.offload(model, config) as wrapped:
            scaler = DynamicLossScaler(2.0**18, growth_interval=2)
            step = StepConfig(max_grad_norm=0.5)
            with OffloadAdamW(
                wrapped.parameters(), lr=1e-2, tiers=wrapped, config=step, loss_scaler=scaler
            ) as opt:
                for i in range(8):
                    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i)).half()
                    (wrapped(x).float().pow(2).mean() * scaler.loss_scale).backward()
                    opt.step()
                    opt.zero_grad()
                    assert opt.last_step is not None
                    skipped.append(opt.last_step.skipped)
            return skipped, dict(wrapped.iter_state_dict())

    free_skipped, free_params = train(_unlimited())
    tight_skipped, tight_params = train(_tight(tmp_path))
    assert free_skipped == tight_skipped, free_skipped
    assert any(free_skipped) and not all(free_skipped), free_skipped
    for name, value in free_params.items():
        assert torch.equal(value, tight_params[name]), name
