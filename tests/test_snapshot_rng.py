"""The RNG record of a training snapshot (:mod:`swapper.zero.checkpoint.rng`): a record
whose states torch would refuse is a damaged snapshot naming the file, never a raw
RuntimeError/TypeError from ``torch.set_rng_state`` at resume."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swapper.zero.checkpoint.rng import decode_rng, rng_state, set_rng_state
from tiers.nvme.snapshots import SnapshotDamagedError

WHERE = "/tmp/somewhere/snapshot-7.json"
CPU_NBYTES = torch.get_rng_state().numel()


@pytest.fixture(autouse=True)
def _keep_rng() -> Iterator[None]:
    saved = torch.get_rng_state()
    yield
    torch.set_rng_state(saved)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _good_cpu() -> str:
    return _b64(torch.get_rng_state().numpy().tobytes())


#: a CPU state torch refuses: wrong byte length, another dtype's bytes, bad content
_bad_cpu_text = st.one_of(
    st.binary(max_size=2 * CPU_NBYTES).filter(lambda b: len(b) != CPU_NBYTES).map(_b64),
    st.sampled_from([torch.int16, torch.int32, torch.int64, torch.float32, torch.float64]).map(
        lambda dtype: _b64(torch.get_rng_state().to(dtype).numpy().tobytes())
    ),
    st.just(_b64(bytes(CPU_NBYTES))),  # right length, not an mt19937 state
)
#: a value that is not base64 text at all
_not_text = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=False),
    st.lists(st.integers(0, 255), max_size=8),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.text(alphabet="!@#$%^&*é", min_size=1, max_size=8),  # not base64
)
_bad_cuda_text = st.binary(max_size=64).filter(lambda b: len(b) not in (8, 16)).map(_b64)


def _malformed() -> st.SearchStrategy[Any]:
    good_cuda = st.lists(st.binary(min_size=16, max_size=16).map(_b64), max_size=2)
    return st.one_of(
        st.builds(
            lambda c, cu: {"cpu": c, "cuda": cu}, st.one_of(_bad_cpu_text, _not_text), good_cuda
        ),
        st.builds(
            lambda before, bad, after: {"cpu": _good_cpu(), "cuda": [*before, bad, *after]},
            good_cuda,
            st.one_of(_bad_cuda_text, _not_text),
            good_cuda,
        ),
        st.builds(
            lambda cu: {"cpu": _good_cpu(), "cuda": cu},
            _not_text.filter(lambda v: not isinstance(v, list)),
        ),
        _not_text,
    )


@settings(max_examples=150, deadline=None)
@given(raw=_malformed())
def test_a_malformed_rng_record_is_a_damaged_snapshot_naming_the_file(raw: Any) -> None:
    before = torch.get_rng_state()
    with pytest.raises(SnapshotDamagedError, match=re.escape(WHERE)):
        set_rng_state(decode_rng(raw, WHERE))  # a raw RuntimeError/TypeError fails this
    assert torch.equal(torch.get_rng_state(), before)  # nothing was set


def test_the_message_says_what_is_wrong() -> None:
    short = {"cpu": _b64(bytes(10)), "cuda": []}
    with pytest.raises(SnapshotDamagedError, match=r"CPU RNG state.*size"):
        decode_rng(short, WHERE)
    cuda = {"cpu": _good_cpu(), "cuda": [_b64(bytes(16)), _b64(bytes(3))]}
    with pytest.raises(SnapshotDamagedError, match="device 1 has 3 bytes"):
        decode_rng(cuda, WHERE)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), draws=st.integers(0, 50))
def test_a_recorded_state_restores_exactly(seed: int, draws: int) -> None:
    torch.manual_seed(seed)
    torch.rand(draws)
    record = rng_state()
    expected = torch.rand(17)
    torch.rand(5)  # move on
    set_rng_state(decode_rng(record, WHERE))
    assert torch.equal(torch.rand(17), expected)
