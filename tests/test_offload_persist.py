"""Persistent parameters (``swapper.zero.local.persist``, issue 14): with budgets that hold
everything the parameters stay fetched between uses, the module hooks are off and the
gradients are kept by reference. Nothing a user sees changes: the numbers are those of a
run under tight budgets bit for bit (clipping, accumulation, fp16 with skipped steps),
``.grad`` is empty after a backward, ``state_dict()`` and snapshots see every write,
and leaving the mode (a snapshot, ``set_persistent(False)``) gives the gradients back to
the manager's entries.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig
from swapper.step.scaler import DynamicLossScaler
from swapper.zero.checkpoint.snapshot import save_snapshot


def _model(dtype: torch.dtype = torch.bfloat16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Linear(16, 4)).to(dtype)


def _unlimited(nvme: Path | None = None) -> OffloadConfig:
    return OffloadConfig.create(
        device="cpu",
        nvme_dirs=[] if nvme is None else [nvme],
        step=StepConfig(sub_group_numel=256),
    )


def _tight(tmp_path: Path) -> OffloadConfig:
    return OffloadConfig.create(
        device="cpu",
        device_nbytes=700,  # < every parameter (1 160 B): the hooks' full path
        host_nbytes=64_000,
        nvme_dirs=[tmp_path / "tight"],
        step=StepConfig(sub_group_numel=256),
    )


def _x(seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    return model(_x(seed)).float().pow(2).mean()


def _swapper_hooks(module: nn.Module) -> int:
    return len(module._forward_pre_hooks) + len(module._forward_hooks)


def test_no_module_hook_runs_and_no_parameter_is_fetched() -> None:
    plain = _model()
    model = copy.deepcopy(plain)
    user_calls: list[str] = []
    first = model[0].register_forward_pre_hook(lambda m, a: user_calls.append("before"))
    with swapper.offload(model, _unlimited()) as wrapped:
        last = model[0].register_forward_pre_hook(lambda m, a: user_calls.append("after"))
        _loss(wrapped, 0).backward()
        assert wrapped.persistent
        assert _swapper_hooks(model[2]) == 0  # swapper's taken off
        assert list(model[0]._forward_pre_hooks) == [first.id, last.id]  # the user's stay
        keys = [f"param/{name}" for name, _, _ in wrapped.named_offloaded()]
        assert all(wrapped.manager.info(k).users == 1 for k in keys)  # one hold each
        before = wrapped.stats()
        wrapped.zero_grad()
        plain.zero_grad()
        _loss(wrapped, 1).backward()
        _loss(plain, 1).backward()
        assert wrapped.stats().fetches == before.fetches  # nothing fetched at all
        assert all(p.grad is None for p in wrapped.parameters())  # moved out of .grad
        source = wrapped.param_source()
        for (name, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
            assert p.grad is not None
            grad = torch.empty_like(p.grad)
            assert source.read_grad(q, 0, grad.view(-1))
            assert torch.equal(grad, p.grad), name
        # leaving: hooks back where they were, the gradients in the manager's entries
        wrapped.set_persistent(False)
        assert not wrapped.persistent
        assert all(wrapped.manager.info(k).users == 0 for k in keys)
        assert all(p.data.numel() == 0 for p in wrapped.parameters())
        pre = list(model[0]._forward_pre_hooks)
        assert pre[0] == first.id and pre[-1] == last.id and len(pre) == 3
        for name, p in plain.named_parameters():
            entry = wrapped.manager.fetch(f"grad/{name}")
            try:
                assert torch.equal(entry, p.grad), name  # type: ignore[arg-type]
            finally:
                wrapped.manager.release(f"grad/{name}", modified=False)
        user_calls.clear()
        _loss(wrapped, 2)
        assert user_calls == ["before", "after"]
        assert not wrapped.persistent  # (not allowed now)
        wrapped.set_persistent(True)
        _loss(wrapped, 2)
        assert wrapped.persistent


@pytest.mark.parametrize(
    ("max_grad_norm", "micro", "leave"),
    [(None, 1, False), (1e-3, 1, False), (1e-3, 2, False), (1e-3, 2, True)],
)
def test_persistent_training_equals_tight_training(
    max_grad_norm: float | None, micro: int, leave: bool, tmp_path: Path
) -> None:
    """Bit-identical losses, parameters and optimizer state; ``micro`` backwards per step
    add into the gradients kept by reference; ``leave``: persistence ended between the
    backwards and the step (the gradients moved into entries, then added to there) and a
    ``state_dict()`` read every step."""

    Run = tuple[list[float], dict[str, torch.Tensor], list[bool]]

    def train(config: OffloadConfig) -> Run:
        losses, modes = [], []
        params: dict[str, torch.Tensor] = {}
        with swapper.offload(_model(), config) as wrapped:
            step = StepConfig(max_grad_norm=max_grad_norm)
            with OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped, config=step) as opt:
                for i in range(4):
                    for m in range(1, micro):
                        _loss(wrapped, 100 * i + m).backward()
                    if leave and i % 2:
                        wrapped.set_persistent(False)
                    loss = _loss(wrapped, i)
                    loss.backward()
                    modes.append(wrapped.persistent)
                    opt.step()
                    opt.zero_grad()
                    wrapped.set_persistent(True)
                    losses.append(loss.item())
                    if leave:
                        wrapped.state_dict()
                for index, state in opt.state_dict()["state"].items():
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor):
                            params[f"opt/{index}/{k}"] = v.clone()
            params.update(wrapped.iter_state_dict())
            return losses, params, modes

    free_losses, free_params, modes = train(_unlimited())
    tight_losses, tight_params, tight_modes = train(_tight(tmp_path))
    assert not any(tight_modes)
    assert modes == ([True, False, True, False] if leave else [True] * 4)
    assert free_losses == tight_losses
    assert list(free_params) == list(tight_params)
    for name, value in free_params.items():
        assert torch.equal(value, tight_params[name]), name


def test_persistent_fp16_with_skipped_steps_equals_tight(tmp_path: Path) -> None:
    def train(config: OffloadConfig) -> tuple[list[bool], dict[str, torch.Tensor], bool]:
        skipped = []
        with swapper.offload(_model(torch.float16), config) as wrapped:
            scaler = DynamicLossScaler(2.0**18, growth_interval=2)
            step = StepConfig(max_grad_norm=0.5)
            with OffloadAdamW(
                wrapped.parameters(), lr=1e-2, tiers=wrapped, config=step, loss_scaler=scaler
            ) as opt:
                for i in range(8):
                    x = _x(i, torch.float16)
                    for _ in range(2):  # two backwards per step
                        (wrapped(x).float().pow(2).mean() * scaler.loss_scale).backward()
                    opt.step()
                    opt.zero_grad()
                    assert opt.last_step is not None
                    skipped.append(opt.last_step.skipped)
                persistent = wrapped.persistent
            return skipped, dict(wrapped.iter_state_dict()), persistent

    free_skipped, free_params, persistent = train(_unlimited())
    tight_skipped, tight_params, _ = train(_tight(tmp_path))
    assert persistent
    assert free_skipped == tight_skipped
    assert any(free_skipped) and not all(free_skipped), free_skipped
    for name, value in free_params.items():
        assert torch.equal(value, tight_params[name]), name


def _steps(wrapped: swapper.OffloadedModel, opt: OffloadAdamW, seeds: range) -> list[float]:
    losses = []
    for i in seeds:
        loss = _loss(wrapped, i)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_snapshot_taken_persistent_resumes_exactly(tmp_path: Path) -> None:
    """A snapshot taken while persistent, after a write through ``.data`` that no version
    counter shows: the run resumed from it equals the run that went on."""
    swap = tmp_path / "swap"
    with swapper.offload(_model(), _unlimited(swap)) as wrapped:
        opt = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
        _steps(wrapped, opt, range(2))
        assert wrapped.persistent
        wrapped.module[2].bias.data.mul_(2)  # lands in the held bytes: no counter moves
        save_snapshot(wrapped, opt)
        assert not wrapped.persistent  # (until the next forward)
        went_on = _steps(wrapped, opt, range(2, 4))
        assert wrapped.persistent
        final = dict(wrapped.iter_state_dict())
        opt.close()
    with swapper.offload(_model(), _unlimited(swap), resume=True) as wrapped:
        opt = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
        assert opt.step_count == 2
        assert _steps(wrapped, opt, range(2, 4)) == went_on
        for name, value in wrapped.iter_state_dict():
            assert torch.equal(value, final[name]), name
        opt.close()


def test_state_dict_sees_what_is_written_while_persistent() -> None:
    model = _model()
    with swapper.offload(model, _unlimited()) as wrapped:
        opt = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
        _steps(wrapped, opt, range(2))
        assert wrapped.persistent
        # the step's writes
        stepped = {k: v.clone() for k, v in model.state_dict().items()}
        for name, value in wrapped.iter_state_dict():
            assert torch.equal(value, stepped[name]), name
        # a write through .data, and one in place on the parameter
        model[0].weight.data.mul_(2)
        with torch.no_grad():
            model[3].bias.add_(1)
        state = model.state_dict()
        assert torch.equal(state["0.weight"], stepped["0.weight"] * 2)
        assert torch.equal(state["3.bias"], stepped["3.bias"] + 1)
        # a load while persistent: the next forward computes with it
        values = {k: torch.full_like(v, 0.5) for k, v in stepped.items()}
        model.load_state_dict(values)
        assert wrapped.persistent
        reference = copy.deepcopy(_model())
        reference.load_state_dict(values)
        assert torch.equal(wrapped(_x(7)), reference(_x(7)))
        opt.close()
    for name, value in model.state_dict().items():  # unwrap() gives the loaded values back
        assert torch.equal(value, values[name]), name


def test_overlapped_optimizer_ends_persistence(tmp_path: Path) -> None:
    """An overlapped optimizer's gate fetches per piece: persistence ends when it is set
    and does not come back while it is."""
    with swapper.offload(_model(), _unlimited()) as wrapped:
        _loss(wrapped, 0).backward()
        assert wrapped.persistent
        opt = OffloadAdamW(
            wrapped.parameters(), lr=1e-2, tiers=wrapped, config=StepConfig(overlap=True)
        )
        assert not wrapped.persistent
        _steps(wrapped, opt, range(1, 3))
        assert not wrapped.persistent
        opt.close()


def test_grad_reads_none_and_setting_none_keeps_the_gradient() -> None:
    """While autograd keeps the gradients in its own fields, ``.grad`` reads None (as when
    the hooks moved them) and ``param.grad = None`` drops nothing (the retained gradient
    is not ``.grad``): the step sees the whole gradient."""
    plain = _model()
    with swapper.offload(copy.deepcopy(plain), _unlimited()) as wrapped:
        _loss(wrapped, 0).backward()
        assert wrapped.persistent
        for p in wrapped.parameters():
            assert p.grad is None
            p.grad = None
        _loss(plain, 0).backward()
        source = wrapped.param_source()
        for (name, p), q in zip(plain.named_parameters(), wrapped.parameters(), strict=True):
            assert p.grad is not None
            grad = torch.empty_like(p.grad)
            assert source.read_grad(q, 0, grad.view(-1))
            assert torch.equal(grad, p.grad), name


def test_a_forward_cut_while_persistent_and_training_goes_on(tmp_path: Path) -> None:
    """Ctrl-C inside a forward (in a user's hook) while persistent: nothing is held but
    the persistent holds, and the run, that step done again, equals one never cut."""

    def train(config: OffloadConfig, cut: bool) -> dict[str, torch.Tensor]:
        model = _model()
        left = {"cuts": int(cut)}

        def interrupt(module: nn.Module, args: object) -> None:
            if left["cuts"]:
                left["cuts"] -= 1
                raise KeyboardInterrupt

        with swapper.offload(model, config) as wrapped:
            opt = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
            _steps(wrapped, opt, range(1))
            handle = model[2].register_forward_pre_hook(interrupt)
            if cut:
                with pytest.raises(KeyboardInterrupt):
                    _loss(wrapped, 1).backward()
                keys = [f"param/{name}" for name, _, _ in wrapped.named_offloaded()]
                assert all(wrapped.manager.info(k).users == 1 for k in keys)
            _steps(wrapped, opt, range(1, 3))
            handle.remove()
            out = dict(wrapped.iter_state_dict())
            opt.close()
        return out

    cut = train(_unlimited(), True)
    for name, value in train(_tight(tmp_path), False).items():
        assert torch.equal(value, cut[name]), name


class _Checkpointed(nn.Module):
    """The model of ``_model`` with its middle layers under activation checkpointing."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.layers = _model()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        head, middle, tail = self.layers[0], self.layers[1:3], self.layers[3]
        h = head(x)
        h = checkpoint(middle, h, use_reentrant=self.reentrant)
        return tail(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_recompute_while_persistent_equals_tight(reentrant: bool, tmp_path: Path) -> None:
    """Activation checkpointing recomputes with the persistent parameters (no hook runs
    in the recompute either): bit-identical to tight budgets."""

    def train(config: OffloadConfig) -> tuple[list[float], dict[str, torch.Tensor], bool]:
        with swapper.offload(_Checkpointed(reentrant), config) as wrapped:
            opt = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
            x = _x(0).requires_grad_(reentrant)  # (reentrant: an input that needs grad)
            losses = []
            for _ in range(3):
                loss = wrapped(x).float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            persistent = wrapped.persistent
            out = dict(wrapped.iter_state_dict())
            opt.close()
        return losses, out, persistent

    free_losses, free, persistent = train(_unlimited())
    tight_losses, tight, _ = train(_tight(tmp_path))
    assert persistent
    assert free_losses == tight_losses
    for name, value in free.items():
        assert torch.equal(value, tight[name]), name


class _OwnParameter(nn.Parameter):
    """A parameter class of the user's own: not guarded, so its gradient hook stays."""


def test_unguarded_parameters_keep_their_gradient_hooks_and_equal_tight(tmp_path: Path) -> None:
    def train(config: OffloadConfig) -> tuple[dict[str, torch.Tensor], bool, bool]:
        model = _model()
        for module in (model[0], model[2]):
            module.weight = _OwnParameter(module.weight.detach())
        with swapper.offload(model, config) as wrapped:
            opt = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
            for i in range(3):
                for m in range(2):  # accumulated into the gradients held by reference
                    _loss(wrapped, 10 * i + m).backward()
                opt.step()
                opt.zero_grad()  # (held ones dropped: the next step starts afresh)
            persistent, native = wrapped.persistent, wrapped.core.persist.native
            out = dict(wrapped.iter_state_dict())
            opt.close()
        return out, persistent, native

    free, persistent, native = train(_unlimited())
    tight, _, _ = train(_tight(tmp_path))
    assert persistent and not native
    for name, value in free.items():
        assert torch.equal(value, tight[name]), name


def test_a_snapshot_taken_persistent_leaves_out_what_the_hooks_path_does(tmp_path: Path) -> None:
    """Leaving persistence releases a parameter as modified only when it was written
    outside the step (in place, or through ``.data``): a snapshot right after a step
    leaves out (rebuilds at resume) the same parameters as with the hooks' path, and one
    written through ``.data`` while persistent is written, not left out."""
    reports = []
    for persistent, write in ((True, False), (False, False), (True, True)):
        swap = tmp_path / f"swap-{persistent}-{write}"
        with swapper.offload(_model(), _unlimited(swap)) as wrapped:
            wrapped.set_persistent(persistent)
            opt = OffloadAdamW(wrapped.parameters(), lr=1e-2, tiers=wrapped)
            _steps(wrapped, opt, range(2))
            assert wrapped.persistent is persistent
            if write:
                wrapped.module[2].bias.data.add_(1)  # (lost, and refused, if not persistent)
            reports.append(save_snapshot(wrapped, opt))
            opt.close()
    persistent, hooks, written = reports
    assert persistent.rebuilt_nbytes == hooks.rebuilt_nbytes > 0
    assert abs(persistent.written_nbytes - hooks.written_nbytes) < 64  # (the file's names)
    assert written.rebuilt_nbytes == hooks.rebuilt_nbytes - 16 * 2  # 2.bias written
