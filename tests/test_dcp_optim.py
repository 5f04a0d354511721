"""Distributed Checkpoint export and import of ``OffloadOptimizer``'s state (issue 26):
every optimizer's declared state goes through ``export_dcp`` / ``import_dcp``, the
element-wise rows resharded by element, the per-parameter state (Adafactor's factored
moments) whole, and what the rule keeps in memory per parameter (each piece's ``step``
and whether it was stepped: SGD's momentum buffer starts as the first gradient) as
``optim.memory.<name>``.

- One process, export then import into a fresh model and optimizer: the optimizer's
  state dict is the exporter's bit for bit, and the next steps are the uninterrupted
  run's bit for bit (SGD with momentum, Adagrad, Adafactor, Adam).
- 2 gloo ranks export, one process imports (resharded): what was imported is what was
  exported (exported again, every tensor equal), and the next steps are within the
  multi-rank tolerance of the 2-rank run (tests/test_dist_train.py's ``ABS_TOL``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_dist_reshard import _steps
from test_dist_train import ABS_TOL, LR, TIGHT, _batches, _config, _model, _spawn

import swapper
from swapper import OffloadOptimizer
from swapper.step.rules.torch_optim import NOT_ELEMENTWISE
from swapper.zero import OffloadConfig
from swapper.zero.checkpoint.dcp_export import DcpCheckpointError, export_dcp
from swapper.zero.checkpoint.dcp_import import import_dcp

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

EXPORT_AT = 3  # steps before the export
AFTER = 2  # steps after it (uninterrupted, and after the import)

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": LR}),
    "adafactor": (torch.optim.Adafactor, {"lr": LR}),
    "adam": (torch.optim.Adam, {"lr": LR}),
}


def _wrap(tmp: str, name: str, label: str, world: int) -> Any:
    """A tight wrap (the state on NVMe); an optimizer that is not element-wise gets every
    parameter owned whole by one rank (and room on the host for a whole fc1)."""
    cls = OPTIMIZERS[name][0]
    variant: dict[str, Any] = {"name": f"{name}-{label}", "tight": True}
    whole = cls.__name__ in NOT_ELEMENTWISE
    if whole:
        variant["method"] = "all_reduce"
    config: OffloadConfig = _config(tmp, variant)
    config = dataclasses.replace(
        config,
        manager=dataclasses.replace(config.manager, host_nbytes=2 * TIGHT["host_nbytes"]),
        distributed=dataclasses.replace(
            config.distributed, ownership="contiguous" if whole else "balanced"
        ),
    )
    group = dist.group.WORLD if world > 1 else None
    return swapper.offload(_model(), config, group)


def _optimizer_state(optimizer: OffloadOptimizer) -> dict[tuple[int, str], torch.Tensor]:
    """Every state tensor of ``optimizer``'s state dict, cloned."""
    states = optimizer.state_dict()["state"]
    return {(i, k): v.clone() for i, entry in states.items() for k, v in entry.items()}


def export_run(rank: int, world: int, tmp: str, name: str) -> dict[str, Any]:
    """The uninterrupted run, exporting after :data:`EXPORT_AT` steps."""
    cls, kwargs = OPTIMIZERS[name]
    data = _batches()[: EXPORT_AT + AFTER]
    out: dict[str, Any] = {}
    with _wrap(tmp, name, "export", world) as wrapped:
        optimizer = OffloadOptimizer(cls, wrapped.parameters(), tiers=wrapped, **kwargs)
        try:
            _steps(wrapped, optimizer, rank, world, data[:EXPORT_AT])
            export_dcp(wrapped, Path(tmp, "dcp"), optimizer)
            out["at_export"] = wrapped.state_dict()
            if world == 1:
                out["state"] = _optimizer_state(optimizer)
            _steps(wrapped, optimizer, rank, world, data[EXPORT_AT:])
            out["straight"] = wrapped.state_dict()
        finally:
            optimizer.close()
    return out


def import_run(tmp: str, source: Path, name: str) -> dict[str, Any]:
    """One process imports ``source`` into a fresh wrap, exports it again, trains
    :data:`AFTER` steps."""
    cls, kwargs = OPTIMIZERS[name]
    data = _batches()[: EXPORT_AT + AFTER]
    out: dict[str, Any] = {}
    with _wrap(tmp, name, "import", 1) as wrapped:
        optimizer = OffloadOptimizer(cls, wrapped.parameters(), tiers=wrapped, **kwargs)
        try:
            import_dcp(wrapped, source, optimizer)
            out["step"] = optimizer.step_count
            out["at_import"] = wrapped.state_dict()
            out["state"] = _optimizer_state(optimizer)
            export_dcp(wrapped, Path(tmp, "again"), optimizer)
            _steps(wrapped, optimizer, 0, 1, data[EXPORT_AT:])
            out["resumed"] = wrapped.state_dict()
        finally:
            optimizer.close()
    return out


def _same(a: dict[Any, torch.Tensor], b: dict[Any, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def _load_all(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole, through plain ``dcp.load``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(directory).read_metadata()
    target: dict[str, Any] = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    dcp.load(target, checkpoint_id=directory)
    return target


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_one_process_export_import_continues_bitwise(tmp_path: Path, name: str) -> None:
    run = export_run(0, 1, str(tmp_path / "a"), name)
    got = import_run(str(tmp_path / "b"), tmp_path / "a" / "dcp", name)
    assert got["step"] == EXPORT_AT
    _same(got["at_import"], run["at_export"])
    _same(got["state"], run["state"])  # every state tensor, as the exporter's state dict
    _same(got["resumed"], run["straight"])  # the next steps bit-identical
    names = set(_load_all(tmp_path / "a" / "dcp"))
    if name == "adafactor":  # the factored moments whole, in their own shapes
        assert {"optim.row_var.fc1.weight", "optim.col_var.fc1.weight"} <= names
    if name == "sgd":
        assert "optim.momentum_buffer.fc1.weight" in names


@pytest.mark.dist
@pytest.mark.parametrize("name", ["sgd", "adagrad", "adafactor"])
def test_two_rank_export_imports_into_one_process(tmp_path: Path, name: str) -> None:
    """Resharded 2 → 1: what is imported is what was exported (exported again, the same
    tensors), and the next steps are within the multi-rank tolerance."""
    run = _spawn(export_run, 2, tmp_path / "ranks", name)[0]
    got = import_run(str(tmp_path / "one"), tmp_path / "ranks" / "dcp", name)
    assert got["step"] == EXPORT_AT
    _same(got["at_import"], run["at_export"])
    _same(_load_all(tmp_path / "one" / "again"), _load_all(tmp_path / "ranks" / "dcp"))
    for key, value in run["straight"].items():
        diff = float((value.float() - got["resumed"][key].float()).abs().max())
        assert diff <= ABS_TOL, f"{key}: max |diff| {diff}"


def test_another_optimizers_checkpoint_is_refused(tmp_path: Path) -> None:
    """An AdamW (OffloadAdamW) export has the rows torch.optim.AdamW declares but not the
    pieces' step counts: refused by name before anything is written."""
    data = _batches()[:1]
    wrapped = _wrap(str(tmp_path / "a"), "adam", "a", 1)
    with wrapped, swapper.OffloadAdamW(wrapped.parameters(), lr=LR, tiers=wrapped) as adamw:
        _steps(wrapped, adamw, 0, 1, data)
        export_dcp(wrapped, tmp_path / "dcp", adamw)
    wrapped = _wrap(str(tmp_path / "b"), "adam", "b", 1)
    with wrapped, OffloadOptimizer(torch.optim.AdamW, wrapped.parameters(), tiers=wrapped) as opt:
        before = _optimizer_state(opt)
        with pytest.raises(DcpCheckpointError, match=r"optim\.memory\..* is missing"):
            import_dcp(wrapped, tmp_path / "dcp", opt)
        assert opt.step_count == 0
        _same(_optimizer_state(opt), before)
