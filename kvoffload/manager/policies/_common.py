"""Helpers shared by the policy implementations."""

from __future__ import annotations

from kvoffload.errors import ConfigError

__all__ = ["check_capacity"]


def check_capacity(owner: str, capacity: object) -> int:
    """Validate a policy capacity: a positive int (``bool`` is refused)."""
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ConfigError(f"{owner}: capacity must be a positive int, got {capacity!r}")
    return capacity
