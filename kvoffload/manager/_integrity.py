"""Consistency checks of the index's bookkeeping, kept out of the hot module.

They are O(capacity) and meant for tests and debugging (``check_integrity``),
never for the scheduler's step loop.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from kvoffload.errors import IntegrityError
from kvoffload.keys import short_key

__all__ = ["check_index", "check_resident"]


def check_index(
    ready: Mapping[bytes, int],
    storing: Mapping[bytes, int],
    pins: Mapping[bytes, int],
    free: Collection[int],
    capacity: int,
) -> None:
    """Every slot is exactly one of free / ready / storing; pins only on ready chunks."""
    both = ready.keys() & storing.keys()
    if both:
        raise IntegrityError(f"{len(both)} chunk(s) are both ready and storing")
    total = len(ready) + len(storing) + len(free)
    if total != capacity:
        raise IntegrityError(
            f"slots: {len(ready)} ready + {len(storing)} storing + {len(free)} free "
            f"= {total}, capacity is {capacity}"
        )
    slots = set(ready.values()) | set(storing.values()) | set(free)
    if len(slots) != capacity:
        raise IntegrityError(f"only {len(slots)} distinct slots for capacity {capacity}")
    if slots and (min(slots) < 0 or max(slots) >= capacity):
        raise IntegrityError(f"slot ids span {min(slots)}..{max(slots)}, capacity {capacity}")
    for key, count in pins.items():
        if key not in ready or count <= 0:
            raise IntegrityError(
                f"chunk {short_key(key)} has {count} pin(s) but is "
                f"{'ready' if key in ready else 'not ready'}"
            )


def check_resident(name: str, tracked: Collection[bytes], resident: Collection[bytes]) -> None:
    """A policy's resident set equals the index's ready set (helper for policies)."""
    if len(tracked) != len(resident):
        raise IntegrityError(
            f"policy {name!r} tracks {len(tracked)} keys, the index has {len(resident)} ready"
        )
    extra = [key for key in tracked if key not in resident]
    if extra:
        raise IntegrityError(
            f"policy {name!r} tracks {len(extra)} key(s) the index does not hold, "
            f"e.g. {short_key(extra[0])}"
        )
