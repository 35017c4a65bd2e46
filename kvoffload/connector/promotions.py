"""Promotions: lower-tier chunks read into CPU slots, for a load or ahead of one.

A chunk only the disk or remote tier holds is read into a CPU slot before the
engine gets it; this module reserves those slots, orders the reads and completes
them. There are two ways to serve a hit that needs such chunks, and which one runs
is ``KVOFFLOAD_LOWER_TIER_HITS`` (read by :func:`promotes_lower_hits`):

* ``load`` (the default, measured: docs/benchmarks.md, "Time to first token"):
  vLLM allocates the request's blocks at once and the request waits while its
  load reads the lower tier into the slots reserved here (:meth:`Promotions.reserve`)
  and copies into those blocks (``load_kv_async``); vLLM schedules it at the step
  after the load is reported.
* ``promote``: the lookup reserves CPU slots for those chunks, orders them
  read in (a :attr:`~kvoffload.messages.JobKind.PROMOTE` job: verified reads
  into the slots, nothing copied into the engine; :meth:`Promotions.promote`) and
  answers "ask again" (``None``). vLLM asks at every step; the lookup after the
  promotion finds every chunk in the CPU tier and the hit loads in that step, as
  any CPU-tier hit does. The request holds no engine blocks while its chunks are
  read.

A request promotes once: if a chunk did not come in (a damaged file, say), or
left the CPU tier again before the next lookup, that lookup takes the ``load``
way, whose failures vLLM recomputes. Promotions run only where CPU-tier hits load
in the step (:class:`~kvoffload.connector.loads.HitLoading`); elsewhere the
second lookup would load a step later anyway. :meth:`Promotions.promote` takes
any request and a hit found for it, so a request still queued may have its hit's
chunks read in as well.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.connector._hits import Hit, HitNeeds
from kvoffload.connector._request import JobState, RequestState
from kvoffload.connector._retention import Retention
from kvoffload.connector._tails import with_tail
from kvoffload.connector.jobs import JobBook
from kvoffload.connector.misses import MissLedger
from kvoffload.connector.stats import SchedulerStats
from kvoffload.connector.stores import record_stored
from kvoffload.errors import ConfigError
from kvoffload.manager.index import OffloadIndex
from kvoffload.manager.results import StoreResult
from kvoffload.messages import NO_BLOCKS, ChunkSpan, JobKind, JobReport

__all__ = ["LOWER_TIER_HITS_ENV", "Promotions", "promotes_lower_hits"]

LOWER_TIER_HITS_ENV = "KVOFFLOAD_LOWER_TIER_HITS"
_WAYS = ("load", "promote")


def promotes_lower_hits() -> bool:
    """Whether lower-tier hits are promoted first (``KVOFFLOAD_LOWER_TIER_HITS``; see above)."""
    value = os.environ.get(LOWER_TIER_HITS_ENV, "").strip().lower() or "load"
    if value not in _WAYS:
        raise ConfigError(
            f"{LOWER_TIER_HITS_ENV}={value!r} is not a way to serve lower-tier hits; use "
            f"{' or '.join(_WAYS)}, or leave it unset for the measured default (load)"
        )
    return value == "promote"


@dataclass(slots=True, kw_only=True)
class Promotions:
    """Reserves CPU slots for lower-tier chunks, orders promotions, and completes them."""

    needs: HitNeeds
    index: OffloadIndex
    retention: Retention
    jobs: JobBook
    stats: SchedulerStats
    misses: MissLedger

    def reserve(self, keys: Sequence[bytes], tenant: str | None) -> StoreResult | None:
        """CPU slots for lower-tier ``keys`` (``None``: no room), evictions counted as misses."""
        reserved = self.index.prepare_promotion(keys, tenant=tenant)
        if reserved is not None and reserved.evicted:
            self.misses.evicted(reserved.evicted, reserved.capped)
        return reserved

    def promote(self, req: RequestState, req_id: str, hit: Hit) -> bool:
        """Order the lower-tier chunks ``hit`` needs into the CPU tier, ahead of its load.

        ``False``, with nothing reserved, where the request promoted already or
        the CPU tier has no room for them: the hit then loads over later steps.
        """
        if req.promotion is not None:
            return False
        keys = req.keys
        if hit.tail:  # a hit at a tail: its keys end with the tail's
            keys = with_tail(keys, hit.tail, hit.tokens, self.needs.tokens_per_chunk)
        needed = self.needs.chunks(req.local_hit, hit.tokens)
        lower = [(g, keys[g][c]) for g, chunks in enumerate(needed) for c in chunks]
        lower = [(g, k) for g, k in lower if k in hit.found_in]
        reserved = self.reserve([k for _, k in lower], req.tenant)
        if reserved is None or not reserved.keys:
            return False
        slot_of = dict(zip(reserved.keys, reserved.slots, strict=True))
        by_group: dict[int, list[bytes]] = {}
        for g, k in lower:
            if k in slot_of:
                by_group.setdefault(g, []).append(k)
        spans = tuple(
            ChunkSpan(g, tuple(chunks), tuple(slot_of[k] for k in chunks), NO_BLOCKS)
            for g, chunks in by_group.items()
        )
        job = JobState(self.jobs.order(req_id, JobKind.PROMOTE, spans), promoted=reserved.keys)
        self.jobs.queue(req, job)
        req.promotion = {k: hit.found_in[k] for k in reserved.keys}
        self.stats.promotions += 1
        return True

    def complete(
        self, req: RequestState | None, job: JobState, report: JobReport
    ) -> Sequence[bytes]:
        """Every rank reported a promotion: its chunks are CPU-tier chunks now; returns them."""
        done, unpromoted = self.record(req, job, report)
        self.stats.promoted_chunks += len(done)
        self.stats.failed_promoted_chunks += len(unpromoted)
        return done

    def record(
        self, req: RequestState | None, job: JobState, report: JobReport
    ) -> tuple[Sequence[bytes], set[bytes]]:
        """Complete ``job`` 's promotions in the index: (chunks now in the CPU tier, the rest).

        A chunk is in the CPU tier only where every rank read its part in.
        """
        world = self.jobs.world_size
        everywhere = {k for k, ranks in report.promoted.items() if ranks >= world}
        failed = report.failed_keys
        unpromoted = {k for k in job.promoted if k in failed or k not in everywhere}
        done = record_stored(
            self.index, self.retention, req, job, keys=job.promoted, failed=unpromoted
        )
        self.misses.stored(done)
        return done, unpromoted
