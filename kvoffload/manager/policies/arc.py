"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03), driven by the index.

``T1`` holds chunks used once since they arrived, ``T2`` chunks used again;
the ghost lists ``B1``/``B2`` remember recently evicted keys of each. A store
of a ``B1`` ghost says "recency was evicted too early" and grows the target
``p`` of ``T1``; a ``B2`` ghost shrinks it. Departures from the paper, because
the index (not the policy) decides when to evict and never names the
incoming key at eviction time:

* ``evict`` applies REPLACE without the paper's "incoming key is in B2" tie
  rule, and skips protected keys (falling back to the other list);
* ghosts are trimmed when a new key arrives, to the paper's bounds
  ``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <= 2c``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator

from kvoffload.errors import IntegrityError
from kvoffload.manager._integrity import check_resident
from kvoffload.manager.policies._common import check_capacity
from kvoffload.manager.policy import EvictionPolicy

__all__ = ["ARCPolicy"]

_Queue = OrderedDict[bytes, None]


def _unprotected(queue: _Queue, protected: Callable[[bytes], bool]) -> Iterator[bytes]:
    return (key for key in queue if not protected(key))


class ARCPolicy(EvictionPolicy):
    """ARC over the index's ready chunks; ``p`` adapts between recency and frequency."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(check_capacity("ARCPolicy", capacity))
        self._t1: _Queue = OrderedDict()
        self._t2: _Queue = OrderedDict()
        self._b1: _Queue = OrderedDict()
        self._b2: _Queue = OrderedDict()
        #: Target size of T1, in [0, capacity].
        self.p = 0.0

    def insert(self, key: bytes) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        if key in t1 or key in t2:
            self.touch(key)
        elif key in b1:
            self.p = min(float(self.capacity), self.p + max(len(b2) / len(b1), 1.0))
            del b1[key]
            t2[key] = None
        elif key in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[key]
            t2[key] = None
        else:
            # Only a new key grows the lists, by one: one ghost pop restores the bounds.
            t1[key] = None
            c = self.capacity
            if b1 and len(t1) + len(b1) > c:
                b1.popitem(last=False)
            elif len(t1) + len(t2) + len(b1) + len(b2) > 2 * c:
                (b2 or b1).popitem(last=False)

    def touch(self, key: bytes) -> None:
        t2 = self._t2
        if key in t2:
            t2.move_to_end(key)
        elif key in self._t1:
            del self._t1[key]
            t2[key] = None

    def refresh(self, key: bytes) -> None:
        """Most recent in its own list: recency without the promotion a hit earns."""
        for queue in (self._t1, self._t2):
            if key in queue:
                queue.move_to_end(key)
                return

    def remove(self, key: bytes) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def evict(self, n: int, protected: Callable[[bytes], bool]) -> list[bytes]:
        """REPLACE ``n`` times on a simulated size, then move the victims to their ghosts.

        A victim moves to its own list's ghost, which keeps both ARC bounds,
        so nothing needs trimming here.
        """
        from1 = _unprotected(self._t1, protected)
        from2 = _unprotected(self._t2, protected)
        size1, size2 = len(self._t1), len(self._t2)
        victims1: list[bytes] = []
        victims2: list[bytes] = []
        for _ in range(max(n, 0)):
            take_t1 = size1 > 0 and (size1 > self.p or size2 == 0)
            key = next(from1 if take_t1 else from2, None)
            if key is None:
                take_t1 = not take_t1
                key = next(from1 if take_t1 else from2, None)
                if key is None:
                    break
            if take_t1:
                victims1.append(key)
                size1 -= 1
            else:
                victims2.append(key)
                size2 -= 1
        for key in victims1:
            del self._t1[key]
            self._b1[key] = None
        for key in victims2:
            del self._t2[key]
            self._b2[key] = None
        return victims1 + victims2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def reset(self) -> None:
        for queue in (self._t1, self._t2, self._b1, self._b2):
            queue.clear()
        self.p = 0.0

    def sizes(self) -> dict[str, float]:
        """``t1``, ``t2``, ``b1``, ``b2`` lengths and the target ``p``, for reports."""
        return {
            "t1": len(self._t1),
            "t2": len(self._t2),
            "b1": len(self._b1),
            "b2": len(self._b2),
            "p": self.p,
        }

    def check_integrity(self, resident: Collection[bytes]) -> None:
        t1, t2, b1, b2, c = self._t1, self._t2, self._b1, self._b2, self.capacity
        check_resident(self.name, t1.keys() | t2.keys(), resident)
        overlaps = len(t1.keys() & t2.keys()) + len(b1.keys() & b2.keys())
        overlaps += len((t1.keys() | t2.keys()) & (b1.keys() | b2.keys()))
        total = len(t1) + len(t2) + len(b1) + len(b2)
        if overlaps or not 0 <= self.p <= c or len(t1) + len(b1) > c or total > 2 * c:
            raise IntegrityError(
                f"arc: |T1|={len(t1)} |T2|={len(t2)} |B1|={len(b1)} |B2|={len(b2)} "
                f"p={self.p} capacity={c} overlaps={overlaps}"
            )
