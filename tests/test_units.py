"""tiers.units: parse_size / format_size."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiers.units import format_size, parse_size

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("4096", 4096),
        ("1b", 1),
        ("512B", 512),
        ("64KiB", 64 * KiB),
        ("64k", 64 * KiB),
        ("64KB", 64_000),
        ("64kb", 64_000),
        ("8M", 8 * MiB),
        ("8MiB", 8 * MiB),
        ("8mib", 8 * MiB),
        ("8MB", 8_000_000),
        ("1GiB", GiB),
        ("1g", GiB),
        ("1.5GB", 1_500_000_000),
        ("1.5GiB", 3 * GiB // 2),
        ("0.5KiB", 512),
        ("2TiB", 2 * TiB),
        ("3TB", 3 * 10**12),
        ("  2 MiB  ", 2 * MiB),
        ("10 KiB", 10 * KiB),
    ],
)
def test_parse_size_examples(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("value", [0, 1, 4096, 1 << 50])
def test_parse_size_passes_ints_through(value: int) -> None:
    assert parse_size(value) == value


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "abc",
        "MiB",
        "-1",
        "-4KiB",
        "1e3",
        "0x10",
        "1,5MiB",
        "1.KiB",
        ".5KiB",
        "5 XB",
        "5 mibs",
        "5 PiB",
        "1 2",
        "0.5",  # half a byte
        "0.5B",
        "1.1KiB",  # 1126.4 bytes
        "1.0000001MiB",
    ],
)
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_parse_size_messages_say_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"not a size.*'abc'"):
        parse_size("abc")
    with pytest.raises(ValueError, match="unknown size unit 'XB'"):
        parse_size("5XB")
    with pytest.raises(ValueError, match="whole number of bytes"):
        parse_size("0.5B")


def test_parse_size_rejects_negative_int() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        parse_size(-1)


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (0, "0B"),
        (1, "1B"),
        (1023, "1023B"),
        (1024, "1KiB"),
        (4096, "4KiB"),
        (1536, "1.5KiB"),
        (MiB, "1MiB"),
        (8 * MiB, "8MiB"),
        (3 * GiB, "3GiB"),
        (3 * GiB // 2, "1536MiB"),
        (1500, "1.5KiB"),
        (TiB, "1TiB"),
        (1024 * TiB, "1024TiB"),
    ],
)
def test_format_size_examples(nbytes: int, expected: str) -> None:
    assert format_size(nbytes) == expected


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [(1025 * KiB, "1025KiB"), (MiB + 4 * KiB, "1028KiB"), (TiB + GiB, "1025GiB")],
)
def test_format_size_uses_largest_unit_that_divides(nbytes: int, expected: str) -> None:
    assert format_size(nbytes) == expected


_UNIT = st.sampled_from([1, KiB, MiB, GiB, TiB])


@given(n=st.integers(0, 1 << 60))
def test_round_trip_where_format_is_exact(n: int) -> None:
    """Every n whose formatted text has no decimal point parses back to n."""
    text = format_size(n)
    if "." not in text:
        assert parse_size(text) == n


@given(k=st.integers(0, 1 << 20), unit=_UNIT)
def test_round_trip_multiples_of_a_unit_below_the_next(k: int, unit: int) -> None:
    """k units with k < 1024 (or any k for TiB) format as an integer and parse back exactly."""
    if unit != TiB:
        k %= 1024
    n = k * unit
    assert parse_size(format_size(n)) == n


@given(n=st.integers(0, 1 << 52))
def test_parse_of_plain_integer_text(n: int) -> None:
    assert parse_size(str(n)) == n
    assert parse_size(f"{n}B") == n


@pytest.mark.parametrize("n", [2**53 + 1, 10**17 + 3])
def test_parse_of_huge_integer_text_is_exact(n: int) -> None:
    assert parse_size(str(n)) == n
