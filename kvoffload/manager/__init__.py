"""Scheduler-side offload index: lookup, pins, all-or-nothing stores, eviction policies.

The manager never touches bytes; it hands out slot ids and reports events.
"""

from __future__ import annotations

from kvoffload.manager.index import OffloadIndex
from kvoffload.manager.policies import (
    AdaptivePolicy,
    AdmissionFilter,
    ARCPolicy,
    LRUPolicy,
    S3FIFOPolicy,
)
from kvoffload.manager.policy import EvictionPolicy, nothing_protected
from kvoffload.manager.results import EventKind, IndexEvent, LoadResult, StoreResult

__all__ = [
    "ARCPolicy",
    "AdaptivePolicy",
    "AdmissionFilter",
    "EventKind",
    "EvictionPolicy",
    "IndexEvent",
    "LRUPolicy",
    "LoadResult",
    "OffloadIndex",
    "S3FIFOPolicy",
    "StoreResult",
    "nothing_protected",
]
