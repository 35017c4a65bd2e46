"""Promotions: a hit's lower-tier chunks read into the CPU tier first, then loaded in its step.

A hit that needs a chunk only the disk or remote tier holds cannot load in the
step that asks for it: a read takes longer than a step. There are two ways to
serve it, and which one runs is ``KVOFFLOAD_LOWER_TIER_HITS``:

* ``load`` (the default, measured: docs/benchmarks.md, "Time to first token"):
  vLLM allocates the request's blocks at once and the request waits while its
  load reads the lower tier and copies into those blocks (``load_kv_async``);
  vLLM schedules it at the step after the load is reported.
* ``promote``: the lookup reserves CPU slots for those chunks, orders them
  read in (a :attr:`~kvoffload.messages.JobKind.PROMOTE` job: verified reads
  into the slots, nothing copied into the engine) and answers "ask again"
  (``None``). vLLM asks at every step; the lookup after the promotion finds
  every chunk in the CPU tier and the hit loads in that step, as any CPU-tier
  hit does. The request holds no engine blocks while its chunks are read.

A request promotes once: if a chunk did not come in (a damaged file, say), or
left the CPU tier again before the next lookup, that lookup takes the ``load``
way, whose failures vLLM recomputes. Promotions run only where CPU-tier hits load
in the step (:func:`~kvoffload.connector.loads.loads_in_step`); elsewhere the
second lookup would load a step later anyway.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from kvoffload.connector._request import JobState, RequestState
from kvoffload.connector._retention import Retention
from kvoffload.connector.jobs import JobBook
from kvoffload.connector.misses import MissLedger
from kvoffload.connector.stats import SchedulerStats
from kvoffload.connector.stores import record_stored
from kvoffload.errors import ConfigError
from kvoffload.manager.index import OffloadIndex
from kvoffload.messages import NO_BLOCKS, ChunkSpan, JobKind, JobReport

__all__ = ["LOWER_TIER_HITS_ENV", "Promoter", "promotes_lower_hits", "record_promoted"]

LOWER_TIER_HITS_ENV = "KVOFFLOAD_LOWER_TIER_HITS"
_WAYS = ("load", "promote")


def promotes_lower_hits(loads_in_step: bool) -> bool:
    """Whether lower-tier hits are promoted first (``KVOFFLOAD_LOWER_TIER_HITS``; see above)."""
    value = os.environ.get(LOWER_TIER_HITS_ENV, "").strip().lower() or "load"
    if value not in _WAYS:
        raise ConfigError(
            f"{LOWER_TIER_HITS_ENV}={value!r} is not a way to serve lower-tier hits; use "
            f"{' or '.join(_WAYS)}, or leave it unset for the measured default (load)"
        )
    return value == "promote" and loads_in_step


def record_promoted(
    index: OffloadIndex,
    retention: Retention,
    misses: MissLedger,
    world_size: int,
    *,
    req: RequestState | None,
    job: JobState,
    report: JobReport,
) -> tuple[Sequence[bytes], set[bytes]]:
    """Complete ``job`` 's promotions in the index: (chunks now in the CPU tier, the rest).

    A chunk is in the CPU tier only where every rank read its part in.
    """
    everywhere = {k for k, ranks in report.promoted.items() if ranks >= world_size}
    failed = report.failed_keys
    unpromoted = {k for k in job.promoted if k in failed or k not in everywhere}
    done = record_stored(index, retention, req, job, keys=job.promoted, failed=unpromoted)
    misses.stored(done)
    return done, unpromoted


class Promoter:
    """Orders and completes the promotions of one scheduler's hits."""

    def __init__(
        self,
        *,
        index: OffloadIndex,
        retention: Retention,
        jobs: JobBook,
        stats: SchedulerStats,
        misses: MissLedger,
    ) -> None:
        self.index = index
        self.retention = retention
        self.jobs = jobs
        self.stats = stats
        self.misses = misses

    def start(self, req: RequestState, req_id: str, needed: Sequence[tuple[int, bytes]]) -> bool:
        """Order ``req`` 's lower-tier chunks of ``needed`` (``(group, key)``) into the CPU tier.

        ``False``, with nothing reserved, where the request promoted already or
        the CPU tier has no room for them: the hit then loads the ``load`` way.
        """
        if req.promotion is not None:
            return False
        lower = [(g, k) for g, k in needed if k in req.found_in]
        reserved = self.index.prepare_store(
            [k for _, k in lower], admit_all=True, tenant=req.tenant
        )
        if reserved is None or not reserved.keys:
            return False
        if reserved.evicted:
            self.misses.evicted(reserved.evicted, reserved.capped)
        slot_of = dict(zip(reserved.keys, reserved.slots, strict=True))
        by_group: dict[int, list[bytes]] = {}
        for g, k in lower:
            if k in slot_of:
                by_group.setdefault(g, []).append(k)
        spans = tuple(
            ChunkSpan(g, tuple(keys), tuple(slot_of[k] for k in keys), NO_BLOCKS)
            for g, keys in by_group.items()
        )
        job = JobState(self.jobs.order(req_id, JobKind.PROMOTE, spans), promoted=reserved.keys)
        self.jobs.queue(req, job)
        req.promotion = {k: req.found_in[k] for k in reserved.keys}
        self.stats.promotions += 1
        return True

    def complete(self, req: RequestState | None, job: JobState, report: JobReport) -> None:
        """Every rank reported the promotion: its chunks are CPU-tier chunks now."""
        done, unpromoted = record_promoted(self.index, self.retention, self.misses,
                                           self.jobs.world_size, req=req, job=job,
                                           report=report)  # fmt: skip
        self.stats.promoted_chunks += len(done)
        self.stats.failed_promoted_chunks += len(unpromoted)
