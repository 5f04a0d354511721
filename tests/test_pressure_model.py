"""The pressure-run GPT: shapes, exact parameter count, for_params accuracy, config
validation, streamed (meta, module by module) init equal to all-at-once init, the tied
weight, learning, and bitwise determinism."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swapper.pressure.model import (
    GPT,
    GPTConfig,
    batches,
    init_module_,
    init_weights_,
    materialize_,
)
from swapper.pressure.weights import DrawScratch
from tiers.errors import SwapConfigError

TINY = GPTConfig(vocab_size=64, context=32, d_model=64, n_layers=2, n_heads=2)


def _built(config: GPTConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> GPT:
    model = GPT(config)
    init_weights_(model, seed)
    return model.to(dtype)


def _own_param_modules(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if list(m.parameters(recurse=False))]


def _assert_bitwise_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype, key
        assert torch.equal(sa[key].view(torch.uint8), sb[key].view(torch.uint8)), key


# --- shapes and counts ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_forward_shapes_and_dtypes(dtype: torch.dtype) -> None:
    model = _built(TINY, dtype=dtype)
    tokens = batches(TINY, batch=3, seq=TINY.context, steps=1, seed=0)[0]
    logits = model(tokens)
    assert logits.shape == (3, TINY.context, TINY.vocab_size)
    assert logits.dtype == dtype
    loss = model.loss(tokens)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    loss.backward()
    assert torch.isfinite(loss)
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == dtype, name
        assert torch.isfinite(p.grad).all(), name


def test_loss_accepts_context_plus_one_and_forward_rejects_longer() -> None:
    model = _built(TINY)
    tokens = batches(TINY, batch=2, seq=TINY.context + 1, steps=1, seed=1)[0]
    model.loss(tokens)  # feeds context tokens
    with pytest.raises(SwapConfigError, match="context"):
        model(tokens)
    with pytest.raises(SwapConfigError, match="seq"):
        model.loss(tokens[:, :1])


def test_attention_is_causal() -> None:
    model = _built(TINY)
    tokens = batches(TINY, batch=1, seq=16, steps=1, seed=2)[0]
    changed = tokens.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


@pytest.mark.parametrize(
    "config",
    [
        TINY,
        GPTConfig(vocab_size=100, context=7, d_model=48, n_layers=3, n_heads=4, tie_weights=False),
        GPTConfig(vocab_size=17, context=5, d_model=32, n_layers=1, n_heads=1, mlp_ratio=2),
        GPTConfig.for_params(1_000_000),
    ],
)
def test_num_params_is_exact(config: GPTConfig) -> None:
    model = GPT(config)
    assert config.num_params() == sum(p.numel() for p in model.parameters())
    assert (model.head.weight is model.tok_emb.weight) == config.tie_weights


@pytest.mark.parametrize(
    "target",
    [200_000, 1_000_000, 2_000_000, 3_000_000, 5_000_000, 20_000_000, 100_000_000,
     350_000_000, 1_000_000_000, 7_000_000_000],
)  # fmt: skip
def test_for_params_is_close(target: int) -> None:
    config = GPTConfig.for_params(target)
    assert abs(config.num_params() - target) <= 0.15 * target
    if target >= 500_000:  # documented: d_model = 64 alone reaches ±5% from here
        assert abs(config.num_params() - target) <= 0.05 * target
    assert config.d_model % 64 == 0
    assert config.n_heads == config.d_model // 64 >= 1
    assert config.n_layers >= 1


def test_for_params_shapes_are_sensible() -> None:
    c = GPTConfig.for_params(100_000_000)
    assert 512 <= c.d_model <= 1024 and 8 <= c.n_layers <= 24
    big = GPTConfig.for_params(100_000_000, vocab_size=50_304, context=1024, tie_weights=False)
    assert abs(big.num_params() - 100_000_000) <= 0.05 * 100_000_000
    assert not big.tie_weights and big.vocab_size == 50_304


def test_for_params_too_small_raises() -> None:
    with pytest.raises(SwapConfigError, match="n_params"):
        GPTConfig.for_params(1_000)
    with pytest.raises(SwapConfigError, match="n_params"):
        GPTConfig.for_params(0)


# --- validation -------------------------------------------------------------------------

GOOD = {"vocab_size": 64, "context": 32, "d_model": 64, "n_layers": 2, "n_heads": 2}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("vocab_size", 1),
        ("vocab_size", 64.0),
        ("context", 0),
        ("d_model", -64),
        ("n_layers", 0),
        ("n_layers", True),
        ("n_heads", 0),
        ("n_heads", 3),  # does not divide d_model
        ("mlp_ratio", 0),
        ("tie_weights", 1),
    ],
)
def test_bad_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(SwapConfigError, match=field):
        GPTConfig(**{**GOOD, field: value})  # type: ignore[arg-type]


def test_bad_batches_and_materialize_arguments() -> None:
    with pytest.raises(SwapConfigError, match="seq"):
        batches(TINY, batch=1, seq=TINY.context + 2, steps=1, seed=0)
    with pytest.raises(SwapConfigError, match="batch"):
        batches(TINY, batch=0, seq=4, steps=1, seed=0)
    with pytest.raises(SwapConfigError, match="dtype"):
        with torch.device("meta"):
            model = GPT(TINY)
        materialize_(model, dtype=torch.int64, seed=0)
    with pytest.raises(SwapConfigError, match="meta"):
        materialize_(GPT(TINY), dtype=torch.float32, seed=0)
    with pytest.raises(SwapConfigError, match="meta"):
        with torch.device("meta"):
            model = GPT(TINY)
        init_weights_(model, 0)


def test_init_module_rejects_unknown_module_with_params() -> None:
    with pytest.raises(TypeError, match="Conv1d"):
        init_module_(nn.Conv1d(2, 2, 1), torch.Generator().manual_seed(0))
    init_module_(nn.GELU(), torch.Generator().manual_seed(0))  # no own params: no-op


# --- meta and streamed initialisation ---------------------------------------------------


def test_meta_build_allocates_nothing() -> None:
    config = GPTConfig.for_params(20_000_000_000)  # 80 GB in fp32
    with torch.device("meta"):
        model = GPT(config)
    assert all(p.is_meta for p in model.parameters())
    assert model.head.weight is model.tok_emb.weight
    assert sum(p.numel() for p in model.parameters()) == config.num_params()


def test_init_weights_values() -> None:
    model = _built(TINY)
    assert torch.equal(model.ln_f.weight, torch.ones(TINY.d_model))
    assert torch.equal(model.blocks[0].attn.qkv.bias, torch.zeros(3 * TINY.d_model))
    w = model.blocks[1].mlp.fc.weight
    assert abs(w.mean().item()) < 0.002 and abs(w.std().item() - 0.02) < 0.001
    assert not torch.equal(model.blocks[0].attn.qkv.weight, model.blocks[1].attn.qkv.weight)
    _assert_bitwise_equal(model, _built(TINY))
    assert not torch.equal(model.tok_emb.weight, _built(TINY, seed=1).tok_emb.weight)


def test_tied_weight_initialised_once_by_embedding() -> None:
    untied = GPTConfig(**{**GOOD, "tie_weights": False})
    tied, free = _built(GPTConfig(**GOOD)), _built(untied)
    # the embedding draws first in both; the untied head draws after every other module,
    # so everything before the head matches, and the tied model never re-draws for it
    assert torch.equal(tied.tok_emb.weight, free.tok_emb.weight)
    sd_tied, sd_free = tied.state_dict(), free.state_dict()
    for key in sd_tied:
        if key != "head.weight":
            assert torch.equal(sd_tied[key], sd_free[key]), key


@pytest.mark.parametrize("tie_weights", [True, False])
def test_materialize_equals_init_weights_bf16(tie_weights: bool) -> None:
    config = GPTConfig(**{**GOOD, "tie_weights": tie_weights})
    with torch.device("meta"):
        streamed = GPT(config)
    materialize_(streamed, dtype=torch.bfloat16, seed=7)
    whole = _built(config, seed=7, dtype=torch.bfloat16)
    _assert_bitwise_equal(streamed, whole)
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in streamed.parameters())
    assert (streamed.head.weight is streamed.tok_emb.weight) == tie_weights
    # and init_weights_ on a model already in bf16 draws the same (always drawn in fp32)
    direct = GPT(config).to(torch.bfloat16)
    init_weights_(direct, 7)
    _assert_bitwise_equal(direct, whole)


def test_manual_stream_to_empty_equals_init_weights() -> None:
    """meta → to_empty(recurse=False) → init_module_, module by module (untied: to_empty
    replaces each Parameter, and the streaming API handles ties; this checks the draws)."""
    config = GPTConfig(**{**GOOD, "tie_weights": False})
    with torch.device("meta"):
        model = GPT(config)
    g = torch.Generator().manual_seed(3)
    for module in model.modules():
        module.to_empty(device="cpu", recurse=False)
        init_module_(module, g)
    _assert_bitwise_equal(model, _built(config, seed=3))


def test_draws_in_a_scratch_equal_fresh_draws_and_reuse_its_memory() -> None:
    """The draws made in a reused scratch (every one, some, none) give the same weights;
    the scratch hands out one memory for every draw that fits it."""
    config = GPTConfig(**{**GOOD, "tie_weights": False})
    models = []
    for scratch in (None, DrawScratch(), DrawScratch(max_nbytes=4096)):
        with torch.device("meta"):
            model = GPT(config)
        g = torch.Generator().manual_seed(5)
        for module in model.modules():
            module.to_empty(device="cpu", recurse=False)
            init_module_(module, g, scratch=scratch)
        models.append(model)
    _assert_bitwise_equal(models[0], models[1])
    _assert_bitwise_equal(models[0], models[2])
    scratch = DrawScratch(max_nbytes=1 << 20)
    first = scratch.empty(torch.Size([256, 256]))  # 256 KiB
    assert scratch.empty(torch.Size([8, 8])).data_ptr() == first.data_ptr()
    big = scratch.empty(torch.Size([1 << 19]))  # 2 MiB: past the scratch's 1 MiB
    assert big.shape == (1 << 19,) and big.data_ptr() != first.data_ptr()
    assert scratch.empty(torch.Size([4])).data_ptr() == first.data_ptr()


def test_materialize_keeps_tie_and_calls_on_module_in_order() -> None:
    with torch.device("meta"):
        model = GPT(TINY)
        reference = GPT(TINY)
    expected = _own_param_modules(reference)
    assert expected[0] == "tok_emb" and expected[-1] == "head"
    calls: list[str] = []
    modules = dict(model.named_modules())

    def on_module(name: str, module: nn.Module) -> None:
        assert module is modules[name]
        own = list(module.parameters(recurse=False))
        assert own and all(not p.is_meta and p.dtype == torch.bfloat16 for p in own)
        # streamed: everything after this module is still on meta
        later = expected[expected.index(name) + 1 :]
        for other in later:
            for p in modules[other].parameters(recurse=False):
                assert p.is_meta or p is model.tok_emb.weight, other
        calls.append(name)

    materialize_(model, dtype=torch.bfloat16, seed=0, on_module=on_module)
    assert calls == expected
    assert model.head.weight is model.tok_emb.weight
    assert len(list(model.parameters())) == len(list(reference.parameters()))
    with pytest.raises(SwapConfigError, match="meta"):  # only once
        materialize_(model, dtype=torch.bfloat16, seed=0)


def test_on_module_may_offload_data_and_tie_follows() -> None:
    """The offload moves data out in on_module; the head gets the same Parameter object."""
    with torch.device("meta"):
        model = GPT(TINY)
    stored: dict[str, torch.Tensor] = {}

    def offload(name: str, module: nn.Module) -> None:
        for pname, p in module.named_parameters(recurse=False):
            if p.numel():  # the tied weight arrives already emptied
                stored[f"{name}.{pname}"] = p.data.clone()
                p.data = torch.empty(0, dtype=p.dtype)

    materialize_(model, dtype=torch.bfloat16, seed=5, on_module=offload)
    assert model.head.weight is model.tok_emb.weight
    assert "head.weight" not in stored
    whole = _built(TINY, seed=5, dtype=torch.bfloat16).state_dict()
    assert stored.keys() == whole.keys() - {"head.weight"}
    for key, value in stored.items():
        assert torch.equal(value, whole[key]), key


# --- data, learning, determinism --------------------------------------------------------


def test_batches_deterministic_and_patterned() -> None:
    a = batches(TINY, batch=4, seq=16, steps=3, seed=0)
    b = batches(TINY, batch=4, seq=16, steps=3, seed=0)
    c = batches(TINY, batch=4, seq=16, steps=3, seed=1)
    assert len(a) == 3 and all(t.shape == (4, 16) and t.dtype == torch.int64 for t in a)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    assert all(int(t.min()) >= 0 and int(t.max()) < TINY.vocab_size for t in a)
    # mostly a function of the previous token
    tokens = torch.cat(batches(TINY, batch=64, seq=32, steps=1, seed=0))
    pairs = torch.stack([tokens[:, :-1].reshape(-1), tokens[:, 1:].reshape(-1)], 1)
    follow = {}
    for prev, nxt in pairs.tolist():
        follow.setdefault(prev, []).append(nxt)
    hits = sum(max(v.count(x) for x in set(v)) for v in follow.values())
    assert hits / len(pairs) > 0.85


def _train(config: GPTConfig, dtype: torch.dtype, steps: int, lr: float) -> tuple[GPT, list[float]]:
    torch.manual_seed(0)
    model = _built(config, seed=0, dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for tokens in batches(config, batch=8, seq=config.context + 1, steps=steps, seed=0):
        loss = model.loss(tokens)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, losses


def test_loss_decreases_fp32() -> None:
    _, losses = _train(TINY, torch.float32, steps=20, lr=1e-2)
    assert losses[0] > 3.5  # about ln(64) = 4.16 at init
    assert sum(losses[-3:]) / 3 < 0.75 * losses[0], losses


def test_training_is_bitwise_deterministic_bf16() -> None:
    a, la = _train(TINY, torch.bfloat16, steps=3, lr=1e-3)
    b, lb = _train(TINY, torch.bfloat16, steps=3, lr=1e-3)
    assert la == lb
    _assert_bitwise_equal(a, b)
    assert a.head.weight is a.tok_emb.weight
