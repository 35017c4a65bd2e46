"""The one check for integer arguments: an int (never a bool or a float) inside its bounds.

Settings from users go through :mod:`kvoffload.config.values`, which also
accepts ``"2"`` and ``2.0``; this is for values code hands to code (layouts,
capacities, slots, block ids), where anything but a real int is a bug in the
caller that must fail loudly, not be truncated.
"""

from __future__ import annotations

import numpy as np

from kvoffload.errors import ConfigError, KVOffloadError

__all__ = ["checked_int"]


def _bounds(minimum: int, maximum: int | None) -> str:
    if maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum == 1:
        return "a positive int"
    return "a non-negative int" if minimum == 0 else f"an int >= {minimum}"


def checked_int(
    name: str,
    value: object,
    *,
    minimum: int = 1,
    maximum: int | None = None,
    error: type[KVOffloadError] = ConfigError,
) -> int:
    """``value`` as an ``int`` in ``[minimum, maximum]``; ``error`` naming ``name`` otherwise."""
    if isinstance(value, int | np.integer) and not isinstance(value, bool):
        number = int(value)
        if number >= minimum and (maximum is None or number <= maximum):
            return number
    raise error(f"{name} must be {_bounds(minimum, maximum)}, got {value!r}")
