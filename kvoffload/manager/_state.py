"""The index's slots and the queries that read them without changing anything.

vLLM asks the connector for hits in ``get_num_new_matched_tokens``, which must be free of
side effects (it may be called twice for one request): these queries touch no counter and
tell the policy nothing. The mutations (stores, loads, evictions) are
:class:`~kvoffload.manager.index.OffloadIndex`'s.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["IndexState"]


class IndexState:
    """Which chunk is in which slot: ready, being stored, pinned, or free."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        #: Keys being stored for the lower tiers only: the policy turned them away.
        self._cold: set[bytes] = set()
        self._ready: dict[bytes, int] = {}
        self._storing: dict[bytes, int] = {}
        self._pins: dict[bytes, int] = {}
        #: Ready keys held for requests still queued (holders each): never evicted.
        self._held: dict[bytes, int] = {}
        # Popped from the end: slot 0 is handed out first.
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    def ready_mask(self, keys: Iterable[bytes]) -> list[bool]:
        """Whether each key is ready now: a pure query, no counters, nothing told to the policy.

        For planners that may ask about the same request more than once
        (vLLM's ``get_num_new_matched_tokens`` must be side-effect free) and
        that need every key, not just the leading run ``lookup`` counts.
        """
        ready = self._ready
        return [key in ready for key in keys]

    def available_run(self, keys: Iterable[bytes]) -> tuple[int, bool]:
        """How many leading ``keys`` are ready or being stored, and whether one is being stored.

        A pure query like ``ready_mask``, which stops at the first key that is
        neither: a planner of chains needs no more.
        """
        ready, storing = self._ready, self._storing
        n, pending = 0, False
        for key in keys:
            if key not in ready:
                if key not in storing:
                    break
                pending = True
            n += 1
        return n, pending

    def ready_run(self, keys: Iterable[bytes]) -> int:
        """How many leading ``keys`` are ready; a pure query like ``ready_mask``."""
        ready, n = self._ready, 0
        for key in keys:
            if key not in ready:
                break
            n += 1
        return n

    def any_ready(self, keys: Iterable[bytes]) -> bool:
        """Whether one of ``keys`` is ready; a pure query like ``ready_mask``, at C speed."""
        return any(map(self._ready.__contains__, keys))

    def storing_mask(self, keys: Iterable[bytes]) -> list[bool]:
        """Whether each key's store or promotion is in flight; a pure query like ``ready_mask``."""
        storing = self._storing
        return [key in storing for key in keys]

    @property
    def held(self) -> int:
        """Chunks held for queued requests now (``OffloadIndex.hold``)."""
        return len(self._held)

    def room(self) -> int:
        """The most chunks one new load can use at once: slots neither pinned nor being stored.

        A planner that offers more than this would promise chunks it cannot
        stage; it should offer a shorter hit instead.
        """
        return self.capacity - len(self._pins) - len(self._storing)

    def _evictable(self, found: set[bytes]) -> int:
        """Ready chunks an eviction may take: neither pinned, held nor found by this call.

        Never more than the policy can give: a held chunk that is also pinned or found
        is subtracted twice, which only refuses a store that might have fit.
        """
        pins = self._pins
        protected = sum(1 for key in found if key not in pins) if found else 0
        return len(self._ready) - len(pins) - protected - len(self._held)
