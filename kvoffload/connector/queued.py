"""Requests in the engine's waiting queue keep the CPU-tier chunks they will hit.

A request waits in vLLM's queue while others run, and their stores evict the
least recently used chunks of the CPU tier: quite possibly the very chunks the
waiting request arrived for, which it then recomputes. vLLM tells the connector
of every arrival before queueing it (``on_new_request``); from then on the
chunks of the request's hit that the CPU tier holds are *held*: out of the
eviction policy's reach until the request is scheduled (its load pins them),
finishes without running (aborted), or has waited :data:`MAX_WAIT_S`. At most
``queued_cpu_share`` of the tier is held at once, first come first held, so a
long queue cannot freeze the tier or starve the running requests' stores.

What a request would hit is its leading run of chunks in each full-attention
group (the chain a prefix hit needs), and the chunks of its window and state
groups before where that run ends: a superset of what a hit needs, not a search
(the hit itself is found at its lookup, which must stay free of side effects).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from kvoffload.config.layout import KVLayout, Reuse
from kvoffload.connector.stats import SchedulerStats
from kvoffload.manager.index import OffloadIndex

__all__ = ["MAX_WAIT_S", "QueuedHolds"]

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
        self._stats = stats
        self._clock = clock
        #: Request -> the chunks held for it and since when, oldest first.
        self._held: dict[str, tuple[list[bytes], float]] = {}
        #: Requests whose lower-tier chunks are being fetched while they wait.
        self._fetching: set[str] = set()

    def hold(self, req_id: str, keys: Sequence[Sequence[bytes]]) -> int:
        """Hold the chunks of ``keys`` (the request's, per group) its hit would use; how many."""
        if req_id in self._held or not self.limit:
            return 0
        return self._take(req_id, self._would_hit(keys), self._clock())

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
        """Chunks that may still be held (fetches take from it too)."""
        return max(0, self.limit - self.index.held)

    def _take(self, req_id: str, keys: Sequence[bytes], since: float) -> int:
        held = self.index.hold(keys, self.limit)
        if not held:
            return 0
        before = self._held.get(req_id)
        if before is None:
            self._stats.queued_holds += 1
        self._held[req_id] = ([*before[0], *held] if before else held, since)
        self._stats.queued_held_chunks += len(held)
        return len(held)

    def release(self, req_id: str) -> None:
        """The request left the queue (scheduled, or finished without running)."""
        self._fetching.discard(req_id)
        entry = self._held.pop(req_id, None)
        if entry is not None:
            self.index.unhold(entry[0])

    def expire(self) -> None:
        """Let go of the holds of requests queued longer than :data:`MAX_WAIT_S`."""
        if not self._held:
            return
        since = self._clock() - MAX_WAIT_S
        for req_id, (_, held_at) in list(self._held.items()):
            if held_at > since:
                break  # in arrival order: the rest are younger
            self.release(req_id)
            self._stats.queued_hold_expiries += 1

    def clear(self) -> None:
        """The index dropped every hold (a reset): forget them here too."""
        self._held.clear()
        self._fetching.clear()

    def _would_hit(self, keys: Sequence[Sequence[bytes]]) -> list[bytes]:
        """The CPU-tier chunks of ``keys`` a hit could use, head first (see the module doc)."""
        ready = self.index.ready_mask
        spans = self.tokens_per_chunk
        end = None
        for g, group_keys in enumerate(keys):
            if self._prefix[g]:
                mask = ready(group_keys)
                run = mask.index(False) if False in mask else len(mask)
                reach = run * spans[g]
                end = reach if end is None else min(end, reach)
        chunks: list[tuple[int, bytes]] = []
        for g, group_keys in enumerate(keys):
            head = group_keys[: len(group_keys) if end is None else end // spans[g]]
            found = ready(head)
            chunks += [(c * spans[g], key) for c, key in enumerate(head) if found[c]]
        chunks.sort(key=lambda item: item[0])
        return [key for _, key in chunks]
