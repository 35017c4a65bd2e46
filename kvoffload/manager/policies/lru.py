"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable
from itertools import filterfalse, islice

from kvoffload.manager._integrity import check_resident
from kvoffload.manager.policies._common import check_capacity
from kvoffload.manager.policy import EvictionPolicy, nothing_protected

__all__ = ["LRUPolicy"]


class LRUPolicy(EvictionPolicy):
    """An ``OrderedDict`` from oldest to newest; eviction skips protected keys.

    Skipping costs a step per protected key older than the victims; pinned
    keys are usually recent (they were just looked up), so this stays cheap.
    """

    name = "lru"

    @property
    def takes_back(self) -> bool:
        """An insert is a key at the newest end, nothing more. Under the usage rules
        (:mod:`kvoffload.manager.usage`) a parent is ranked after its children, so the
        oldest chunk is a leaf: the index gives back a victim only where a pin, a hold
        or a store protected its child (``tests/test_chains.py``)."""
        return True

    def __init__(self, capacity: int) -> None:
        super().__init__(check_capacity("LRUPolicy", capacity))
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self._order[key] = None  # a new key lands at the most recent end

    def insert_many(self, keys: Iterable[bytes]) -> None:
        order = self._order
        for key in keys:  # a loop: OrderedDict.update(dict) is twice as slow
            order[key] = None

    def touch(self, key: bytes) -> None:
        # try/except, not suppress() or a membership test: this is the hot path
        # and a zero-cost try in 3.11+ beats both.
        try:  # noqa: SIM105
            self._order.move_to_end(key)
        except KeyError:
            pass

    def refresh(self, key: bytes) -> None:
        # Recency is all LRU ranks by; written out so subclasses that count hits in
        # ``touch`` (the adaptive policy's shadows) inherit a refresh that counts none.
        try:  # noqa: SIM105
            self._order.move_to_end(key)
        except KeyError:
            pass

    def touch_many(self, keys: Iterable[bytes]) -> None:
        order = self._order
        move = order.move_to_end
        for key in keys:
            if key in order:
                move(key)

    def refresh_many(self, keys: Iterable[bytes]) -> None:
        # Asked for what is resident (the chain ahead of a completed store, a prefix the
        # engine served): a zero-cost try per key, not a membership test before each move.
        move = self._order.move_to_end
        for key in keys:
            try:  # noqa: SIM105
                move(key)
            except KeyError:
                pass

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, protected: Callable[[bytes], bool]) -> list[bytes]:
        victims: list[bytes] = []
        if n <= 0:
            return victims
        if protected is nothing_protected:  # the oldest n, popped at once
            pop = self._order.popitem
            return [pop(last=False)[0] for _ in range(min(n, len(self._order)))]
        # The oldest n unprotected, chosen at C speed (islice asks no key past the n-th).
        victims = list(islice(filterfalse(protected, self._order), n))
        deque(map(self._order.__delitem__, victims), 0)
        return victims

    def __len__(self) -> int:
        return len(self._order)

    def reset(self) -> None:
        self._order.clear()

    def check_integrity(self, resident: Collection[bytes]) -> None:
        check_resident(self.name, self._order, resident)
