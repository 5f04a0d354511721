"""Tests of swapper.zero.model.saved: autograd's saved views of parameters under budgets that
cannot hold every parameter (the blocks move between a module's forward and backward).

Before the fix, ``addmm`` kept ``weight.t()``, a view of the block the forward fetched;
the forward hook released it, another entry was given the block (host tier: carved from
a reused arena) and the backward read that entry's bytes: the final weights differed
from the unlimited run, from run to run. On the device tier (its CPU stand-in) the view
kept the released block alive outside the budget instead.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_step_overlap import ADAM, _data, _host_use_config, _loss, _mlp
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

import swapper
from swapper import OffloadAdamW, OffloadConfig, StepConfig
from swapper.zero import final_digest
from swapper.zero.model.saved import SavedParamError, SavedParams


def _run(
    model: nn.Module,
    config: OffloadConfig,
    steps: int = 3,
    around: Any = None,
    backwards: int = 1,
) -> tuple[str, list[float], bool]:
    losses = []
    with (
        swapper.offload(model, config) as wrapped,
        OffloadAdamW(wrapped.parameters(), **ADAM, tiers=wrapped) as opt,
    ):
        for ((x, y),) in _data(1, torch.bfloat16)[:steps]:
            if around is None:
                loss = _loss(wrapped, x, y)
            else:
                with around():
                    loss = _loss(wrapped, x, y)
            for i in range(backwards):  # (through the retained graph again)
                loss.backward(retain_graph=i < backwards - 1)
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        return final_digest(wrapped, opt), losses, wrapped.core.keep_held


@pytest.mark.parametrize("host", [90_000, 95_000])
def test_host_use_tier_with_a_tight_budget_matches_the_unlimited_run(
    tmp_path: Path, host: int
) -> None:
    """Bitwise: the digest of weights and optimizer state, and the losses (3 steps, bf16),
    twice (the corruption varied from run to run)."""
    expected = _run(_mlp(), _host_use_config(tmp_path, "all", None))
    assert expected[2]  # (the unlimited run keeps its holds: nothing moves)
    for attempt in range(2):
        got = _run(_mlp(), _host_use_config(tmp_path, f"h{host}-{attempt}", host))
        assert not got[2]
        assert got[:2] == expected[:2]


def test_a_second_backward_through_a_retained_graph_matches_the_unlimited_run(
    tmp_path: Path,
) -> None:
    """Each backward pass fetches the parameters again and unpacks the saved views from
    that fetch (the blocks of the first pass were released at its end)."""
    expected = _run(_mlp(), _host_use_config(tmp_path, "all", None), backwards=2)
    got = _run(_mlp(), _host_use_config(tmp_path, "tight", 90_000), backwards=2)
    assert got[:2] == expected[:2]
    assert expected[:2] != _run(_mlp(), _host_use_config(tmp_path, "once", None))[:2]


class _Checkpointed(nn.Module):
    """The MLP's layers in two activation-checkpointed blocks."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        layers = list(_mlp())
        self.a, self.b = nn.Sequential(*layers[:4]), nn.Sequential(*layers[4:])
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant:  # (reentrant checkpointing computes no gradient otherwise)
            x = x.detach().requires_grad_()
        for block in (self.a, self.b):
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_with_a_tight_budget_matches_the_unlimited_run(
    tmp_path: Path, reentrant: bool
) -> None:
    """The recompute fetches and releases parameters inside the backward: its saved views
    are kept as positions too, and non-reentrant checkpointing (whose own hooks count the
    tensors saved in both passes) still matches them up."""
    expected = _run(_Checkpointed(reentrant), _host_use_config(tmp_path, "all", None))
    got = _run(_Checkpointed(reentrant), _host_use_config(tmp_path, "tight", 90_000))
    assert not got[2]
    assert got[:2] == expected[:2]
    # and the same losses as without checkpointing (the digest names the parameters)
    assert expected[1] == _run(_mlp(), _host_use_config(tmp_path, "plain", None))[1]


def test_reentrant_recompute_under_a_limited_budget_that_holds_every_parameter(
    tmp_path: Path,
) -> None:
    """120 000 B holds every parameter (100 224 B: the forward's holds are kept for the
    backward) but not them and the gradients: a reentrant recompute's holds are not kept
    (its forward ran under no_grad), the blocks it saved views of were evicted and given
    to other entries before its backward: before, intermittent (2 of ~26 runs of this
    model differed, timing of the mover threads); this test guards the path, it does not
    reliably fail without the fix. Three runs."""
    expected = _run(_Checkpointed(True), _host_use_config(tmp_path, "all", None))
    for attempt in range(3):
        got = _run(_Checkpointed(True), _host_use_config(tmp_path, f"t{attempt}", 120_000))
        assert got[2]  # (holds kept: the budget holds every parameter)
        assert got[:2] == expected[:2]


def test_a_users_saved_tensor_hooks_still_see_the_other_tensors(tmp_path: Path) -> None:
    """torch applies only the innermost pair: the model's pair passes every tensor that
    is not a parameter view to the user's (here ``save_on_cpu``, and a counting pair),
    which then unpacks it; results unchanged."""
    seen: dict[str, int] = {"pack": 0, "unpack": 0}

    def pack(tensor: torch.Tensor) -> Any:
        seen["pack"] += 1
        return ("mine", tensor)

    def unpack(packed: Any) -> torch.Tensor:
        seen["unpack"] += 1
        assert packed[0] == "mine"
        return packed[1]

    def counting() -> Any:
        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    expected = _run(_mlp(), _host_use_config(tmp_path, "all", None))
    got = _run(_mlp(), _host_use_config(tmp_path, "tight", 90_000), around=counting)
    assert got[:2] == expected[:2]
    assert seen["pack"] > 0 and seen["unpack"] == seen["pack"]
    cpu = _run(
        _mlp(),
        _host_use_config(tmp_path, "cpu", 90_000),
        around=lambda: torch.autograd.graph.save_on_cpu(),
    )
    assert cpu[:2] == expected[:2]


def test_device_stand_in_does_not_keep_released_blocks_alive(tmp_path: Path) -> None:
    """Device tier (CPU stand-in) with room for about one module: after the forward,
    every block whose parameter was evicted from the device is freed (before, the graph's
    saved ``weight.t()`` kept each one alive, outside the budget)."""
    config = OffloadConfig.create(
        nvme_dirs=[tmp_path / "d"],
        device="cpu",
        device_nbytes=40_000,  # about the largest module's parameters (33 024 B)
        host_nbytes=None,
        step=StepConfig(sub_group_numel=4096),
    )
    model = _mlp()
    linears = [m for m in model if isinstance(m, nn.Linear)]
    blocks: list[tuple[nn.Linear, StorageWeakRef]] = []
    with swapper.offload(model, config) as wrapped:
        assert not wrapped.core.keep_held
        for linear in linears:  # registered after the wrap's: runs with the weight fetched

            def note(module: nn.Module, args: Any) -> None:
                assert isinstance(module, nn.Linear)
                blocks.append((module, StorageWeakRef(module.weight.untyped_storage())))

            linear.register_forward_pre_hook(note)
        ((x, y),) = _data(1, torch.bfloat16)[0]
        loss = _loss(wrapped, x, y)
        assert len(blocks) == len(linears)
        # Only the last Linear's block can still be in the 40 KB device tier; the others
        # were evicted and are freed (before the fix only the first was: its input needs
        # no gradient, so addmm saved no weight.t() of it).
        assert [linears.index(m) for m, ref in blocks if ref.expired()] == [0, 1, 2]
        loss.backward()  # unpacked from the blocks fetched again: it still works
        assert all(slot.has_grad for slot in wrapped.core.by_name.values())


def test_a_saved_view_used_after_its_module_is_refused_not_read(tmp_path: Path) -> None:
    """A saved view whose parameter is not held when the backward unpacks it raises
    :class:`SavedParamError` instead of reading a block that is not the parameter's."""
    model = _mlp()
    first = model[3]  # (its input requires grad: addmm saves weight.t())
    with swapper.offload(model, _host_use_config(tmp_path, "t", 90_000)) as wrapped:
        ((x, y),) = _data(1, torch.bfloat16)[0]  # (its input requires grad: addmm saves weight.t())
        captured: list[torch.Tensor] = []
        first.register_forward_hook(lambda m, a, out: captured.append(out) and None)
        loss = _loss(wrapped, x, y)
        node = captured[0].grad_fn
        assert node is not None
        with pytest.raises(SavedParamError, match="not fetched now"):
            getattr(node, "_saved_mat2")  # (addmm's weight.t(), read outside the backward)  # noqa: B009
        loss.backward()


def test_disabled_saved_tensor_hooks_are_refused_with_a_tight_budget(tmp_path: Path) -> None:
    """Where saved-tensor hooks are disabled the views cannot be kept safely: the forward
    raises :class:`SavedParamError` (naming the budget), releases what it fetched, and
    the next forward runs."""
    with swapper.offload(_mlp(), _host_use_config(tmp_path, "t", 90_000)) as wrapped:
        ((x, y),) = _data(1, torch.bfloat16)[0]
        with (
            torch.autograd.graph.disable_saved_tensors_hooks("not here"),
            pytest.raises(SavedParamError, match=r"not here.*hold every parameter"),
        ):
            wrapped(x)
        assert not any(slot.users for slot in wrapped.core.by_name.values())
        _loss(wrapped, x, y).backward()
    # budgets that hold every parameter need no hooks: allowed
    with (
        swapper.offload(_mlp(), _host_use_config(tmp_path, "all", None)) as wrapped,
        torch.autograd.graph.disable_saved_tensors_hooks("not here"),
    ):
        wrapped(x)


def saved_views_rank(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Rank body of the sharded test: which gathered buffers of fc1 and fc2 are still
    alive after the forward (released by then), and the loss and its gradient's effect."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from test_dist_train import VOCAB, _batches, _config, _model

    model = _model()
    fcs = [model.fc1, model.fc2]
    blocks: list[StorageWeakRef] = []
    wrapped = swapper.offload(model, _config(tmp, {"tight": True, "name": "s"}), dist.group.WORLD)
    try:
        for fc in fcs:  # registered after the wrap's pre-hook: runs with the weight gathered

            def note(module: nn.Module, args: Any) -> None:
                assert isinstance(module, nn.Linear)
                blocks.append(StorageWeakRef(module.weight.untyped_storage()))

            fc.register_forward_pre_hook(note)
        tokens = _batches()[0][rank * 4 : rank * 4 + 4]
        logits = wrapped(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        alive = [not ref.expired() for ref in blocks]
        loss.backward()  # the saved views read from the backward's gathers
        return {"alive": alive, "loss": float(loss)}
    finally:
        wrapped.close()


@pytest.mark.dist
def test_sharded_forward_does_not_keep_released_buffers_alive(tmp_path: Path) -> None:
    """Two gloo ranks, tight budgets: after the forward, fc1's and fc2's gathered
    buffers are freed (before, addmm's saved ``weight.t()`` kept each one alive outside
    the device budget until the backward), and the backward still runs."""
    from test_dist_train import _spawn

    results = _spawn(saved_views_rank, 2, tmp_path, join_s=90.0)
    for result in results:
        assert result["alive"] == [False, False]
        assert result["loss"] > 0


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    cols=st.integers(1, 6),
    view=st.sampled_from(["whole", "t", "row", "col", "slice", "diag", "flat", "float"]),
    at=st.integers(0, 5),
)
def test_pack_then_unpack_gives_the_same_view_of_the_current_block(
    rows: int, cols: int, view: str, at: int
) -> None:
    """Round trip through the hooks: any view of a parameter is rebuilt with its size,
    strides and values from the parameter's data *at unpack* (a new block); a tensor
    that cannot be a view of it (another dtype) is copied, never kept as a reference."""
    param = nn.Parameter(torch.arange(rows * cols, dtype=torch.bfloat16).reshape(rows, cols))
    slot = SimpleNamespace(name="w", param=param, dtype=param.dtype, users=1)
    saved = SavedParams(lambda s: s.users > 0)
    data = param.data
    tensor = {
        "whole": lambda: data,
        "t": lambda: data.t(),
        "row": lambda: data[min(at, rows - 1)],
        "col": lambda: data[:, min(at, cols - 1)],
        "slice": lambda: data[min(at, rows - 1) :, ::2],
        "diag": lambda: data.diagonal(),
        "flat": lambda: data.view(-1)[min(at, rows * cols - 1) :],
        "float": lambda: data.float(),
    }[view]()
    saved.push(0, [slot])
    try:
        pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(False)  # type: ignore[misc]
        packed = pack(tensor)
    finally:
        saved.pop_from(0)
    expected = tensor.clone()
    param.data = (data.float() + 100).to(torch.bfloat16) - 100  # a new block, same values
    data.fill_(-1)  # the old block given to another entry
    got = unpack(packed)
    assert torch.equal(got, expected)
    assert got.size() == expected.size()
    if view != "float":
        assert got.stride() == tensor.stride()
        assert got.untyped_storage().data_ptr() == param.untyped_storage().data_ptr()
