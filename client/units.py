"""Parsing of sizes and durations as written in channel URIs, TOML and the environment.

One place for both so that ``term-length=64k`` in a URI and ``term_buffer_length = "64k"`` in
driver.toml mean the same thing.  Durations are returned in nanoseconds, sizes in bytes.
"""

from __future__ import annotations

import re
from fractions import Fraction

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ns|us|µs|ms|s|m|h)?\s*$")
_DURATION_SCALE = {
    None: 1,
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_SIZE = re.compile(r"^\s*(\d+)\s*([kKmMgG](?:i?[bB])?|[bB])?\s*$")
_SIZE_SCALE = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


def _whole_quantity(value: int, what: str) -> int:
    """An int given for a ``what`` (a duration, a size), already in its base units (ns,
    bytes): ``value`` itself; ValueError for a bool or a negative int."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a {what}")
    if value < 0:
        raise ValueError(f"{value} is negative; a {what} is >= 0")
    return value


def parse_duration_ns(text: str | int | float) -> int:
    """``"100us"``, ``"5s"``, ``"200ms"`` or a bare number of nanoseconds → nanoseconds.

    Raises ``ValueError`` with the accepted forms when the text is not a duration.
    """
    if isinstance(text, int):
        return _whole_quantity(text, "duration")
    if isinstance(text, float):
        if not text >= 0 or text == float("inf"):
            raise ValueError(f"{text} is not a duration >= 0")
        value, unit = repr(text), None  # its shortest decimal spelling, as if written so
    else:
        match = _DURATION.match(text)
        if not match:
            raise ValueError(
                f"{text!r} is not a duration (a number with ns, us, ms, s, m or h)")
        value, unit = match.groups()
    # Exact decimal arithmetic: 4.1s is 4_100_000_000 ns, not a float's 4_099_999_999.
    ns = Fraction(value) * _DURATION_SCALE[unit]
    if ns.denominator != 1:
        raise ValueError(f"{text!r} is not a whole number of nanoseconds")
    return int(ns)


def parse_size(text: str | int) -> int:
    """``"64k"``, ``"16m"``, ``"1g"``, ``"128KiB"`` or a bare number of bytes → bytes.

    Units are powers of 1024.
    """
    if isinstance(text, int):
        return _whole_quantity(text, "size")
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with k, m or g)")
    value, unit = match.groups()
    return int(value) * _SIZE_SCALE[(unit or "")[:1].lower()]


def format_duration_ns(ns: int) -> str:
    """The shortest exact spelling of a duration, for --print-config and error messages."""
    for unit in ("h", "m", "s", "ms", "us"):
        scale = _DURATION_SCALE[unit]
        if ns and ns % scale == 0:
            return f"{ns // scale}{unit}"
    return f"{ns}ns"


def format_size(n: int) -> str:
    """The shortest exact spelling of a size (``65536`` → ``"64k"``)."""
    for unit, scale in (("g", 1 << 30), ("m", 1 << 20), ("k", 1 << 10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)
