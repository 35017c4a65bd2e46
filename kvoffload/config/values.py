"""Coercion of one raw configuration value into the type its key declares.

vLLM hands connector settings over as JSON-ish values, often strings from a
command line. Each coercer accepts the spellings a user plausibly means and
nothing else: ``"2"`` and ``2.0`` are the integer 2, ``2.5`` is an error, not
2; ``"false"`` is False, not ``bool("false")``. Every rejection is a
``ConfigError`` naming the key, the value and what would be accepted.

A number is checked against its key's :class:`Bounds` before it becomes an
``int``: ``"1e999999999"`` is refused as too large without building a
billion-digit integer, and nothing downstream (``float()``, a C timeout, a
tensor size) ever sees a number it cannot hold.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation, localcontext
from fractions import Fraction

from kvoffload.errors import ConfigError

__all__ = [
    "Bounds",
    "format_bytes",
    "safe_repr",
    "to_bool",
    "to_env_name",
    "to_fraction",
    "to_int",
    "to_path",
    "to_remote_url",
    "to_share",
    "to_size",
    "to_str",
]

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "eb": 10**18,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "pib": 2**50,
    "eib": 2**60,
}
#: The units as an error message lists them.
_UNITS_TEXT = "B, KiB, MiB, GiB, TiB, PiB, EiB (powers of 1024) or KB, MB, GB, TB, PB, EB (of 1000)"
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


@dataclass(frozen=True, slots=True)
class Bounds:
    """The inclusive range of a numeric setting; ``note`` says what the maximum is."""

    minimum: int
    maximum: int
    note: str = ""

    def text(self, in_bytes: bool) -> str:
        """The range as the key table shows it: '1 to 1,048,576 (2^20)', '1 B to 1 EiB'."""
        if in_bytes:
            return f"{format_bytes(self.minimum)} to {format_bytes(self.maximum)}"
        return f"{self.minimum:,} to {self._maximum_text(in_bytes)}"

    def _maximum_text(self, in_bytes: bool) -> str:
        if in_bytes:
            return f"{self.maximum:,} bytes ({format_bytes(self.maximum)})"
        return f"{self.maximum:,}" + (f" ({self.note})" if self.note else "")

    def check(self, key: str, number: int | Decimal, raw: object, in_bytes: bool) -> int:
        """``number`` as an ``int`` if it lies in the range; a ``ConfigError`` naming it if not."""
        if number < self.minimum:
            bound = "greater than 0" if self.minimum == 1 else f"at least {self.minimum:,}"
            raise ConfigError(f"{key!r} must be {bound}, got {safe_repr(raw)}")
        if number > self.maximum:
            maximum = self._maximum_text(in_bytes)
            raise ConfigError(f"{key!r} must be at most {maximum}, got {safe_repr(raw)}")
        return int(number)


def safe_repr(value: object, limit: int = 80) -> str:
    """``repr`` for error messages: never raises, never floods the terminal."""
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not hide the real error
        if isinstance(value, int):  # an int too long for str() (over 4300 digits)
            return f"<an int of {value.bit_length():,} bits>"
        text = f"<unprintable {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reject(key: str, value: object, expected: str) -> ConfigError:
    return ConfigError(f"{key!r} must be {expected}, got {safe_repr(value)}")


def _integer(key: str, value: object, expected: str) -> int | Decimal:
    """An int, or a float or string holding exactly an integer (a string's as a Decimal)."""
    if isinstance(value, bool):
        raise _reject(key, value, expected)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise _reject(key, value, expected)
    if isinstance(value, str):
        try:
            exact = Decimal(value.strip())
        except InvalidOperation:
            raise _reject(key, value, expected) from None
        if exact.is_finite() and exact == exact.to_integral_value():
            return exact
    raise _reject(key, value, expected)


def to_int(key: str, value: object, bounds: Bounds) -> int:
    """An integer inside ``bounds``: an int, or a float or string holding exactly one."""
    number = _integer(key, value, "an integer (e.g. 2 or '2')")
    return bounds.check(key, number, value, in_bytes=False)


def to_size(key: str, value: object, bounds: Bounds) -> int:
    """Bytes inside ``bounds``: an integer, or a size like '512MiB', '8GiB' (binary), '500MB'."""
    expected = (
        f"a byte count: an integer or a size such as '512MiB', '8GiB', '500MB' (units: "
        f"{_UNITS_TEXT}; no exponents)"
    )
    if not isinstance(value, str):
        return bounds.check(key, _integer(key, value, expected), value, in_bytes=True)
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise _reject(key, value, expected)
    digits = match.group(1)
    with localcontext() as exact_arithmetic:  # the product keeps every digit
        exact_arithmetic.prec = len(digits) + 20
        exact = Decimal(digits) * _SIZE_UNITS[unit]
    if exact != exact.to_integral_value():
        raise _reject(key, value, "a whole number of bytes")
    return bounds.check(key, exact, value, in_bytes=True)


def to_bool(key: str, value: object) -> bool:
    """True/False, or the strings 'true'/'false' in any case; nothing else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _reject(key, value, "true or false")


def to_fraction(key: str, value: object) -> float:
    """A number in ``(0, 1]``: ``0.25``, ``"0.25"``, ``1``; never 0, a percentage or a bool."""
    expected = "a fraction greater than 0 and at most 1, such as 0.25"
    number: float | None = None
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int past float's range: far above 1 all the same
            number = None
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number) or not 0.0 < number <= 1.0:
        raise _reject(key, value, expected)
    return number


def to_share(key: str, value: object) -> float:
    """A number in ``[0, 1]``, where 0 turns the feature off: ``0``, ``0.25``, ``"1"``."""
    if value == 0 and not isinstance(value, bool):
        return 0.0
    if isinstance(value, str) and value.strip() in ("0", "0.0"):
        return 0.0
    try:
        return to_fraction(key, value)
    except ConfigError:
        raise _reject(key, value, "a fraction from 0 (off) to 1, such as 0.25") from None


def to_str(key: str, value: object) -> str:
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise _reject(key, value, "a non-empty string")


#: Where chunk keys come from (see ``kvoffload.keys``): the connector's ``key_source``.
KEY_SOURCES = ("auto", "tokens", "engine")


#: When the worker moves pages with the Triton kernel (``kvoffload.transfer.KernelUse``).
TRANSFER_KERNELS = ("off", "auto", "always")
#: When a hit found in host memory is loaded: see the key ``load_in_step``.
LOAD_IN_STEP = ("auto", "always", "never")


def _choice(key: str, value: object, choices: tuple[str, ...]) -> str:
    """One of ``choices``, in any case."""
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    raise _reject(key, value, " or ".join(repr(name) for name in choices))


def to_key_source(key: str, value: object) -> str:
    return _choice(key, value, KEY_SOURCES)


def to_transfer_kernel(key: str, value: object) -> str:
    return _choice(key, value, TRANSFER_KERNELS)


def to_load_in_step(key: str, value: object) -> str:
    return _choice(key, value, LOAD_IN_STEP)


def to_path(key: str, value: object) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str) and value.strip() and "\0" not in value:
        return value
    raise _reject(key, value, "a non-empty directory path")


def to_remote_url(key: str, value: object) -> str:
    """A checked remote URL in its canonical form (see :mod:`kvoffload.config.remote_url`)."""
    from kvoffload.config.remote_url import parse_remote_url

    if not isinstance(value, str) or not value.strip():
        raise _reject(key, value, "a URL such as redis://host:6379/0")
    return str(parse_remote_url(key, value))


def to_env_name(key: str, value: object) -> str:
    """The name of an environment variable (never its value)."""
    if isinstance(value, str) and _ENV_NAME.match(value.strip()):
        return value.strip()
    raise _reject(
        key, value, "the name of an environment variable, such as KVOFFLOAD_REDIS_PASSWORD"
    )


def format_bytes(n: int) -> str:
    """Binary units for humans: 524288 -> '512 KiB', 1536 -> '1.50 KiB'; exact for any int."""
    sign, n = ("-", -n) if n < 0 else ("", n)
    power = 0
    while power < len(_BINARY_UNITS) - 1 and n >= 1024 ** (power + 1):
        power += 1
    unit, scale = _BINARY_UNITS[power], 1024**power
    if n >= 1024 * scale:  # beyond the largest unit: no digits that str() might refuse
        return f"{sign}about 2^{n.bit_length() - 1} B"
    if n % scale == 0:
        return f"{sign}{n // scale} {unit}"
    hundredths = round(Fraction(n, scale) * 100)
    return f"{sign}{hundredths // 100}.{hundredths % 100:02d} {unit}"
