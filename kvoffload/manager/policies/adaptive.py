"""The default policy: LRU that turns an admission filter and a protected segment on and off.

Why: on serving traces most chunks are stored once and never reused. At a
small capacity, storing them flushes chunks that would have been hit, so
admitting a chunk only on its *second* sighting pays (x1.7 the hit ratio of
LRU on the Mooncake conversation trace at 4,000 chunks). At a large capacity
the same filter costs a miss on every second sighting that LRU would have
hit (-20% at 16,000). In between, admitting everything but keeping chunks
that were hit in a protected segment of a quarter of the cache (segmented
LRU, :mod:`~kvoffload.manager.policies._segmented`) keeps the reused chunks
from being pushed out by the stream of new ones (+4% over LRU at 16,000
chunks), and at a capacity that holds nearly all the reuse, plain LRU is
best. Which wins depends on capacity *and* workload, so the policy measures
it instead of guessing.

How: residents are a segmented LRU; chain tails go first because the usage
rules (:mod:`kvoffload.manager.usage`) touch a request tail first, leaving
its head most recent. Beside it run three *miniature simulations*
(Waldspurger et al., USENIX ATC'17): a deterministic 1/8 sample of the key
space (by CRC-32, so runs are reproducible) is replayed into three small
caches of 1/8 the capacity: plain LRU, LRU admitting on second sighting, and
the segmented LRU. Their hit counts, halved every few capacities' worth of
sampled requests so the choice follows phase changes, decide the mode of the
real cache. The filter is on while its shadow hits at least 10% more than
plain LRU's; the segment is on while its shadow hits at least 2% more than
plain LRU's and more than the filter's (it costs no miss outright, only
reorders evictions, so it needs less proof). The margins keep the policy
plain LRU when the shadows are close, so it is never worse than LRU where
LRU is right. The filter never rejects while the cache still has free room.

Cost: O(1) per key (one CRC-32, and OrderedDict moves for 1 key in 8); the
shadows hold at most ``3 * capacity / 8`` keys plus their sightings, and the
sighting ghost ``4 * capacity``. Turning the segment off sends its keys back
to probation at once (O(capacity / 4), rare). Eviction skips protected keys
exactly like LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from zlib import crc32

from kvoffload.errors import IntegrityError
from kvoffload.manager.policies._segmented import SegmentedLRU

__all__ = ["AdaptivePolicy"]

#: One key in ``SAMPLE`` feeds the shadows, which have 1/``SAMPLE`` the capacity.
SAMPLE = 8
#: The filter must beat plain LRU by this factor in the shadows to be switched on.
MARGIN = 1.1
#: The protected segment must beat plain LRU by this factor to be switched on.
PROTECT_MARGIN = 1.02
#: The protected segment's size while it is on, as a fraction of the capacity (the
#: Mooncake traces gained most at 1/5 to 1/3; at 1/2 and above, new chunks are
#: evicted before their conversation's next turn reads them).
PROTECTED_SHARE = 0.25
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
    """A miniature cache over sampled keys that counts its own hits: LRU, LRU with the
    second-sighting filter (``filtering``), or segmented LRU (``protected_limit`` > 0).

    Its residents follow :class:`SegmentedLRU` 's rules exactly, written out on two
    ``OrderedDict`` s rather than calling one: a shadow sees one key in eight, three
    times over, and the calls cost a tenth of the scheduler's time at 64,000 chunks.
    A test keeps the two alike (``tests/test_adaptive.py``).
    """

    __slots__ = ("capacity", "filtering", "hits", "limit", "protected", "resident", "seen")

    def __init__(self, capacity: int, *, filtering: bool = False, protected_limit: int = 0) -> None:
        self.capacity = capacity
        self.filtering = filtering
        self.limit = protected_limit
        self.hits = 0.0
        self.resident: OrderedDict[bytes, None] = OrderedDict()  # probation, with a segment
        self.protected: OrderedDict[bytes, None] = OrderedDict()
        self.seen: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.resident) + len(self.protected)

    def request(self, key: bytes) -> None:
        resident, protected = self.resident, self.protected
        if key in protected:
            self.hits += 1.0
            protected.move_to_end(key)
            return
        if key in resident:
            self.hits += 1.0
            if self.limit:
                del resident[key]
                protected[key] = None
                if len(protected) > self.limit:
                    resident[protected.popitem(last=False)[0]] = None
            else:
                resident.move_to_end(key)
            return
        held = len(resident) + len(protected)  # lengths written out: one call per sampled key
        if self.filtering and held >= self.capacity:
            if key not in self.seen:
                _remember(self.seen, key, GHOST * self.capacity)
                return
            del self.seen[key]
        resident[key] = None
        if held >= self.capacity:
            (resident or protected).popitem(last=False)

    def clear(self) -> None:
        self.hits = 0.0
        self.resident.clear()
        self.protected.clear()
        self.seen.clear()


class AdaptivePolicy(SegmentedLRU):
    """Segmented LRU whose admission filter and protected segment follow three shadow caches.

    Residents, eviction and their integrity check are :class:`SegmentedLRU` 's
    (plain LRU while the segment is off); this class adds admission and the
    shadows that decide both modes.
    """

    name = "adaptive"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        small = max(1, capacity // SAMPLE)
        self._lru = _Shadow(small)
        self._filtered = _Shadow(small, filtering=True)
        self._segmented = _Shadow(small, protected_limit=max(1, int(PROTECTED_SHARE * small)))
        #: The protected segment's size while it is on.
        self._segment = int(PROTECTED_SHARE * capacity)
        self._period = DECAY * small
        self._sampled = 0
        #: Whether first sightings are currently rejected (read it for reports).
        self.filtering = False

    @property
    def protecting(self) -> bool:
        """Whether keys that were hit are currently protected (read it for reports)."""
        return self.protected_limit > 0

    # -- the shadows -----------------------------------------------------------
    def _observe(self, key: bytes) -> None:
        """Feed a request of ``key``, if sampled, to the shadows and re-decide the mode."""
        if not crc32(key) % SAMPLE:
            self._observe_sampled(key)

    def _observe_sampled(self, key: bytes) -> None:
        lru, filtered, segmented = self._lru, self._filtered, self._segmented
        lru.request(key)
        filtered.request(key)
        segmented.request(key)
        self._sampled += 1
        if self._sampled >= self._period:
            self._sampled = 0
            lru.hits *= 0.5
            filtered.hits *= 0.5
            segmented.hits *= 0.5
        filtering = filtered.hits > MARGIN * lru.hits
        protecting = segmented.hits > PROTECT_MARGIN * lru.hits and (
            not filtering or segmented.hits > filtered.hits
        )
        self.filtering = filtering and not protecting
        limit = self._segment if protecting else 0
        if limit != self.protected_limit:
            self.protect(limit)

    # -- EvictionPolicy ------------------------------------------------------------
    def admit(self, key: bytes) -> bool:
        return bool(self.admit_many((key,)))

    def admit_many(self, keys: Sequence[bytes]) -> list[bytes]:
        seen, limit, admitted = self._seen, GHOST * self.capacity, []
        # With room left (admission adds no resident) every key is let in.
        room = len(self._probation) + len(self._protected) < self.capacity
        open_door = room or not self.filtering
        for key in keys:
            if not crc32(key) % SAMPLE:
                self._observe_sampled(key)  # may switch the filter, for this key and the next
                open_door = room or not self.filtering
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
        if self.hit(key):
            self._observe(key)

    def touch_many(self, keys: Iterable[bytes]) -> None:
        # touch, written out: a request's whole prompt comes here.
        rest = iter(keys)
        if not self.protected_limit:
            probation = self._probation  # the segment is off and empty: LRU's moves
            move = probation.move_to_end
            for key in rest:
                if key in probation:
                    move(key)
                    if not crc32(key) % SAMPLE:
                        self._observe_sampled(key)
                        if self.protecting:
                            break  # the segment came on: the keys after this one protect
            else:
                return
        hit = self.hit  # hit() reads the segment's limit at every key, as touch() does
        for key in rest:
            if hit(key) and not crc32(key) % SAMPLE:
                self._observe_sampled(key)

    def reset(self) -> None:
        super().reset()
        self._seen.clear()
        for shadow in (self._lru, self._filtered, self._segmented):
            shadow.clear()
        self._sampled = 0
        self.filtering = False
        self.protect(0)

    def check_integrity(self, resident: Collection[bytes]) -> None:
        super().check_integrity(resident)
        small = self._lru.capacity
        shadows = (self._lru, self._filtered, self._segmented)
        sizes = tuple(len(shadow) for shadow in shadows)
        ghosts = (len(self._seen), len(self._filtered.seen))
        if (
            max(sizes) > small
            or len(self._segmented.protected) > self._segmented.limit
            or ghosts[0] > GHOST * self.capacity
            or ghosts[1] > GHOST * small
        ):
            raise IntegrityError(
                f"adaptive: shadows hold {sizes} keys (capacity {small}), ghosts hold {ghosts} "
                f"(limits {GHOST * self.capacity}, {GHOST * small})"
            )
