"""The clairvoyant bound: Belady's MIN replayed with prefix-hit semantics.

MIN keeps, among the resident chunks and the one being offered, those whose
next use is soonest, and bypasses a chunk whose next use is later than every
resident one. It is optimal for plain per-key hits; kvoffload reports it as
the ceiling a policy can hope for at a given capacity. The count is honest
for the replay's measure: a request scores only its *leading* resident
blocks, exactly like :func:`kvoffload.replay.loop.replay`, so a block held
behind an evicted predecessor is not counted (MIN, not knowing prefixes, may
keep such blocks; that is why the bound is not always tight).

Cost is O(N log N) for N blocks: next-use times come from one backward pass,
and the resident set is a max-heap of next-use times with lazy deletion.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvoffload._checks import checked_int

__all__ = ["belady_hits", "next_uses"]

#: Next-use time of a block that is never requested again.
NEVER = 1 << 62


def next_uses(requests: Sequence[Sequence[bytes]]) -> list[list[int]]:
    """For each block of each request, the index of the next request that holds it.

    A key repeated inside one request gets the same (later) next use at
    every position, because replay serves the whole request at one time.
    """
    later: dict[bytes, int] = {}
    result: list[list[int]] = [[] for _ in requests]
    for t in range(len(requests) - 1, -1, -1):
        keys = requests[t]
        result[t] = [later.get(k, NEVER) for k in keys]
        for k in keys:
            later[k] = t
    return result


def belady_hits(
    requests: Sequence[Sequence[bytes]], capacity: int, usable: Sequence[int] | None = None
) -> int:
    """Prefix-hit blocks of MIN (with bypass) at ``capacity`` chunks over ``requests``.

    ``usable``: per request, the most leading blocks a hit may count (an engine computes
    at least a prompt's last token, so its last full block may be stored, never hit).
    """
    checked_int("capacity", capacity)
    uses = next_uses(requests)
    resident: dict[bytes, tuple[int, int]] = {}  # key -> (-next use, -depth in its chain)
    heap: list[tuple[int, int, bytes]] = []  # max-heap via negation; stale entries skipped
    hits = 0
    for t, (keys, nexts) in enumerate(zip(requests, uses, strict=True)):
        n = 0
        for k in keys:
            if k not in resident:
                break
            n += 1
        hits += n if usable is None else min(n, usable[t])
        for depth, (k, nxt) in enumerate(zip(keys, nexts, strict=True)):
            rank = (-nxt, -depth)
            if k not in resident and (
                nxt == NEVER or not _make_room(resident, heap, capacity, rank)
            ):
                continue
            resident[k] = rank
            heapq.heappush(heap, (*rank, k))
        if len(heap) > 4 * capacity:  # stale entries dominate: rebuild, O(capacity)
            heap[:] = [(*rank, k) for k, rank in resident.items()]
            heapq.heapify(heap)
    return hits


def _make_room(
    resident: dict[bytes, tuple[int, int]],
    heap: list[tuple[int, int, bytes]],
    capacity: int,
    rank: tuple[int, int],
) -> bool:
    """Evict the block used furthest ahead if it is worth less than one of ``rank``.

    ``rank`` is ``(-next use, -depth)``: among blocks next used at the same
    time the deepest goes first, since a chain tail is useless without its
    head. Returns whether there is room; when every resident block is worth
    more, MIN bypasses the new block.
    """
    if len(resident) < capacity:
        return True
    while True:
        neg_next, neg_depth, victim = heap[0]
        if resident.get(victim) == (neg_next, neg_depth):
            break
        heapq.heappop(heap)
    if (neg_next, neg_depth) >= rank:
        return False
    heapq.heappop(heap)
    del resident[victim]
    return True
