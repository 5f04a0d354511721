"""``swapper.hf.Trainer``: Hugging Face's ``Trainer`` with swapper's tiers, in one line.

::

    trainer = swapper.hf.Trainer(model=model, args=args, train_dataset=data, offload=config)
    trainer.train()                 # or train(resume_from_checkpoint=True)
    trainer.save_model()

``offload`` is an :class:`~swapper.OffloadConfig`, or a DeepSpeed config (a path to its
JSON file, or the dict) read as :func:`swapper.load_deepspeed` reads it. What the
subclass does that ``transformers.Trainer`` cannot (the five wirings a user otherwise
writes by hand; docs/huggingface.md):

- :meth:`train` wraps the model with :func:`swapper.offload` when it starts (after
  ``args.gradient_checkpointing`` is enabled on the model, so the wrap checks the device
  budget against what a recompute holds) and gives the model its real weights back when
  it ends (normally or not): before and after ``train()`` the model is an ordinary one
  (``save_model()``, ``evaluate()``);
- the optimizer is :class:`~swapper.OffloadAdamW` over the trainable parameters, with
  ``args``' learning rate, betas, epsilon and weight decay (the Trainer's decay / no-decay
  groups) and its learning-rate scheduler; ``zero_grad()`` is called after each step
  (the Trainer calls only ``model.zero_grad()``, which does not reach swapper's retained
  gradients);
- clipping is swapper's, at ``args.max_grad_norm``, and the logged ``grad_norm`` is the
  real pre-clip global norm the step computed (the Trainer's own clipping would see no
  ``.grad`` and log 0); with ``max_grad_norm=0`` the norm is still computed and logged,
  and nothing is clipped;
- a checkpoint's optimizer state is a swapper snapshot in the swap store (written
  copy-on-write, its cost the dirty bytes, never the whole state in memory), named in
  the checkpoint directory's ``swapper_snapshot.json``; ``train(resume_from_checkpoint=)``
  opens the store at that snapshot (weights, optimizer state, RNG), then lets the
  Trainer restore its scheduler, state and data position: bit-exact. The store is the
  swap directory of ``offload``: resume with the same one.

Needs ``transformers`` and ``accelerate`` (``pip install swapper[hf]``). One process:
``TrainingArguments`` for several (``torchrun``) are refused at construction, naming why.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from swapper.step import OffloadAdamW, StepConfig
from swapper.zero import OffloadConfig, load_deepspeed, save_snapshot
from swapper.zero.config.deepspeed_training import TrainingSettings
from swapper.zero.local.offload import OffloadedModel
from tiers.errors import SwapConfigError

__all__ = ["SNAPSHOT_FILE", "Trainer"]

#: In a Trainer checkpoint directory: the swapper snapshot holding its optimizer state.
SNAPSHOT_FILE = "swapper_snapshot.json"
_SCHEDULER_FILE = "scheduler.pt"  # (transformers.trainer.SCHEDULER_NAME)


def _offload_config(
    offload: OffloadConfig | str | os.PathLike[str] | Mapping[str, Any],
) -> tuple[OffloadConfig, TrainingSettings | None]:
    if isinstance(offload, OffloadConfig):
        return offload, None
    if isinstance(offload, (str, os.PathLike, Mapping)):
        return load_deepspeed(offload)
    raise SwapConfigError(
        f"offload={offload!r} must be an OffloadConfig, a DeepSpeed JSON file's path or its dict"
    )


def _optimizer_kwargs(
    args: transformers.TrainingArguments, training: TrainingSettings | None
) -> dict[str, Any]:
    """AdamW's hyper-parameters from ``args``; a DeepSpeed file's explicit values must
    agree with them (as the Trainer's DeepSpeed integration requires; "auto" is filled
    from ``args``).

    Raises:
        SwapConfigError: a value of the DeepSpeed file differs from ``args``' (both named).
    """
    kwargs: dict[str, Any] = {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
    }
    if training is None:
        return kwargs
    given = dict(training.optimizer)
    if training.max_grad_norm is not None:
        given["max_grad_norm"] = training.max_grad_norm
    ours = {**kwargs, "max_grad_norm": args.max_grad_norm}
    for key, value in given.items():
        mine = ours.get(key)
        if key == "betas":
            value = tuple(value)
        if mine is not None and value != mine:
            raise SwapConfigError(
                f"the DeepSpeed config sets {key}={value!r} but the TrainingArguments give "
                f'{mine!r}: make them agree, or write "auto" in the DeepSpeed file'
            )
    return kwargs


class Trainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose model lives in swapper's tiers while it trains
    (module docstring).

    Args:
        model: the model (16-bit parameters; fp32 adapters beside a 16-bit base, as
            PEFT's defaults, too). Not wrapped yet: :meth:`train` wraps it.
        args: the ``TrainingArguments``.
        offload: an :class:`~swapper.OffloadConfig`, or a DeepSpeed config (path or dict)
            read as :func:`swapper.load_deepspeed` reads it (its fp16 section gives the
            loss scaler).
        **kwargs: the Trainer's other arguments, except ``optimizers`` (swapper makes
            the optimizer and its scheduler is the Trainer's).

    Raises:
        SwapConfigError: ``offload`` is not a config, ``optimizers`` is given, the
            DeepSpeed file disagrees with ``args`` (named), or ``args`` are for several
            processes (``world_size`` > 1: one process only, :func:`_refuse_several_ranks`
            says why).
    """

    def __init__(
        self,
        model: nn.Module,
        args: transformers.TrainingArguments,
        *,
        offload: OffloadConfig | str | os.PathLike[str] | Mapping[str, Any],
        **kwargs: Any,
    ) -> None:
        optimizers = kwargs.pop("optimizers", (None, None))
        if tuple(optimizers) != (None, None):
            raise SwapConfigError(
                "swapper.hf.Trainer makes its optimizer (OffloadAdamW over the tiers): do "
                "not pass optimizers=; set the learning rate and schedule in the "
                "TrainingArguments"
            )
        _refuse_several_ranks(args)
        self.offload_config, self._training = _offload_config(offload)
        self._adam = _optimizer_kwargs(args, self._training)
        self._wrapped: OffloadedModel | None = None
        #: the optimizer made over the wrap (``self.optimizer`` is accelerate's wrapper of it)
        self._offload_optimizer: OffloadAdamW | None = None
        #: the pre-clip global norm of the step running now, filled when it is computed
        self._grad_norm = torch.zeros(())
        super().__init__(model=model, args=args, **kwargs)
        self.add_callback(_AfterStep(self))

    # -- the wrap, around train() ----------------------------------------------------------

    @property
    def wrapped(self) -> OffloadedModel | None:
        """The offloaded model while :meth:`train` runs, else None."""
        return self._wrapped

    def train(  # type: ignore[override]
        self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any
    ) -> Any:
        """The Trainer's ``train``, the model in the tiers meanwhile (module docstring).

        Raises:
            SwapConfigError: the budgets cannot hold the model (named, before anything
                moves), or the checkpoint has no swapper snapshot.
            and what ``transformers.Trainer.train`` and the tiers raise; the model has
            its weights back either way.
        """
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = transformers.trainer_utils.get_last_checkpoint(self.args.output_dir)
            if checkpoint is None:
                raise SwapConfigError(
                    f"resume_from_checkpoint=True: no checkpoint in {self.args.output_dir!r}"
                )
        resume: str | bool = False
        if isinstance(checkpoint, (str, os.PathLike)):
            checkpoint = os.fspath(checkpoint)
            resume = _snapshot_name(Path(checkpoint))
        model = self._model()
        if self.args.gradient_checkpointing:  # before the wrap: its floor is checked
            _enable_checkpointing(model, self.args.gradient_checkpointing_kwargs)
        self.optimizer, self.lr_scheduler = None, None  # (made over this wrap)
        # Leaving the block gives the model its weights back (an error too: see
        # swapper.zero.local.weights.leave); a store holding snapshots keeps its files.
        with OffloadedModel(model, self.offload_config, resume=resume) as wrapped:
            self._wrapped = wrapped
            try:
                return super().train(resume_from_checkpoint=checkpoint or None, **kwargs)
            finally:
                optimizer, self._offload_optimizer = self._offload_optimizer, None
                self.optimizer, self._wrapped = None, None
                if optimizer is not None:
                    optimizer.close()

    def _model(self) -> nn.Module:
        model = self.model
        if not isinstance(model, nn.Module):
            raise SwapConfigError("swapper.hf.Trainer needs a model (model_init is not supported)")
        return model

    # -- the optimizer and clipping --------------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """:class:`~swapper.OffloadAdamW` over the trainable parameters, in the Trainer's
        decay and no-decay groups, clipping at ``args.max_grad_norm`` (the norm computed
        without clipping when it is 0)."""
        if self.optimizer is not None:
            return self.optimizer
        wrapped = self._wrapped
        if wrapped is None:
            raise SwapConfigError("swapper.hf.Trainer: the optimizer is made inside train()")
        model = self._model()
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = []
        for names, weight_decay in (
            ([n for n, _ in named if n in decay], self._adam["weight_decay"]),
            ([n for n, _ in named if n not in decay], 0.0),
        ):
            if names:
                params = dict(named)
                groups.append(
                    {
                        "params": [params[n] for n in names],
                        "param_names": names,
                        "weight_decay": weight_decay,
                    }
                )
        norm = self.args.max_grad_norm
        # max_grad_norm=inf: the norm computed (and logged), nothing clipped (the
        # coefficient is 1.0 exactly, and multiplying by it changes no bit)
        step = StepConfig(max_grad_norm=norm if norm and norm > 0 else math.inf)
        scaler = self._training.make_loss_scaler() if self._training is not None else None
        self.optimizer = self._offload_optimizer = OffloadAdamW(
            groups,
            lr=self._adam["lr"],
            betas=self._adam["betas"],
            eps=self._adam["eps"],
            tiers=wrapped,
            config=step,
            loss_scaler=scaler,
        )
        return self.optimizer

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, whose ``clip_grad_norm_`` gives the step's norm:
        transformers 4.x clips through it (5.x through :meth:`_clip_grad_norm`), and
        there too it would find no ``.grad`` and log 0."""
        super().create_accelerator_and_postprocess()
        self.accelerator.clip_grad_norm_ = self._accelerator_clip  # type: ignore[method-assign]

    def _accelerator_clip(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        return self._clip_grad_norm(self._model())

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        # The step clips (and computes the norm) itself: the gradients are in swapper's
        # retained buffers, not in .grad. What the Trainer logs is this tensor, filled with
        # the step's pre-clip norm once it ran (_AfterStep.on_optimizer_step).
        self._grad_norm = torch.full((), float("nan"))
        return self._grad_norm

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return self._clip_grad_norm(model) if grad_norm is None else grad_norm

    # -- checkpoints -----------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The optimizer state as a swapper snapshot (the model's weights and the RNG with
        it), named in ``output_dir``; the scheduler as the Trainer saves it."""
        wrapped, optimizer = self._wrapped, self._offload_optimizer
        if wrapped is None or optimizer is None:
            raise SwapConfigError("swapper.hf.Trainer: checkpoints are saved inside train()")
        name = Path(output_dir).name  # checkpoint-<step>
        limit = self.args.save_total_limit
        report = save_snapshot(wrapped, optimizer, name=name, keep_last=limit or None)
        record = {"snapshot": report.name, "step": report.step, "store": str(report.path)}
        Path(output_dir, SNAPSHOT_FILE).write_text(json.dumps(record, indent=1))
        if self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # The weights come from the snapshot train() opened the store at.
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # The optimizer adopted the snapshot's state when made; the scheduler is the
        # Trainer's file.
        if checkpoint is None or self.lr_scheduler is None:
            return
        path = os.path.join(checkpoint, _SCHEDULER_FILE)
        if not os.path.isfile(path):
            return
        scheduler = self.lr_scheduler
        scheduler.load_state_dict(torch.load(path, weights_only=True))
        # The scheduler was made over the resumed optimizer, so it took the resumed lr for
        # its base and set the lr of step 0: both put back as the checkpoint had them (what
        # torch's optimizer.load_state_dict does with its saved param groups).
        optimizer = self._offload_optimizer
        if optimizer is not None and isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            groups = optimizer.param_groups
            for group, lr, base in zip(
                groups, scheduler.get_last_lr(), scheduler.base_lrs, strict=True
            ):
                group["lr"], group["initial_lr"] = lr, base


def _enable_checkpointing(model: nn.Module, kwargs: dict[str, Any] | str | None) -> None:
    """HF's gradient checkpointing on ``model`` with ``kwargs``. Reentrant (transformers
    4.x's default) over a frozen input embedding (a PEFT model's), the inputs are made to
    require grad, as transformers 5 always does and PEFT does for a base checkpointing
    when it is wrapped: else, with 4.x, the checkpointed blocks' outputs need no grad and
    the backward fails ("element 0 of tensors does not require grad")."""
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        return
    enable(gradient_checkpointing_kwargs=kwargs)
    default = int(transformers.__version__.split(".")[0]) < 5  # (5.x: non-reentrant)
    # (a str: the arguments' JSON form, which TrainingArguments parses into a dict)
    reentrant = kwargs.get("use_reentrant", default) if isinstance(kwargs, dict) else default
    embeddings = getattr(model, "get_input_embeddings", None)
    require = getattr(model, "enable_input_require_grads", None)
    if not reentrant or embeddings is None or require is None:
        return
    embedding = embeddings()
    if isinstance(embedding, nn.Module) and not any(
        p.requires_grad for p in embedding.parameters()
    ):
        require()


def _refuse_several_ranks(args: transformers.TrainingArguments) -> None:
    """Several processes (``torchrun --nproc_per_node N``, ``accelerate launch``) are
    refused: there the Trainer (through accelerate) wraps the model in
    ``DistributedDataParallel``, which broadcasts the parameters from rank 0 and
    all-reduces their ``.grad``; under swapper a parameter is an empty placeholder
    whose bytes are in the tiers (a rank's shard of them, sharded) and its gradient is
    in swapper's retained buffers, reduce-scattered by swapper itself, so neither would
    happen right. Several ranks need ``swapper.offload(model, config, process_group)``
    and a training loop (docs/distributed.md).

    Raises:
        SwapConfigError: ``args.world_size`` is more than 1 (named).
    """
    world = args.world_size
    if world > 1:
        raise SwapConfigError(
            f"swapper.hf.Trainer runs in one process; these TrainingArguments have "
            f"world_size={world} (torchrun or accelerate launch): the Trainer would wrap "
            "the model in DistributedDataParallel, which cannot broadcast or reduce "
            "parameters whose bytes live in swapper's tiers. Launch one process, or train "
            "several ranks with swapper.offload(model, config, process_group) and your own "
            "loop (docs/distributed.md)"
        )


def _snapshot_name(checkpoint: Path) -> str:
    """The snapshot a Trainer checkpoint directory names.

    Raises:
        SwapConfigError: the directory has no (readable) ``swapper_snapshot.json``.
    """
    path = checkpoint / SNAPSHOT_FILE
    try:
        record = json.loads(path.read_text())
        return str(record["snapshot"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SwapConfigError(
            f"resume_from_checkpoint={str(checkpoint)!r}: {path} cannot be read ({exc}); "
            "resume from a checkpoint that swapper.hf.Trainer saved, with the same "
            "offload config (the snapshot is in its swap store)"
        ) from None


class _AfterStep(transformers.TrainerCallback):
    """After each optimizer step: the logged norm filled with the step's, and
    ``zero_grad()`` of swapper's optimizer."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = self._trainer._offload_optimizer
        report = optimizer.last_step if optimizer is not None else None
        if report is not None and report.grad_norm is not None:
            self._trainer._grad_norm.fill_(report.grad_norm)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        optimizer = self._trainer._offload_optimizer
        if optimizer is not None:
            optimizer.zero_grad()
