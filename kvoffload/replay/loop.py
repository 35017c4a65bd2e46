"""The index-only replay: drive an :class:`OffloadIndex` with a trace, one request at a time.

This is the policy study of ``kvoffload replay --index-only``: no engine, no
GPU prefix cache, every request served whole before the next. Per request:

1. ``lookup`` the request's keys: the ready prefix is the hit;
2. ``prepare_load`` + ``complete_load`` of the hit prefix (pins, then unpins);
3. :func:`~kvoffload.manager.usage.record_use` of every key;
4. ``prepare_store`` of the rest (the index skips what it already holds);
5. :func:`~kvoffload.manager.usage.record_stores` of what it reserved.

Steps 3 and 5 are the rules the connector's scheduler follows too (see
:mod:`kvoffload.manager.usage`), so a policy ranks here as it ranks in the
product. The measure is the *prefix-hit ratio*: hit blocks over all blocks, a
block counting only if every block before it in the request hit too. The
engine replay (:mod:`kvoffload.replay.engine`) measures the product itself.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvoffload.manager import EvictionPolicy, OffloadIndex
from kvoffload.manager.usage import record_stores, record_use
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


def drive(manager: OffloadIndex, requests: Iterable[Sequence[bytes]]) -> int:
    """Replay ``requests`` through ``manager``; return the prefix-hit block count.

    Kept free of timing and reporting so the benchmark and the tests run
    exactly the loop users get.
    """
    hits = 0
    lookup, prepare_store = manager.lookup, manager.prepare_store
    for keys in requests:
        n = lookup(keys)
        if n:
            head = keys[:n]
            manager.prepare_load(head)
            manager.complete_load(head)
            hits += n
        record_use(manager, keys)
        store = prepare_store(keys[n:])
        if store is not None:
            record_stores(manager, keys, store.keys)
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
    manager = OffloadIndex(capacity, policy, record_events=False)
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
