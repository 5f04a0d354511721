"""Byte sizes: one parser for every size swapper reads (``parse_size("8MiB") == 8 << 20``)
and one formatter for every size it prints (``format_size(3 << 30) == "3 GiB"``)."""

from __future__ import annotations

import re
from fractions import Fraction

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse a byte size such as ``"1GiB"``, ``"8M"``, ``"4096"`` or ``"1.5GB"``.

    Binary prefixes (KiB, MiB, GiB, TiB and the bare K, M, G, T) are powers of 1024;
    decimal ones (KB, MB, GB, TB) are powers of 1000. Case is ignored.

    Raises:
        ValueError: the text is not a non-negative size with a known unit, or a fractional
            size does not come to a whole number of bytes.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 64KiB, 8MiB, 1GiB, 1.5GB)")
    number, unit = match.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(
            f"unknown size unit {unit!r} in {text!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)"
        )
    value = Fraction(number) * factor  # exact: no float rounding above 2**53
    if value.denominator != 1:
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


_BINARY = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def format_size(nbytes: float) -> str:
    """A byte count for people: the one formatter of every human-readable size swapper
    prints (command-line output, log lines, error messages, ``stats().summary()``).

    Binary units (KiB = 1024 B), the largest the count reaches, to three significant
    digits, labelled after a space; plain bytes below 1 KiB: ``format_size(512) ==
    "512 B"``, ``format_size(1536) == "1.5 KiB"``, ``format_size(1_134_336) == "1.08
    MiB"``, ``format_size(8 << 20) == "8 MiB"``, ``format_size(240_009_216) == "229
    MiB"``. Counts of 1000 to 1023 of a unit keep their four digits (``"1023 KiB"``),
    never an exponent. A rate is ``format_size(bytes_per_s) + "/s"``.

    It rounds, so it is for reading, not for parsing back: a message that must name an
    exact count gives the bytes beside it. Negative counts (a difference) keep their sign.
    """
    magnitude = abs(nbytes)
    for unit, factor in _BINARY:
        if magnitude >= factor:
            value = nbytes / factor
            text = f"{value:.3g}"
            if "e" in text:  # 999.5 and up rounds to 1e+03: show the whole number
                text = f"{value:.0f}"
            return f"{text} {unit}"
    return f"{nbytes:.0f} B"
