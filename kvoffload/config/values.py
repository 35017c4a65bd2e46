"""Coercion of one raw configuration value into the type its key declares.

vLLM hands connector settings over as JSON-ish values, often strings from a
command line. Each coercer accepts the spellings a user plausibly means and
nothing else: ``"2"`` and ``2.0`` are the integer 2, ``2.5`` is an error, not
2; ``"false"`` is False, not ``bool("false")``. Every rejection is a
``ConfigError`` naming the key, the value and what would be accepted.
"""

from __future__ import annotations

import math
import os
import re
from decimal import Decimal, InvalidOperation

from kvoffload.errors import ConfigError

__all__ = [
    "format_bytes",
    "safe_repr",
    "to_bool",
    "to_env_name",
    "to_int",
    "to_path",
    "to_remote_url",
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
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
#: Largest integer magnitude (decimal digits) accepted from text; far above any byte count.
_MAX_DIGITS = 30
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def safe_repr(value: object, limit: int = 80) -> str:
    """``repr`` for error messages: never raises, never floods the terminal."""
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not hide the real error
        text = f"<unprintable {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reject(key: str, value: object, expected: str) -> ConfigError:
    return ConfigError(f"{key!r} must be {expected}, got {safe_repr(value)}")


def to_int(key: str, value: object) -> int:
    """An int, or a float or string holding exactly an integer."""
    expected = "an integer (e.g. 2 or '2')"
    if isinstance(value, bool):
        raise _reject(key, value, expected)
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise _reject(key, value, expected)
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            exact = Decimal(text)
        except InvalidOperation:
            raise _reject(key, value, expected) from None
        # Bound the magnitude before int(): '1e999999999' must not build a huge int.
        if (
            exact.is_finite()
            and exact.adjusted() < _MAX_DIGITS
            and exact == exact.to_integral_value()
        ):
            return int(exact)
    raise _reject(key, value, expected)


def to_size(key: str, value: object) -> int:
    """Bytes: an integer, or a size string like '512MiB', '8GiB' (binary), '500MB' (decimal)."""
    expected = "a byte count: an integer or a size such as '512MiB', '8GiB', '500MB'"
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise _reject(key, value, expected)
        exact = Decimal(match.group(1)) * _SIZE_UNITS[unit]
        if exact.adjusted() >= _MAX_DIGITS:
            raise _reject(key, value, expected)
        if exact != exact.to_integral_value():
            raise _reject(key, value, "a whole number of bytes")
        return int(exact)
    try:
        return to_int(key, value)
    except ConfigError:
        raise _reject(key, value, expected) from None


def to_bool(key: str, value: object) -> bool:
    """True/False, or the strings 'true'/'false' in any case; nothing else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise _reject(key, value, "true or false")


def to_str(key: str, value: object) -> str:
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise _reject(key, value, "a non-empty string")


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
    """Binary units for humans: 524288 -> '512 KiB'."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if size.is_integer() else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
