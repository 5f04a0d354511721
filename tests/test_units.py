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
        (0, "0 B"),
        (1, "1 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (4096, "4 KiB"),
        (1536, "1.5 KiB"),
        (MiB, "1 MiB"),
        (8 * MiB, "8 MiB"),
        (3 * GiB, "3 GiB"),
        (3 * GiB // 2, "1.5 GiB"),
        (1500, "1.46 KiB"),
        (TiB, "1 TiB"),
        (1024 * TiB, "1024 TiB"),
        # the figures of issue 28, each once in the old styles
        (1_134_336, "1.08 MiB"),
        (23_071, "22.5 KiB"),
        (26_648_832, "25.4 MiB"),
        (234_384 * KiB, "229 MiB"),
        (21_552 * KiB, "21 MiB"),
        (1023 * KiB, "1023 KiB"),  # four digits rather than an exponent
        (-1536, "-1.5 KiB"),
        (2.5 * MiB, "2.5 MiB"),  # a float (a rate's bytes per second)
    ],
)
def test_format_size_examples(nbytes: float, expected: str) -> None:
    assert format_size(nbytes) == expected


@given(n=st.integers(0, 1 << 60))
def test_format_size_three_significant_digits_binary_units(n: int) -> None:
    """Binary unit, a space, at most three significant digits (four only for 1000-1023
    of a unit), within half a unit of the last digit of the count; bytes below 1 KiB."""
    text = format_size(n)
    number, unit = text.split(" ")
    assert unit in ("B", "KiB", "MiB", "GiB", "TiB")
    if unit == "B":
        assert n < KiB and number == str(n)
        return
    factor = {"KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB}[unit]
    assert n >= factor and "e" not in number
    digits = number.replace(".", "").lstrip("0")
    assert len(digits) <= 3 or float(number) >= 1000
    assert float(number) < 1024 or unit == "TiB"  # (no larger unit)
    value = float(number)
    places = len(number.split(".")[1]) if "." in number else 0
    assert abs(n / factor - value) <= 0.5 * 10**-places + 1e-9


@given(k=st.integers(0, 1023), unit=st.sampled_from([1, KiB, MiB, GiB, TiB]))
def test_whole_counts_of_a_unit_parse_back(k: int, unit: int) -> None:
    """What it prints for a whole number of units up to 999 (the sizes people type)
    parses back exactly: ``parse_size(format_size(8 << 20)) == 8 << 20``."""
    if k < 1000 and (unit > 1 or k > 0):
        assert parse_size(format_size(k * unit)) == k * unit


@given(n=st.integers(0, 1 << 52))
def test_parse_of_plain_integer_text(n: int) -> None:
    assert parse_size(str(n)) == n
    assert parse_size(f"{n}B") == n


@pytest.mark.parametrize("n", [2**53 + 1, 10**17 + 3])
def test_parse_of_huge_integer_text_is_exact(n: int) -> None:
    assert parse_size(str(n)) == n
