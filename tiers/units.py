"""Human byte sizes: ``parse_size("8MiB") == 8 << 20``, ``format_size(3 << 30) == "3GiB"``."""

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


def format_size(nbytes: int) -> str:
    """Format a byte count exactly with the largest binary unit that divides it.

    Counts no binary unit divides are shown with one decimal of the largest unit that fits
    (``format_size(1500) == "1.5KiB"``): only those lose precision.
    """
    units = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))
    for unit, factor in units:
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor}{unit}"
    if nbytes < 1024:
        return f"{nbytes}B"
    unit, factor = next((u, f) for u, f in units if nbytes >= f)
    return f"{nbytes / factor:.1f}{unit}"
