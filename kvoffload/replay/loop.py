"""The replay loop: drive an :class:`OffloadManager` with a trace, as a scheduler would.

Per request, in the order vLLM's offloading connector drives its manager:

1. ``lookup`` the request's keys: the ready prefix is the hit;
2. ``prepare_load`` + ``complete_load`` of the hit prefix (pins, then unpins);
3. ``touch`` every key, tail first, so the chain *head* ends most recent and
   the reused prefix is the last thing this request's stores could evict;
4. ``prepare_store`` of the rest (the index skips what it already holds);
5. ``complete_store`` of what it reserved, tail first, for the same reason;
6. if anything was stored behind a hit prefix, ``touch`` that prefix again,
   tail first, so the whole request ends ordered head-newest, tail-oldest.

Step 6 mirrors vLLM's request-finished hook, which re-ranks every key of a
request head-most-recent. The order is what makes an LRU index evict chain
tails before heads (a tail is worthless without its head); with it,
kvoffload's LRU reproduces vLLM's hit ratios on every trace we have.
The measure is the *prefix-hit ratio*: hit blocks over all blocks, a block
counting only if every block before it in the request hit too.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvoffload.manager import EvictionPolicy, OffloadManager
from kvoffload.replay.trace import Trace

__all__ = ["ReplayResult", "drive", "replay"]


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """What one replay of one trace through one policy at one capacity measured."""

    trace: str
    policy: str
    capacity: int
    requests: int
    blocks: int
    hit_blocks: int
    seconds: float

    @property
    def hit_ratio(self) -> float:
        """Prefix-hit blocks over all blocks."""
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def keys_per_s(self) -> float:
        """Blocks replayed per second of wall time (the index's throughput)."""
        return self.blocks / self.seconds if self.seconds > 0 else float("inf")


def drive(manager: OffloadManager, requests: Iterable[Sequence[bytes]]) -> int:
    """Replay ``requests`` through ``manager``; return the prefix-hit block count.

    Kept free of timing and reporting so the benchmark and the tests run
    exactly the loop users get.
    """
    hits = 0
    lookup, touch = manager.lookup, manager.touch
    prepare_store, complete_store = manager.prepare_store, manager.complete_store
    for keys in requests:
        n = lookup(keys)
        if n:
            head = keys[:n]
            manager.prepare_load(head)
            manager.complete_load(head)
            hits += n
        touch(keys[::-1])
        store = prepare_store(keys[n:])
        if store is not None and store.keys:
            complete_store(store.keys[::-1])
            if n:
                touch(keys[n - 1 :: -1])
    return hits


def replay(
    trace: Trace,
    capacity: int,
    policy: str | EvictionPolicy | None = None,
    *,
    progress: bool = False,
) -> ReplayResult:
    """Replay ``trace`` through a fresh index of ``capacity`` chunks.

    ``policy`` is a registry name, an instance built for ``capacity``, or
    ``None`` for the default. ``progress`` shows a tqdm bar on stderr.
    """
    manager = OffloadManager(capacity, policy, record_events=False)
    requests: Iterable[Sequence[bytes]] = trace.requests
    if progress:
        from tqdm import tqdm

        requests = tqdm(
            trace.requests,
            desc=f"{manager.policy.name}@{capacity}",
            unit="req",
            file=sys.stderr,
            leave=False,
        )
    start = time.perf_counter()
    hits = drive(manager, requests)
    seconds = time.perf_counter() - start
    return ReplayResult(
        trace=trace.name,
        policy=manager.policy.name,
        capacity=capacity,
        requests=len(trace.requests),
        blocks=trace.num_blocks,
        hit_blocks=hits,
        seconds=seconds,
    )
