"""The connector's scheduler side in plain terms: hits, load plans, store plans.

An engine calls its adapter with its own objects (vLLM: :mod:`kvoffload.vllm.connector`);
the adapter turns them into token ids, block id lists and counts and calls this class,
which knows no engine and is tested without one.

**Hits** follow each group kind's rule (:mod:`kvoffload.connector._hits`): full
attention needs every chunk up to the hit point, a sliding window only the
chunks inside the window before it, a recurrent group only the state taken
at it. **Stores** keep every full-attention chunk, and window chunks and
states only for the request's hit points (:mod:`kvoffload.connector._retention`).

The work is split by what it does: the request table and its keys (``requests``), the
search for hits (``_search``), load plans (``loads``, ``promotions``), store plans
(``stores``), the misses (``misses``), the job book of orders out and reports in
(``jobs``), all modules of :mod:`kvoffload.connector`. This class is their one face. A
lookup is one pass: the request's keys, the hit (tails included), how it loads, the misses.

**What may be stored.** A chunk whose tokens are computed and whose blocks
all hold real KV (computed, served by vLLM's prefix cache, or loaded by us).
A sliding-window load skips blocks and vLLM nulls (block id 0) those it
frees, so each request keeps, per group, the token ranges known valid; a
chunk outside them or with a null block is never stored. A recurrent state
is in the block ending at its boundary only from the end of the step that
reached it to the end of the next one: stored then or never, and with
speculative decoding only where a step without draft tokens reached it
(:mod:`kvoffload.connector._drafts`).

**Blocks are never reused under a store.** The worker side finishes every
store's copy out of the engine's blocks before the step's output reaches
vLLM (see :mod:`kvoffload.connector.worker`), so a finished request's blocks may
be freed at once (``request_finished`` answers false) and its orders are
completed here whenever their reports arrive.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

from kvoffload.config import OffloadConfig
from kvoffload.connector._request import StepRequest
from kvoffload.connector._retention import Retention
from kvoffload.connector._search import HitFinder
from kvoffload.connector._tails import Tails
from kvoffload.connector.handoffs import Handoffs
from kvoffload.connector.hints import RetentionHints
from kvoffload.connector.jobs import JobBook
from kvoffload.connector.key_source import engine_keys_refusal
from kvoffload.connector.loads import HitLoading, LoadPlanner
from kvoffload.connector.misses import MissLedger, MissReason
from kvoffload.connector.promotions import Promotions
from kvoffload.connector.queued import QueuedHolds, WaitingFetches
from kvoffload.connector.requests import RequestTable
from kvoffload.connector.stats import SchedulerStats
from kvoffload.connector.stores import StorePlanner
from kvoffload.errors import ConfigError
from kvoffload.keys import EngineHashes, KeyExtras
from kvoffload.manager.index import OffloadIndex
from kvoffload.manager.results import IndexEvent
from kvoffload.messages import JobKind, JobReport, TransferOrder
from kvoffload.tiers.base import TierProbe
from kvoffload.tiers.handoff import HandoffBoard

__all__ = ["MAX_FAILED_LOADS", "HitLoading", "OffloadScheduler", "StepRequest", "TierProbe"]

#: Failed loads after which a request is offered nothing more: vLLM starts a request whose
#: load failed over, lookup included, and a chunk that fails every time (only a bug can
#: make one) would have it retried forever.
MAX_FAILED_LOADS = 2

logger = logging.getLogger("kvoffload")


class OffloadScheduler:
    """Plans loads and stores of one engine's requests over the offload index.

    ``probes`` are the lower tiers as the scheduler side sees them (see
    :class:`TierProbe`); ``world_size`` ranks report every order. With
    ``engine_hashes``, keys are made from the block hashes every lookup and
    step hands in; without, from the token ids. ``hit_loading`` says when a
    hit's chunks are copied into the engine's blocks (:class:`HitLoading`;
    the adapter decides it with :func:`~kvoffload.connector.loads.hit_loading`
    from the key ``load_in_step`` and from what its engine can recompute).
    ``handoff``: a producer's or a consumer's marks in the shared tiers
    (:func:`~kvoffload.tiers.handoff.handoff_board`), which it then owns. ``clock``:
    the seconds that queued holds and retention hints last in (a replay's simulated time).
    """

    def __init__(
        self,
        config: OffloadConfig,
        namespace: bytes,
        probes: Sequence[TierProbe] = (),
        *,
        world_size: int = 1,
        engine_hashes: EngineHashes | None = None,
        hit_loading: HitLoading = HitLoading.LATER,
        handoff: HandoffBoard | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if engine_hashes is not None:
            for span in config.tokens_per_chunk:
                engine_hashes.check_span(span)
            if config.layout.lookahead:
                raise ConfigError(engine_keys_refusal(config.layout.lookahead))
        self.config = config
        self.layout = layout = config.layout
        self.index = index = OffloadIndex.from_config(config)
        self.probes = tuple(probes)
        #: Hits land on multiples of this many tokens (every group's chunk boundary).
        self.alignment = config.hit_alignment
        self.namespace = namespace
        self.tails = Tails(config, namespace, engine_hashes)
        self.retention = Retention(config, trail_step=self.tails.block)
        self.hits = HitFinder(
            layout,
            config.tokens_per_chunk,
            index,
            self.probes,
            alignment=self.alignment,
            tails=self.tails,
        )
        self.requests = RequestTable(
            config.tokens_per_chunk,
            namespace,
            plain=self.retention.plain,
            alignment=self.alignment,
            engine_hashes=engine_hashes,
            lookahead=layout.lookahead,
        )
        self.jobs = JobBook(world_size)
        self._stats = SchedulerStats()
        self.misses = MissLedger.from_config(config)
        self.stores, self.promotions, self.loads = self._planners(config, hit_loading)
        self.queued = QueuedHolds.from_config(config, index, self._stats, clock=clock)
        fetching = config.fetch_while_queued and bool(self.probes)
        self.fetches = WaitingFetches(
            self.requests, self.hits, self.promotions, self.queued, self._stats, enabled=fetching
        )
        self.handoffs = Handoffs.from_config(config, handoff, self._stats, self.tails)
        self.hints = RetentionHints.from_config(config, index, self._stats, clock=clock)

    def _planners(
        self, config: OffloadConfig, hit_loading: HitLoading
    ) -> tuple[StorePlanner, Promotions, LoadPlanner]:
        """What plans and completes the jobs, over the index, books and counters above."""
        index, retention, jobs = self.index, self.retention, self.jobs
        stats, misses = self._stats, self.misses
        stores = StorePlanner(
            config,
            index=index,
            retention=retention,
            jobs=jobs,
            stats=stats,
            requests=self.requests,
            misses=misses,
            tails=self.tails,
        )
        promotions = Promotions(
            needs=self.hits.needs,
            index=index,
            retention=retention,
            jobs=jobs,
            stats=stats,
            misses=misses,
        )
        loads = LoadPlanner(
            config,
            hit_loading,
            index=index,
            retention=retention,
            jobs=jobs,
            stats=stats,
            misses=misses,
            promotions=promotions,
        )
        return stores, promotions, loads

    # -- arrivals and lookups ------------------------------------------------------
    def request_queued(
        self,
        req_id: str,
        token_ids: Sequence[int],
        extras: KeyExtras | None = None,
        block_hashes: Sequence[bytes] | None = None,
        *,
        fetch: bool = True,
    ) -> None:
        """vLLM's ``on_new_request``: if a step leaves the request waiting, hold the CPU-tier
        chunks it will hit until it runs, and with ``fetch`` read in its lower-tier ones
        (:mod:`~kvoffload.connector.queued`). Its keys are made once, here."""
        if not self.queued.limit:
            return
        req = self.requests.arrived(req_id, token_ids, extras, block_hashes)
        if fetch:
            self.fetches.arrived(req_id, token_ids, block_hashes)
        self.queued.arrived(req_id, req.keys)

    def read_hint(self, req_id: str, params: object) -> None:
        """A client's retention hint in the request's ``kv_transfer_params`` (``hints``)."""
        self.hints.read(self.requests.get(req_id), params)  # known after its first lookup

    def lookup(
        self,
        req_id: str,
        token_ids: Sequence[int],
        local_hit: int,
        extras: KeyExtras | None = None,
        block_hashes: Sequence[bytes] | None = None,
    ) -> int | None:
        """Tokens beyond ``local_hit`` the tiers can serve: 0, ``H - local_hit``, or ``None``.

        ``extras`` is what the request's KV depends on besides ``token_ids``
        (salt, LoRA adapter, multimodal inputs, embeddings): it goes into
        every key of the request, here and when its chunks are stored.
        ``block_hashes``: the engine's hashes of the request's blocks (vLLM's
        ``request.block_hashes``), needed with ``engine_hashes``.

        ``None`` (vLLM: ask again at a later step) when the best hit needs a
        chunk another job is storing or promoting right now, or has its
        lower-tier chunks promoted first (:attr:`HitLoading.PROMOTE_FIRST`):
        waiting turns it into a CPU hit, where planning now would have to fail
        it. A consumer's also while a producer is storing chunks past the hit
        (:mod:`~kvoffload.connector.handoffs`). Free of side effects on the
        index and the tiers (but for such a promotion), as vLLM asks (it may
        call twice); it remembers the request's keys and what it offered.
        """
        self._stats.lookups += 1
        lookup = self.requests.lookup(req_id, token_ids, local_hit, extras, block_hashes)
        if not self.config.loads:  # a kv_producer computes its prompts, for other engines
            return 0
        req = lookup.req
        if req.failed_loads >= MAX_FAILED_LOADS:  # the engine computes it from here on
            self.misses.count(MissReason.FAILED_LOAD, lookup.top - local_hit)
            return 0
        hit = self.hits.find(lookup)
        served = local_hit if hit is None else max(hit.tokens, local_hit)
        if self.handoffs is not None and self.handoffs.waits(lookup, served):
            return None  # a producer is storing what lies past the hit: ask again
        if hit is None:
            return 0
        req.junction = hit.prefix_end  # a hit point its window chunks are kept for
        offered = self.loads.offer(req, req_id, hit)
        if offered is None:
            self._stats.deferred_lookups += 1
            return None
        if hit.tokens < lookup.top:
            self.misses.count_lookup(req.keys, local_hit, lookup.top, hit)
        return offered

    def loads_in_step(self, req_id: str) -> bool:
        """Whether the last lookup's hit loads in the step that asks for it.

        True when every chunk it needs is in the CPU tier (and the adapter
        allows it): the engine may then schedule the request's remaining
        tokens at once, as for a hit in its own cache, and the worker copies
        the chunks in before the forward pass reads them. They cannot go
        meanwhile: the engine allocates the request's blocks and plans its
        load (:meth:`plan_load`, which pins them) before it looks anything
        else up. A hit that needs a lower tier loads over later steps.
        """
        req = self.requests.get(req_id)
        return req is not None and req.in_step

    def loads_from_lower_tier(self, req_id: str) -> bool:
        """Whether the last lookup's hit needs chunks the disk or remote tier holds.

        Such a load reads a lower tier, over later steps. It is a hint: true too
        where the lookup found a lower-tier chunk past the hit.
        """
        req = self.requests.get(req_id)
        return req is not None and bool(req.offered) and bool(req.found_in)

    # -- loads and stores -----------------------------------------------------------
    def plan_load(
        self, req_id: str, block_ids: Sequence[Sequence[int]], num_external: int
    ) -> TransferOrder | None:
        """Pin and reserve what the offered hit needs and queue its load order.

        ``block_ids`` are the request's engine blocks per group after vLLM's
        allocation, ``num_external`` the tokens vLLM accepted of the offer.
        Chunks that turned out unservable (no CPU slot could be reserved for
        their promotion) go into the order as ``unloadable``: the worker
        reports them failed and vLLM recomputes them.
        """
        self.queued.release(req_id)  # scheduled: its load pins what it needs
        self.fetches.left(req_id)
        req = self.requests.get(req_id)
        if req is None:
            return None
        return self.loads.plan(req, req_id, block_ids, num_external)

    def plan_step(
        self, scheduled: Iterable[StepRequest], preempted: Iterable[str] = ()
    ) -> list[TransferOrder]:
        """vLLM's ``build_connector_meta``: the stores of what ``scheduled`` computes now
        (after ``preempted`` lost their blocks), with the loads planned since the last step.
        """
        for req_id in preempted:
            self.preempted(req_id)
        plan, steps = self.stores.plan, list(scheduled)
        self.queued.step()  # those scheduled left the queue in plan_load
        self.fetches.fetch()
        self.hints.expire()
        if self.config.stores:  # not a kv_consumer's, unless it writes back
            for step in steps:
                plan(step)
        self.loads.aim_states(steps)
        stored, loaded = self._stats.stored_chunks, self._stats.loaded_tokens
        if not self.misses.warned and self.config.loads and stored and not loaded:
            advice = self.misses.advice(stored, loaded)
            if advice is not None:
                logger.warning(advice)
        return self.take_orders()

    # -- reports and lifecycle ----------------------------------------------------------
    def take_orders(self) -> list[TransferOrder]:
        """Orders queued since the last call, for this step's connector metadata (a producer
        marks its stores' chunks here, before its output leaves: ``handoffs``)."""
        orders = self.jobs.take_orders()
        if self.handoffs is not None:
            self.handoffs.mark(orders)
        return orders

    def on_report(self, report: JobReport) -> None:
        """Fold one worker report in; a job completes once every rank reported it."""
        job = self.jobs.fold(report)
        if job is None or job.report is None:
            return
        order = job.order
        req = self.requests.get(order.req_id)
        if order.kind is JobKind.LOAD:
            self.loads.complete(req, job, job.report)
        elif order.kind is JobKind.PROMOTE:
            done = self.promotions.complete(req, job, job.report)
            self.fetches.landed(order.req_id, done)
        else:
            self.stores.complete(req, job, job.report)
            if req is not None and req.finished:  # its last stores: a hint applies to them
                self.hints.apply(req, order.keys)
            if self.handoffs is not None:
                self.handoffs.unmark(order)
        self.requests.release(order.req_id, order.job_id)

    def request_finished(self, req_id: str) -> None:
        """Forget the request once its orders are reported; its blocks may be freed now."""
        self.queued.release(req_id)  # aborted while queued, or done
        self.fetches.left(req_id)
        req = self.requests.get(req_id)
        if req is not None:
            req.finished = True
            self.stores.finish(req, req_id)
            self.hints.apply(req)
            self.requests.release(req_id, None)

    def preempted(self, req_id: str) -> None:
        """The request lost its blocks: nothing in them is known valid any more."""
        req = self.requests.get(req_id)
        if req is not None:
            req.forget_blocks()

    def reset(self) -> bool:
        """Drop every CPU chunk no job is using (vLLM's ``reset_prefix_cache`` with the connector);
        lower tiers keep theirs: they are shared (a remote server) or outlive the process (disk).
        """
        self.index.reset()
        self.queued.clear()
        self.hints.clear()
        self._stats.resets += 1
        return True

    def keys_for(
        self,
        token_ids: Sequence[int],
        extras: KeyExtras | None = None,
        block_hashes: Sequence[bytes] | None = None,
    ) -> list[list[bytes]]:
        """Per group, the keys this scheduler gives the full chunks of a request (as
        :meth:`lookup` and :meth:`plan_step` make them), without tracking it."""
        return self.requests.keys_for(token_ids, extras, block_hashes)

    def take_events(self) -> list[IndexEvent]:
        return self.index.take_events()

    def stats(self) -> dict[str, int | dict[str, int]]:
        """Counters since start: offered and loaded tokens (also by tier), stores, index state."""
        return self._stats.report(self.index, self.misses, len(self.jobs), len(self.requests))

    def close(self) -> None:
        for probe in self.probes:
            probe.close()
        if self.handoffs is not None:
            self.handoffs.board.close()
