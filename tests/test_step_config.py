"""StepConfig: validation names the setting, None fields merge from defaults, frozen and
keyword-only; OffloadAdamW takes it as ``config=`` and nothing else there."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import swapper
from swapper.manager import ManagerConfig
from swapper.step import OffloadAdamW, StepConfig
from swapper.step.config import check_hyper
from tiers.errors import SwapConfigError, SwapError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sub_group_numel": 0}, r"^sub_group_numel=0 must be > 0"),
        ({"sub_group_numel": True}, r"^sub_group_numel=True must be > 0"),
        ({"sub_group_numel": 2.0}, r"^sub_group_numel=2.0 must be > 0"),
        ({"host_fraction": -0.1}, r"^host_fraction=-0.1 must be between 0 and 1"),
        ({"host_fraction": float("nan")}, r"^host_fraction=nan must be between"),
        ({"host_fraction": "0.5"}, r"^host_fraction='0.5' must be between"),
        ({"max_grad_norm": 0}, r"^max_grad_norm=0 must be > 0 or None"),
        ({"max_grad_norm": float("nan")}, r"^max_grad_norm=nan must be > 0"),
        ({"accumulate_fp32": 1}, r"^accumulate_fp32=1 must be True or False"),
        ({"readahead": -1}, r"^readahead=-1 must be an int >= 0 .*'auto'.* or None"),
        ({"readahead": 1.0}, r"^readahead=1.0 must be an int"),
        ({"readahead": "Auto"}, r"^readahead='Auto' must be an int >= 0"),
        ({"readahead": True}, r"^readahead=True must be an int"),
        ({"name": ""}, r"^name='' must be a non-empty key prefix"),
    ],
)
def test_invalid_settings_are_refused_naming_them(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(SwapConfigError, match=message) as caught:
        StepConfig(**kwargs)
    assert isinstance(caught.value, SwapError) and isinstance(caught.value, ValueError)


def test_frozen_keyword_only_and_normalised() -> None:
    config = StepConfig(host_fraction=1, max_grad_norm=2)
    assert config.host_fraction == 1.0 and isinstance(config.host_fraction, float)
    assert config.max_grad_norm == 2.0 and isinstance(config.max_grad_norm, float)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        StepConfig(100)  # type: ignore[misc]
    assert swapper.StepConfig is StepConfig


@settings(deadline=None)  # a loaded machine: building configs is not what is timed
@given(
    mine=st.builds(
        StepConfig,
        sub_group_numel=st.none() | st.integers(1, 10**9),
        host_fraction=st.none() | st.floats(0, 1),
        max_grad_norm=st.none() | st.floats(0.001, 10),
        readahead=st.none() | st.just("auto") | st.integers(0, 8),
    ),
    theirs=st.builds(
        StepConfig,
        sub_group_numel=st.integers(1, 10**9),
        host_fraction=st.floats(0, 1),
        max_grad_norm=st.none() | st.floats(0.001, 10),
        readahead=st.none() | st.just("auto") | st.integers(0, 8),
        name=st.sampled_from(["a", "b"]),
    ),
)
def test_merged_takes_only_the_unset_fields(mine: StepConfig, theirs: StepConfig) -> None:
    merged = mine.merged(theirs)
    for field in dataclasses.fields(StepConfig):
        own = getattr(mine, field.name)
        expected = getattr(theirs, field.name) if own is None else own
        assert getattr(merged, field.name) == expected, field.name


def test_optimizer_refuses_a_config_that_is_not_a_step_config() -> None:
    param = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    tiers = ManagerConfig(device_nbytes=0, host_nbytes=None)
    with pytest.raises(
        SwapConfigError, match=r"config=\{'sub_group_numel': 8\} must be a StepConfig"
    ):
        OffloadAdamW([param], tiers=tiers, config={"sub_group_numel": 8})  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # the old keywords are gone, not silently ignored
        OffloadAdamW([param], tiers=tiers, sub_group_numel=8)  # type: ignore[call-arg]


def test_optimizer_uses_the_config_it_is_given() -> None:
    params = [torch.nn.Parameter(torch.zeros(5000, dtype=torch.bfloat16))]
    tiers = ManagerConfig(device_nbytes=0, host_nbytes=None)
    with OffloadAdamW(
        params, tiers=tiers, config=StepConfig(sub_group_numel=2048, name="mine")
    ) as opt:
        assert [sg.numel for sg in opt.sub_groups] == [2048, 2048, 904]
        assert opt.config.host_fraction == 0.0 and opt.config.sub_group_numel == 2048
        keys = list(opt.manager.keys())
        assert keys and all(key.startswith("mine/") for key in keys), keys


def test_check_hyper_names_the_value() -> None:
    check_hyper(0.0, (0.0, 0.5), 0.0, 0.0)
    with pytest.raises(SwapConfigError, match=r"^eps=nan must be a number >= 0"):
        check_hyper(1e-3, (0.9, 0.999), float("nan"), 0.0)
