"""What the connector's scheduler side remembers between steps, per request and per order."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from kvoffload.keys import EngineHashes, KeyExtras, extend_engine_keys, extend_prefix_keys
from kvoffload.messages import JobReport, TransferOrder

if TYPE_CHECKING:
    from kvoffload.connector.hints import TokenRange

__all__ = ["JobState", "RequestState", "StepRequest", "add_range", "covered", "tier_shares"]


def add_range(ranges: list[tuple[int, int]], start: int, stop: int) -> None:
    """Merge ``[start, stop)`` into a sorted list of disjoint ranges."""
    if start >= stop:
        return
    if ranges and ranges[-1][0] <= start <= ranges[-1][1]:  # a step extending the last range
        lo, hi = ranges[-1]
        ranges[-1] = (lo, max(hi, stop))
        return
    merged: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if hi < start or lo > stop:
            merged.append((lo, hi))
        else:
            start, stop = min(start, lo), max(stop, hi)
    merged.append((start, stop))
    merged.sort()
    ranges[:] = merged


def covered(ranges: list[tuple[int, int]], start: int, stop: int) -> bool:
    """Whether ``[start, stop)`` lies inside one of ``ranges``."""
    # A loop, not any() over a generator (8x slower): asked at every step of every request.
    for lo, hi in ranges:  # noqa: SIM110
        if lo <= start and stop <= hi:
            return True
    return False


@dataclass(slots=True)
class RequestState:
    """Per group: chunk keys so far, token ranges whose KV is valid, store progress.

    ``valid[g]`` holds the token ranges whose KV in the engine's blocks of
    group ``g`` is known to be real (computed, served by vLLM's prefix cache,
    or loaded by us); only chunks inside them may be stored. Chunks below
    ``next_chunk[g]`` were stored or skipped, except those in ``retry[g]``
    (no CPU room at the time, or a window chunk a later hit point may want).
    The hit points its window chunks and states are kept for are in
    :mod:`kvoffload.connector._retention`.
    """

    keys: list[list[bytes]]
    valid: list[list[tuple[int, int]]]
    next_chunk: list[int]
    retry: list[set[int]]
    #: What the request's KV depends on besides its tokens (salt, adapter, ...).
    extras: KeyExtras | None = None
    #: Keys the lookup of the offered hit found in a lower tier -> that tier's name.
    found_in: Mapping[bytes, str] = field(default_factory=dict)
    #: The engine's own hit at the last lookup, and the hit we offered.
    local_hit: int = 0
    offered: int = 0
    #: Whether that hit loads in the step that asks for it (its lookup found every chunk
    #: in the CPU tier, none in a lower one).
    in_step: bool = False
    #: Chunks promoted into the CPU tier for its hit -> the tier they came from (``None``:
    #: no promotion; a request promotes once, :mod:`~kvoffload.connector.promotions`).
    promotion: dict[bytes, str] | None = None
    #: Its loads that failed (see ``scheduler.MAX_FAILED_LOADS``).
    failed_loads: int = 0
    #: Whether this admission's use was told to the index (once per lookup: vLLM calls
    #: update_state_after_alloc again when a request resumes after its load).
    use_recorded: bool = False
    #: Where the full-prefix chunks the last lookup found end (a hit point to keep).
    junction: int = 0
    prompt_tokens: int = 0
    #: The trailing hit point (0: none yet), and the keys stored only for it.
    trail: int = 0
    trail_keys: set[bytes] = field(default_factory=set)
    #: Every group's tail key where the offered hit is at a tail (:mod:`~._tails`).
    tail_keys: tuple[bytes, ...] = ()
    #: The keys of the tail stored at the trailing point, if that is one.
    trail_tail: tuple[bytes, ...] = ()
    #: Tokens computed before the request's last step (``None``: no step since its lookup or
    #: preemption), and whether that step verified draft tokens (:mod:`~._drafts`).
    last_computed: int | None = None
    last_drafted: bool = False
    #: ``[lo, hi)`` ranges of block boundaries (in tokens) whose recurrent state accepted
    #: draft tokens may have moved, or was computed from one: no state there is stored.
    drafted: list[tuple[int, int]] = field(default_factory=list)
    #: When a lookup first waited for chunks a producer marked (a consumer's; ``None``:
    #: never; ``-inf``: its wait ran out, :mod:`~kvoffload.connector.handoffs`).
    handoff_since: float | None = None
    #: The client's retention hint, its token ranges (:mod:`~kvoffload.connector.hints`).
    hint: tuple[TokenRange, ...] = ()
    jobs: set[int] = field(default_factory=set)
    finished: bool = False

    @classmethod
    def empty(cls, num_groups: int, extras: KeyExtras | None = None) -> RequestState:
        if num_groups == 1:  # a plain transformer's, made at every lookup: written out
            return cls([[]], [[]], [0], [set()], extras)
        return cls(
            [[] for _ in range(num_groups)],
            [[] for _ in range(num_groups)],
            [0] * num_groups,
            [set() for _ in range(num_groups)],
            extras,
        )

    @property
    def tenant(self) -> str | None:
        """Whose share of the CPU tier the request's chunks count against (its salt)."""
        return None if self.extras is None else self.extras.tenant

    def mark_valid(self, start: int, stop: int, group: int | None = None) -> None:
        """Tokens ``[start, stop)`` of ``group`` (or of every group) now hold real KV."""
        if len(self.valid) == 1:  # a plain transformer's, at every step
            if not group:
                add_range(self.valid[0], start, stop)
            return
        for g, ranges in enumerate(self.valid):
            if group is None or g == group:
                add_range(ranges, start, stop)

    def forget_blocks(self) -> None:
        """The request lost its blocks (preemption): nothing in them is known valid."""
        n = len(self.valid)
        self.valid = [[] for _ in range(n)]
        self.next_chunk = [0] * n
        self.retry = [set() for _ in range(n)]
        self.last_computed, self.last_drafted, self.drafted = None, False, []

    def chain(
        self, tokens_per_chunk: Sequence[int], wanted: Sequence[Container[int] | None] = ()
    ) -> list[bytes]:
        """Keys so far in chain order, head first: by the token their chunk ends at, then group.

        The order :mod:`kvoffload.manager.usage` needs for a request that spans
        several groups with different chunk sizes. ``wanted[g]``, if given and
        not ``None``, keeps only those chunk indices of group ``g``.
        """
        if len(self.keys) == 1 and not wanted:
            return list(self.keys[0])
        return [self.keys[g][c] for _, g, c in self.chain_ends(tokens_per_chunk, wanted)]

    def chain_ends(
        self, tokens_per_chunk: Sequence[int], wanted: Sequence[Container[int] | None] = ()
    ) -> list[tuple[int, int, int]]:
        """``(end token, group, chunk)`` of :meth:`chain`'s keys, in its order."""
        only = list(wanted) or [None] * len(self.keys)
        return sorted(
            ((c + 1) * span, g, c)
            for g, (span, keep) in enumerate(zip(tokens_per_chunk, only, strict=True))
            for c in range(len(self.keys[g]))
            if keep is None or c in keep
        )

    def extend_keys(
        self,
        token_ids: Sequence[int],
        tokens: int,
        tokens_per_chunk: Sequence[int],
        namespace: bytes,
        *,
        engine: EngineHashes | None = None,
        block_hashes: Sequence[bytes] = (),
        lookahead: int = 0,
    ) -> None:
        """Make ``keys[g]`` name every full chunk of group ``g`` in the first ``tokens`` tokens:
        from ``token_ids``, or with ``engine`` from the engine's ``block_hashes`` (as far as
        they go). With ``lookahead``, a chunk's key names that many tokens after it, so only
        chunks that many tokens before the end of ``token_ids`` get one."""
        if lookahead:
            tokens = min(tokens, len(token_ids) - lookahead)
        for g, span in enumerate(tokens_per_chunk):
            keys, want = self.keys[g], tokens // span
            if len(keys) >= want:
                continue
            if engine is None:
                stop = want * span + lookahead
                keys += extend_prefix_keys(
                    keys,
                    token_ids,
                    span,
                    g,
                    namespace,
                    extras=self.extras,
                    stop=stop,
                    lookahead=lookahead,
                )
            else:
                keys += extend_engine_keys(
                    keys,
                    block_hashes,
                    span,
                    g,
                    namespace,
                    engine=engine,
                    extras=self.extras,
                    stop=want * span,
                )


class StepRequest(NamedTuple):
    """One request a step runs, as vLLM's scheduler output describes it."""

    req_id: str
    token_ids: Sequence[int]
    #: Tokens computed before the step, and scheduled in it.
    computed: int
    scheduled: int
    #: The request's engine blocks per group (vLLM's null block where it holds none).
    block_ids: Sequence[Sequence[int]]
    num_prompt_tokens: int
    #: ``(group, block id, tokens)`` of recurrent states vLLM says the step writes besides
    #: the one at its end: vLLM's ``boundary_state_offloads``, a prefill checkpoint; the
    #: states after ``computed`` and after ``computed + scheduled`` are found without it.
    states: Collection[tuple[int, int, int]] = ()
    #: The engine's block hashes of the request (vLLM's ``request.block_hashes``), if keys
    #: are made from them.
    block_hashes: Sequence[bytes] | None = None

    @property
    def drafts(self) -> int:
        """Draft tokens the step verifies: what it schedules past the request's tokens.

        vLLM's ``all_token_ids`` holds no draft token (they are
        ``scheduled_spec_decode_tokens``), so a step verifying ``k`` drafts
        schedules ``k`` tokens past them; no other step does under synchronous
        scheduling. Under asynchronous scheduling the placeholders of tokens
        still being sampled count too, which only keeps more states unstored.
        """
        return max(0, self.computed + self.scheduled - len(self.token_ids))


@dataclass(slots=True)
class JobState:
    """An order in flight, until every worker reported it: what to complete in the index."""

    order: TransferOrder
    #: Load: CPU-resident chunks pinned for it, and chunks promoted from lower tiers.
    pinned: tuple[bytes, ...] = ()
    promoted: tuple[bytes, ...] = ()
    #: Load: tokens it serves and the ``(group, start, stop)`` token ranges it makes valid.
    tokens: int = 0
    ranges: tuple[tuple[int, int, int], ...] = ()
    #: Load: its tokens by the tier their chunks come from (see :func:`tier_shares`).
    tiers: dict[str, int] = field(default_factory=dict)
    #: Store of a one-group layout: the chunk index of each of the order's keys, in order.
    chunks: Sequence[int] = ()
    report: JobReport | None = None


def tier_shares(tokens: int, chunk_tiers: Sequence[str]) -> dict[str, int]:
    """``tokens`` split over tiers in proportion to the chunks each serves; sums to ``tokens``.

    A load's chunks may come from several tiers (the CPU tier holds the head
    of a prefix, the disk its tail); each tier is credited its share, the
    rounding remainder going to the tier with the most chunks.
    """
    if not chunk_tiers or tokens <= 0:
        return {}
    if chunk_tiers.count(chunk_tiers[0]) == len(chunk_tiers):  # one tier: most loads
        return {chunk_tiers[0]: tokens}
    counts = Counter(chunk_tiers)
    total = sum(counts.values())
    shares = {tier: tokens * n // total for tier, n in counts.items()}
    top = max(counts, key=lambda tier: (counts[tier], tier))
    shares[top] += tokens - sum(shares.values())
    return shares
