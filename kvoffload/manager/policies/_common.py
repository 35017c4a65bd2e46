"""Helpers shared by the policy implementations."""

from __future__ import annotations

from kvoffload._checks import checked_int

__all__ = ["check_capacity"]


def check_capacity(owner: str, capacity: object) -> int:
    """Validate a policy capacity: a positive int (``bool`` is refused)."""
    return checked_int(f"{owner}: capacity", capacity)
