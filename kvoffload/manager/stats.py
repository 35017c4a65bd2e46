"""The index's counters, as a record with a field per figure (like the tiers' ``TierStats``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload._records import as_dict

__all__ = ["IndexCounters", "IndexStats"]


@dataclass(slots=True)
class IndexCounters:
    """What the index counts as it happens; ``hits`` and ``misses`` count keys, not lookups."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    stores: int = 0
    store_failures: int = 0
    evictions: int = 0
    #: Keys the policy's admission turned away from this tier.
    rejected: int = 0
    #: Of those, keys stored through a slot for the lower tiers only (write-around).
    written_around: int = 0
    #: Chunks dropped on request (``discard``, ``reset``), not by eviction.
    removed: int = 0
    resets: int = 0
    #: Chunks held for queued requests let go to make room for a store (the newest held
    #: first): the running requests' stores come first.
    spilled: int = 0
    #: Of ``evictions``: chunks whose parent had left the CPU tier (orphans), evicted
    #: before the policy was asked (:mod:`kvoffload.manager._chains`).
    orphan_evictions: int = 0
    #: Of ``evictions``: chunks with a child present, evicted because pins, holds or the
    #: store's own chunks protected every leaf the policy could take.
    interior_evictions: int = 0

    def snapshot(self) -> dict[str, int]:
        """Every figure by name, for an exporter or a log line."""
        return as_dict(self)


@dataclass(slots=True)
class IndexStats(IndexCounters):
    """A snapshot of the counters and the occupancy of the index's slots.

    ``used`` is ``ready + storing``; ``pinned`` and ``held`` count distinct chunks.
    """

    capacity: int = 0
    used: int = 0
    ready: int = 0
    storing: int = 0
    pinned: int = 0
    #: Chunks held for requests in the engine's waiting queue (``OffloadIndex.hold``).
    held: int = 0
    free: int = 0
    #: Chunks whose parent in their chain is not in the CPU tier now: the first to go.
    orphans: int = 0
