"""The connector's scheduler side in plain terms: hits, load plans, store plans.

vLLM calls the connector with its own objects; :mod:`kvoffload.vllm.connector`
turns them into token ids, block id lists and counts and calls this class,
which knows nothing of vLLM and is tested without it.

**Hits** follow each group kind's rule (:mod:`kvoffload.connector._hits`): full
attention needs every chunk up to the hit point, a sliding window only the
chunks inside the window before it, a recurrent group only the state taken
at it. **Stores** keep every full-attention chunk, and window chunks and
states only for the request's hit points (:mod:`kvoffload.connector._retention`).

**Keys.** Each request's chunk keys are made once, as its tokens become
known: from its token ids, or, given the engine's ``engine_hashes``, from
vLLM's own block hashes of the request (:func:`~kvoffload.keys.extend_engine_keys`;
the connector chooses by the ``key_source`` key).

**What may be stored.** A chunk whose tokens are computed and whose blocks
all hold real KV (computed, served by vLLM's prefix cache, or loaded by us).
A sliding-window load skips blocks and vLLM nulls (block id 0) those it
frees, so each request keeps, per group, the token ranges known valid; a
chunk outside them or with a null block is never stored. A recurrent state
is in the block ending at its boundary only from the end of the step that
reached it to the end of the next one: stored then or never.

**Blocks are never reused under a store.** The worker side finishes every
store's copy out of the engine's blocks before the step's output reaches
vLLM (see :mod:`kvoffload.connector.worker`), so a finished request's blocks may
be freed at once (``request_finished`` answers false) and its orders are
completed here whenever their reports arrive.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from kvoffload.config import OffloadConfig
from kvoffload.config.layout import Reuse
from kvoffload.connector._hits import HitFinder
from kvoffload.connector._request import JobState, RequestState, StepRequest, tier_shares
from kvoffload.connector._retention import Choice, Chosen, Retention, Selection, Trails
from kvoffload.connector._spans import (
    StorePiece,
    load_pieces,
    load_spans,
    run_spans,
    stateless,
    store_spans,
)
from kvoffload.errors import ProtocolError
from kvoffload.keys import EngineHashes, KeyExtras
from kvoffload.manager.offload_manager import OffloadManager
from kvoffload.manager.results import IndexEvent, StoreResult
from kvoffload.manager.usage import record_stores, record_use
from kvoffload.messages import ChunkSpan, JobKind, JobReport, TransferOrder, merge_reports
from kvoffload.tiers.base import TierProbe

__all__ = ["OffloadScheduler", "StepRequest", "TierProbe"]


class OffloadScheduler:
    """Plans loads and stores of one engine's requests over the offload index.

    ``probes`` are the lower tiers as the scheduler side sees them (see
    :class:`TierProbe`); ``world_size`` ranks report every order. With
    ``engine_hashes``, keys are made from the block hashes every lookup and
    step hands in; without, from the token ids.
    """

    def __init__(
        self,
        config: OffloadConfig,
        namespace: bytes,
        probes: Sequence[TierProbe] = (),
        *,
        world_size: int = 1,
        engine_hashes: EngineHashes | None = None,
    ) -> None:
        if engine_hashes is not None:
            for span in config.tokens_per_chunk:
                engine_hashes.check_span(span)
        self.engine_hashes = engine_hashes
        self.config = config
        self.namespace = namespace
        self.index = OffloadManager.from_config(config)
        self.probes = tuple(probes)
        self.world_size = world_size
        self.layout = config.layout
        self.bpc = config.blocks_per_chunk
        self.tokens_per_chunk = config.tokens_per_chunk
        #: Hits land on multiples of this many tokens (every group's chunk boundary).
        self.alignment = config.hit_alignment
        self.hits = HitFinder(self.layout, self.tokens_per_chunk, self.index, self.probes)
        self.retention = Retention(config)
        #: Whether some group keeps only some chunks (windows, states): those may trail.
        self._windowed = any(g.reuse is not Reuse.PREFIX for g in self.layout.groups)
        self._prompt_only = config.offload_prompt_only
        self.trails = Trails(self.index)
        self._requests: dict[str, RequestState] = {}
        self._jobs: dict[int, JobState] = {}
        self._orders: list[TransferOrder] = []
        self._next_job = 1
        self._figures = dict.fromkeys(
            ("lookups", "deferred_lookups", "hit_requests", "hit_tokens", "loaded_tokens",
             "failed_load_tokens", "loads", "failed_loads", "unloadable_chunks", "stores",
             "stored_chunks", "failed_store_chunks", "skipped_store_chunks", "cpu_hit_chunks",
             "lower_hit_chunks", "unretained_chunks", "dropped_chunks", "no_room_chunks",
             "resets"),
            0)  # fmt: skip
        #: hit_tokens / loaded_tokens -> tier -> tokens (see ``tier_shares``).
        self._by_tier: dict[str, dict[str, int]] = {"hit_tokens": {}, "loaded_tokens": {}}

    # -- lookups ------------------------------------------------------------------
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
        chunk another job is storing or promoting right now: waiting a step
        turns it into a CPU hit, where planning now would have to fail it.
        Free of side effects on the index and the tiers, as vLLM asks (it may
        call twice); it remembers the request's keys and what it offered.
        """
        self._figures["lookups"] += 1
        req = self._request(req_id, extras)
        top = self._keyable(len(token_ids) - 1, block_hashes)  # one token is computed
        top = top // self.alignment * self.alignment
        req.local_hit, req.offered, req.use_recorded = local_hit, 0, False
        # Keys even when vLLM's own cache serves everything: plan_load records their use.
        self._extend_keys(req, token_ids, block_hashes, top)
        if top <= local_hit:
            return 0
        hit = self.hits.find(req.keys, local_hit, top, self.alignment)
        req.found_in = self.hits.found_in
        req.junction = hit.prefix_end
        if hit.tokens <= local_hit:
            return 0
        if hit.pending:
            self._figures["deferred_lookups"] += 1
            return None
        req.offered = hit.tokens
        return hit.tokens - local_hit

    # -- loads ----------------------------------------------------------------------
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
        req = self._requests.get(req_id)
        if req is None:
            return None
        if not req.use_recorded:  # vLLM's own prefix-cache hits included
            record_use(self.index, *self.retention.used(req))
            req.use_recorded = True
        if num_external <= 0 or not req.offered:
            # vLLM's own prefix-cache blocks (null ones are skipped later).
            req.mark_valid(0, req.local_hit)
            return None
        # The hit point is what lookup checked; vLLM may have moved the local/external split.
        hit = req.offered
        local = hit - num_external
        req.mark_valid(0, local)
        groups = self.layout.groups
        pieces = load_pieces(groups, req.keys, block_ids, (local, hit), self.bpc)
        slots, lost, job = self._reserve([k for p in pieces for k in p.keys], req.tenant)
        lost |= stateless(pieces, groups, block_ids)  # a state needs its block: fail, not skip
        spans, unloadable = load_spans(pieces, block_ids, slots, lost, self.bpc, groups=groups)
        order = TransferOrder(self._new_job_id(), req_id, JobKind.LOAD, spans, unloadable)
        job.order, job.tokens = order, num_external
        tiers = ["cpu"] * len(job.pinned) + [req.found_in.get(k, "lower") for k in job.promoted]
        job.tiers = tier_shares(num_external, tiers)
        self._count_tiers("hit_tokens", job.tiers)
        job.ranges = tuple(
            (p.group, p.first * self.layout.groups[p.group].tokens_per_block, hit) for p in pieces
        )
        self._queue(req, job)
        figures = self._figures
        figures["hit_requests"] += 1
        figures["hit_tokens"] += num_external
        figures["cpu_hit_chunks"] += len(job.pinned)
        figures["lower_hit_chunks"] += len(job.promoted)
        figures["unloadable_chunks"] += len(lost)
        return order

    def _reserve(
        self, keys: list[bytes], tenant: str | None
    ) -> tuple[dict[bytes, int], set[bytes], JobState]:
        """Slots for ``keys``: pins for CPU-resident ones, promotion slots for the rest.

        Returns key -> slot, the keys that got no slot, and a job holding the
        pins and reservations until its report completes them.
        """
        mask = self.index.ready_mask(keys)
        if all(mask):  # the common load: all of it in the CPU tier
            resident, lower = keys, []
        else:
            resident = [key for key, ok in zip(keys, mask, strict=True) if ok]
            lower = [key for key, ok in zip(keys, mask, strict=True) if not ok]
        slots = dict(zip(resident, self.index.prepare_load(resident).slots, strict=True))
        promoted: tuple[bytes, ...] = ()
        if lower:
            reserved = self.index.prepare_store(lower, admit_all=True, tenant=tenant)
            if reserved is not None:
                promoted = reserved.keys
                slots.update(zip(reserved.keys, reserved.slots, strict=True))
        lost = set(lower) - set(promoted)
        placeholder = TransferOrder(0, "", JobKind.LOAD, ())
        return slots, lost, JobState(placeholder, pinned=tuple(resident), promoted=promoted)

    # -- stores -----------------------------------------------------------------------
    def plan_step(
        self, scheduled: Iterable[StepRequest], preempted: Iterable[str] = ()
    ) -> list[TransferOrder]:
        """vLLM's ``build_connector_meta``: the stores of what ``scheduled`` computes now
        (after ``preempted`` lost their blocks), with the loads planned since the last step.
        """
        for req_id in preempted:
            self.preempted(req_id)
        for step in scheduled:
            self._plan_store(step)
        return self.take_orders()

    def plan_store(
        self,
        req_id: str,
        token_ids: Sequence[int],
        *,
        computed: int,
        scheduled: int,
        block_ids: Sequence[Sequence[int]],
        num_prompt_tokens: int,
        states: Collection[tuple[int, int, int]] = (),
        block_hashes: Sequence[bytes] | None = None,
    ) -> TransferOrder | None:
        """Queue a store of the chunks this step completes (tokens ``computed + scheduled``).

        Called for every scheduled request at every step; the worker runs the
        order after the step's forward pass, when those tokens' KV is written.
        ``states`` are ``(group, block id, tokens)`` of recurrent states vLLM
        reports its forward pass writes besides the one at the step's end
        (vLLM's ``boundary_state_offloads``); the states after ``computed``
        and after ``computed + scheduled`` tokens are found without it.
        ``block_hashes`` as in :meth:`lookup`.
        """
        return self._plan_store(StepRequest(req_id, token_ids, computed, scheduled, block_ids,
                                            num_prompt_tokens, states, block_hashes))  # fmt: skip

    def _plan_store(self, step: StepRequest) -> TransferOrder | None:
        req_id, computed, block_hashes = step.req_id, step.computed, step.block_hashes
        req = self._request(req_id)
        end = min(computed + step.scheduled, len(step.token_ids))
        req.mark_valid(computed, end)
        if self._prompt_only:
            end = min(end, step.num_prompt_tokens)
        end = self._keyable(end, block_hashes)
        req.prompt_tokens = step.num_prompt_tokens
        self._extend_keys(req, step.token_ids, block_hashes, end)
        moved = self.retention.advance(req, end)
        run = self.retention.plain_run(req, step.block_ids[0], end)
        if run is not None:  # a plain layout's common step: every new chunk, at once
            return self._store_run(req, req_id, run, step.block_ids[0]) if run else None
        selection = self.retention.select(req, step.block_ids, (computed, end), step.states)
        if selection.invalid or selection.unretained:
            self._figures["skipped_store_chunks"] += selection.invalid + selection.unretained
            self._figures["unretained_chunks"] += selection.unretained
        if self._windowed:  # only window chunks and states are ever trailed
            self.trails.keep(
                req.keys[c.group][c.chunk] for c in selection.chosen if c.choice is Choice.KEEP
            )
        order = self._store(req, req_id, selection) if selection else None
        if moved and self._windowed:  # only window chunks and states trail a point
            still = self.retention.point_chunks(req, req.trail)
            self._figures["dropped_chunks"] += self.trails.release(req, req_id, still)
            if self.retention.is_point(req, req.trail):
                self.trails.finish(req, req_id)  # the trailing point is a lasting one
        return order

    def _store(self, req: RequestState, req_id: str, selection: Selection) -> TransferOrder | None:
        """Reserve CPU slots for the selected chunks (as many as fit) and queue their store."""
        keys, chosen = self._candidates(req, selection)
        reserved, n = self._reserve_slots(keys, req.tenant)
        for c in chosen[n:]:
            if self.layout.groups[c.group].reuse is not Reuse.STATE:
                req.retry[c.group].add(c.chunk)  # no room now (stores in flight): next step
        if self._windowed:
            new = set(reserved.keys) if reserved is not None else set()
            trailing = [k for k, c in zip(keys, chosen, strict=True) if c.choice is Choice.TRAIL]
            self.trails.hold(req, req_id, trailing, new)
        if reserved is None or not reserved.keys:
            return None
        position = {key: i for i, key in enumerate(keys)}
        spans = store_spans([
            StorePiece(c.group, c.chunk, key, slot, c.blocks)
            for key, slot in zip(reserved.keys, reserved.slots, strict=True)
            for c in (chosen[position[key]],)
        ])  # fmt: skip
        return self._queue_store(req, req_id, spans)

    def _store_run(
        self, req: RequestState, req_id: str, run: range, blocks: Sequence[int]
    ) -> TransferOrder | None:
        """:meth:`_store` for a plain step's chunks ``run``, in the one group's ``blocks``."""
        keys = req.keys[0][run.start : run.stop]
        reserved, n = self._reserve_slots(keys, req.tenant)
        req.retry[0].update(run[n:])  # no room now (stores in flight): next step
        if reserved is None or not reserved.keys:
            return None
        if len(reserved.keys) == len(keys):
            chunks = list(run)
        else:  # admission turned some away; the others keep their order
            position = {key: i for i, key in enumerate(keys)}
            chunks = [run.start + position[key] for key in reserved.keys]
        spans = run_spans(0, chunks, reserved.keys, reserved.slots, blocks,
                          blocks_per_chunk=self.bpc)  # fmt: skip
        return self._queue_store(req, req_id, spans, chunks)

    def _reserve_slots(
        self, keys: Sequence[bytes], tenant: str | None
    ) -> tuple[StoreResult | None, int]:
        """Slots for as many leading ``keys`` as the index can take now, and how many were asked.

        Stores in flight hold slots no eviction can free: if all of ``keys``
        do not fit, half of them are asked, and so on (``None``, 0: none fit).
        """
        index = self.index
        n = min(len(keys), index.room())
        while n > 0:
            reserved = index.prepare_store(keys if n == len(keys) else keys[:n], tenant=tenant)
            if reserved is not None:
                return reserved, n
            n //= 2
        return None, 0

    def _queue_store(
        self,
        req: RequestState,
        req_id: str,
        spans: tuple[ChunkSpan, ...],
        chunks: Sequence[int] = (),
    ) -> TransferOrder:
        """Queue a store of ``spans`` (``chunks``: its chunk indices, for a plain layout)."""
        order = TransferOrder(self._new_job_id(), req_id, JobKind.STORE, spans)
        self._queue(req, JobState(order, chunks=chunks))
        self._figures["stores"] += 1
        return order

    # -- reports and lifecycle ----------------------------------------------------------
    def take_orders(self) -> list[TransferOrder]:
        """Orders queued since the last call, for this step's connector metadata."""
        orders, self._orders = self._orders, []
        return orders

    def on_report(self, report: JobReport) -> None:
        """Fold one worker report in; a job completes once every rank reported it."""
        job = self._jobs.get(report.job_id)
        if job is None:
            return
        job.report = report if job.report is None else merge_reports(job.report, report)
        if job.report.workers >= self.world_size:
            del self._jobs[report.job_id]
            self._complete(job, job.report)

    def _complete(self, job: JobState, report: JobReport) -> None:
        order, index, figures = job.order, self.index, self._figures
        failed = report.failed_keys
        req = self._requests.get(order.req_id)
        if order.kind is JobKind.LOAD:
            index.complete_load(job.pinned)
            everywhere = {k for k, ranks in report.promoted.items() if ranks >= self.world_size}
            unpromoted = {k for k in job.promoted if k in failed or k not in everywhere}
            self._stored(req, job, job.promoted, unpromoted)
            figures["loads"] += 1
            if report.ok:
                figures["loaded_tokens"] += job.tokens
                self._count_tiers("loaded_tokens", job.tiers)
                if req is not None:
                    for g, lo, hi in job.ranges:
                        req.mark_valid(lo, hi, group=g)
            else:
                figures["failed_loads"] += 1
                figures["failed_load_tokens"] += job.tokens
        else:
            keys = order.keys
            lost = failed.intersection(keys) if failed else frozenset()
            self._stored(req, job, keys, lost)
            figures["dropped_chunks"] += self.trails.stored(keys)
            figures["stored_chunks"] += len(keys) - len(lost)
            figures["failed_store_chunks"] += len(lost)
        self._release(order.req_id, order.job_id)

    def _stored(
        self,
        req: RequestState | None,
        job: JobState,
        keys: Sequence[bytes],
        failed: Collection[bytes],
    ) -> None:
        """Complete ``job`` 's stores (or promotions) of ``keys`` in chain order: those in
        ``failed`` failed.

        One group's ``keys`` come in chain order already (an order's spans are sorted
        by chunk), and a store knows where its first stored chunk is; other layouts'
        keys are put in that order.
        """
        first = None
        if req is None or self.retention.plain:
            chain: Sequence[bytes] = keys if req is None else req.keys[0]
            done = [k for k in keys if k not in failed] if failed else keys
            if req is not None and done and len(job.chunks) == len(keys):
                first = job.chunks[keys.index(done[0])]
        else:
            chain = self.retention.chain(req, keys)
            good = set(keys).difference(failed)
            done = [k for k in chain if k in good]
        record_stores(self.index, chain, done, [k for k in keys if k in failed], first=first)

    def request_finished(self, req_id: str) -> None:
        """Forget the request once its orders are reported; its blocks may be freed now."""
        req = self._requests.get(req_id)
        if req is not None:
            req.finished = True
            # Chunks still waiting for a CPU slot (stores in flight held them all) are never
            # stored now: vLLM frees the blocks. Counted, so an undersized tier shows.
            self._figures["no_room_chunks"] += sum(len(chunks) for chunks in req.retry)
            self.trails.finish(req, req_id)  # its trailing point is its output's end
            self._release(req_id, None)

    def preempted(self, req_id: str) -> None:
        """The request lost its blocks: nothing in them is known valid any more."""
        req = self._requests.get(req_id)
        if req is not None:
            req.forget_blocks()

    def reset(self) -> bool:
        """Drop every CPU chunk no job is using (vLLM's ``reset_prefix_cache`` with the connector);
        lower tiers keep theirs: they are shared (a remote server) or outlive the process (disk).
        """
        self.index.reset()
        self._figures["resets"] += 1
        return True

    def keys_for(
        self,
        token_ids: Sequence[int],
        extras: KeyExtras | None = None,
        block_hashes: Sequence[bytes] | None = None,
    ) -> list[list[bytes]]:
        """Per group, the keys this scheduler gives the full chunks of a request (as
        :meth:`lookup` and :meth:`plan_step` make them), without tracking it."""
        req = RequestState.empty(len(self.tokens_per_chunk), extras)
        self._extend_keys(req, token_ids, block_hashes, self._keyable(len(token_ids), block_hashes))
        return req.keys

    def take_events(self) -> list[IndexEvent]:
        return self.index.take_events()

    def figures(self) -> dict[str, int | dict[str, int]]:
        """Counters since start: offered and loaded tokens (also by tier), stores, index state."""
        out: dict[str, int | dict[str, int]] = dict(self._figures)
        out.update({f"index_{name}": value for name, value in self.index.stats().items()})
        out.update({f"{name}_by_tier": dict(tiers) for name, tiers in self._by_tier.items()})
        out["jobs_in_flight"] = len(self._jobs)
        out["requests_tracked"] = len(self._requests)
        return out

    def close(self) -> None:
        for probe in self.probes:
            probe.close()

    # -- internals ----------------------------------------------------------------------
    def _request(self, req_id: str, extras: KeyExtras | None = None) -> RequestState:
        """The request's state; created with ``extras`` at first sight (they never change)."""
        req = self._requests.get(req_id)
        if req is None:
            req = RequestState.empty(len(self.tokens_per_chunk), extras)
            self._requests[req_id] = req
        return req

    def _candidates(
        self, req: RequestState, selection: Selection
    ) -> tuple[list[bytes], list[Chosen]]:
        """The selected chunks' keys in chain order, and the chunks in the same order.

        Chain order is by chunk end in tokens: if the CPU tier has room for
        only some of them, the ones kept form a prefix in every group, which
        is what later hits need.
        """
        chosen, spans = selection.chosen, self.tokens_per_chunk
        if len(spans) > 1:  # one group's chunks come in order
            chosen.sort(key=lambda c: ((c.chunk + 1) * spans[c.group], c.group))
        return [req.keys[c.group][c.chunk] for c in chosen], chosen

    def _keyable(self, tokens: int, block_hashes: Sequence[bytes] | None) -> int:
        """How many of the first ``tokens`` tokens can be keyed: with engine keys, those the
        engine has hashed."""
        engine = self.engine_hashes
        if engine is None or block_hashes is None:
            return tokens
        return min(tokens, len(block_hashes) * engine.block_size)

    def _extend_keys(
        self,
        req: RequestState,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes] | None,
        tokens: int,
    ) -> None:
        engine = self.engine_hashes
        if engine is not None and block_hashes is None:
            raise ProtocolError(
                "this scheduler makes keys from the engine's block hashes: pass each "
                "request's block_hashes to lookup and plan_step"
            )
        if self.retention.plain and len(req.keys[0]) >= tokens // self.tokens_per_chunk[0]:
            return  # keyed already: most steps after a request's lookup
        req.extend_keys(token_ids, tokens, self.tokens_per_chunk, self.namespace,
                        engine=engine, block_hashes=block_hashes or ())  # fmt: skip

    def _count_tiers(self, name: str, tokens: dict[str, int]) -> None:
        counts = self._by_tier[name]
        for tier, n in tokens.items():
            counts[tier] = counts.get(tier, 0) + n

    def _new_job_id(self) -> int:
        job_id, self._next_job = self._next_job, self._next_job + 1
        return job_id

    def _queue(self, req: RequestState, job: JobState) -> None:
        self._jobs[job.order.job_id] = job
        req.jobs.add(job.order.job_id)
        self._orders.append(job.order)

    def _release(self, req_id: str, job_id: int | None) -> None:
        req = self._requests.get(req_id)
        if req is None:
            return
        if job_id is not None:
            req.jobs.discard(job_id)
        if req.finished and not req.jobs:
            del self._requests[req_id]
