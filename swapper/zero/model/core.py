"""The model core: the state one wrapped model's lifecycle and its helpers share, as one
object handed over by name instead of read off the model as private attributes (issue 25).

Why an object: the helpers of the hook lifecycle (persistence, the resident fast paths,
real weights, the optimizer's view, the checkpoint exports) each needed the lock, the
manager, the records by name, the hold counters and the optimizer's gate; they took the
whole model and read ``model._lock``, ``model._by_name``, ... (a class split over several
files that share its private state). Each model now owns one :class:`ModelCore` (the
one-process model a :class:`~swapper.zero.local.params.LocalCore`, which adds what only
its helpers use) and hands it over; a helper states in its signature that it reads the
core, not the model.

Invariants (each a promise the lifecycle keeps, not the core itself):

* ``lock`` guards every counter below and every record's hold counts; it is reentrant
  (a release inside a fetch's clean-up takes it again) and never held across a wait.
* ``holds`` and the records' counters change only inside ``signals.held`` (or
  ``at_waits``) sections, so an interrupt leaves a hold counted and held, or neither.
* ``manager`` is set once, when the store is opened, and is the only manager the
  model's records live in.

May import: ``tiers``, :mod:`swapper.manager`, :mod:`swapper.step`'s public seams; nothing
of the models (both build on it).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Generic, TypeVar

import torch

from swapper.manager import Tier, TierManager
from swapper.step.sources import ParamGate
from tiers.errors import SwapConfigError

__all__ = ["Holds", "ModelCore", "not_the_models"]

#: a model's record of one parameter (one process: ``Slot``; N ranks: ``ShardSlot``)
S = TypeVar("S")
#: what a forward that runs now holds: the module and the units its pre-hook acquired
F = TypeVar("F")


@dataclasses.dataclass(slots=True)
class Holds:
    """What a model's hooks count, kept off the module: every attribute write on an
    ``nn.Module`` goes through ``Module.__setattr__`` (isinstance checks, ~3 µs), several
    per hook call."""

    held_nbytes: int = 0  # parameters with users, in the use tier
    forward_depth: int = 0  # calls of forward() running
    carried: int = 0  # holds kept from a forward for its backward (Slot.carried)
    in_backward: bool = False


class ModelCore(Generic[S, F]):
    """The state of one wrapped model that its lifecycle and its helpers share (module
    docstring).

    Attributes:
        lock: guards the counters and the records' hold counts (reentrant).
        use_tier: the tier the parameters are used from (device, or host).
        room_limit: that tier's byte budget (None: unlimited).
        manager: the tier manager holding the records' bytes (set once it is opened).
        by_name: every record by parameter name.
        slots: every record by ``id()`` of its parameter object.
        holds: the hooks' counters.
        forward_holds: per forward running now (outermost first), the module and the
            units its pre-hook acquired (released by its forward hook, or by a failed
            pass's clean-up).
        keep_held: a forward's holds are kept for its backward (one process, when the
            use tier holds every parameter at once; never on N ranks).
        param_gate: an overlapped optimizer's gate (None: none installed).
        closed: ``close()`` has begun (the model is unusable from then).
    """

    manager: TierManager

    def __init__(self, use_tier: Tier, room_limit: int | None) -> None:
        self.lock = threading.RLock()
        self.use_tier = use_tier
        self.room_limit = room_limit
        self.by_name: dict[str, S] = {}
        self.slots: dict[int, S] = {}
        self.holds = Holds()
        self.forward_holds: list[F] = []
        self.keep_held = False
        self.param_gate: ParamGate | None = None
        self.closed = False


def not_the_models(param: torch.Tensor) -> SwapConfigError:
    """The error the optimizer's view of a model raises for a tensor that is none of the
    model's parameters (both models' ``ParamSource``)."""
    return SwapConfigError(
        f"a parameter of shape {list(param.shape)} given to the optimizer is not one "
        "of the offloaded model's: pass wrapped.parameters()"
    )
