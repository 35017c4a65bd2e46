"""Hypothesis strategies for numbers a user might type, or paste, or have a program spell.

Huge and non-finite ones above all: integers far past any bound (some longer
than ``str()`` of an int may be), floats up to the largest and inf/nan, and
strings that spell them in every way ``Decimal`` reads.
"""

from __future__ import annotations

from hypothesis import strategies as st

__all__ = ["NUMBERS"]

_huge_ints = st.integers(300, 5000).map(lambda digits: 10**digits) | st.integers(
    min_value=2**59, max_value=2**70
)
_number_text = st.sampled_from(
    [
        "1" + "0" * 320,
        "9" * 5000,
        "1e306",
        "1E+400",
        "-1e400",
        "1e-400",
        "0e999999999",
        "1e999999999999999999999",
        "NaN",
        "sNaN",
        "-Infinity",
        "inf",
        "2." + "0" * 40 + "1",
        "1e400GiB",
        "9" * 40 + "GiB",
        "1" + "0" * 5000 + "KiB",
        "0.5B",
        "1_000",
        "\u0663",  # an Arabic-Indic 3
    ]
) | st.builds(lambda m, e: f"{m}e{e}", st.integers(-(10**6), 10**6), st.integers(-999, 999))
NUMBERS = (
    st.integers()
    | _huge_ints
    | _huge_ints.map(lambda n: -n)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.sampled_from([1e306, -1e306, 1.7976931348623157e308, 2.0**60, 2.0**60 + 2**8])
    | _number_text
    | st.integers(300, 5000).map(lambda digits: "1" + "0" * digits)
    | st.decimals(allow_nan=True, allow_infinity=True)
)
