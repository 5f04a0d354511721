"""Update rules: what one optimizer stores per sub-group and how it updates it
(:mod:`swapper.step.rules.base`). One module per rule, registered by name:
:mod:`~swapper.step.rules.adamw` (the fused AdamW kernel, bf16/int8 moment codecs) and
:mod:`~swapper.step.rules.torch_optim` (any ``torch.optim.Optimizer``, its own step on
fp32 views). They may import ``swapper.step``'s layout and codecs, never the optimizer
that runs them (it imports them)."""

from swapper.step.rules.base import RULES, StateRow, UpdateRule, register, rule_named

__all__ = ["RULES", "StateRow", "UpdateRule", "register", "rule_named"]
