"""Store plans: which chunks each step completes, the CPU slots they get, and their completion.

Every scheduled request is planned at every step. Full-prefix chunks are all stored;
window chunks and states only for the request's hit points
(:class:`~kvoffload.connector._retention.Retention` chooses, and owns the chunks that
wait for a later step); chunks kept only for a trailing point are tracked by
:class:`~kvoffload.connector._trails.Trails`. The CPU tier may not have room for all of a
step's chunks while stores are in flight: as many leading ones as fit are stored, in
chain order, so what is kept is always a prefix that later hits can use.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvoffload.config import OffloadConfig
from kvoffload.config.layout import Reuse
from kvoffload.connector._drafts import DraftedStates
from kvoffload.connector._request import JobState, RequestState, StepRequest
from kvoffload.connector._retention import Choice, Retention
from kvoffload.connector._selection import Chosen, Selection, Selector
from kvoffload.connector._spans import StorePiece, run_spans, store_spans
from kvoffload.connector._tails import Tails
from kvoffload.connector._trails import Trails
from kvoffload.connector.hints import steering
from kvoffload.connector.jobs import JobBook
from kvoffload.connector.misses import MissLedger
from kvoffload.connector.requests import RequestTable
from kvoffload.connector.stats import SchedulerStats
from kvoffload.manager.index import OffloadIndex
from kvoffload.manager.results import Steer, StoreResult
from kvoffload.manager.usage import record_stores
from kvoffload.messages import ChunkSpan, JobKind, JobReport, TransferOrder

__all__ = ["StorePlanner", "record_stored"]


class StorePlanner:
    """Plans and completes the stores of one scheduler's requests."""

    def __init__(
        self,
        config: OffloadConfig,
        *,
        index: OffloadIndex,
        retention: Retention,
        jobs: JobBook,
        stats: SchedulerStats,
        requests: RequestTable,
        misses: MissLedger,
        tails: Tails,
    ) -> None:
        self.layout = config.layout
        self.tails = tails
        self.bpc = config.blocks_per_chunk
        self.spans = config.tokens_per_chunk
        self.index = index
        self.requests = requests
        self.jobs = jobs
        self.stats = stats
        self.misses = misses
        self.retention = retention
        self.selector = Selector(config, retention)
        self.trails = Trails(index)
        self.drafts = DraftedStates(self.layout)
        self._prompt_only = config.offload_prompt_only
        #: Whether some group keeps only some chunks (windows, states): those may trail.
        self._windowed = any(g.reuse is not Reuse.PREFIX for g in self.layout.groups)

    def plan(self, step: StepRequest) -> TransferOrder | None:
        """Queue a store of the chunks ``step`` completes (tokens ``computed + scheduled``)."""
        req_id, computed, block_hashes = step.req_id, step.computed, step.block_hashes
        requests, retention = self.requests, self.retention
        req = requests.open(req_id)
        self.drafts.note(req, step)
        end = min(computed + step.scheduled, len(step.token_ids))
        req.mark_valid(computed, end)
        end = requests.storable(end, len(step.token_ids))
        if self._prompt_only:
            end = min(end, step.num_prompt_tokens)
        end = requests.keyable(end, block_hashes)
        req.prompt_tokens = step.num_prompt_tokens
        requests.extend_keys(req, step.token_ids, block_hashes, end)
        moved = retention.advance(req, end)
        run = self.selector.plain_run(req, step.block_ids[0], end)
        if run is not None:  # a plain layout's common step: every new chunk, at once
            return self._store_run(req, req_id, run, step.block_ids[0]) if run else None
        selection = self.selector.select(req, step.block_ids, (computed, end), step.states)
        if self.tails:
            selection.chosen.extend(self.tails.chosen(req, step, (computed, end)))
        if selection.invalid or selection.unretained or selection.drafted:
            skipped = selection.invalid + selection.unretained + selection.drafted
            self.stats.skipped_store_chunks += skipped
            self.stats.unretained_chunks += selection.unretained
            self.stats.drafted_states += selection.drafted
        if self._windowed:  # only window chunks and states are ever trailed
            self.trails.keep(c.key_in(req) for c in selection.chosen if c.choice is Choice.KEEP)
        order = self._store(req, req_id, selection) if selection else None
        if moved and self._windowed:  # only window chunks and states trail a point
            still = retention.point_chunks(req, req.trail).union(req.trail_tail)
            self.stats.dropped_chunks += self.trails.release(req, req_id, still)
            if retention.is_point(req, req.trail):
                self.trails.finish(req, req_id)  # the trailing point is a lasting one
        return order

    def _store(self, req: RequestState, req_id: str, selection: Selection) -> TransferOrder | None:
        """Reserve CPU slots for the selected chunks (as many as fit) and queue their store."""
        keys, chosen = self._candidates(req, selection)
        steer = None
        if req.hint:  # a client's retention hint: what this tier admits
            at = [(key, c.chunk) for key, c in zip(keys, chosen, strict=True)]
            steer = steering(req.hint, at, [self.spans[c.group] for c in chosen])
        reserved, n = self._reserve_slots(keys, req.tenant, self._parents(req, chosen), steer=steer)
        self.selector.retry_later(req, chosen[n:])
        if self._windowed:
            new = set(reserved.keys) if reserved is not None else set()
            trailing = [k for k, c in zip(keys, chosen, strict=True) if c.choice is Choice.TRAIL]
            self.trails.hold(req, req_id, trailing, new)
        if reserved is None or not reserved.keys:
            return None
        position = {key: i for i, key in enumerate(keys)}
        pieces = [
            StorePiece(c.group, c.chunk, key, slot, c.blocks)
            for key, slot in zip(reserved.keys, reserved.slots, strict=True)
            for c in (chosen[position[key]],)
        ]
        spans = store_spans(pieces)
        return self._queue(req, req_id, spans)

    def _store_run(
        self, req: RequestState, req_id: str, run: range, blocks: Sequence[int]
    ) -> TransferOrder | None:
        """:meth:`_store` for a plain step's chunks ``run``, in the one group's ``blocks``."""
        chain = req.keys[0]
        keys = chain[run.start : run.stop]
        after = chain[run.start - 1] if run.start else None
        steer = steering(req.hint, zip(keys, run, strict=True), self.spans) if req.hint else None
        reserved, n = self._reserve_slots(keys, req.tenant, after=after, steer=steer)
        self.selector.retry_run(req, run[n:])
        if reserved is None or not reserved.keys:
            return None
        if len(reserved.keys) == len(keys):
            chunks = list(run)
        else:  # admission turned some away; the others keep their order
            position = {key: i for i, key in enumerate(keys)}
            chunks = [run.start + position[key] for key in reserved.keys]
        spans = run_spans(
            0, chunks, reserved.keys, reserved.slots, blocks, blocks_per_chunk=self.bpc
        )
        return self._queue(req, req_id, spans, chunks)

    def _reserve_slots(
        self,
        keys: Sequence[bytes],
        tenant: str | None,
        parents: Sequence[bytes | None] | None = None,
        *,
        after: bytes | None = None,
        steer: Steer | None = None,
    ) -> tuple[StoreResult | None, int]:
        """Slots for as many leading ``keys`` as the index can take now, and how many were asked.

        Stores in flight hold slots no eviction can free: if all of ``keys``
        do not fit, half of them are asked, and so on (``None``, 0: none fit).
        For the index's prefix order: ``parents``, each key's parent in its chain;
        without, ``keys`` are a plain chain's consecutive chunks after ``after``.
        ``steer``: what a client's retention hint admits (``hints.steering``).
        """
        index = self.index
        n = min(len(keys), index.room())
        while n > 0:
            whole = n == len(keys)
            if parents is None:
                reserved = index.prepare_store(
                    keys if whole else keys[:n], tenant=tenant, chain=True, after=after, steer=steer
                )
            else:
                reserved = index.prepare_store(
                    keys if whole else keys[:n],
                    tenant=tenant,
                    parents=parents if whole else parents[:n],
                    steer=steer,
                )
            if reserved is not None:
                if reserved.evicted:
                    self.misses.evicted(reserved.evicted, reserved.capped)
                if steer is not None and steer.drop:  # kept out of this tier by the hint
                    out = [key for key in keys[:n] if key in steer.drop]
                    self.stats.retention_dropped_chunks += index.ready_mask(out).count(False)
                return reserved, n
            n //= 2
        return None, 0

    def _queue(
        self,
        req: RequestState,
        req_id: str,
        spans: tuple[ChunkSpan, ...],
        chunks: Sequence[int] = (),
    ) -> TransferOrder:
        """Queue a store of ``spans`` (``chunks``: its chunk indices, for a plain layout)."""
        order = self.jobs.order(req_id, JobKind.STORE, spans)
        self.jobs.queue(req, JobState(order, chunks=chunks))
        self.stats.stores += 1
        return order

    def _parents(self, req: RequestState, chosen: Sequence[Chosen]) -> list[bytes | None]:
        """Each chosen chunk's parent: the chunk before it in a full-prefix group's chain
        (``None`` for a head, a window chunk, a state or a tail's own key)."""
        chains = [g.reuse is Reuse.PREFIX for g in self.layout.groups]
        keys = req.keys
        return [
            keys[c.group][c.chunk - 1] if c.chunk and c.key is None and chains[c.group] else None
            for c in chosen
        ]

    def _candidates(
        self, req: RequestState, selection: Selection
    ) -> tuple[list[bytes], list[Chosen]]:
        """The selected chunks' keys in chain order, and the chunks in the same order.

        Chain order is by chunk end in tokens: if the CPU tier has room for
        only some of them, the ones kept form a prefix in every group, which
        is what later hits need.
        """
        chosen, spans = selection.chosen, self.spans
        if len(spans) > 1:  # one group's chunks come in order
            chosen.sort(key=lambda c: ((c.chunk + 1) * spans[c.group], c.group))
        return [c.key_in(req) for c in chosen], chosen

    def complete(self, req: RequestState | None, job: JobState, report: JobReport) -> None:
        """Every rank reported the store: record what is stored, drop what was released."""
        keys = job.order.keys
        failed = report.failed_keys
        lost = failed.intersection(keys) if failed else frozenset()
        done = record_stored(
            self.index, self.retention, req, job, keys=keys, failed=lost, linked=True
        )  # linked when their slots were reserved (_reserve_slots)
        self.misses.stored(done)
        stats = self.stats
        stats.dropped_chunks += self.trails.stored(keys)
        stats.stored_chunks += len(keys) - len(lost)
        stats.failed_store_chunks += len(lost)

    def finish(self, req: RequestState, req_id: str) -> None:
        """``req`` finished: what it still waited to store is lost; its trail stays for good."""
        # Chunks still waiting for a CPU slot (stores in flight held them all) are never
        # stored now: vLLM frees the blocks. Counted, so an undersized tier shows.
        self.stats.no_room_chunks += sum(len(chunks) for chunks in req.retry)
        self.trails.finish(req, req_id)  # its trailing point is its output's end


def record_stored(
    index: OffloadIndex,
    retention: Retention,
    req: RequestState | None,
    job: JobState,
    *,
    keys: Sequence[bytes],
    failed: Collection[bytes],
    linked: bool = False,
) -> Sequence[bytes]:
    """Complete ``job`` 's stores (or promotions) of ``keys`` in chain order: those in
    ``failed`` failed. Returns the keys stored.

    One group's ``keys`` come in chain order already (an order's spans are sorted
    by chunk), and a store knows where its first stored chunk is; other layouts'
    keys are put in that order. The index learns each chunk's parent in its chain
    (``record_stores``), unless it was told when their slots were reserved
    (``linked``).
    """
    first = None
    parents: Sequence[bytes | None] | None = None  # from the chain: a plain request's
    if req is None or retention.plain:
        chain: Sequence[bytes] = keys if req is None else req.keys[0]
        done = [k for k in keys if k not in failed] if failed else keys
        if req is None:
            linked = True  # its chain is gone: nothing to link
        elif done and len(job.chunks) == len(keys):
            first = job.chunks[keys.index(done[0])]
    else:
        chain = retention.chain(req, keys)
        good = set(keys).difference(failed)
        done = [k for k in chain if k in good]
        if len(done) < len(good):  # tails (kvoffload.connector._tails): after the chain
            known = set(done)
            tails = [k for k in keys if k in good and k not in known]
            chain, done = [*chain, *tails], [*done, *tails]
        if not linked:
            parents = retention.parents(req, done)
    failures = [k for k in keys if k in failed]
    record_stores(
        index,
        chain,
        done,
        failures,
        first=first,
        parents=parents,
        linked=linked,
        chained=req is None or len(retention.layout.groups) == 1,  # one group's chain
    )
    return done
