"""Segmented LRU: an LRU whose reused keys may sit in a protected segment.

Why: a serving trace stores a stream of new chunks, most never read again.
Under plain LRU that stream pushes out the chunks that *were* read again
(shared prefixes, a conversation's earlier turns) as soon as it is longer
than the cache. SLRU (Karedla et al., 1994) keeps a key that was hit in a
*protected* segment of at most ``protected_limit`` keys; new keys enter a
*probation* segment, and eviction takes probation's oldest first. A key
pushed out of the protected segment goes back to probation as its newest
key, so it gets one more round before it can go.

With ``protected_limit`` 0 no key is ever protected and this is LRU exactly
(same victims in the same order): the adaptive policy turns the segment on
and off at run time through :meth:`SegmentedLRU.protect`.

Chains keep their order: a request's keys are touched tail first, so within
either segment its head is newer than its tail, and a segment overflows
oldest first, tails before heads. Across the segments they do not (a tail
that was hit is protected, a head the engine served is not): the index gives
such a head back when the policy picks it (``takes_back``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable
from itertools import filterfalse, islice

from kvoffload.errors import ConfigError, IntegrityError
from kvoffload.manager._integrity import check_resident
from kvoffload.manager.policies._common import check_capacity
from kvoffload.manager.policy import EvictionPolicy, nothing_protected

__all__ = ["SegmentedLRU"]


class SegmentedLRU(EvictionPolicy):
    """Probation and protected ``OrderedDict`` s, each from oldest to newest.

    ``touch`` (a hit) moves a probation key to the protected segment while
    ``protected_limit`` allows; ``refresh`` (recent, no hit) and ``insert``
    never protect a key.
    """

    name = "slru"

    def __init__(self, capacity: int, protected_limit: int = 0) -> None:
        super().__init__(check_capacity(type(self).__name__, capacity))
        self._probation: OrderedDict[bytes, None] = OrderedDict()
        self._protected: OrderedDict[bytes, None] = OrderedDict()
        self.protected_limit = 0
        self.protect(protected_limit)

    @property
    def takes_back(self) -> bool:
        """An insert is a key at the newest end of probation, nothing more (the adaptive
        policy's shadows see admissions and hits, not inserts)."""
        return True

    def protect(self, limit: int) -> None:
        """Let at most ``limit`` keys be protected; the oldest beyond it go back to probation."""
        if not 0 <= limit <= self.capacity:
            raise ConfigError(f"protected_limit must be in [0, {self.capacity}], got {limit}")
        self.protected_limit = limit
        self._overflow()

    def _overflow(self) -> None:
        protected, probation = self._protected, self._probation
        for _ in range(len(protected) - self.protected_limit):
            probation[protected.popitem(last=False)[0]] = None

    # -- EvictionPolicy ------------------------------------------------------------
    def insert(self, key: bytes) -> None:
        self._probation[key] = None

    def insert_many(self, keys: Iterable[bytes]) -> None:
        probation = self._probation
        for key in keys:  # a loop: OrderedDict.update(dict) is twice as slow
            probation[key] = None

    def touch(self, key: bytes) -> None:
        self.hit(key)

    def hit(self, key: bytes) -> bool:
        """Touch ``key``; whether it is resident (a hit)."""
        protected = self._protected
        if key in protected:
            protected.move_to_end(key)
            return True
        probation = self._probation
        if key not in probation:
            return False
        if self.protected_limit:
            del probation[key]
            protected[key] = None
            self._overflow()
        else:
            probation.move_to_end(key)
        return True

    def refresh(self, key: bytes) -> None:
        for segment in (self._probation, self._protected):
            if key in segment:
                segment.move_to_end(key)
                return

    def touch_many(self, keys: Iterable[bytes]) -> None:
        hit = self.hit
        for key in keys:
            hit(key)

    def refresh_many(self, keys: Iterable[bytes]) -> None:
        # Asked for what is resident (the chain ahead of a completed store, a prefix the
        # engine served): a zero-cost try per key, not a membership test before each move.
        probation, protected = self._probation.move_to_end, self._protected.move_to_end
        for key in keys:
            try:
                probation(key)
            except KeyError:
                try:  # noqa: SIM105
                    protected(key)
                except KeyError:
                    pass

    def remove(self, key: bytes) -> None:
        self._probation.pop(key, None)
        self._protected.pop(key, None)

    def evict(self, n: int, protected: Callable[[bytes], bool]) -> list[bytes]:
        victims: list[bytes] = []
        if n <= 0:
            return victims
        for segment in (self._probation, self._protected):
            if protected is nothing_protected:  # the oldest, popped at once
                pop = segment.popitem
                victims += [pop(last=False)[0] for _ in range(min(n - len(victims), len(segment)))]
            else:
                # The oldest unprotected, at C speed (islice asks no key past the last).
                chosen = list(islice(filterfalse(protected, segment), n - len(victims)))
                deque(map(segment.__delitem__, chosen), 0)
                victims += chosen
            if len(victims) == n:
                break
        return victims

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def reset(self) -> None:
        self._probation.clear()
        self._protected.clear()

    def check_integrity(self, resident: Collection[bytes]) -> None:
        self.check_segments()
        check_resident(self.name, self._probation.keys() | self._protected.keys(), resident)

    def check_segments(self) -> None:
        """Raise ``IntegrityError`` if a key is in both segments or one is over its limit."""
        probation, protected = self._probation, self._protected
        overlap = len(probation.keys() & protected.keys())
        if overlap or len(protected) > self.protected_limit:
            raise IntegrityError(
                f"{self.name}: {len(protected)} protected keys (limit {self.protected_limit}), "
                f"{overlap} also on probation"
            )
