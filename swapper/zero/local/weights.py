# Size: ~520 lines: the real weights' three ways in and out (state-dict hooks, unwrap and its
# undo, writes outside the hooks caught) share one fetch-for-a-copy path and its checks.
"""The real weights of an offloaded model, never silently empty.

Between uses an offloaded parameter's ``.data`` is a 0-element placeholder (see
:mod:`swapper.zero.local.offload`); everything a user does with weights outside the training
step would see that placeholder. This module makes each such path give the real bytes or
a clear error:

- ``module.state_dict()`` of the wrapped model or any sub-module (hence ``torch.save``,
  ``save_pretrained``): a state-dict post-hook on every module owning offloaded
  parameters puts in an ordinary CPU copy of each, fetched one at a time (on the host
  tier: the device budget and the recorded fetch order are not touched);
- ``module.load_state_dict(sd)``: a load pre-hook writes each offloaded parameter's value
  through to the tiers, one at a time, and takes it out of what torch copies into the
  placeholder; a post-hook keeps those keys out of ``missing_keys`` (a shape mismatch
  names the real shape);
- in-place writes outside the hooks, on the parameter (``torch.nn.init.*``,
  ``param.zero_()`` under ``no_grad``) or through ``.data`` (``param.data.normal_()``, as
  Hugging Face's ``_init_weights`` does): they land on the placeholder and cannot be
  recovered, but they bump a version counter: ``param._version``, or, since an offloaded
  ``nn.Parameter`` is a :class:`GuardedParameter` whose ``.data`` between uses is the
  placeholder object itself (not a fresh alias with a counter of its own), the
  placeholder's. Swapper records both whenever it sets ``.data`` and raises
  :class:`OffloadedWriteError` naming the parameter at its next fetch, ``state_dict()`` or
  ``unwrap()``. A write on the parameter while it is fetched (inside a forward) lands in
  the fetched bytes and is written back when it is released (``modified=True``);
- :func:`restore`: what ``unwrap()`` and leaving ``with swapper.offload(...)`` use: every
  parameter copied back into an ordinary tensor on the device it was on when wrapped,
  after a check that they fit (else :class:`WeightsDoNotFitError`, nothing changed).

Not caught: a write through ``.data`` while the parameter is fetched by a hook (written,
not marked modified), writes to an ``nn.Parameter`` subclass (not guarded). Persistent
parameters (:mod:`swapper.zero.local.persist`) keep such writes in their bytes.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, cast

import torch
from torch import nn

from swapper.manager import Kind, ManagerClosedError, Tier
from swapper.zero.config.settings import tiers_of
from swapper.zero.local.params import LocalCore, Slot
from tiers import signals
from tiers.errors import SwapConfigError, SwapError
from tiers.units import format_size


class Wrapper(Protocol):
    """What :func:`unwrap` and :func:`leave` use of the wrapped model (one process): its
    core, the module, and three calls of its lifecycle."""

    core: LocalCore
    module: nn.Module

    def release_stale_holds(self, *, warn: bool = True) -> int:
        """Release what a forward or backward that raised left held."""
        ...

    def end_persistence(self) -> None:
        """Release the persistent holds (:mod:`swapper.zero.local.persist`)."""
        ...

    def close(self) -> None:
        """Remove the hooks and drop the tiers."""
        ...


log = logging.getLogger(__name__)

__all__ = [
    "NATIVE_GRADS",
    "PERSISTENT_DATA",
    "TENSOR_GRAD",
    "GuardedParameter",
    "OffloadedWriteError",
    "WeightHooks",
    "WeightsDoNotFitError",
    "Wrapper",
    "available_nbytes",
    "check_unwritten",
    "fetch_copy",
    "guard",
    "leave",
    "restore",
    "unguard",
    "unwrap",
]


class WeightsDoNotFitError(SwapError, MemoryError):
    """The offloaded model's weights cannot be given back as ordinary tensors: the
    device they were on lacks the memory. Nothing was changed: the weights are still in
    the tiers."""


class OffloadedWriteError(SwapError, RuntimeError):
    """An offloaded parameter was written in place outside swapper's hooks while its
    bytes were in the tiers; the write landed on the empty placeholder and is lost."""


#: ``torch.Tensor.data``'s own descriptor (what :class:`GuardedParameter` falls back to).
_TENSOR_DATA: Any = torch._C.TensorBase.__dict__["data"]

#: id(param) → (a weak reference to it, its placeholder), while it is guarded.
_PLACEHOLDERS: dict[int, tuple[weakref.ref[nn.Parameter], torch.Tensor]] = {}
TENSOR_GRAD: Any = torch._C.TensorBase.__dict__["grad"]  # (autograd's gradient field)
#: While persistent (:mod:`swapper.zero.local.persist`), id(param) → what ``param.grad = value``
#: does instead (``param.grad`` reads None: as moved), and → the one alias ``.data``
#: returns (a write through it shows in its version counter).
NATIVE_GRADS: dict[int, Callable[[torch.Tensor | None], None]] = {}
PERSISTENT_DATA: dict[int, torch.Tensor] = {}


class GuardedParameter(nn.Parameter):
    """An offloaded ``nn.Parameter`` while wrapped: ``.data`` returns one object whose
    version counter swapper reads (between uses the placeholder itself, not a fresh alias;
    ``PERSISTENT_DATA``), ``.grad`` None while autograd keeps it for swapper. No
    ``__torch_function__`` (no cost in torch calls); pickled, an ``nn.Parameter``."""

    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        alias = PERSISTENT_DATA.get(id(self))
        if alias is not None:
            return alias
        current = _TENSOR_DATA.__get__(self)
        entry = _PLACEHOLDERS.get(id(self))
        if entry is not None and entry[0]() is self and current.numel() == 0:
            return entry[1]
        return current

    @data.setter
    def data(self, value: torch.Tensor) -> None:  # pyright: ignore[reportIncompatibleVariableOverride]
        PERSISTENT_DATA.pop(id(self), None)  # (then counted as written: persist.leave)
        _TENSOR_DATA.__set__(self, value)

    @property
    def grad(self) -> torch.Tensor | None:  # type: ignore[override]
        if id(self) in NATIVE_GRADS:
            return None  # (swapper's: see NATIVE_GRADS)
        return TENSOR_GRAD.__get__(self)

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:  # pyright: ignore[reportIncompatibleVariableOverride]
        instead = NATIVE_GRADS.get(id(self))
        if instead is not None:
            instead(value)
            return
        TENSOR_GRAD.__set__(self, value)


def guard(slot: Slot) -> None:
    """Make the slot's parameter a :class:`GuardedParameter` (an exact ``nn.Parameter``
    only; a subclass of its own is left alone) and record the placeholder versions."""
    param = slot.param
    slot.placeholder_version = slot.placeholder._version
    if type(param) is not nn.Parameter:
        return
    key = id(param)

    def forget(ref: weakref.ref[nn.Parameter], key: int = key) -> None:
        entry = _PLACEHOLDERS.get(key)
        if entry is not None and entry[0] is ref:  # (not a later parameter of the same id)
            del _PLACEHOLDERS[key]

    _PLACEHOLDERS[key] = (weakref.ref(param, forget), slot.placeholder)
    param.__class__ = GuardedParameter


def unguard(slots: Iterable[Slot]) -> None:
    """Give the parameters back their ``nn.Parameter`` class (idempotent)."""
    for slot in slots:
        param = slot.param
        entry = _PLACEHOLDERS.get(id(param))
        if entry is not None and entry[0]() is param:
            del _PLACEHOLDERS[id(param)]
        if type(param) is GuardedParameter:
            cast(Any, param).__class__ = nn.Parameter


def check_unwritten(slot: Slot) -> None:
    """Raise if the parameter was written in place since swapper last set its ``.data``
    (it is not fetched now). The error is raised once: the version is recorded again, the
    parameter keeps the value the tiers hold.

    Raises:
        OffloadedWriteError: naming the parameter and how to write it instead.
    """
    version, placeholder_version = slot.param._version, slot.placeholder._version
    if version == slot.version and placeholder_version == slot.placeholder_version:
        return
    slot.version, slot.placeholder_version = version, placeholder_version
    raise OffloadedWriteError(
        f"offload: parameter {slot.name!r} (shape {list(slot.shape)}) was written in place "
        "outside the forward/backward (torch.nn.init.*, param.zero_(), param.data.normal_() "
        "...) while "
        "its bytes were in the tiers: the write landed on an empty placeholder and is lost "
        "(the parameter keeps the value the tiers hold). Write offloaded parameters with "
        "model.load_state_dict({name: value}, strict=False), which writes through to the "
        "tiers, or initialise the model before swapper.offload(...) / after unwrap()"
    )


def _rw_tier(core: LocalCore) -> Tier:
    """Where weights are read and written outside the step: the host, not the device
    tier (no device room taken, nothing moved to where the forward uses it)."""
    tiers = tiers_of(core.manager.config, Kind.PARAM16)
    return Tier.HOST if Tier.HOST in tiers else tiers[0]


@contextlib.contextmanager
def _held(core: LocalCore, slot: Slot, *, write: bool) -> Iterator[torch.Tensor]:
    """The parameter's bytes: the fetched tensor if a forward holds it, else fetched on
    the host tier for the block and released after it (``modified=write``)."""
    if core.closed:
        raise ManagerClosedError(
            f"offload: the weights of {slot.name!r} were dropped by close(); leave the "
            "`with swapper.offload(...)` block or call unwrap() to get the weights back "
            "instead of close()"
        )
    if core.param_gate is not None:
        core.param_gate(slot.param)  # an overlapped step's update of it first
    if slot.users:
        if write:
            raise SwapConfigError(
                f"offload: cannot write parameter {slot.name!r} while it is in use (inside "
                "a forward or backward); load weights between steps"
            )
        yield slot.param.data
        return
    if core.persist.active:  # fetched between uses (swapper.zero.local.persist): its bytes
        yield slot.param.data  # (released as modified when persistence ends)
        return
    if write:  # a lost write before is superseded by this one
        slot.version, slot.placeholder_version = slot.param._version, slot.placeholder._version
    else:
        check_unwritten(slot)
    manager = core.manager
    with signals.at_waits:  # fetched and released, or neither
        tensor = manager.fetch(slot.key, _rw_tier(core))
        try:
            yield tensor
        finally:
            manager.release(slot.key, modified=write)


def fetch_copy(core: LocalCore, slot: Slot, device: torch.device | str = "cpu") -> torch.Tensor:
    """An ordinary tensor holding the parameter's current value (a copy on ``device``).

    Raises:
        OffloadedWriteError: the parameter was written outside the hooks (see
            :func:`check_unwritten`).
        ManagerClosedError: the wrapper was closed (its weights dropped).
        and what :meth:`TierManager.fetch` raises (I/O, corruption).
    """
    with _held(core, slot, write=False) as tensor:
        out = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        out.copy_(tensor.view(slot.shape))
        return out


def write_through(core: LocalCore, slot: Slot, value: torch.Tensor) -> None:
    """Copy ``value`` (the parameter's shape, any float dtype) into the parameter's bytes
    in the tiers; the manager writes it back to NVMe as needed."""
    with torch.no_grad(), _held(core, slot, write=True) as tensor, signals.held:
        tensor.view(slot.shape).copy_(value)
    # the load is the parameter's value now
    slot.version, slot.placeholder_version = slot.param._version, slot.placeholder._version


def available_nbytes(device: torch.device) -> int | None:
    """Bytes that can be allocated on ``device`` now (None: unknown, not checked): free
    CUDA memory, or ``MemAvailable`` of ``/proc/meminfo`` for the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB: KiB
        except (OSError, ValueError, IndexError):
            return None
    return None


def restore(core: LocalCore) -> list[tuple[Slot, torch.Tensor]]:
    """Copy every offloaded parameter, one at a time, into an ordinary tensor on the
    device it was on when wrapped; the caller then sets ``.data`` (nothing is changed
    here, so a failure leaves the model as it was).

    Raises:
        WeightsDoNotFitError: the weights need more memory on a device than it has free
            (checked first), or an allocation failed part-way.
        OffloadedWriteError: a parameter was written outside the hooks (named).
        SwapConfigError: a forward or backward holds a parameter now.
    """
    slots = list(core.by_name.values())
    for slot in slots:
        if slot.users:
            raise SwapConfigError(
                f"offload: cannot unwrap while parameter {slot.name!r} is in use (inside a "
                "forward or backward)"
            )
        check_unwritten(slot)
    need: dict[torch.device, int] = {}
    for slot in slots:
        need[slot.home] = need.get(slot.home, 0) + slot.nbytes
    for device, nbytes in need.items():
        free = available_nbytes(device)
        if free is not None and nbytes > free:
            raise _does_not_fit(device, nbytes, f"{format_size(free)} ({free} bytes) is free")
    copies: list[tuple[Slot, torch.Tensor]] = []
    device = torch.device("cpu")
    try:
        for slot in slots:
            device = slot.home
            copies.append((slot, fetch_copy(core, slot, device)))
    except (torch.OutOfMemoryError, MemoryError) as exc:
        copies.clear()
        raise _does_not_fit(device, need[device], f"an allocation failed: {exc}") from exc
    except RuntimeError as exc:
        # the CPU allocator's failure is a plain RuntimeError
        if "can't allocate memory" not in str(exc):
            raise
        copies.clear()
        raise _does_not_fit(device, need[device], f"an allocation failed: {exc}") from exc
    return copies


def unwrap(model: Wrapper) -> nn.Module:
    """Give the model back with real weights and close the wrapper: every parameter is
    copied, one at a time, into an ordinary tensor on the device it was on when wrapped
    (:func:`restore`); then its ``.data`` is set, the hooks removed, the buffers moved
    back, the tiers dropped (their files deleted). Retained gradients are dropped.

    Returns:
        the wrapped module.

    Raises (nothing changed; the wrapper stays open, the weights in the tiers):
        WeightsDoNotFitError: the weights do not fit in the memory free on their device;
            stream them with ``wrapped.iter_state_dict()``, then ``wrapped.close()``.
        OffloadedWriteError: a parameter was written outside the hooks (named).
        SwapConfigError: called inside a forward or backward.
        ManagerClosedError: closed already (the weights were dropped).
    """
    if model.core.closed:
        raise ManagerClosedError(
            "offload: unwrap() after close(): the weights were dropped with the tiers"
        )
    model.release_stale_holds(warn=False)
    model.end_persistence()  # (writes kept while persistent are in the tiers' bytes)
    copies = restore(model.core)
    with signals.held:  # all parameters real and the wrapper closed, or neither
        with model.core.lock:
            for slot, tensor in copies:
                slot.param.data = tensor
        if model.core.weights is not None:
            model.core.weights.remove()
        model.close()
    return model.module


def leave(model: Wrapper, *, block_raised: bool) -> None:
    """Leaving ``with swapper.offload(...)``: :func:`unwrap`. If that fails, the wrapper
    stays open with the weights in the tiers: the error is raised, or, when the block
    itself raised, logged (the block's exception is the one that propagates).

    A Ctrl-C (any BaseException) while the weights are fetched back stops it: the
    wrapper is closed as by ``close()`` (the weights not given back are dropped with the
    tiers; a store holding training snapshots is kept, durable), then it propagates.
    Left open, nobody could close it: its store stayed locked by this process, and the
    next ``swapper.offload`` on that directory failed with StoreLockedError."""
    if model.core.closed:
        return
    try:
        unwrap(model)
    except BaseException as error:
        if not isinstance(error, Exception):
            _close_interrupted(model)
            raise
        if not block_raised:
            raise
        log.error(
            "offload: could not give the weights back after the block raised (%s); they are "
            "still in the tiers: wrapped.iter_state_dict(), then wrapped.close()",
            error,
        )


def _close_interrupted(model: Wrapper) -> None:
    """``model.close()`` after an interrupt cut :func:`unwrap`. In a ``held`` section: a
    second Ctrl-C waits until the close is done (then replaces the first), rather than
    leave the manager half closed. A failure to close is logged: the interrupt is what
    propagates."""
    with signals.held:
        try:
            model.close()
        except Exception:
            log.exception("offload: closing the wrapper after an interrupt failed")


def _does_not_fit(device: torch.device, nbytes: int, why: str) -> WeightsDoNotFitError:
    return WeightsDoNotFitError(
        f"offload: the weights need {format_size(nbytes)} ({nbytes} bytes) of {device} "
        f"memory to be given back as ordinary tensors, and {why}. They are still in the "
        "tiers (the wrapper stays open): stream them one parameter at a time with "
        "wrapped.iter_state_dict() (e.g. into safetensors files), then call wrapped.close()"
    )


#: module → the hooks that act for it now: a module wrapped again after a close() gets
#: new hooks, and the closed wrapper's (which raise ManagerClosedError) stand down.
_CURRENT: weakref.WeakKeyDictionary[nn.Module, WeightHooks] = weakref.WeakKeyDictionary()


class WeightHooks:
    """The state-dict and load hooks of every module owning offloaded parameters.

    They look the module's parameters up when they run (not when installed), so a
    parameter replaced since (``module.weight = other``) is left to torch. They stay
    after ``close()`` (so that the dropped weights raise instead of saving as empty
    tensors) until :meth:`remove` or until the module is wrapped again.
    """

    def __init__(self, core: LocalCore, modules: list[nn.Module]) -> None:
        self._core = core
        self._handles: list[Any] = []
        self._modules = list(modules)
        for module in modules:
            _CURRENT[module] = self
            taken: list[str] = []  # keys the pre-hook took, for the post-hook
            self._handles.append(module.register_state_dict_post_hook(self._save_hook()))
            self._handles.append(
                module.register_load_state_dict_pre_hook(self._load_pre_hook(taken))
            )
            self._handles.append(
                module.register_load_state_dict_post_hook(self._load_post_hook(taken))
            )

    def remove(self) -> None:
        """Remove every hook (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module in self._modules:
            if _CURRENT.get(module) is self:
                del _CURRENT[module]
        self._modules.clear()

    def _own(self, module: nn.Module) -> Iterator[tuple[str, Slot]]:
        if _CURRENT.get(module) is not self:
            return
        for p_name, param in module._parameters.items():
            if param is None:
                continue
            slot = self._core.slots.get(id(param))
            if slot is not None and slot.param is param:
                yield p_name, slot

    def _save_hook(self) -> Callable[..., None]:
        # (a function, not a bound method: torch sets an attribute on the hook)
        def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
            for p_name, slot in self._own(module):
                key = prefix + p_name
                if key in state_dict:
                    state_dict[key] = fetch_copy(self._core, slot)

        return hook

    def _load_pre_hook(self, taken: list[str]) -> Callable[..., None]:
        def hook(
            module: nn.Module,
            state_dict: dict[str, Any],
            prefix: str,
            _meta: Any,
            _strict: bool,
            _missing: list[str],
            _unexpected: list[str],
            error_msgs: list[str],
        ) -> None:
            # (state_dict is load_state_dict's own copy: popping leaves the caller's alone)
            taken.clear()  # from a load that raised before its post-hook
            for p_name, slot in self._own(module):
                key = prefix + p_name
                if key not in state_dict:
                    continue
                value = state_dict.pop(key)
                taken.append(key)
                if not isinstance(value, torch.Tensor):
                    error_msgs.append(f"{key}: expected a tensor, got {type(value).__name__}")
                elif value.shape != slot.shape:
                    error_msgs.append(
                        f"size mismatch for {key}: copying a param with shape "
                        f"{value.shape} from checkpoint, the shape in current model is "
                        f"{slot.shape}."
                    )
                else:
                    write_through(self._core, slot, value)

        return hook

    def _load_post_hook(self, taken: list[str]) -> Callable[..., None]:
        def hook(_module: nn.Module, incompatible: Any) -> None:
            missing = incompatible.missing_keys
            for key in taken:
                while key in missing:
                    missing.remove(key)
            taken.clear()

        return hook
