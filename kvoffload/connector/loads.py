"""Load plans: how a hit loads, what an accepted hit pins and copies, what its report completes.

At lookup, :meth:`LoadPlanner.offer` settles how the hit found
(:class:`~kvoffload.connector._search.HitFinder`) loads, as :class:`HitLoading` says:
in the step that asks for it, over later steps, or after its lower-tier chunks are
promoted into the CPU tier (:mod:`~kvoffload.connector.promotions`). Once vLLM
allocated the request's blocks and accepted ``num_external`` tokens of it, the chunks
it needs are pinned where the CPU tier holds them and given a CPU slot to be promoted
into where a lower tier does. What gets no slot goes into the order as
``unloadable``: the worker reports it failed at once and vLLM recomputes it, never
waiting on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from enum import Enum

from kvoffload.config import OffloadConfig
from kvoffload.config.layout import KVLayout, Reuse
from kvoffload.connector._hits import Hit
from kvoffload.connector._request import JobState, RequestState, StepRequest, tier_shares
from kvoffload.connector._retention import Retention
from kvoffload.connector._spans import NULL_BLOCK, load_pieces, load_spans, stateless
from kvoffload.connector._tails import with_tail
from kvoffload.connector.jobs import JobBook
from kvoffload.connector.misses import MissLedger, MissReason
from kvoffload.connector.promotions import Promotions, promotes_lower_hits
from kvoffload.connector.stats import SchedulerStats
from kvoffload.manager.index import OffloadIndex
from kvoffload.manager.usage import record_use
from kvoffload.messages import JobKind, JobReport, TransferOrder

__all__ = ["HitLoading", "LoadPlanner", "failures_by_block", "hit_loading", "loads_in_step"]


class HitLoading(Enum):
    """When a hit's chunks are copied into the engine's blocks."""

    #: Over later steps: vLLM waits for the load (``load_in_step: never``, or ``auto``
    #: where vLLM could not take a failed load in the step back: :func:`loads_in_step`).
    LATER = "later"
    #: A hit whose chunks are all in the CPU tier in the step that asks for it (invariant
    #: 8); one that needs a lower tier over later steps.
    IN_STEP = "in_step"
    #: As ``IN_STEP``, but a hit that needs lower-tier chunks has them promoted into the
    #: CPU tier first, then loads in its step (``KVOFFLOAD_LOWER_TIER_HITS=promote``).
    PROMOTE_FIRST = "promote_first"


def failures_by_block(layout: KVLayout, num_engine_groups: int) -> bool:
    """Whether a failed load may go back to vLLM as engine block ids.

    vLLM resumes the request at the first failed block, taking every block
    before it as real KV. Block ids are one list per group only with one KV
    cache group (vLLM 0.32 to 0.34 raise a ``RuntimeError`` in the scheduler
    on block ids with several), and every block before is real only where
    the group keeps the whole prefix: a sliding window loads (and vLLM
    allocates) only the blocks inside the window of the hit point, so the
    tokens recomputed after a failed block would attend null blocks; a state
    group keeps no state there. Elsewhere a failed load fails its request,
    which vLLM starts over (``failed_recving``).
    """
    return num_engine_groups == 1 and all(g.reuse is Reuse.PREFIX for g in layout.groups)


def loads_in_step(config: OffloadConfig, num_engine_groups: int) -> bool:
    """Whether CPU-tier hits load in the step that asks for them (the key ``load_in_step``).

    ``num_engine_groups``: the KV cache groups the engine itself keeps. A
    request loading in its step is running, so vLLM can take its failure
    only as block ids (``failed_recving`` acts on requests waiting for a
    load): ``auto`` loads in the step where :func:`failures_by_block` holds,
    ``always`` on every layout (a recurrent state too: see
    :meth:`LoadPlanner.aim_states`).
    """
    if config.load_in_step == "never":
        return False
    return config.load_in_step == "always" or failures_by_block(config.layout, num_engine_groups)


def hit_loading(config: OffloadConfig, num_engine_groups: int) -> HitLoading:
    """How an engine's hits load: the key ``load_in_step`` (:func:`loads_in_step`), and
    ``KVOFFLOAD_LOWER_TIER_HITS`` where CPU-tier hits load in their step."""
    promote = promotes_lower_hits()  # a bad value fails at start, whatever the layout
    if not loads_in_step(config, num_engine_groups):
        return HitLoading.LATER
    return HitLoading.PROMOTE_FIRST if promote else HitLoading.IN_STEP


class LoadPlanner:
    """Offers, plans and completes the loads of one scheduler's requests."""

    def __init__(
        self,
        config: OffloadConfig,
        mode: HitLoading,
        *,
        index: OffloadIndex,
        retention: Retention,
        jobs: JobBook,
        stats: SchedulerStats,
        misses: MissLedger,
        promotions: Promotions,
    ) -> None:
        self.mode = mode
        self.groups = config.layout.groups
        self.bpc = config.blocks_per_chunk
        self.spans = config.tokens_per_chunk
        self.index = index
        self.retention = retention
        self.jobs = jobs
        self.stats = stats
        self.misses = misses
        self.promotions = promotions
        #: This step's in-step loads of a recurrent state, until :meth:`aim_states`.
        self._unaimed: list[JobState] = []

    def offer(self, req: RequestState, req_id: str, hit: Hit) -> int | None:
        """Settle how ``hit`` loads; the tokens offered beyond the engine's hit, or ``None``.

        ``None`` (vLLM: ask again at a later step) where a chunk it needs is in
        flight, or its lower-tier chunks are being promoted first: the next lookup
        finds them in the CPU tier, where planning now would have to fail them or load
        them over later steps.
        """
        local = req.local_hit
        if hit.tokens <= local:
            return 0
        if hit.pending:
            return None
        if (
            self.mode is HitLoading.PROMOTE_FIRST
            and hit.found_in
            and self.promotions.promote(req, req_id, hit)
        ):
            return None
        req.offered, req.tail_keys, req.found_in = hit.tokens, hit.tail, hit.found_in
        # Any lower-tier chunk the lookup found, the hit's or past it, loads it later.
        req.in_step = self.mode is not HitLoading.LATER and not hit.found_in
        return hit.tokens - local

    def plan(
        self, req: RequestState, req_id: str, block_ids: Sequence[Sequence[int]], num_external: int
    ) -> TransferOrder | None:
        """Pin and reserve what ``req`` 's offered hit needs and queue its load order.

        ``block_ids`` are the request's engine blocks per group after vLLM's
        allocation, ``num_external`` the tokens vLLM accepted of the offer.
        """
        if not req.use_recorded:  # vLLM's own prefix-cache hits included
            used, served = self.retention.used(req)
            if req.tail_keys:  # a tail ends the chain it used
                used = [*used, *req.tail_keys]
            record_use(self.index, used, served)
            req.use_recorded = True
        if num_external <= 0 or not req.offered:
            # vLLM's own prefix-cache blocks (null ones are skipped later).
            req.mark_valid(0, req.local_hit)
            return None
        # The hit point is what lookup checked; vLLM may have moved the local/external split.
        hit = req.offered
        req.mark_valid(0, hit - num_external)
        groups, keys = self.groups, req.keys
        if req.tail_keys:  # a hit at a tail: its keys end with the tail's
            keys = with_tail(keys, req.tail_keys, hit, self.spans)
        pieces = load_pieces(groups, keys, block_ids, (hit - num_external, hit), self.bpc)
        slots, lost, job = self._reserve([k for p in pieces for k in p.keys], req.tenant)
        lost |= stateless(pieces, groups, block_ids)  # a state needs its block: fail, not skip
        spans, unloadable = load_spans(pieces, block_ids, slots, lost, self.bpc, groups=groups)
        order = self.jobs.order(req_id, JobKind.LOAD, spans, unloadable, in_step=req.in_step)
        job.order, job.tokens = order, num_external
        if req.in_step and any(groups[s.group].reuse is Reuse.STATE for s in spans):
            self._unaimed.append(job)
        # A chunk promoted for this hit counts for the tier it was promoted from.
        came_from = req.promotion or {}
        tiers = [came_from.get(k, "cpu") for k in job.pinned]
        tiers += [req.found_in.get(k, "lower") for k in job.promoted]
        job.tiers = tier_shares(num_external, tiers)
        job.ranges = tuple(
            (p.group, p.first * groups[p.group].tokens_per_block, hit) for p in pieces
        )
        self.jobs.queue(req, job)
        stats = self.stats
        stats.add_by_tier(stats.hit_tokens_by_tier, job.tiers)
        stats.hit_requests += 1
        stats.hit_tokens += num_external
        stats.in_step_hit_tokens += num_external if req.in_step else 0
        promoted_first = sum(k in came_from for k in job.pinned)
        stats.cpu_hit_chunks += len(job.pinned) - promoted_first
        stats.lower_hit_chunks += len(job.promoted) + promoted_first
        stats.unloadable_chunks += len(lost)
        return order

    def aim_states(self, steps: Iterable[StepRequest]) -> None:
        """Point this step's in-step loads of a state also at the block the forward pass reads.

        vLLM (``mamba_cache_mode="align"``) runs a request's state in the block
        of its step's last token, ``ceil((computed + scheduled) / block) - 1``,
        and fills it from the hit's state block before the connector's
        ``start_load_kv``: before a load in the step lands (measured: the tokens
        of a zeroed state). So the worker writes the state into that block as
        well (``TransferOrder.running_states``). Known only now: vLLM says what
        it scheduled after it allocated the blocks the load was planned for.
        """
        if not self._unaimed:
            return
        by_id = {step.req_id: step for step in steps}
        for job in self._unaimed:
            step = by_id.get(job.order.req_id)
            if step is None:  # not run in this step: no forward pass reads the state
                continue
            running: dict[int, int] = {}
            for span in job.order.spans:
                group = self.groups[span.group]
                if group.reuse is not Reuse.STATE:
                    continue
                ids = step.block_ids[span.group]
                at = -(-(step.computed + step.scheduled) // group.tokens_per_block) - 1
                if 0 <= at < len(ids) and ids[at] not in (NULL_BLOCK, *span.blocks.block_ids):
                    running[span.group] = ids[at]
            if running:
                self.jobs.revise(job, replace(job.order, running_states=running))
        self._unaimed.clear()

    def _reserve(
        self, keys: list[bytes], tenant: str | None
    ) -> tuple[dict[bytes, int], set[bytes], JobState]:
        """Slots for ``keys``: pins for CPU-resident ones, promotion slots for the rest.

        Returns key -> slot, the keys that got no slot, and a job holding the
        pins and reservations until its report completes them.
        """
        index = self.index
        mask = index.ready_mask(keys)
        if all(mask):  # the common load: all of it in the CPU tier
            resident, lower = keys, []
        else:
            resident = [key for key, ok in zip(keys, mask, strict=True) if ok]
            lower = [key for key, ok in zip(keys, mask, strict=True) if not ok]
        slots = dict(zip(resident, index.prepare_load(resident).slots, strict=True))
        promoted: tuple[bytes, ...] = ()
        if lower:
            reserved = self.promotions.reserve(lower, tenant)
            if reserved is not None:
                promoted = reserved.keys
                slots.update(zip(reserved.keys, reserved.slots, strict=True))
        lost = set(lower) - set(promoted)
        placeholder = TransferOrder(0, "", JobKind.LOAD, ())
        return slots, lost, JobState(placeholder, pinned=tuple(resident), promoted=promoted)

    def complete(self, req: RequestState | None, job: JobState, report: JobReport) -> None:
        """Every rank reported the load: unpin, record promotions, count, mark KV valid.

        A promoted chunk is stored in the CPU tier only where every rank promoted it.
        """
        self.index.complete_load(job.pinned)
        self.promotions.record(req, job, report)
        stats = self.stats
        stats.loads += 1
        if not report.ok:
            stats.failed_loads += 1
            if req is not None:
                req.failed_loads += 1
            stats.failed_load_tokens += job.tokens
            self.misses.count(MissReason.FAILED_LOAD, job.tokens)
            return
        stats.loaded_tokens += job.tokens
        stats.add_by_tier(stats.loaded_tokens_by_tier, job.tiers)
        if req is not None:
            for g, lo, hi in job.ranges:
                req.mark_valid(lo, hi, group=g)
