"""Consistency checks of the index's bookkeeping, kept out of the hot module.

They are O(capacity) and meant for tests and debugging (``check_integrity``),
never for the scheduler's step loop.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from kvoffload.errors import IntegrityError
from kvoffload.keys import short_key

__all__ = ["check_index", "check_resident", "check_victims"]


def check_index(
    ready: Mapping[bytes, int],
    storing: Mapping[bytes, int],
    pins: Mapping[bytes, int],
    free: Collection[int],
    capacity: int,
    *,
    cold: Collection[bytes] = (),
) -> None:
    """Every slot is exactly one of free / ready / storing; pins only on ready chunks; every
    chunk stored for the lower tiers only (``cold``) has its store in flight."""
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
    orphans = [key for key in cold if key not in storing]
    if orphans:
        raise IntegrityError(
            f"{len(orphans)} chunk(s) marked for the lower tiers only have no store in flight"
        )


def check_victims(
    policy: str,
    victims: Collection[bytes],
    need: int,
    *,
    ready: Mapping[bytes, int],
    pins: Mapping[bytes, int],
    found: Collection[bytes],
    held: Mapping[bytes, int] | None = None,
) -> None:
    """A policy's ``need`` victims are distinct, ready, unpinned, not held for a queued
    request and not protected by the call.

    Checked at every eviction, at once on the whole batch (a few set operations): a
    policy out of step with the index must fail loudly before any slot is freed.
    """
    chosen = set(victims)
    if (
        len(victims) == len(chosen) == need
        and ready.keys() >= chosen
        and pins.keys().isdisjoint(chosen)
        and chosen.isdisjoint(found)
        and (not held or held.keys().isdisjoint(chosen))
    ):
        return
    held = held or {}
    bad = [k for k in victims if k not in ready or k in pins or k in found or k in held]
    shown = ", ".join(short_key(k) for k in bad[:3])
    raise IntegrityError(
        f"policy {policy!r} returned {len(victims)} victim(s) for {need} "
        f"({len(bad)} not evictable: {shown or 'none'}); it is out of sync with the index"
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
