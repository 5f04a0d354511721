"""OffloadConfig.distributed (issue 12): the multi-rank settings, their validation, the
as_dict / from_dict round trip, the flat ``fetch_collective`` key, and DeepSpeed's
``stage3_use_all_reduce_for_fetch_params``."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from swapper import OffloadConfig, SwapConfigError
from swapper.zero.config.distributed import DistributedConfig

DS_BASE: dict[str, Any] = {"zero_optimization": {"stage": 3}}

configs = st.builds(
    DistributedConfig,
    fetch_collective=st.sampled_from(["all_gather", "all_reduce"]),
    fetch_ahead=st.integers(0, 8),
    timeout_s=st.none() | st.floats(0.001, 1e6, allow_nan=False, allow_infinity=False),
    reduce_dtype=st.sampled_from([None, "float32"]),
)


@given(configs)
def test_round_trip_through_json(dist: DistributedConfig) -> None:
    cfg = OffloadConfig(distributed=dist)
    data = json.loads(json.dumps(cfg.as_dict()))
    assert data["distributed"]["fetch_collective"] == dist.fetch_collective
    assert OffloadConfig.from_dict(data) == cfg
    assert DistributedConfig.from_dict(dist.as_dict()) == dist


def test_default_is_all_gather() -> None:
    assert OffloadConfig().distributed == DistributedConfig()
    assert DistributedConfig().fetch_collective == "all_gather"


def test_flat_key_wins_over_section() -> None:
    cfg = OffloadConfig.from_dict(
        {"distributed": {"fetch_collective": "all_gather", "fetch_ahead": 0},
         "fetch_collective": "all_reduce"}
    )  # fmt: skip
    assert cfg.distributed == DistributedConfig(fetch_collective="all_reduce", fetch_ahead=0)
    nested = OffloadConfig.from_dict({"manager": {}, "fetch_collective": "all_reduce"})
    assert nested.distributed.fetch_collective == "all_reduce"


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"fetch_collective": "broadcast"}, "fetch_collective='broadcast'"),
        ({"fetch_ahead": -1}, "fetch_ahead=-1"),
        ({"fetch_ahead": True}, "fetch_ahead=True"),
        ({"timeout_s": 0}, "timeout_s=0"),
        ({"timeout_s": float("inf")}, "timeout_s=inf"),
        ({"reduce_dtype": "float16"}, "reduce_dtype='float16'"),
    ],
)
def test_bad_values_named(settings: dict[str, Any], named: str) -> None:
    with pytest.raises(SwapConfigError, match=re.escape(named)):
        DistributedConfig(**settings)
    with pytest.raises(SwapConfigError, match="distributed"):
        OffloadConfig.from_dict({"distributed": settings})


def test_unknown_key_and_wrong_type() -> None:
    with pytest.raises(SwapConfigError, match=r"unknown distributed setting.*collective"):
        OffloadConfig.from_dict({"distributed": {"collective": "all_reduce"}})
    with pytest.raises(SwapConfigError, match="distributed must be a mapping"):
        OffloadConfig.from_dict({"distributed": ["all_reduce"]})
    with pytest.raises(SwapConfigError, match="must be a DistributedConfig"):
        OffloadConfig(distributed={"fetch_collective": "all_reduce"})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "key", ["stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params"]
)
@pytest.mark.parametrize(("value", "method"), [(True, "all_reduce"), (False, "all_gather")])
def test_from_deepspeed_reads_the_all_reduce_switch(key: str, value: bool, method: str) -> None:
    ds = {"zero_optimization": {"stage": 3, key: value}}
    assert OffloadConfig.from_deepspeed(ds).distributed.fetch_collective == method


def test_from_deepspeed_switch_absent_and_bad(tmp_path: Path) -> None:
    assert OffloadConfig.from_deepspeed(DS_BASE).distributed.fetch_collective == "all_gather"
    bad = {"zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": 1}}
    with pytest.raises(SwapConfigError, match="must be true or false"):
        OffloadConfig.from_deepspeed(bad)
    both = {
        "zero_optimization": {
            "stage": 3,
            "stage3_use_all_reduce_for_fetch_params": True,
            "use_all_reduce_for_fetch_params": False,
        }
    }
    with pytest.raises(SwapConfigError, match="disagree"):
        OffloadConfig.from_deepspeed(both)
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({"zero_optimization": {"stage": 3, "use_all_reduce_for_fetch_params": True}})
    )
    assert OffloadConfig.from_json(path).distributed.fetch_collective == "all_reduce"
