"""The connector core's counters, one record per side, each event counted once where it happens.

Like the tiers' :class:`~kvoffload.tiers.stats.TierStats`, they are records with a field per
figure, not string-keyed dicts: a typo is an ``AttributeError`` at once, not a new key that
nobody reads. ``snapshot()`` gives the plain numbers an exporter, a log line or a test
reads (the adapter maps them to Prometheus series in one place,
:mod:`kvoffload.vllm._metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvoffload._records import as_dict

if TYPE_CHECKING:
    from kvoffload.connector.misses import MissLedger
    from kvoffload.manager.index import OffloadIndex

__all__ = ["SchedulerStats", "WorkerStats"]


@dataclass(slots=True)
class SchedulerStats:
    """What the scheduler side offered, loaded and stored, in tokens, chunks and jobs."""

    #: Lookups asked, and those answered "ask again" (a chunk they need is in flight).
    lookups: int = 0
    deferred_lookups: int = 0
    #: Requests that took a hit, and the tokens vLLM accepted of it.
    hit_requests: int = 0
    hit_tokens: int = 0
    #: Of those, the tokens loaded in the step that asked for them (the rest a step later).
    in_step_hit_tokens: int = 0
    #: Tokens whose load every rank reported done, or failed.
    loaded_tokens: int = 0
    failed_load_tokens: int = 0
    loads: int = 0
    failed_loads: int = 0
    #: Hits whose lower-tier chunks were promoted into the CPU tier first, to load in
    #: their step (KVOFFLOAD_LOWER_TIER_HITS=promote), and those chunks, in or failed.
    promotions: int = 0
    promoted_chunks: int = 0
    failed_promoted_chunks: int = 0
    #: Chunks a hit needed that got no CPU slot for their promotion (failed at once).
    unloadable_chunks: int = 0
    stores: int = 0
    stored_chunks: int = 0
    failed_store_chunks: int = 0
    #: Chunks a step passed over: KV not there (a null block) or not retained.
    skipped_store_chunks: int = 0
    #: Window chunks and states no hit point of their request wanted.
    unretained_chunks: int = 0
    #: Recurrent states not stored because accepted draft tokens may have moved them
    #: (speculative decoding: :mod:`kvoffload.connector._drafts`).
    drafted_states: int = 0
    #: Chunks of a hit found in the CPU tier, and in a lower tier.
    cpu_hit_chunks: int = 0
    lower_hit_chunks: int = 0
    #: Chunks stored only for a trailing hit point and dropped when it moved on.
    dropped_chunks: int = 0
    #: Chunks a finished request never found a CPU slot for (an undersized tier shows here).
    no_room_chunks: int = 0
    resets: int = 0
    #: Queued requests whose CPU-tier chunks were held until they ran
    #: (:mod:`kvoffload.connector.queued`), the chunks held for them, and holds let go
    #: because the request waited too long.
    queued_holds: int = 0
    queued_held_chunks: int = 0
    queued_hold_expiries: int = 0
    #: Fetches of queued requests' lower-tier chunks into the CPU tier while they waited,
    #: and the chunks that came in (then held for them).
    queued_fetches: int = 0
    queued_fetched_chunks: int = 0
    #: Clients' retention hints (:mod:`kvoffload.connector.hints`): taken, ignored as
    #: malformed, and the CPU-tier chunks they kept and dropped.
    retention_hints: int = 0
    retention_hints_ignored: int = 0
    retention_kept_chunks: int = 0
    retention_dropped_chunks: int = 0
    #: Prefill and decode on different engines (:mod:`kvoffload.connector.handoffs`): a
    #: producer's chunks marked as on their way, and marks that failed; a consumer's
    #: lookups answered "ask again" for marked chunks, the requests that waited, and
    #: those whose wait ran out (``handoff_wait_ms``).
    handoff_marked_chunks: int = 0
    handoff_mark_failures: int = 0
    handoff_waits: int = 0
    handoff_waited_requests: int = 0
    handoff_timeouts: int = 0
    #: ``hit_tokens`` and ``loaded_tokens`` by the tier their chunks came from.
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    loaded_tokens_by_tier: dict[str, int] = field(default_factory=dict)

    def add_by_tier(self, counts: dict[str, int], tokens: dict[str, int]) -> None:
        """Add a job's ``tokens`` per tier to ``counts`` (one of the ``*_by_tier`` fields)."""
        for tier, n in tokens.items():
            counts[tier] = counts.get(tier, 0) + n

    def snapshot(self) -> dict[str, int | dict[str, int]]:
        """Every figure by name; the ``*_by_tier`` ones as fresh dicts."""
        return as_dict(self)

    def report(
        self, index: OffloadIndex, misses: MissLedger, jobs: int, requests: int
    ) -> dict[str, int | dict[str, int]]:
        """``OffloadScheduler.stats()``: these counters, the index's as ``index_*``, the
        misses by reason, and what is in flight."""
        out = self.snapshot()
        by_tier = {name: out.pop(name) for name in ("hit_tokens_by_tier", "loaded_tokens_by_tier")}
        out.update({f"index_{name}": value for name, value in index.stats().snapshot().items()})
        out.update(by_tier)
        out["miss_lookups_by_reason"] = dict(misses.lookups)
        out["miss_tokens_by_reason"] = dict(misses.tokens)
        out["reuse_distance_chunks"] = misses.reuse_distance() or 0
        out["jobs_in_flight"] = jobs
        out["requests_tracked"] = requests
        return out


@dataclass(slots=True)
class WorkerStats:
    """One worker's orders and jobs, counted from their reports (bytes are the tiers')."""

    #: Orders held back while the side was suspended, and orders it could not run.
    suspended_orders: int = 0
    refused_orders: int = 0
    store_jobs: int = 0
    load_jobs: int = 0
    failed_store_jobs: int = 0
    failed_load_jobs: int = 0
    store_chunks: int = 0
    load_chunks: int = 0
    failed_store_chunks: int = 0
    failed_load_chunks: int = 0
    #: Promotions (lower tier -> CPU tier, for a hit then loaded in its step) and their chunks.
    promote_jobs: int = 0
    promoted_chunks: int = 0
    failed_promote_chunks: int = 0
    #: Engine blocks of failed loads, handed back to the engine to recompute.
    failed_load_blocks: int = 0
    #: Loads run in the step that asked for them (load_in_step), copied layer by layer.
    in_step_load_jobs: int = 0
    #: ``wait_for_layer_load`` calls of steps with such loads: one per attention layer.
    in_step_layer_waits: int = 0
    #: Store orders not run because an in-step load of their step failed.
    voided_store_orders: int = 0
    #: Failed in-step loads the engine could not recompute (load_in_step "always" only).
    unrecoverable_load_jobs: int = 0

    def snapshot(self) -> dict[str, int]:
        return as_dict(self)
