"""A small deterministic GPT for memory-pressure runs.

The model is built to be trained under a ZeRO-3-style parameter offload, whose module
forward pre-hooks fetch each module's *own* parameters (``parameters(recurse=False)``)
just before the module runs and release them after. So:

- every parameter belongs to a leaf module (``nn.Embedding``, ``nn.Linear``,
  ``nn.LayerNorm``) that is run through ``__call__``; no forward reads another module's
  parameter;
- with ``tie_weights`` the lm head is an ``nn.Linear`` whose ``weight`` *is* the token
  embedding's Parameter: one Parameter, used by two modules in one forward.

Module tree (names as in ``named_modules()``, which is also the initialisation order)::

    tok_emb            nn.Embedding(vocab_size, d_model)
    pos_emb            nn.Embedding(context, d_model)
    blocks.{i}.ln1     nn.LayerNorm(d_model)
    blocks.{i}.attn.qkv   nn.Linear(d_model, 3 * d_model)
    blocks.{i}.attn.proj  nn.Linear(d_model, d_model)
    blocks.{i}.ln2     nn.LayerNorm(d_model)
    blocks.{i}.mlp.fc     nn.Linear(d_model, mlp_ratio * d_model)
    blocks.{i}.mlp.act    nn.GELU()
    blocks.{i}.mlp.proj   nn.Linear(mlp_ratio * d_model, d_model)
    ln_f               nn.LayerNorm(d_model)
    head               nn.Linear(d_model, vocab_size, bias=False)  (weight tied to tok_emb)

Parameter count (``V`` vocab_size, ``C`` context, ``d`` d_model, ``L`` n_layers, ``r``
mlp_ratio)::

    V*d + C*d + L * ((4 + 2r)*d^2 + (9 + r)*d) + 2*d + (0 if tie_weights else V*d)

(per block: ln1 2d, qkv 3d^2+3d, proj d^2+d, ln2 2d, fc r*d^2+r*d, proj r*d^2+d.)

Initialisation is streamable: a model built under ``torch.device("meta")`` can be
materialised one module at a time (:func:`materialize_`) and ends up bit-identical to a
model built normally and initialised all at once (:func:`init_weights_`), because both
walk ``named_modules()`` in the same order, draw from one generator seeded once, and
always draw in fp32 on the CPU whatever the parameter's dtype or device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from swapper.pressure.weights import init_module_, init_weights_, materialize_
from tiers.errors import SwapConfigError

__all__ = [
    "GPT",
    "MLP",
    "Block",
    "CausalSelfAttention",
    "GPTConfig",
    "batches",
    "init_module_",
    "init_weights_",
    "materialize_",
]

#: Width of every attention head, in elements; d_model chosen by for_params is a multiple.
HEAD_DIM = 64
#: Standard deviation of the normal init of Linear and Embedding weights.
#: for_params prefers shapes whose d_model / n_layers is closest to this (GPT-2 small: 768/12).
_TARGET_ASPECT = 64.0
#: for_params picks by aspect only among shapes within this relative error of the target.
_PREFERRED_REL_ERROR = 0.05
#: for_params raises when no shape comes within this relative error of the target.
MAX_REL_ERROR = 0.15


def _check_int(name: str, value: object, minimum: int) -> None:
    """Raise SwapConfigError unless ``value`` is an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SwapConfigError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise SwapConfigError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`.

    Attributes:
        vocab_size: number of token ids (>= 2).
        context: longest sequence the model accepts, in tokens (>= 1); the size of the
            learned position embedding.
        d_model: width of the residual stream, in elements (>= 1, a multiple of n_heads).
        n_layers: number of transformer blocks (>= 1).
        n_heads: attention heads per block (>= 1).
        mlp_ratio: hidden width of the MLP as a multiple of d_model (>= 1).
        tie_weights: the lm head's weight is the token embedding's Parameter.

    Raises:
        SwapConfigError: a field has a value that cannot work; the message names it.
    """

    vocab_size: int
    context: int
    d_model: int
    n_layers: int
    n_heads: int
    mlp_ratio: int = 4
    tie_weights: bool = True

    def __post_init__(self) -> None:
        _check_int("vocab_size", self.vocab_size, 2)
        _check_int("context", self.context, 1)
        _check_int("d_model", self.d_model, 1)
        _check_int("n_layers", self.n_layers, 1)
        _check_int("n_heads", self.n_heads, 1)
        _check_int("mlp_ratio", self.mlp_ratio, 1)
        if not isinstance(self.tie_weights, bool):
            raise SwapConfigError(f"tie_weights must be a bool, got {self.tie_weights!r}")
        if self.d_model % self.n_heads:
            raise SwapConfigError(
                f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads}); "
                f"pick n_heads dividing d_model, e.g. d_model // {HEAD_DIM}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head, in elements."""
        return self.d_model // self.n_heads

    def num_params(self) -> int:
        """Exact number of parameter elements of ``GPT(self)``, tied weights counted once."""
        return _count(
            self.vocab_size, self.context, self.d_model, self.n_layers, self.mlp_ratio,
            self.tie_weights,
        )  # fmt: skip

    @classmethod
    def for_params(
        cls,
        n_params: int,
        *,
        vocab_size: int = 512,
        context: int = 128,
        mlp_ratio: int = 4,
        tie_weights: bool = True,
    ) -> GPTConfig:
        """A config whose :meth:`num_params` is close to ``n_params``.

        ``d_model`` is a multiple of 64 with ``n_heads = d_model // 64`` (head width 64),
        ``n_layers >= 1``. For every such width the nearest layer count is taken; among the
        shapes within ±5% of the target, the one whose ``d_model / n_layers`` is closest
        (in log scale) to 64 wins (ties: smaller error, then smaller width); when none is
        within ±5%, the shape with the smallest error wins.

        Accuracy: the result is always within ±15% of ``n_params``, or this raises. With
        d_model = 64 a layer adds ``12*64^2 + 13*64 = 49 984`` parameters (for
        mlp_ratio 4), so the nearest layer count is within ±25 000 of the target: with
        the default vocab_size and context, every target of 500 000 or more comes within
        ±5% and every target of 170 000 or more within ±15%; smaller targets may raise.

        Args:
            n_params: wanted number of parameter elements (>= 1).
            vocab_size: as :class:`GPTConfig`.
            context: as :class:`GPTConfig`, in tokens.
            mlp_ratio: as :class:`GPTConfig`.
            tie_weights: as :class:`GPTConfig`.

        Raises:
            SwapConfigError: a value is invalid, or ``n_params`` is too small for any shape
                to come within ±15% (the embeddings alone may exceed it: lower vocab_size
                or context, or ask for more parameters).
        """
        _check_int("n_params", n_params, 1)
        _check_int("vocab_size", vocab_size, 2)
        _check_int("context", context, 1)
        _check_int("mlp_ratio", mlp_ratio, 1)
        best_key: tuple[int, float, float, int] | None = None
        best: tuple[int, int] | None = None
        d = HEAD_DIM
        while True:
            fixed = _count(vocab_size, context, d, 0, mlp_ratio, tie_weights)
            per_layer = _count(vocab_size, context, d, 1, mlp_ratio, tie_weights) - fixed
            if d > HEAD_DIM and fixed + per_layer > n_params * (1 + MAX_REL_ERROR):
                break  # wider models only get larger
            n_layers = max(1, round((n_params - fixed) / per_layer))
            rel = abs(fixed + n_layers * per_layer - n_params) / n_params
            aspect = abs(math.log(d / n_layers / _TARGET_ASPECT))
            # within ±5%: closest aspect first; otherwise: smallest error first
            key = (0, aspect, rel, d) if rel <= _PREFERRED_REL_ERROR else (1, rel, aspect, d)
            if best_key is None or key < best_key:
                best_key, best = key, (d, n_layers)
            d += HEAD_DIM
        if best is None:  # unreachable: the loop always scores d = 64
            raise SwapConfigError(f"n_params={n_params}: no shape found")
        d, n_layers = best
        config = cls(
            vocab_size=vocab_size, context=context, d_model=d, n_layers=n_layers,
            n_heads=d // HEAD_DIM, mlp_ratio=mlp_ratio, tie_weights=tie_weights,
        )  # fmt: skip
        got = config.num_params()
        if abs(got - n_params) > MAX_REL_ERROR * n_params:
            raise SwapConfigError(
                f"n_params={n_params} is too small: the smallest model with vocab_size="
                f"{vocab_size} and context={context} has {got} parameters, more than "
                f"{MAX_REL_ERROR:.0%} away; ask for more parameters or lower vocab_size/context"
            )
        return config


def _count(
    vocab_size: int, context: int, d: int, n_layers: int, mlp_ratio: int, tie_weights: bool
) -> int:
    """The parameter-count formula of the module docstring, in elements."""
    per_layer = (4 + 2 * mlp_ratio) * d * d + (9 + mlp_ratio) * d
    head = 0 if tie_weights else vocab_size * d
    return vocab_size * d + context * d + n_layers * per_layer + 2 * d + head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection, written in plain
    matmul/softmax ops (deterministic on the CPU); the softmax runs in fp32."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [B, T, d_model] → [B, T, d_model]."""
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # [B, H, T, hd]
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu_(1)
        scores = scores.masked_fill(mask, float("-inf"))
        att = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class MLP(nn.Module):
    """Linear → GELU → Linear, hidden width ``mlp_ratio * d_model``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [B, T, d_model] → [B, T, d_model]."""
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [B, T, d_model] → [B, T, d_model]."""
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style decoder; see the module docstring for the module tree.

    Builds under ``torch.device("meta")`` without allocating. The parameters a normal
    construction gets come from PyTorch's default init; call :func:`init_weights_` (or
    build on meta and call :func:`materialize_`) for the deterministic init.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise SwapConfigError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_weights:
            self.head.weight = self.tok_emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next token at every position.

        Args:
            tokens: int64 token ids, shape [B, T] with 1 <= T <= config.context.

        Returns:
            logits, shape [B, T, vocab_size], in the parameters' dtype.

        Raises:
            SwapConfigError: ``tokens`` is not 2-D or T exceeds ``config.context``.
        """
        if tokens.dim() != 2:
            raise SwapConfigError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
        t = tokens.shape[1]
        if not 1 <= t <= self.config.context:
            raise SwapConfigError(f"seq ({t}) must be in 1..context ({self.config.context})")
        pos = torch.arange(t, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy, computed in fp32.

        Positions ``0..T-2`` predict tokens ``1..T-1``.

        Args:
            tokens: int64 token ids, shape [B, T] with 2 <= T <= config.context + 1.

        Returns:
            a 0-d fp32 tensor, in nats per token.

        Raises:
            SwapConfigError: ``tokens`` is not 2-D or T is outside 2..context + 1.
        """
        if tokens.dim() != 2 or tokens.shape[1] < 2:
            raise SwapConfigError(
                f"loss needs tokens of shape [batch, seq] with seq >= 2, got {tuple(tokens.shape)}"
            )
        logits = self(tokens[:, :-1]).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batches(
    config: GPTConfig, *, batch: int, seq: int, steps: int, seed: int
) -> list[torch.Tensor]:
    """Deterministic token batches with a learnable pattern.

    Each sequence starts at a random token; each next token is ``perm[previous]`` for a
    fixed random permutation ``perm`` of the vocabulary with probability 0.9, else a
    uniformly random token. A model can learn ``perm``, so the loss goes down (towards
    about ``0.1 * ln(vocab_size) + 0.33`` nats). Same arguments, same tensors.

    Args:
        config: supplies vocab_size and context.
        batch: sequences per batch (>= 1).
        seq: tokens per sequence (2 <= seq <= context + 1; :meth:`GPT.loss` feeds the
            first seq - 1 to the model).
        steps: number of batches (>= 1).
        seed: seed of the generator.

    Returns:
        ``steps`` int64 tensors of shape [batch, seq] on the CPU.

    Raises:
        SwapConfigError: a value is out of range; the message names it.
    """
    _check_int("batch", batch, 1)
    _check_int("seq", seq, 2)
    _check_int("steps", steps, 1)
    if seq > config.context + 1:
        raise SwapConfigError(f"seq ({seq}) must be <= context + 1 ({config.context + 1})")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    vocab = config.vocab_size
    perm = torch.randperm(vocab, generator=generator)
    out: list[torch.Tensor] = []
    for _ in range(steps):
        tokens = torch.empty(batch, seq, dtype=torch.int64)
        tokens[:, 0] = torch.randint(vocab, (batch,), generator=generator)
        noise = torch.rand(batch, seq, generator=generator) < 0.1
        random = torch.randint(vocab, (batch, seq), generator=generator)
        for i in range(1, seq):
            tokens[:, i] = torch.where(noise[:, i], random[:, i], perm[tokens[:, i - 1]])
        out.append(tokens)
    return out
