"""Train a small GPT on several ranks with swapper: ZeRO-3 over torch.distributed.

Each rank keeps 1/N of the 16-bit parameters, the 16-bit gradients and the optimizer
state, under its own budgets, spilling to its own directory ``<swap>/rank{r}of{N}``::

    torchrun --nproc-per-node 2 examples/train_dist.py --swap ./swap --steps 20

CPU only (gloo); with one GPU per rank, pass ``--backend nccl``. Rank 0 prints the loss
of the whole batch (the mean of the ranks' shares) and, at the end, what each rank moved.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import swapper
from swapper import DistributedConfig, OffloadAdamW, OffloadConfig, StepConfig, Tier
from swapper.pressure.model import GPT, GPTConfig, batches, init_weights_
from tiers.units import format_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swap", default="./swap", help="NVMe swap directory (shared)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    parser.add_argument("--fetch", default="all_gather", choices=["all_gather", "all_reduce"])
    args = parser.parse_args()

    timeout = datetime.timedelta(seconds=120)
    dist.init_process_group(args.backend, timeout=timeout)  # torchrun sets the rest
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)

    model_config = GPTConfig(vocab_size=256, context=64, d_model=128, n_layers=4, n_heads=2)
    model = GPT(model_config)
    init_weights_(model, seed=0)  # the same weights on every rank
    model = model.to(torch.bfloat16)

    os.makedirs(args.swap, exist_ok=True)
    # Per-rank budgets, small enough that every rank spills to NVMe.
    config = OffloadConfig.create(
        device_nbytes=1 << 20,
        host_nbytes=4 << 20,
        nvme_dirs=[args.swap],
        device="cuda" if args.backend == "nccl" else "cpu",
        step=StepConfig(sub_group_numel=65_536, max_grad_norm=1.0),
        distributed=DistributedConfig(
            fetch_collective=args.fetch, timeout_s=timeout.total_seconds()
        ),
    )
    data = batches(
        model_config, batch=args.batch, seq=model_config.context, steps=args.steps, seed=1
    )
    with swapper.offload(model, config, dist.group.WORLD) as wrapped:
        optimizer = OffloadAdamW(wrapped.parameters(), lr=1e-3, tiers=wrapped)
        share = args.batch // world
        for step, tokens in enumerate(data):
            mine = tokens[rank * share : (rank + 1) * share].to(device)
            logits = wrapped(mine[:, :-1]).float()
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mine[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step:3d}  loss {float(mean) / world:.4f}", flush=True)
        stats = wrapped.stats()
        moved = torch.tensor(
            [stats.moved(Tier.HOST, Tier.NVME).nbytes, stats.moved(Tier.NVME, Tier.HOST).nbytes],
            dtype=torch.float64,
            device=device,
        )
        everyone = [torch.zeros_like(moved) for _ in range(world)]
        dist.all_gather(everyone, moved)
        if rank == 0:
            for r, (written, read) in enumerate(everyone):
                wrote, got = format_size(float(written)), format_size(float(read))
                print(f"rank {r}: wrote {wrote} to NVMe, read {got}")
        optimizer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
