"""Chunks stored only for requests' trailing hit points.

What a trailing point is: :mod:`kvoffload.connector._retention`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvoffload.connector._request import RequestState
from kvoffload.manager.index import OffloadIndex

__all__ = ["Trails"]


class Trails:
    """Chunks stored only for requests' trailing points, dropped when no request trails them.

    A chunk another request keeps for good is never dropped: keeping it
    removes it from here. A chunk still being stored when it is released is
    dropped when its store completes, unless someone wanted it again meanwhile.
    """

    def __init__(self, index: OffloadIndex) -> None:
        self.index = index
        self._holders: dict[bytes, set[str]] = {}
        self._doomed: set[bytes] = set()

    def keep(self, keys: Iterable[bytes]) -> None:
        """``keys`` are wanted for good."""
        if not self._holders and not self._doomed:
            return  # nothing trailed (a layout of full-attention groups only never trails)
        for key in keys:
            self._holders.pop(key, None)
            self._doomed.discard(key)

    def hold(self, req: RequestState, req_id: str, keys: Iterable[bytes], new: set[bytes]) -> None:
        """``req`` trails ``keys``; ``new`` are those its store reserved (nobody held them)."""
        for key in keys:
            holders = self._holders.get(key)
            if holders is None and key not in new and key not in self._doomed:
                continue  # stored for good by someone else, or not stored at all
            self._holders.setdefault(key, set()).add(req_id)
            self._doomed.discard(key)
            req.trail_keys.add(key)

    def release(self, req: RequestState, req_id: str, still: set[bytes]) -> int:
        """``req`` no longer trails its keys outside ``still``; returns how many were dropped."""
        gone = req.trail_keys - still
        req.trail_keys -= gone
        dropped = []
        for key in gone:
            holders = self._holders.get(key)
            if holders is None:
                continue
            holders.discard(req_id)
            if not holders:
                del self._holders[key]
                dropped.append(key)
        removed = self.index.discard(dropped)
        self._doomed.update(set(dropped) - set(removed))
        return len(removed)

    def finish(self, req: RequestState, req_id: str) -> None:
        """The request ended: what it trails now is its output's hit point, kept for good."""
        for key in req.trail_keys:
            holders = self._holders.get(key)
            if holders is not None and req_id in holders:
                del self._holders[key]
        req.trail_keys.clear()

    def stored(self, keys: Sequence[bytes]) -> int:
        """Stores of ``keys`` completed: drop those released meanwhile; returns how many."""
        if not self._doomed:
            return 0
        doomed = [key for key in keys if key in self._doomed]
        if not doomed:
            return 0
        self._doomed.difference_update(doomed)
        return len(self.index.discard(doomed))
