"""Byte sizes: parse_size accepts what the CLI and config promise, exactly, and
rejects the rest naming the text; format_size is readable and parses back."""

from __future__ import annotations

from decimal import Decimal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moed.protocol.sizes import format_size, parse_size

UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


@pytest.mark.parametrize(
    "text, n",
    [
        ("512MiB", 512 << 20),
        ("4GiB", 4 << 30),
        ("4gib", 4 << 30),
        ("4 GiB", 4 << 30),
        ("  16KiB\n", 16 << 10),
        ("1.5G", 1_500_000_000),
        ("1.5GiB", 3 << 29),
        ("0.5KiB", 512),
        ("1KB", 1000),
        ("1k", 1000),
        ("2TiB", 2 << 40),
        ("4096", 4096),
        ("0", 0),
        ("10B", 10),
        (4096, 4096),
        (0, 0),
        ("1.001KB", 1001),  # decimals are exact, not floats
        ("4.35GB", 4_350_000_000),
        ("18446744073709551615", 2**64 - 1),  # plain integers past 2**53 stay exact
    ],
)
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize(
    "text",
    [
        "",
        "  ",
        "abc",
        "GiB",
        "-1",
        "-1GiB",
        "1.5.2G",
        "12 XB",
        "1e9",
        "1,5G",
        ".5G",
        "1 G B",
        "0x100",
        "1GiBs",
        True,
        False,
        -5,
        None,
        "1.9",
        "0.5B",
    ],
)
def test_parse_size_rejects(text):
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert str(text) in str(info.value) or repr(text) in str(info.value)


@given(st.integers(0, 2**70))
def test_plain_integers_parse_exactly(n):
    assert parse_size(str(n)) == n
    assert parse_size(n) == n


@given(st.integers(0, 10**6), st.sampled_from(sorted(UNITS)), st.booleans(), st.booleans())
def test_every_unit_in_any_case(n, unit, upper, space):
    text = f"{n}{' ' if space else ''}{unit.upper() if upper else unit}"
    assert parse_size(text) == n * UNITS[unit]


@given(
    st.decimals(min_value=0, max_value=10**6, places=3, allow_nan=False, allow_infinity=False),
    st.sampled_from(sorted(u for u in UNITS if UNITS[u] > 1)),
)
def test_decimals_round_down_to_whole_bytes_exactly(d, unit):
    text = f"{d:f}{unit}"
    assert parse_size(text) == int(Decimal(text[: len(f"{d:f}")]) * UNITS[unit])


@given(
    st.decimals(min_value=0, max_value=10**6, places=3, allow_nan=False, allow_infinity=False),
    st.sampled_from(sorted(u for u in UNITS if UNITS[u] == 1)),
)
def test_plain_bytes_must_be_whole(d, unit):
    text = f"{d:f}{unit}"
    if d == int(d):
        assert parse_size(text) == int(d)
    else:
        with pytest.raises(ValueError, match="whole number"):
            parse_size(text)


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (512 << 20, "512.00 MiB"),
        (3 << 30, "3.00 GiB"),
        (5 << 40, "5.00 TiB"),
        (-2048, "-2.00 KiB"),
    ],
)
def test_format_size(n, text):
    assert format_size(n) == text


@given(st.integers(0, 2**50))
def test_format_size_parses_back_within_its_rounding(n):
    back = parse_size(format_size(n))
    assert abs(back - n) <= max(1, n) * 0.005 + 1
