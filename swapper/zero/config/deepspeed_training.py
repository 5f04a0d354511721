"""The training sections of a DeepSpeed config: ``optimizer``, ``gradient_clipping``,
``fp16`` and ``bf16``, read into what :class:`~swapper.step.OffloadAdamW` and the training
loop take (:class:`TrainingSettings`).

The offload sections (``zero_optimization``, ``aio``) are read by
:mod:`swapper.zero.config.deepspeed`, which calls :func:`read_training` and warns once, naming
every key that neither reader honours (:class:`Unhonoured`).

What is honoured:

- ``optimizer``: ``type`` ``AdamW`` or ``Adam`` (DeepSpeed's ``Adam`` is AdamW unless
  ``adam_w_mode`` is false); ``params.lr``, ``betas``, ``eps``, ``weight_decay`` →
  ``OffloadAdamW`` keyword arguments. ``bias_correction: false`` and ``amsgrad: true``
  change the update and are refused: OffloadAdamW is bias-corrected AdamW. ``Adam``
  with ``adam_w_mode: false`` (Adam with L2 regularisation: ``lr``, ``betas``, ``eps``,
  ``weight_decay``, ``amsgrad``) → :class:`~swapper.step.OffloadOptimizer` over
  ``torch.optim.Adam(fused=True)`` (``bias_correction: false`` refused). ``SGD``
  (``lr``, ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``), ``Adagrad``
  (``lr``, ``lr_decay``, ``eps``, ``weight_decay``, ``initial_accumulator_value``) and
  ``Lion`` (``lr``, ``betas``, ``weight_decay``; where ``lion_pytorch`` is importable) →
  :class:`~swapper.step.OffloadOptimizer` over ``torch.optim.SGD``, ``torch.optim.Adagrad``
  or ``lion_pytorch.Lion`` (:meth:`TrainingSettings.make_optimizer`). Another type is
  refused by name.
- ``gradient_clipping`` → ``max_grad_norm`` (0, DeepSpeed's default, is no clipping).
- ``fp16``: ``enabled``; ``loss_scale`` 0 (dynamic) with ``initial_scale_power`` (the
  first scale is 2 ** it), ``loss_scale_window`` (good steps before the scale doubles)
  and ``min_loss_scale`` → :class:`~swapper.step.DynamicLossScaler` settings.
  ``hysteresis`` and ``consecutive_hysteresis`` are not honoured (the scaler halves at
  the first overflow); a static ``loss_scale`` > 0 is not either (the scaler starts
  there and stays dynamic). ``bf16``: ``enabled``. Both enabled is refused.

Values given as ``"auto"`` (placeholders Hugging Face's Trainer fills from its own
arguments) are left unset here and named in the warning.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from swapper.step.config import check_hyper
from swapper.step.scaler import DynamicLossScaler
from tiers.errors import SwapConfigError

__all__ = ["TRAINING_KEYS", "TrainingSettings", "Unhonoured", "read_training"]

#: Top-level keys read here.
TRAINING_KEYS = frozenset({"optimizer", "gradient_clipping", "fp16", "bf16"})

_OPTIMIZER_TYPES = ("adamw", "adam")
_ADAMW_PARAMS = ("lr", "betas", "eps", "weight_decay")
#: DeepSpeed optimizer.type (lower case) → the params it honours, for OffloadOptimizer
_OTHER_TYPES: dict[str, tuple[str, ...]] = {
    "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov"),
    "adagrad": ("lr", "lr_decay", "eps", "weight_decay", "initial_accumulator_value"),
    "lion": ("lr", "betas", "weight_decay"),
    # DeepSpeed's Adam with adam_w_mode false: Adam with L2 regularisation (torch.optim.Adam)
    "adam-l2": ("lr", "betas", "eps", "weight_decay", "amsgrad"),
}
#: optimizer.params keys of ``adam-l2`` read, not passed: the value it is run with
_ADAM_L2_FIXED = {"adam_w_mode": False, "bias_correction": True}
#: optimizer.params keys that change the update: the value OffloadAdamW computes with.
_ADAMW_FIXED = {"adam_w_mode": True, "bias_correction": True, "amsgrad": False}
_FP16_READ = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "min_loss_scale")
_AUTO = "auto"


@dataclasses.dataclass
class Unhonoured:
    """What a DeepSpeed config says that swapper does not do, collected over the whole
    config for the one warning: ``ignored`` (keys with a meaning swapper does not
    follow), ``unneeded`` (keys that tune what swapper's budgets and pipeline do their own
    way), ``auto`` (``"auto"`` placeholders left unset). Each entry is a dotted key,
    with its value where that says more (``fp16.hysteresis=2``)."""

    ignored: list[str] = dataclasses.field(default_factory=list)
    unneeded: list[str] = dataclasses.field(default_factory=list)
    auto: list[str] = dataclasses.field(default_factory=list)

    def message(self) -> str | None:
        """The warning's text, or ``None`` when everything was honoured."""
        parts = []
        if self.ignored:
            parts.append(f"not honoured (ignored): {', '.join(self.ignored)}")
        if self.auto:
            parts.append(
                f"given as 'auto' (left to swapper's defaults or your own arguments; "
                f"Hugging Face's Trainer fills them in its copy): {', '.join(self.auto)}"
            )
        if self.unneeded:
            parts.append(
                "not needed (swapper's byte budgets and step pipeline do this their own "
                f"way): {', '.join(self.unneeded)}"
            )
        if not parts:
            return None
        return "DeepSpeed config keys swapper does not use: " + "; ".join(parts)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainingSettings:
    """What the training sections of a DeepSpeed config ask of the loop and optimizer.

    Attributes:
        optimizer: keyword arguments of :class:`~swapper.step.OffloadAdamW` the config
            gives (``lr``, ``betas``, ``eps``, ``weight_decay``; absent ones keep
            OffloadAdamW's defaults).
        max_grad_norm: ``gradient_clipping`` (``None``: no clipping); also in the offload
            config's ``step``, which an OffloadAdamW over the offloaded model takes.
        dtype: ``"fp16"``, ``"bf16"``, or ``None`` (neither enabled; DeepSpeed would train
            in fp32, swapper's parameters are 16-bit: choose one, bf16 needs no loss
            scaling).
        loss_scaler: :class:`~swapper.step.DynamicLossScaler` keyword arguments with fp16
            (``None`` without).
    """

    optimizer: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    #: ``None``: AdamW (``OffloadAdamW``); else the ``torch.optim.Optimizer`` class of
    #: ``optimizer.type`` (SGD, Adagrad, Lion) for ``OffloadOptimizer``
    optimizer_class: type[torch.optim.Optimizer] | None = None
    max_grad_norm: float | None = None
    dtype: str | None = None
    loss_scaler: Mapping[str, Any] | None = None

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """``dtype`` as a torch dtype (``None``: neither format enabled)."""
        return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(self.dtype or "")

    def make_optimizer(
        self, params: Any, *, tiers: Any, config: Any = None
    ) -> torch.optim.Optimizer:
        """The optimizer the config asks for over ``params`` (``OffloadAdamW``, or
        ``OffloadOptimizer(optimizer_class, ...)``) with its loss scaler, in ``tiers``.

        Raises:
            SwapConfigError: what the optimizer refuses.
        """
        from swapper.step import OffloadAdamW, OffloadOptimizer

        scaler = self.make_loss_scaler()
        if self.optimizer_class is None:
            return OffloadAdamW(
                params, **self.optimizer, tiers=tiers, config=config, loss_scaler=scaler
            )
        return OffloadOptimizer(
            self.optimizer_class, params, tiers=tiers, config=config, loss_scaler=scaler,
            **self.optimizer,
        )  # fmt: skip

    def make_loss_scaler(self) -> DynamicLossScaler | None:
        """A new scaler with the fp16 section's settings, or ``None`` without fp16."""
        return None if self.loss_scaler is None else DynamicLossScaler(**self.loss_scaler)


def read_training(ds: Mapping[str, Any], notes: Unhonoured) -> TrainingSettings:
    """The training sections of DeepSpeed config ``ds``; what is not honoured goes to
    ``notes``.

    Raises:
        SwapConfigError: a section is not an object, a value has the wrong type or range,
            the optimizer is not AdamW (or a key makes it another update), or fp16 and
            bf16 are both enabled; the message names the key.
    """
    optimizer_class, optimizer = _optimizer(ds.get("optimizer"), notes)
    clipping = _number(ds.get("gradient_clipping"), "gradient_clipping", notes, minimum=0.0)
    fp16 = _precision(ds.get("fp16"), "fp16", notes)
    bf16 = _precision(ds.get("bf16"), "bf16", notes)
    if fp16 is not None and bf16 is not None:
        raise SwapConfigError(
            "fp16.enabled and bf16.enabled are both true: enable one 16-bit format"
        )
    return TrainingSettings(
        optimizer=optimizer,
        optimizer_class=optimizer_class,
        max_grad_norm=clipping or None,  # DeepSpeed's 0.0 is "no clipping"
        dtype="fp16" if fp16 is not None else "bf16" if bf16 is not None else None,
        loss_scaler=fp16,
    )


def _section(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SwapConfigError(f"{where}={value!r} must be an object of settings")
    return value


def _number(
    value: object, where: str, notes: Unhonoured, *, minimum: float, above: bool = False
) -> float | None:
    """A finite number ``>= minimum`` (``> minimum`` with ``above``); ``None`` when absent
    or ``"auto"`` (noted)."""
    if value is None:
        return None
    if value == _AUTO:
        notes.auto.append(where)
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < minimum
        or (above and value == minimum)
    ):
        bound = f"> {minimum:g}" if above else f">= {minimum:g}"
        raise SwapConfigError(f"{where}={value!r} must be a finite number {bound}")
    return float(value)


def _other_class(kind: str) -> type[torch.optim.Optimizer]:
    if kind == "sgd":
        return torch.optim.SGD
    if kind == "adam-l2":
        return torch.optim.Adam
    if kind == "adagrad":
        return torch.optim.Adagrad
    try:
        from lion_pytorch import Lion  # pyright: ignore[reportMissingImports]
    except ImportError:
        raise SwapConfigError(
            "optimizer.type='Lion': no Lion implementation is importable here (swapper "
            "runs lion_pytorch.Lion under OffloadOptimizer: pip install lion-pytorch), or "
            "remove the section and build your optimizer yourself"
        ) from None
    return Lion  # pyright: ignore[reportUnknownVariableType]


def _other_optimizer(
    kind: str, section: Mapping[str, Any], notes: Unhonoured
) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    cls = _other_class(kind)
    for key in section:
        if key not in ("type", "params"):
            notes.ignored.append(f"optimizer.{key}")
    # adam-l2: PyTorch's one-pass CPU kernel, as DeepSpeed's CPU Adam is one (the default
    # single-tensor Adam makes five passes: docs/notes/2026-11-28-optim-3.md)
    out: dict[str, Any] = {"fused": True} if kind == "adam-l2" else {}
    for key, value in _section(section.get("params", {}), "optimizer.params").items():
        where = f"optimizer.params.{key}"
        if value == _AUTO:
            notes.auto.append(where)
        elif key in _OTHER_TYPES[kind]:
            out[key] = tuple(value) if key == "betas" and isinstance(value, list) else value
        elif kind == "adam-l2" and key in _ADAM_L2_FIXED:
            if value is not _ADAM_L2_FIXED[key]:
                raise SwapConfigError(
                    f"{where}={value!r}: Adam with adam_w_mode=false runs as "
                    f"torch.optim.Adam, which computes {key}={_ADAM_L2_FIXED[key]!r}"
                )
        else:
            notes.ignored.append(where)
    try:  # the class's own checks, before any state is made
        cls([torch.zeros(1)], **out)
    except (TypeError, ValueError) as exc:
        raise SwapConfigError(f"optimizer.params ({cls.__name__}): {exc}") from None
    return cls, out


def _optimizer(
    value: object, notes: Unhonoured
) -> tuple[type[torch.optim.Optimizer] | None, dict[str, Any]]:
    if value is None:
        return None, {}
    section = _section(value, "optimizer")
    kind = section.get("type")
    if isinstance(kind, str) and kind.lower() in _OTHER_TYPES:
        return _other_optimizer(kind.lower(), section, notes)
    params = section.get("params")
    if (
        isinstance(kind, str)
        and kind.lower() == "adam"
        and isinstance(params, Mapping)
        and params.get("adam_w_mode") is False
    ):  # Adam with L2 regularisation: not OffloadAdamW's update, torch.optim.Adam's
        return _other_optimizer("adam-l2", section, notes)
    if not isinstance(kind, str) or kind.lower() not in _OPTIMIZER_TYPES:
        raise SwapConfigError(
            f"optimizer.type={kind!r}: swapper runs AdamW (OffloadAdamW; 'AdamW', or "
            "'Adam', which DeepSpeed runs as AdamW), 'SGD', 'Adagrad' and 'Lion' "
            "(OffloadOptimizer); remove the section and build your optimizer yourself "
            "for another"
        )
    for key in section:
        if key not in ("type", "params"):
            notes.ignored.append(f"optimizer.{key}")
    params = _section(section.get("params", {}), "optimizer.params")
    out: dict[str, Any] = {}
    for key, value in params.items():
        where = f"optimizer.params.{key}"
        if value == _AUTO:
            notes.auto.append(where)
        elif key in _ADAMW_PARAMS:
            out[key] = tuple(value) if key == "betas" and isinstance(value, list) else value
        elif key == "adam_w_mode" and kind.lower() == "adamw":
            continue  # DeepSpeed's AdamW is AdamW whatever this says
        elif key in _ADAMW_FIXED:
            if value is not _ADAMW_FIXED[key]:
                raise SwapConfigError(
                    f"{where}={value!r}: OffloadAdamW computes bias-corrected AdamW "
                    f"({key}={_ADAMW_FIXED[key]!r}); it cannot run this update"
                )
        else:
            notes.ignored.append(where)
    defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
    try:
        check_hyper(**{**defaults, **out})
    except SwapConfigError as exc:
        raise SwapConfigError(f"optimizer.params: {exc}") from None
    return None, out


def _precision(value: object, name: str, notes: Unhonoured) -> dict[str, Any] | None:
    """``None`` when the format is not enabled; else the loss scaler's settings (fp16) or
    an empty dict (bf16)."""
    if value is None:
        return None
    section = _section(value, name)
    enabled = section.get("enabled", False)
    if enabled == _AUTO:
        notes.auto.append(f"{name}.enabled")
        return None
    if not isinstance(enabled, bool):
        raise SwapConfigError(f"{name}.enabled={enabled!r} must be true or false")
    if not enabled:
        return None  # its other keys do not apply
    read = _FP16_READ if name == "fp16" else ("enabled",)
    for key, given in section.items():
        if key not in read:
            notes.ignored.append(f"{name}.{key}={given!r}")
    if name == "bf16":
        return {}
    scaler: dict[str, Any] = {}
    static = _number(section.get("loss_scale"), "fp16.loss_scale", notes, minimum=0.0)
    if static:
        # DeepSpeed keeps a static scale for good; DynamicLossScaler backs off on overflow
        notes.ignored.append(f"fp16.loss_scale={section['loss_scale']!r} (static)")
        scaler["init_scale"] = static
    else:
        power = _number(
            section.get("initial_scale_power"), "fp16.initial_scale_power", notes, minimum=0.0
        )
        scaler["init_scale"] = 2.0 ** (16 if power is None else power)  # DeepSpeed's 16
    window = _number(section.get("loss_scale_window"), "fp16.loss_scale_window", notes, minimum=1.0)
    if window is not None and not window.is_integer():
        raise SwapConfigError(f"fp16.loss_scale_window={window!r} must be a whole number")
    scaler["growth_interval"] = 1000 if window is None else int(window)  # DeepSpeed's 1000
    low = _number(section.get("min_loss_scale"), "fp16.min_loss_scale", notes, minimum=0.0)
    if low is not None:
        scaler["min_scale"] = low
    try:
        DynamicLossScaler(**scaler)
    except SwapConfigError as exc:
        raise SwapConfigError(f"fp16: {exc}") from None
    return scaler
