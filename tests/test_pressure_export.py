"""``swapper-pressure --export DIR`` (:mod:`swapper.pressure.export`) at 1 and 2 ranks.

The same seed exported by one process and by two gloo ranks (a tiny GPT, 2 steps): each
export is loaded into a plain model with plain ``torch.distributed.checkpoint`` (no
swapper) and with the safetensors index; at the same world size the export is the run's
final state bitwise (its ``final_digest`` recomputed from the import, and the
safetensors equal to the DCP weights), across world sizes the weights and master weights
are within the multi-rank tolerance of ``swapper.pressure.ranks`` (2 * lr * steps + one
ulp, more than half of the elements equal).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from swapper.pressure.cli import main
from swapper.pressure.export import DCP_SUBDIR, INDEX_NAME
from swapper.pressure.model import GPT, GPTConfig
from swapper.pressure.ranks_report import compare_params
from swapper.step.layout import STATE_ROWS

pytestmark = pytest.mark.dist

PARAMS = 300_000
STEPS = 2
LR = 1e-3
ARGV = ["--params", str(PARAMS), "--steps", str(STEPS), "--seq", "16", "--lr", str(LR)]


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[Path, dict[str, Any]]]:
    """nproc -> (export directory, the run's --json), the same seed at 1 and 2 ranks."""
    tmp = tmp_path_factory.mktemp("exports")
    out: dict[int, tuple[Path, dict[str, Any]]] = {}
    for nproc in (1, 2):
        directory, report = tmp / f"export{nproc}", tmp / f"r{nproc}.json"
        argv = [*ARGV, "--nproc", str(nproc), "--export", str(directory)]
        assert main([*argv, "--json", str(report)]) == 0
        out[nproc] = directory, json.loads(report.read_text())
    return out


def _plain_load(directory: Path) -> dict[str, Any]:
    """The DCP export read into a plain GPT's tensors with plain ``dcp.load``."""
    import torch.distributed.checkpoint as dcp

    plain = GPT(GPTConfig.for_params(PARAMS)).to(torch.bfloat16)
    params = dict(plain.named_parameters())  # a tied weight once, by its first name
    target: dict[str, Any] = {f"model.{n}": torch.empty_like(p) for n, p in params.items()}
    for row in STATE_ROWS:
        for n, p in params.items():
            target[f"optim.{row}.{n}"] = torch.empty(p.shape)
    target["optim.step"] = 0
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, checkpoint_id=directory / DCP_SUBDIR, no_dist=True)
    weights = {n: target[f"model.{n}"] for n in params}
    missing, unexpected = plain.load_state_dict(weights, strict=False)
    assert unexpected == [] and set(missing) <= {"head.weight"}  # tied to tok_emb
    return target


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = json.loads((directory / INDEX_NAME).read_text())
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(load_file(directory / shard))
    assert set(out) == set(index["weight_map"])
    return out


def _digest_of_import(directory: Path) -> str:
    """``final_digest`` of the DCP export imported into one process (the digest of the
    same state is the same at every world size)."""
    import swapper
    from swapper.step import OffloadAdamW, StepConfig
    from swapper.zero.checkpoint.dcp_import import import_dcp
    from swapper.zero.checkpoint.snapshot import final_digest
    from swapper.zero.config.offload import OffloadConfig

    gpt = GPT(GPTConfig.for_params(PARAMS)).to(torch.bfloat16)  # other weights: overwritten
    config = OffloadConfig.create(device_nbytes=None, host_nbytes=None, device="cpu")
    with (
        swapper.offload(gpt, config) as wrapped,
        OffloadAdamW(
            wrapped.parameters(),
            lr=LR,
            weight_decay=0.01,
            tiers=wrapped,
            config=StepConfig(max_grad_norm=1.0),
        ) as optimizer,
        warnings.catch_warnings(),
    ):
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        import_dcp(wrapped, directory / DCP_SUBDIR, optimizer)
        return final_digest(wrapped, optimizer)


@pytest.mark.parametrize("nproc", [1, 2])
def test_export_is_the_runs_final_state_bitwise(nproc: int, exports: Any) -> None:
    directory, report = exports[nproc][0], exports[nproc][1]
    assert report["export_seconds"] > 0
    assert report["export"] == {
        "dir": str(directory),
        "safetensors_index": str(directory / INDEX_NAME),
        "dcp": str(directory / DCP_SUBDIR),
    }
    parts = sorted(p.name for p in (directory / DCP_SUBDIR).glob("*.distcp"))
    assert parts == [f"__{r}_0.distcp" for r in range(nproc)]  # a part per rank
    if nproc > 1:
        assert all(r["export_seconds"] > 0 for r in report["per_rank"])
        assert report["export_seconds"] == max(r["export_seconds"] for r in report["per_rank"])
    state = _plain_load(directory)
    assert state["optim.step"] == STEPS
    # the safetensors weights are the DCP's, bitwise
    tensors = _safetensors(directory)
    for name, tensor in tensors.items():
        assert torch.equal(tensor, state[f"model.{name}"]), name
    # the 16-bit weights are the fp32 masters rounded
    for name in tensors:
        master = state[f"optim.master.{name}"]
        assert torch.equal(master.to(torch.bfloat16), state[f"model.{name}"]), name
    # weights and optimizer state as the run ended: its final_digest
    assert _digest_of_import(directory) == report["final_digest"]


def test_two_rank_export_is_within_tolerance_of_one_process(exports: Any) -> None:
    one, two = _plain_load(exports[1][0]), _plain_load(exports[2][0])
    bound = 2 * LR * STEPS  # swapper.pressure.ranks' tolerance
    assert exports[2][1]["tolerance"]["abs"] == pytest.approx(bound)
    weights = [{k: v for k, v in s.items() if k.startswith("model.")} for s in (two, one)]
    assert weights[0].keys() == weights[1].keys() and weights[0]
    worst, equal, within = compare_params(weights[0], weights[1], bound, torch.bfloat16)
    assert within, (worst, equal)
    # the fp32 masters: within the same bound (their low bits differ: not half equal)
    masters = [{k: v for k, v in s.items() if k.startswith("optim.master.")} for s in (two, one)]
    worst = compare_params(masters[0], masters[1], bound, torch.float32)[0]
    assert 0 < worst <= bound


def test_export_over_an_existing_one_exits_2_before_any_work(
    exports: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = exports[2][0]
    assert main([*ARGV, "--nproc", "2", "--export", str(directory)]) == 2
    assert "exists" in capsys.readouterr().err


def test_export_to_a_file_exits_2_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert main([*ARGV, "--export", str(a_file)]) == 2
    assert "not a directory" in capsys.readouterr().err


def test_progress_says_each_quarter_once() -> None:
    from swapper.pressure.export import _Progress

    lines: list[str] = []
    progress = _Progress("DCP", lines.append)
    for done in (10, 30, 30, 99, 100):
        progress(done, 100)
    assert [line.split()[2] for line in lines] == ["25%", "50%", "75%", "100%"]
    assert lines[-1] == "  export: DCP 100% (100 B of 100 B)"  # the one size format
