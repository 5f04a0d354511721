"""The DeepSpeed snippet of docs/huggingface.md round-trips: run as written (on a tiny
random Llama, with its placeholders filled in), the model it trains, saved with
``save_pretrained`` and reloaded with ``from_pretrained(..., dtype=)``, gives bit-identical
logits. ``model.to(dtype)``, which the snippet used to show, casts RoPE's ``inv_freq`` too
and does not (issue 28, item 3)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import VOCAB, _llama  # noqa: E402

PAGE = Path(__file__).resolve().parent.parent / "docs" / "huggingface.md"


def _snippet() -> str:
    text = PAGE.read_text(encoding="utf-8")
    section = text.split("\n## A DeepSpeed config file\n", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "docs/huggingface.md: no python block under 'A DeepSpeed config file'"
    return match[1]


def _tiny_llama_config() -> object:
    return _llama()[1]  # test_hf's: 2 layers, hidden 32, vocabulary VOCAB


def _fill_in(code: str, tmp_path: Path) -> str:
    """The snippet's placeholders replaced with a tiny run; each must be there to replace."""
    train = (
        f"ids = torch.randint(0, {VOCAB}, (2, 8), generator=torch.Generator().manual_seed(0))\n"
        "    wrapped(input_ids=ids, labels=ids).loss.backward(); opt.step(); opt.zero_grad()\n"
        "    opt.close()"
    )
    swaps = {
        "device_nbytes=..., host_nbytes=...": "device_nbytes=64 << 10, host_nbytes=1 << 20",
        '"ds.json"': repr(str(tmp_path / "ds.json")),
        'transformers.AutoConfig.from_pretrained("path/to/model")': "tiny_config",
        '"out"': repr(str(tmp_path / "out")),
    }
    for old, new in swaps.items():
        assert old in code, f"docs/huggingface.md's snippet no longer has {old!r}"
        code = code.replace(old, new)
    return re.sub(r"\.\.\. +# train", train, code)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    # 32 positions: the further along, the more a bf16-rounded inv_freq turns the angle
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture()
def ds_file(tmp_path: Path) -> Path:
    ds = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "swap")},
        },
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds), encoding="utf-8")
    return path


def test_snippet_builds_the_model_in_its_dtype() -> None:
    code = _snippet()
    assert "from_config(cfg, dtype=dtype)" in code
    assert ".to(training.torch_dtype" not in code and "model.to(" not in code


def test_snippet_round_trips_bit_identically(tmp_path: Path, ds_file: Path) -> None:
    torch.manual_seed(0)
    scope: dict[str, object] = {"tiny_config": _tiny_llama_config()}
    exec(compile(_fill_in(_snippet(), tmp_path), str(PAGE), "exec"), scope)
    model = scope["model"]
    assert isinstance(model, torch.nn.Module)
    trained = _logits(model)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.bfloat16
    )
    assert torch.equal(trained, _logits(loaded))


def test_model_to_dtype_does_not_round_trip(tmp_path: Path) -> None:
    """Why the snippet says so: the cast reaches the rotary embedding's buffer."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_tiny_llama_config())
    model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", dtype=torch.bfloat16
    )
    assert not torch.equal(_logits(model), _logits(loaded))
