"""The optimizer step pipeline: fp32 state streamed from the tiers, fp32 gradients built
from the retained 16-bit ones (never written to disk), the update of each sub-group an
:class:`UpdateRule`'s (:mod:`swapper.step.rules`): PyTorch's fused AdamW
(:class:`OffloadAdamW`) or any ``torch.optim`` optimizer's own step
(:class:`OffloadOptimizer`)."""

from swapper.step.config import StepConfig
from swapper.step.layout import ALIGN_NUMEL, Piece, SubGroup, plan_sub_groups
from swapper.step.offload_optimizer import OffloadOptimizer
from swapper.step.optimizer import (
    DeferredStepError,
    OffloadAdamW,
    StateDictError,
    StepPendingError,
    StepReport,
    StreamedOptimizer,
    SubGroupStates,
)
from swapper.step.pipeline import PipelineClosedError, StepFailedError, StepPipeline, StepTraffic
from swapper.step.rules.base import StateRow, UpdateRule
from swapper.step.rules.torch_optim import StateLayoutError, UnsupportedOptimizerError
from swapper.step.scaler import DynamicLossScaler

__all__ = [
    "ALIGN_NUMEL",
    "DeferredStepError",
    "DynamicLossScaler",
    "OffloadAdamW",
    "OffloadOptimizer",
    "Piece",
    "PipelineClosedError",
    "StateDictError",
    "StateLayoutError",
    "StateRow",
    "StepConfig",
    "StepFailedError",
    "StepPendingError",
    "StepPipeline",
    "StepReport",
    "StepTraffic",
    "StreamedOptimizer",
    "SubGroup",
    "SubGroupStates",
    "UnsupportedOptimizerError",
    "UpdateRule",
    "plan_sub_groups",
]
