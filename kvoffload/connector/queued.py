"""Requests in the engine's waiting queue keep the CPU-tier chunks they will hit.

A request waits in vLLM's queue while others run, and their stores evict the
least recently used chunks of the CPU tier: quite possibly the very chunks the
waiting request arrived for, which it then recomputes. vLLM tells the connector
of every arrival before queueing it (``on_new_request``); once a step leaves it
waiting (before that step's stores evict), the chunks of the request's hit that
the CPU tier holds are *held*: passed over by evictions, where the policy ranks
them, until the request is scheduled (its ``plan_load``: its load pins them),
finishes without running (aborted), or has waited :data:`MAX_WAIT_S`. A request
the step it arrived for schedules holds nothing: most do. At most
``queued_cpu_share`` of the tier is held at once, first come first held, so a
long queue cannot freeze the tier or starve the running requests' stores.

What a request would hit is its leading run of chunks in each full-attention
group (the chain a prefix hit needs), and the chunks of its window and state
groups before where that run ends: a superset of what a hit needs, not a search
(the hit itself is found at its lookup, which must stay free of side effects).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvoffload.config import OffloadConfig
from kvoffload.config.layout import KVLayout, Reuse
from kvoffload.connector._search import HitFinder
from kvoffload.connector.promotions import Promotions
from kvoffload.connector.requests import RequestTable
from kvoffload.connector.stats import SchedulerStats
from kvoffload.manager.index import OffloadIndex

__all__ = ["MAX_WAIT_S", "QueuedHolds", "WaitingFetches"]

#: Longest a queued request's chunks are held: past it the request is not about to run.
MAX_WAIT_S = 60.0


class QueuedHolds:
    """The holds of queued requests on ``index``, at most ``limit`` chunks in all."""

    def __init__(
        self,
        index: OffloadIndex,
        layout: KVLayout,
        tokens_per_chunk: Sequence[int],
        *,
        limit: int,
        stats: SchedulerStats,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.limit = limit
        self.tokens_per_chunk = tuple(tokens_per_chunk)
        self._prefix = [g.reuse is Reuse.PREFIX for g in layout.groups]
        self._plain = self._prefix == [True]
        self._stats = stats
        self._clock = clock
        #: Requests that arrived since the last step, with their keys: held if it leaves them
        #: waiting (most are scheduled by the step they arrive for, and need no hold).
        self._arrived: dict[str, Sequence[Sequence[bytes]]] = {}
        #: Request -> the chunks held for it and since when, oldest first; how many in all.
        self._held: dict[str, tuple[list[bytes], float]] = {}
        self._count = 0
        #: Requests whose lower-tier chunks are being fetched while they wait.
        self._fetching: set[str] = set()

    @classmethod
    def from_config(
        cls,
        config: OffloadConfig,
        index: OffloadIndex,
        stats: SchedulerStats,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> QueuedHolds:
        """The holds ``queued_cpu_share`` allows on ``index`` (none where nothing loads)."""
        limit = int(config.queued_cpu_share * index.capacity) if config.loads else 0
        spans = config.tokens_per_chunk
        return cls(index, config.layout, spans, limit=limit, stats=stats, clock=clock)

    def arrived(self, req_id: str, keys: Sequence[Sequence[bytes]]) -> None:
        """A request joined the queue with ``keys`` (its own, per group): its chunks are held
        once a step leaves it waiting (:meth:`step`)."""
        if self.limit and req_id not in self._held:
            self._arrived[req_id] = keys

    def step(self) -> None:
        """After a step's scheduling, before its stores evict: the requests that arrived for
        it and still wait hold their chunks, and holds that waited too long lapse.

        Holding from the step that leaves a request waiting, not from its arrival: most
        requests are scheduled by the step they arrive for (their ``plan_load`` releases
        them, and their loads pin what they use), so holding them would only cost time."""
        arrived = self._arrived
        if not (arrived or self._held):
            return
        now = self._clock()
        for req_id, keys in arrived.items():
            if self._plain:  # one full-attention group: its leading run, in order
                self._take(req_id, keys[0], now, leading=True)
            else:
                self._take(req_id, self._would_hit(keys), now)
        arrived.clear()
        self._expire(now)

    def hold_fetched(self, req_id: str, keys: Sequence[bytes]) -> int:
        """Hold chunks just fetched for a request still queued (none once it left); how many."""
        entry = self._held.get(req_id)
        if entry is None and req_id not in self._fetching:
            return 0
        self._fetching.discard(req_id)
        return self._take(req_id, keys, self._clock() if entry is None else entry[1])

    def fetching(self, req_id: str) -> None:
        """A fetch of the request's lower-tier chunks is on its way (:meth:`hold_fetched`)."""
        self._fetching.add(req_id)

    def queued(self, req_id: str) -> bool:
        """Whether the request is still queued with chunks held or being fetched for it."""
        return req_id in self._held or req_id in self._fetching

    def room(self) -> int:
        """Chunks that may still be held for queued requests (fetches take from it too)."""
        return max(0, self.limit - self._count)

    def _take(self, req_id: str, keys: Sequence[bytes], since: float, leading: bool = False) -> int:
        # Within this share alone (the index holds for retention hints too).
        held = self.index.hold(keys, self.index.held + self.room(), leading=leading)
        if not held:
            return 0
        self._count += len(held)
        before = self._held.get(req_id)
        if before is None:
            self._stats.queued_holds += 1
        self._held[req_id] = ([*before[0], *held] if before else held, since)
        self._stats.queued_held_chunks += len(held)
        return len(held)

    def release(self, req_id: str) -> None:
        """The request left the queue (scheduled, or finished without running)."""
        self._arrived.pop(req_id, None)
        self._fetching.discard(req_id)
        entry = self._held.pop(req_id, None)
        if entry is not None:
            self.index.unhold(entry[0])
            self._count -= len(entry[0])

    def _expire(self, now: float) -> None:
        """Let go of the holds of requests queued longer than :data:`MAX_WAIT_S`."""
        since, held = now - MAX_WAIT_S, self._held
        while held:
            req_id, (_, held_at) = next(iter(held.items()))
            if held_at > since:
                return  # in arrival order: the rest are younger
            self.release(req_id)
            self._stats.queued_hold_expiries += 1

    def clear(self) -> None:
        """The index dropped every hold (a reset): forget them here too."""
        self._arrived.clear()
        self._held.clear()
        self._count = 0
        self._fetching.clear()

    def _would_hit(self, keys: Sequence[Sequence[bytes]]) -> list[bytes]:
        """The CPU-tier chunks of ``keys`` a hit could use, head first (see the module doc)."""
        ready, spans = self.index.ready_mask, self.tokens_per_chunk
        runs = {
            g: self.index.ready_run(group_keys)
            for g, group_keys in enumerate(keys)
            if self._prefix[g]
        }
        end = min((run * spans[g] for g, run in runs.items()), default=None)
        chunks: list[tuple[int, bytes]] = []
        for g, group_keys in enumerate(keys):
            head = group_keys[: len(group_keys) if end is None else end // spans[g]]
            found = ready(head)
            chunks += [(c * spans[g], key) for c, key in enumerate(head) if found[c]]
        chunks.sort(key=lambda item: item[0])
        return [key for _, key in chunks]


class WaitingFetches:
    """Requests a step left waiting, whose lower-tier chunks are read in meanwhile
    (the key ``fetch_while_queued``; see the module docstring of the holds).

    When a step leaves a request in the queue, the chunks of its hit that only a
    lower tier holds are promoted into the CPU tier (verified reads, nothing copied
    into the engine), in arrival order, within what :class:`QueuedHolds` may still
    hold, and held for it as they land: its lookup then finds a CPU-tier hit. A
    request a step schedules at once fetches nothing: its load reads them.
    """

    def __init__(
        self,
        requests: RequestTable,
        hits: HitFinder,
        promotions: Promotions,
        holds: QueuedHolds,
        stats: SchedulerStats,
        *,
        enabled: bool,
    ) -> None:
        self.requests, self.hits, self.promotions = requests, hits, promotions
        self.holds, self.enabled = holds, enabled
        self._stats = stats
        #: Requests queued, not yet scheduled nor fetched for, in arrival order.
        self._waiting: OrderedDict[str, tuple[Sequence[int], Sequence[bytes] | None]] = (
            OrderedDict()
        )

    def arrived(
        self, req_id: str, token_ids: Sequence[int], block_hashes: Sequence[bytes] | None
    ) -> None:
        if self.enabled:
            self._waiting[req_id] = (token_ids, block_hashes)

    def left(self, req_id: str) -> None:
        """The request was scheduled, or finished: nothing to fetch for it any more."""
        if self._waiting:
            self._waiting.pop(req_id, None)

    def fetch(self) -> None:
        """At the end of a step's scheduling: order the fetches of those it left waiting.

        In arrival order. A request whose hit waits for a chunk being stored now is asked
        again at the next step; one whose fetch does not fit in the room holds leave waits
        there, first in line (the requests ahead of it free their room as they run); one
        whose fetch could never fit is passed over, so it cannot stall those behind it.
        """
        waiting, later = self._waiting, []
        while waiting:
            req_id, entry = waiting.popitem(last=False)
            if self.requests.get(req_id) is None:
                continue
            lookup = self.requests.lookup(req_id, entry[0], 0, None, entry[1])
            hit = self.hits.find(lookup)
            if hit is not None and hit.pending:
                later.append((req_id, entry))  # a chunk it needs lands at a later step
                continue
            if hit is None or not hit.found_in or len(hit.found_in) > self.holds.limit:
                continue
            if len(hit.found_in) > self.holds.room():  # at a later step, first in line
                later.append((req_id, entry))
                break
            if self.promotions.promote(lookup.req, req_id, hit):
                self.holds.fetching(req_id)
                self._stats.queued_fetches += 1
        for req_id, entry in reversed(later):
            waiting[req_id] = entry
            waiting.move_to_end(req_id, last=False)

    def landed(self, req_id: str, chunks: Sequence[bytes]) -> None:
        """A promotion reported: chunks fetched for a request still waiting are held for it."""
        if self.holds.queued(req_id):
            self._stats.queued_fetched_chunks += self.holds.hold_fetched(req_id, chunks)
