"""The read-ahead plan along a recorded fetch order (swapper.zero.model.readahead): what each
fetch asks for stays inside the window, everything inside the window has been asked for,
and the work per step is linear in the order's length, not quadratic."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swapper.zero.model.readahead import RETRY, ReadAhead
from tiers.errors import SwapConfigError


@st.composite
def plans(draw: st.DrawFn) -> tuple[list[str], dict[str, int], int | None, int]:
    n_keys = draw(st.integers(1, 12))
    keys = [f"k{i}" for i in range(n_keys)]
    sizes = {k: draw(st.integers(1, 1000)) for k in keys}
    # Every key at least once, some twice (a tied weight used by two modules).
    order = keys + draw(st.lists(st.sampled_from(keys), max_size=6))
    order = draw(st.permutations(order))
    window = draw(st.none() | st.integers(0, 4000))
    max_tensors = draw(st.integers(0, 20))
    return list(order), sizes, window, max_tensors


def _window_positions(
    order: list[str], sizes: dict[str, int], window: int | None, max_tensors: int, cursor: int
) -> list[int]:
    """The unrolled positions the window covers after a fetch at ``cursor`` (reference)."""
    n, out, taken = len(order), [], 0
    for j in range(cursor + 1, min(cursor + 1 + max_tensors, cursor + n)):
        taken += sizes[order[j % n]]
        if window is not None and taken > window:
            break
        out.append(j)
    return out


@settings(max_examples=300, deadline=None)
@given(plans())
def test_asks_only_inside_the_window_and_for_all_of_it(
    plan: tuple[list[str], dict[str, int], int | None, int],
) -> None:
    order, sizes, window, max_tensors = plan
    ahead = ReadAhead(order, sizes, window_nbytes=window, max_tensors=max_tensors)
    n = len(order)
    asked_at: dict[int, int] = {}  # absolute position -> the call that first asked for it
    calls = 0
    for step in range(3):
        for cursor, key in enumerate(order):
            got = ahead.after(key)
            inside = _window_positions(order, sizes, window, max_tensors, cursor)
            inside_keys = {order[j % n] for j in inside}
            assert key not in got
            assert len(got) == len(set(got))
            assert set(got) <= inside_keys  # never beyond the window
            # Every position inside the window has been asked for by now (this call or an
            # earlier one), unless it is the key being fetched.
            for j in inside:
                absolute = step * n + j
                if order[j % n] in got:
                    asked_at.setdefault(absolute, calls)
                if order[j % n] != key:
                    assert absolute in asked_at, (step, cursor, j)
            calls += 1


@settings(max_examples=100, deadline=None)
@given(plans())
def test_keys_asked_per_step_are_linear_in_the_order(
    plan: tuple[list[str], dict[str, int], int | None, int],
) -> None:
    order, sizes, window, max_tensors = plan
    ahead = ReadAhead(order, sizes, window_nbytes=window, max_tensors=max_tensors)
    n, repeats = len(order), len(order) - len(set(order))
    # The first fetch fills the window; from then on each position enters it once, and
    # each fetch asks again for at most RETRY keys; a repeated use of the key being
    # fetched holds the frontier back once (at most a window's worth asked again).
    bound = (1 + RETRY) * n + max_tensors * repeats
    assert sum(len(ahead.after(key)) for key in order) <= bound + max_tensors
    assert sum(len(ahead.after(key)) for key in order) <= bound


def test_unbounded_window_is_bounded_in_tensors() -> None:
    order = [f"k{i}" for i in range(500)]
    ahead = ReadAhead(order, dict.fromkeys(order, 10), window_nbytes=None, max_tensors=64)
    first = ahead.after("k0")
    assert first == [f"k{i}" for i in range(1, 65)]
    assert ahead.after("k1") == ["k2", "k3", "k65"]  # RETRY=2 again, one new at the frontier
    # Over a step of 500 fetches: about one new key per fetch, never the whole order.
    total = sum(len(ahead.after(k)) for k in order[2:])
    assert total <= (1 + RETRY) * 500


def test_window_wraps_into_the_next_step() -> None:
    order = ["a", "b", "c", "d"]
    ahead = ReadAhead(order, dict.fromkeys(order, 1), window_nbytes=2, max_tensors=8)
    assert ahead.after("a") == ["b", "c"]
    assert ahead.after("b") == ["c", "d"]
    assert ahead.after("c") == ["d", "a"]
    assert ahead.after("d") == ["a", "b"]
    assert ahead.after("a") == ["b", "c"]  # the next step


def test_unknown_key_and_bad_settings() -> None:
    ahead = ReadAhead(["a", "b"], {"a": 1, "b": 1}, window_nbytes=None)
    assert ahead.after("zzz") == []
    with pytest.raises(SwapConfigError, match="max_tensors"):
        ReadAhead(["a"], {"a": 1}, window_nbytes=None, max_tensors=-1)
    with pytest.raises(SwapConfigError, match="window_nbytes"):
        ReadAhead(["a"], {"a": 1}, window_nbytes=-1)
    with pytest.raises(SwapConfigError, match="without a size"):
        ReadAhead(["a", "b"], {"a": 1}, window_nbytes=None)
