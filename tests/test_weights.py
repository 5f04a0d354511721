"""swapper.zero.local.weights: an offloaded model's weights are never silently empty (issue 15).

Inside ``with swapper.offload(model, ...)`` the model's own ``state_dict()`` (hence
``torch.save``) gives the real, trained weights; ``load_state_dict`` writes through to the
tiers; after the block (or ``unwrap()``) the parameters are ordinary tensors with the
trained values, or :class:`WeightsDoNotFitError` leaves everything in the tiers. In-place
writes to an offloaded parameter outside the hooks raise :class:`OffloadedWriteError`
naming it; a write made while it is fetched lands. Trained values are compared bit for bit
with a plain PyTorch run (fp32 masters, ``torch.optim.AdamW(fused=True)``).
"""

from __future__ import annotations

import io
import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig, Tier
from swapper.manager import ManagerClosedError
from swapper.pressure.model import GPT, GPTConfig, batches, init_weights_
from swapper.zero.local import weights
from swapper.zero.local.weights import OffloadedWriteError, WeightsDoNotFitError

ADAM = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
STEPS = 3


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(48, 96),
        nn.GELU(),
        nn.LayerNorm(96),
        nn.Linear(96, 80),
        nn.GELU(),
        nn.Linear(80, 24),
    )
    return model.to(torch.bfloat16)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 48, generator=g).bfloat16(), torch.randn(8, 24, generator=g))
        for _ in range(STEPS)
    ]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x).float() - y).pow(2).mean()


def _tight(tmp_path: Path) -> OffloadConfig:
    return OffloadConfig.create(
        nvme_dirs=[tmp_path / "nvme"],
        device="cpu",
        device_nbytes=40_000,  # about twice the largest module (15 520 B)
        host_nbytes=120_000,  # less than params + grads + optimizer state: spills to NVMe
        step=StepConfig(sub_group_numel=4096),
    )


def _plain() -> nn.Sequential:
    """The reference: the same training in plain PyTorch (fp32 masters, fused AdamW)."""
    model = _mlp()
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    optimizer = torch.optim.AdamW(masters, **ADAM, fused=True)  # type: ignore[arg-type]
    for x, y in _data():
        _loss(model, x, y).backward()
        for param, master in zip(params, masters, strict=True):
            assert param.grad is not None
            master.grad, param.grad = param.grad.float(), None
        optimizer.step()
        with torch.no_grad():
            for param, master in zip(params, masters, strict=True):
                param.copy_(master)
    return model


def _train(wrapped: swapper.OffloadedModel, optimizer: OffloadAdamW) -> None:
    for x, y in _data():
        _loss(wrapped, x, y).backward()
        optimizer.step()
        optimizer.zero_grad()


def _assert_bitwise(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for name, value in expected.items():
        got = actual[name]
        assert got.shape == value.shape and got.dtype == value.dtype, name
        assert torch.equal(got, value), f"{name} differs"


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _plain().state_dict().items()}


# -- state_dict inside and after the block --------------------------------------------------


def test_state_dict_inside_and_after_equals_trained_values(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    model = _mlp()
    with swapper.offload(model, _tight(tmp_path)) as wrapped:
        with OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as optimizer:
            _train(wrapped, optimizer)
        assert wrapped.stats().moved(Tier.HOST, Tier.NVME).nbytes > 0  # really spilled
        # the model's own state_dict (what torch.save / save_pretrained call) and a
        # sub-module's, with its prefix; the parameters stay offloaded
        _assert_bitwise(model.state_dict(), reference)
        _assert_bitwise(wrapped.state_dict(), reference)
        _assert_bitwise(
            model[3].state_dict(prefix="3."),
            {k: v for k, v in reference.items() if k.startswith("3.")},
        )
        assert all(p.numel() == 0 for p in model.parameters())
    # after the block: ordinary tensors with the trained values, the tiers gone
    assert all(type(p) is nn.Parameter and p.numel() > 0 for p in model.parameters())
    _assert_bitwise(model.state_dict(), reference)
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").rglob("*.bin"))
    x, _ = _data()[0]
    plain = _mlp()
    plain.load_state_dict(reference)
    assert torch.equal(model(x), plain(x))  # runs as a plain model, no hooks


def test_torch_save_load_round_trip_inside(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    model = _mlp()
    with swapper.offload(model, _tight(tmp_path)) as wrapped:
        with OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as optimizer:
            _train(wrapped, optimizer)
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    _assert_bitwise(loaded, reference)

    # and back into another offloaded model: written through to the tiers
    other = _mlp(seed=5)
    with swapper.offload(other, _tight(tmp_path / "b")) as wrapped:
        result = other.load_state_dict(loaded)
        assert not result.missing_keys and not result.unexpected_keys
        _assert_bitwise(wrapped.state_dict(), reference)
        x, _ = _data()[0]
        plain = _mlp()
        plain.load_state_dict(reference)
        with torch.no_grad():
            assert torch.equal(wrapped(x), plain(x))
    _assert_bitwise(other.state_dict(), reference)


def test_load_state_dict_size_mismatch_names_the_real_shape(tmp_path: Path) -> None:
    model = _mlp()
    with swapper.offload(model, _tight(tmp_path)):
        bad = dict(model.state_dict())
        bad["0.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match=r"0\.weight.*\[3, 3\].*\[96, 48\]"):
            model.load_state_dict(bad)


def test_offloaded_sub_module_inside_a_plain_parent_round_trips(tmp_path: Path) -> None:
    parent = nn.Sequential(nn.Linear(4, 4).bfloat16())
    inner = _mlp()
    expected = {f"1.module.{k}": v.clone() for k, v in inner.state_dict().items()}
    with swapper.offload(inner, _tight(tmp_path)) as wrapped:
        parent.append(wrapped)
        saved = parent.state_dict()
        assert {k: v for k, v in saved.items() if k.startswith("1.")}.keys() == expected.keys()
        _assert_bitwise({k: saved[k] for k in expected}, expected)
        parent.load_state_dict(saved)  # the keys a parent's load expects
        _assert_bitwise(wrapped.state_dict(prefix="1.module."), expected)


def test_tied_weights_saved_under_both_names_and_stay_tied(tmp_path: Path) -> None:
    config = GPTConfig(vocab_size=64, context=16, d_model=32, n_layers=2, n_heads=2)
    model = GPT(config).to(torch.bfloat16)
    init_weights_(model, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = batches(config, batch=2, seq=9, steps=1, seed=0)[0]
    with swapper.offload(model, OffloadConfig.create(device="cpu")):
        inside = model.state_dict()
        with torch.no_grad():
            loss = model.loss(tokens)
    _assert_bitwise(inside, before)
    assert model.head.weight is model.tok_emb.weight
    _assert_bitwise(model.state_dict(), before)
    with torch.no_grad():
        assert torch.equal(model.loss(tokens), loss)


# -- unwrap, and weights that do not fit ------------------------------------------------


def test_unwrap_gives_the_weights_back_and_closes(tmp_path: Path) -> None:
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = swapper.offload(model, _tight(tmp_path))
    assert wrapped.unwrap() is model
    _assert_bitwise(model.state_dict(), before)
    with pytest.raises(ManagerClosedError):
        wrapped.unwrap()
    wrapped.close()  # idempotent
    swapper.offload(model, OffloadConfig.create(device="cpu")).close()  # may wrap again


def test_weights_that_do_not_fit_raise_and_stay_in_the_tiers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(weights, "available_nbytes", lambda device: 1000)
    wrapped = swapper.offload(model, _tight(tmp_path))
    with pytest.raises(WeightsDoNotFitError, match=r"iter_state_dict\(\)") as raised, wrapped:
        pass
    assert isinstance(raised.value, MemoryError)
    # nothing changed: still offloaded and usable; the weights stream out
    assert all(p.numel() == 0 for p in model.parameters())
    _assert_bitwise(dict(wrapped.iter_state_dict()), before)
    x, _ = _data()[0]
    with torch.no_grad():
        wrapped(x)
    monkeypatch.undo()
    wrapped.unwrap()
    _assert_bitwise(model.state_dict(), before)


def test_block_that_raised_keeps_its_error_when_weights_do_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(weights, "available_nbytes", lambda device: 1000)
    wrapped = swapper.offload(model, _tight(tmp_path))
    with pytest.raises(ValueError, match="the block's own"), wrapped:
        raise ValueError("the block's own")
    assert "still in the tiers" in caplog.text
    _assert_bitwise(dict(wrapped.iter_state_dict()), before)  # nothing lost
    wrapped.close()


def test_unwrap_inside_a_forward_raises_and_changes_nothing(tmp_path: Path) -> None:
    model = _mlp()
    wrapped = swapper.offload(model, _tight(tmp_path))
    raised: list[BaseException] = []

    def unwrap_now(module: nn.Module, args: object) -> None:
        try:
            wrapped.unwrap()
        except swapper.SwapConfigError as exc:
            raised.append(exc)

    handle = model[3].register_forward_pre_hook(unwrap_now)
    with torch.no_grad():
        wrapped(_data()[0][0])
    handle.remove()
    assert len(raised) == 1 and "in use" in str(raised[0])
    assert all(p.numel() == 0 for p in model.parameters())  # still offloaded
    wrapped.unwrap()
    assert all(p.numel() > 0 for p in model.parameters())


def test_state_dict_after_close_raises_instead_of_saving_empty(tmp_path: Path) -> None:
    model = _mlp()
    wrapped = swapper.offload(model, _tight(tmp_path))
    wrapped.close()
    with pytest.raises(ManagerClosedError, match="unwrap"):
        model.state_dict()


# -- writes outside the hooks ------------------------------------------------------------


def _init_normal(param: nn.Parameter) -> None:
    torch.nn.init.normal_(param)


def _zero(param: nn.Parameter) -> None:
    with torch.no_grad():
        param.zero_()


def _data_normal(param: nn.Parameter) -> None:
    param.data.normal_(mean=0.0, std=0.02)  # as Hugging Face's _init_weights


def _data_fill(param: nn.Parameter) -> None:
    param.data.fill_(1.0)


@pytest.mark.parametrize(
    "write",
    [_init_normal, _zero, _data_normal, _data_fill],
    ids=["init.normal_", "zero_", "data.normal_", "data.fill_"],
)
@pytest.mark.parametrize("then", ["forward", "state_dict", "unwrap"])
def test_write_outside_hooks_raises_naming_the_parameter(
    tmp_path: Path, write: object, then: str
) -> None:
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    wrapped = swapper.offload(model, _tight(tmp_path))
    try:
        write(model[3].weight)  # type: ignore[operator]
        with pytest.raises(OffloadedWriteError, match=r"'3\.weight'.*load_state_dict"):
            if then == "forward":
                wrapped(_data()[0][0])
            elif then == "state_dict":
                model.state_dict()
            else:
                wrapped.unwrap()
        # raised once; the parameter keeps the value the tiers hold
        _assert_bitwise(model.state_dict(), before)
    finally:
        wrapped.close()


def test_copy_into_data_outside_hooks_raises(tmp_path: Path) -> None:
    model = _mlp()
    with swapper.offload(model, _tight(tmp_path)), pytest.raises(RuntimeError):
        model[0].weight.data.copy_(torch.ones(96, 48))


def test_write_while_fetched_lands_in_the_tiers(tmp_path: Path) -> None:
    model = _mlp()
    expected = model[5].weight.detach() * 2  # exact in bf16

    def double(module: nn.Module, args: object) -> None:
        with torch.no_grad():
            module.weight.mul_(2)

    with swapper.offload(model, _tight(tmp_path)) as wrapped:
        # a clean copy on NVMe first: a release that called the write clean would drop it
        wrapped.manager.evict("param/5.weight", Tier.NVME).result(timeout=20)
        handle = model[5].register_forward_pre_hook(double)  # runs after swapper's fetch
        with torch.no_grad():
            wrapped(_data()[0][0])
        handle.remove()
        # evicted to NVMe and read back: the write was kept
        wrapped.manager.evict("param/5.weight", Tier.NVME).result(timeout=20)
        assert torch.equal(model.state_dict()["5.weight"], expected)
    assert torch.equal(model[5].weight.detach(), expected)


# -- a property: whatever is loaded comes back, inside and after ------------------------------


@settings(max_examples=15, deadline=None)
@given(
    widths=st.lists(st.integers(1, 33), min_size=2, max_size=4),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_load_then_save_round_trip(widths: list[int], dtype: torch.dtype, seed: int) -> None:
    layers = [nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    model = nn.Sequential(*layers).to(dtype)
    g = torch.Generator().manual_seed(seed)
    values = {k: torch.randn(v.shape, generator=g).to(dtype) for k, v in model.state_dict().items()}
    with swapper.offload(model, OffloadConfig.create(device="cpu")):
        model.load_state_dict(values)
        _assert_bitwise(model.state_dict(), values)
    _assert_bitwise(model.state_dict(), values)
