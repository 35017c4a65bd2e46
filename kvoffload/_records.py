"""Flat records' figures as plain dicts, built for the metrics on every engine step.

``dataclasses.asdict`` deep-copies recursively and took about a third of the
connector's per-step statistics work; these records hold numbers and dicts of
numbers, so a shallow copy (each dict copied once) gives the same dict faster.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

__all__ = ["as_dict"]

#: A record class -> its field names, in order (found once per class).
_NAMES: dict[type, tuple[str, ...]] = {}


def as_dict(record: Any) -> dict[str, Any]:
    """``asdict(record)`` for a dataclass of numbers and dicts of numbers (each dict copied)."""
    names = _NAMES.get(type(record))
    if names is None:
        names = _NAMES[type(record)] = tuple(f.name for f in fields(record))
    out = {}
    for name in names:
        value = getattr(record, name)
        out[name] = dict(value) if type(value) is dict else value
    return out
