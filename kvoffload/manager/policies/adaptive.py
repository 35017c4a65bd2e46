"""The default policy: LRU whose admission filter turns itself on and off.

Why: on serving traces most chunks are stored once and never reused. At a
small capacity, storing them flushes chunks that would have been hit, so
admitting a chunk only on its *second* sighting pays (x1.7 the hit ratio of
LRU on the Mooncake conversation trace at 4,000 chunks). At a large capacity
the same filter costs a miss on every second sighting that LRU would have
hit (-20% at 16,000). Which side wins depends on capacity *and* workload, so
the policy measures it instead of guessing.

How: residents are one LRU list; chain tails go first because the replay
(and vLLM's connector) touches a request tail first, leaving its head most
recent. Beside it run two *miniature simulations* (Waldspurger et al.,
USENIX ATC'17): a deterministic 1/8 sample of the key space (by CRC-32, so
runs are reproducible) is replayed into two small LRU caches of 1/8 the
capacity, one admitting everything, one admitting on second sighting. Their
hit counts, halved every few capacities' worth of sampled requests so the
choice follows phase changes, decide the mode of the real cache: the filter
is on while its shadow hits at least 10% more (the margin keeps the policy
plain LRU when both are close, so it is never worse than LRU where LRU is
right). The filter never rejects while the cache still has free room.

Cost: O(1) per key (one CRC-32, and OrderedDict moves for 1 key in 8); the
shadows hold at most ``6 * capacity / 8`` keys and the sighting ghost
``4 * capacity``. Eviction skips protected keys exactly like LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from zlib import crc32

from kvoffload.errors import IntegrityError
from kvoffload.manager.policies._common import check_capacity
from kvoffload.manager.policies.lru import LRUPolicy

__all__ = ["AdaptivePolicy"]

#: One key in ``SAMPLE`` feeds the shadows, which have 1/``SAMPLE`` the capacity.
SAMPLE = 8
#: The filter must beat admit-all by this factor in the shadows to be switched on.
MARGIN = 1.1
#: Sightings remembered, in capacities: a chunk offered again within this many
#: rejected offers is admitted. Longer than the cache, since reuse is sparse.
GHOST = 4
#: Shadow hit counts are halved every ``DECAY`` shadow capacities of sampled requests.
DECAY = 8


def _remember(queue: OrderedDict[bytes, None], key: bytes, limit: int) -> None:
    """Append ``key`` to a bounded FIFO, dropping the oldest entry past ``limit``."""
    queue[key] = None
    if len(queue) > limit:
        queue.popitem(last=False)


class _Shadow:
    """A miniature LRU cache over sampled keys that counts its own hits."""

    __slots__ = ("capacity", "filtering", "hits", "resident", "seen")

    def __init__(self, capacity: int, filtering: bool) -> None:
        self.capacity = capacity
        self.filtering = filtering
        self.hits = 0.0
        self.resident: OrderedDict[bytes, None] = OrderedDict()
        self.seen: OrderedDict[bytes, None] = OrderedDict()

    def request(self, key: bytes) -> None:
        resident = self.resident
        if key in resident:
            self.hits += 1.0
            resident.move_to_end(key)
            return
        if self.filtering and len(resident) >= self.capacity:
            if key not in self.seen:
                _remember(self.seen, key, GHOST * self.capacity)
                return
            del self.seen[key]
        _remember(resident, key, self.capacity)

    def clear(self) -> None:
        self.hits = 0.0
        self.resident.clear()
        self.seen.clear()


class AdaptivePolicy(LRUPolicy):
    """LRU with a second-sighting admission filter driven by two shadow caches.

    Residents, eviction and their integrity check are LRU's; this class adds
    admission and the shadows that decide it.
    """

    name = "adaptive"

    def __init__(self, capacity: int) -> None:
        super().__init__(check_capacity("AdaptivePolicy", capacity))
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        small = max(1, capacity // SAMPLE)
        self._admit_all = _Shadow(small, filtering=False)
        self._filtered = _Shadow(small, filtering=True)
        self._period = DECAY * small
        self._sampled = 0
        #: Whether first sightings are currently rejected (read it for reports).
        self.filtering = False

    # -- the shadows -----------------------------------------------------------
    def _observe(self, key: bytes) -> None:
        """Feed a request of ``key``, if sampled, to both shadows and re-decide the mode."""
        if not crc32(key) % SAMPLE:
            self._observe_sampled(key)

    def _observe_sampled(self, key: bytes) -> None:
        admit_all, filtered = self._admit_all, self._filtered
        admit_all.request(key)
        filtered.request(key)
        self._sampled += 1
        if self._sampled >= self._period:
            self._sampled = 0
            admit_all.hits *= 0.5
            filtered.hits *= 0.5
        self.filtering = filtered.hits > MARGIN * admit_all.hits

    # -- EvictionPolicy ------------------------------------------------------------
    def admit(self, key: bytes) -> bool:
        return bool(self.admit_many((key,)))

    def admit_many(self, keys: Sequence[bytes]) -> list[bytes]:
        seen, limit, admitted = self._seen, GHOST * self.capacity, []
        # With room left (admission adds no resident) every key is let in.
        open_door = len(self._order) < self.capacity or not self.filtering
        for key in keys:
            if not crc32(key) % SAMPLE:
                self._observe_sampled(key)  # may switch the filter, for this key and the next
                open_door = len(self._order) < self.capacity or not self.filtering
            if key in seen:
                del seen[key]
                admitted.append(key)
            elif open_door:
                admitted.append(key)
            else:  # remembered, as _remember does (inline: this loop sees every new chunk)
                seen[key] = None
                if len(seen) > limit:
                    seen.popitem(last=False)
        return admitted

    def touch(self, key: bytes) -> None:
        try:
            self._order.move_to_end(key)
        except KeyError:
            return
        self._observe(key)

    def touch_many(self, keys: Iterable[bytes]) -> None:
        order = self._order
        move = order.move_to_end
        for key in keys:  # touch, written out: a request's whole prompt comes here
            if key in order:
                move(key)
                if not crc32(key) % SAMPLE:
                    self._observe_sampled(key)

    def reset(self) -> None:
        super().reset()
        self._seen.clear()
        self._admit_all.clear()
        self._filtered.clear()
        self._sampled = 0
        self.filtering = False

    def check_integrity(self, resident: Collection[bytes]) -> None:
        super().check_integrity(resident)
        small = self._admit_all.capacity
        sizes = (len(self._admit_all.resident), len(self._filtered.resident))
        ghosts = (len(self._seen), len(self._filtered.seen))
        if max(sizes) > small or ghosts[0] > GHOST * self.capacity or ghosts[1] > GHOST * small:
            raise IntegrityError(
                f"adaptive: shadows hold {sizes} keys (capacity {small}), ghosts hold {ghosts} "
                f"(limits {GHOST * self.capacity}, {GHOST * small})"
            )
