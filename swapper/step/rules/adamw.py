"""AdamW as an :class:`~swapper.step.rules.base.UpdateRule`: PyTorch's fused kernel
(``torch._fused_adamw_``, what ``torch.optim.AdamW(fused=True)`` runs) on the fp32 master
weights and both moments, which may be stored compressed (bf16 or 8-bit blockwise,
:mod:`swapper.step.compress`). The fast path of :class:`~swapper.step.OffloadAdamW`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

from swapper.step.compress import MomentCodec
from swapper.step.layout import STATE_ROWS, SubGroup, plan_sub_groups
from swapper.step.rules.base import StateRow, UpdateRule, register

__all__ = ["AdamWRule"]


class AdamWRule(UpdateRule):
    """Rows ``master``, ``exp_avg``, ``exp_avg_sq`` (:data:`STATE_ROWS`), per element."""

    name = "adamw"

    def state_rows(self) -> tuple[StateRow, ...]:
        return tuple(StateRow(name) for name in STATE_ROWS)

    def plan(
        self, group_numels: Sequence[Sequence[int]], sub_group_numel: int, moments: str
    ) -> list[SubGroup]:
        return plan_sub_groups(group_numels, sub_group_numel, moments)

    def update(
        self,
        sg: SubGroup,
        state: torch.Tensor,
        grad: torch.Tensor,
        group: dict[str, Any],
        step: int,
        codec: MomentCodec,
        *,
        absent: frozenset[int] = frozenset(),
    ) -> None:
        del absent  # (a parameter without a gradient steps with zeros, as in ZeRO)
        beta1, beta2 = group["betas"]
        # (fp32 moments: views of the state; compressed: decoded, and encoded after)
        with codec.rows(sg, state) as (master, exp_avg, exp_avg_sq):
            torch._fused_adamw_(  # pyright: ignore[reportPrivateImportUsage]
                [master],
                [grad],
                [exp_avg],
                [exp_avg_sq],
                [],
                [torch.tensor(float(step), dtype=torch.float32, device=state.device)],
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                weight_decay=float(group["weight_decay"]),
                eps=float(group["eps"]),
                amsgrad=False,
                maximize=False,
            )

    def entries(
        self, sg: SubGroup, state: torch.Tensor
    ) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        for position, piece in enumerate(sg.pieces):
            span = slice(piece.offset, piece.offset + piece.numel)
            yield position, {row: state[i, span] for i, row in enumerate(STATE_ROWS)}

    def bytes_per_element(self, moments: str) -> float:
        return {"fp32": 12.0, "bf16": 8.0, "int8": 6.0}.get(moments, 12.0)


register("adamw", AdamWRule)
