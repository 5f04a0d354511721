"""How much each way of storing Adam's moments changes the update, on real moments.

Trains the pressure GPT (``swapper-pressure``'s defaults: 2M parameters, batch 4 x 64
tokens, lr 1e-3, bf16, seed 0) with fp32 moments in memory and, at a few steps, takes the
optimizer's moments and encodes/decodes them each way (``swapper.step.compress``, plus
variants kept here only for the comparison). For each it prints the error of the Adam
update direction ``u = m_hat / (sqrt(v_hat) + eps)`` that the decoded moments give:
``rel_l2`` = ||u_q - u|| / ||u||, ``p99`` = the 99th percentile of the elementwise
|u_q - u| (u is about ±1 per element), and ``>0.1`` the fraction of elements off by more
than 0.1. This is what chose ``sqrt(exp_avg_sq)`` with the dynamic map for ``"int8"``.

    PYTHONPATH=. python tools/moments_error.py [--steps 200] [--at 10,50,200]
"""

from __future__ import annotations

import argparse

import torch

from swapper import ManagerConfig, OffloadAdamW, StepConfig
from swapper.pressure.model import GPT, GPTConfig, batches, init_weights_
from swapper.step.compress import decode_int8, encode_int8
from swapper.step.layout import INT8_BLOCK_NUMEL


def _int8(x: torch.Tensor, *, signed: bool, linear: bool = False) -> torch.Tensor:
    """x through the blockwise 8-bit form (dynamic map, or a linear absmax one)."""
    n = x.numel()
    padded = -(-n // INT8_BLOCK_NUMEL) * INT8_BLOCK_NUMEL
    src = torch.zeros(padded)
    src[:n] = x
    if linear:
        blocks = src.view(-1, INT8_BLOCK_NUMEL)
        scale = blocks.abs().amax(dim=1, keepdim=True).clamp(min=1e-45)
        levels = 127.0 if signed else 255.0
        return ((blocks / scale * levels).round() / levels * scale).view(-1)[:n]
    codes = torch.empty(padded, dtype=torch.uint8)
    scales = torch.empty(padded // INT8_BLOCK_NUMEL)
    encode_int8(src, codes, scales, signed=signed)
    out = torch.empty(padded)
    decode_int8(codes, scales, out, signed=signed)
    return out[:n]


def _fp8(x: torch.Tensor) -> torch.Tensor:
    """x through blockwise float8 e4m3 (each block's absmax scaled to 448, the format's max)."""
    n = x.numel()
    padded = -(-n // INT8_BLOCK_NUMEL) * INT8_BLOCK_NUMEL
    src = torch.zeros(padded)
    src[:n] = x
    blocks = src.view(-1, INT8_BLOCK_NUMEL)
    scale = blocks.abs().amax(dim=1, keepdim=True).clamp(min=1e-38) / 448.0
    codes = (blocks / scale).to(torch.float8_e4m3fn)
    return (codes.float() * scale).view(-1)[:n]


VARIANTS = {
    "bf16": lambda m, v: (m.bfloat16().float(), v.bfloat16().float()),
    "int8 v direct (bnb)": lambda m, v: (_int8(m, signed=True), _int8(v, signed=False)),
    "int8 sqrt(v) (chosen)": lambda m, v: (
        _int8(m, signed=True),
        _int8(v.sqrt(), signed=False).square(),
    ),
    "fp8 e4m3, sqrt(v)": lambda m, v: (_fp8(m), _fp8(v.sqrt()).square()),
    "fp8 e4m3, v direct": lambda m, v: (_fp8(m), _fp8(v)),
    "int8 linear, sqrt(v)": lambda m, v: (
        _int8(m, signed=True, linear=True),
        _int8(v.sqrt(), signed=False, linear=True).square(),
    ),
}


def _update(m: torch.Tensor, v: torch.Tensor, step: int) -> torch.Tensor:
    m_hat = m / (1 - 0.9**step)
    v_hat = v / (1 - 0.999**step)
    return m_hat / (v_hat.sqrt() + 1e-8)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--at", default="10,50,200")
    args = parser.parse_args()
    at = {int(s) for s in args.at.split(",")}
    config = GPTConfig.for_params(2_000_000)
    gpt = GPT(config).to(torch.bfloat16)
    init_weights_(gpt, seed=0)
    data = batches(config, batch=4, seq=64, steps=args.steps, seed=0)
    print(f"{'step':>5}  {'variant':<24} {'rel_l2':>8} {'p99':>8} {'>0.1':>8}")
    with OffloadAdamW(
        gpt.parameters(),
        lr=1e-3,
        weight_decay=0.01,
        tiers=ManagerConfig(device_nbytes=0, host_nbytes=None),
        config=StepConfig(max_grad_norm=1.0),
    ) as opt:
        for step, tokens in enumerate(data, 1):
            gpt.loss(tokens).backward()
            opt.step()
            opt.zero_grad()
            if step not in at:
                continue
            state = opt.state_dict()["state"]
            m = torch.cat([state[i]["exp_avg"] for i in range(len(state))])
            v = torch.cat([state[i]["exp_avg_sq"] for i in range(len(state))])
            u = _update(m, v, step)
            for name, variant in VARIANTS.items():
                mq, vq = variant(m, v)
                err = (_update(mq, vq, step) - u).abs()
                rel = float(err.norm() / u.norm())
                p99 = float(torch.quantile(err[:: max(1, err.numel() // 1_000_000)], 0.99))
                frac = float((err > 0.1).float().mean())
                print(f"{step:>5}  {name:<24} {rel:>8.4f} {p99:>8.4f} {frac:>8.5f}")


if __name__ == "__main__":
    main()
