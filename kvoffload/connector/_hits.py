"""Which prefix the tiers can serve: the hit rules of every group kind, and availability.

A hit of ``H`` tokens must be servable by every group at once, and vLLM only
resumes a hybrid request at a multiple of every group's block, so ``H`` is a
multiple of the least common multiple of the groups' chunk spans (or a
tail's block boundary inside a chunk, :mod:`kvoffload.connector._tails`:
:meth:`HitFinder.find_tail`). What a
group must supply for ``H`` depends on its :class:`Reuse` (:func:`needed_tokens`):

* full attention (MLA, compressed MLA) attends to everything: every chunk
  from the engine's own hit up to ``H``;
* sliding window ``W`` (plain or MLA) attends to the last ``W - 1`` tokens
  only (vLLM frees the blocks before them): only the chunks covering
  ``[H - W + 1, H)``;
* chunked local attention of chunk ``C`` attends within its attention chunk
  only (vLLM nulls the blocks of earlier chunks): the tokens since the start
  of the current one, ``[H // C * C, H)``, nothing at all when ``H`` is a
  multiple of ``C``;
* a recurrent state (Mamba, gated DeltaNet) carries the whole prefix in one
  snapshot: only the state taken at ``H``, so ``H`` must be a boundary where
  one was stored.

Window chunks and states are stored only at some hit points (see
:mod:`kvoffload.connector._retention`), so the hits a request can get are sparse:
the search below checks each candidate in constant time per group (runs of
available chunks), never chunk by chunk. Availability is the CPU index
(exact) or a lower-tier probe (a hint: disk files, the remote server). Lower
tiers are asked in a few batches: every chunk the full-prefix groups need,
then one chunk per candidate hit point of one window or state group (the
last it needs), then, for the best candidates that passed, the rest of what
they need. A hint that proves wrong is a failed load, which vLLM recomputes
(invariant 3).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

from kvoffload.config.layout import CacheGroup, KVLayout, Reuse
from kvoffload.errors import ConfigError
from kvoffload.manager.index import OffloadIndex
from kvoffload.tiers.base import TierProbe

__all__ = [
    "Availability",
    "Hit",
    "HitFinder",
    "coarse_state_hits",
    "needed_chunks",
    "needed_tokens",
]

logger = logging.getLogger("kvoffload")

#: Candidates (beyond the CPU tier's best) whose whole needs a lookup asks lower tiers about.
PROBE_ROUNDS = 4


class Availability(Enum):
    """Where a chunk a hit needs stands right now."""

    #: In the CPU index, or probably in a lower tier.
    READY = "ready"
    #: Being stored or promoted by a job: a CPU hit a step from now.
    PENDING = "pending"
    MISSING = "missing"


class Hit(NamedTuple):
    """The hit point found, and whether a chunk it needs is still in flight (ask again)."""

    tokens: int
    pending: bool
    #: Where the full-prefix groups' available chunks end (aligned): past the hit, the
    #: junction where this prompt left the history stored so far.
    prefix_end: int = 0


def needed_tokens(group: CacheGroup, local_hit: int, hit: int) -> tuple[int, int]:
    """``[first, stop)``: the tokens of ``group`` a hit at ``hit`` needs beyond ``local_hit``.

    The one place that says what each :class:`Reuse` needs; groups whose rule
    is not written here are refused at engine start, never served wrongly. A
    state group "needs" the last token before ``hit``: the chunk (and the
    engine block) that ends at ``hit`` holds the state after it.
    """
    if group.reuse is Reuse.PREFIX:
        return local_hit, hit
    if group.reuse is Reuse.WINDOW and group.sliding_window is not None:
        return max(local_hit, hit - group.sliding_window + 1), hit
    if group.reuse is Reuse.WINDOW and group.attention_chunk_size is not None:
        chunk = group.attention_chunk_size
        return max(local_hit, hit // chunk * chunk), hit
    if group.reuse is Reuse.STATE:
        return max(local_hit, hit - 1), hit
    raise ConfigError(f"no hit rule for KV cache groups of kind {group.kind!r} yet")


def needed_chunks(group: CacheGroup, span: int, local_hit: int, hit: int) -> range:
    """Indices of the chunks (``span`` tokens each) of ``group`` a hit at ``hit`` needs."""
    first, stop = needed_tokens(group, local_hit, hit)
    return range(first // span, -(-stop // span)) if first < stop else range(0)


def coarse_state_hits(layout: KVLayout, tokens_per_chunk: Sequence[int]) -> str | None:
    """Which states of recurrent groups at several blocks per chunk kvoffload does not serve.

    A hit at ``H`` needs the state taken at ``H``. vLLM (align mode) keeps a
    state only where a step ended: for a prompt computed in one step, its last
    block boundary before its last token, and each block boundary its output
    passes, which a chunk often cuts in two. Those are served: a request stores
    a tail there (:mod:`kvoffload.connector._tails`; issue 29: 1280 tokens
    shared, 256-token blocks, 512-token chunks). States vLLM keeps where a
    chunked prefill step ends inside a chunk are not; nor is any on layouts
    that have no tails. ``None`` where every state is servable.
    """
    groups = layout.groups
    tails = len({g.tokens_per_block for g in groups}) == 1 and all(
        g.reuse in (Reuse.STATE, Reuse.PREFIX) for g in groups
    )
    for group, span in zip(groups, tokens_per_chunk, strict=True):
        if group.reuse is Reuse.STATE and span > group.tokens_per_block:
            block = group.tokens_per_block
            where = (
                f"or at a {block}-token block boundary where a prompt or a decoded output "
                "ends (stored as a tail); states vLLM keeps where a chunked prefill step "
                "ends inside a chunk serve no hit from kvoffload"
                if tails
                else f"but vLLM keeps one only where a step ends (at its {block}-token "
                "blocks), so a prompt whose boundary falls inside a chunk gets no hit from "
                "kvoffload where vLLM's own cache has one"
            )
            return (
                f"blocks_per_chunk={span // block} with recurrent state groups: a hit needs "
                f"a state taken on a multiple of {span} tokens, {where}; set "
                "blocks_per_chunk to 1 to serve every state vLLM keeps"
            )
    return None


def _availability(ready: bool, storing: bool) -> Availability:
    if ready:
        return Availability.READY
    return Availability.PENDING if storing else Availability.MISSING


class _Search:
    """One lookup's availability, per group, from chunk ``base[g]`` up to the top."""

    def __init__(self, finder: HitFinder, keys: Sequence[Sequence[bytes]], local: int, top: int):
        self.finder, self.keys, self.local = finder, keys, local
        index, spans = finder.index, finder.tokens_per_chunk
        self.base = [local // span for span in spans]
        self.states: list[list[Availability]] = []
        for g, span in enumerate(spans):  # past an aligned top: a tail (see _tails)
            group_keys = keys[g][self.base[g] : -(-top // span)]
            ready, busy = index.ready_mask(group_keys), index.storing_mask(group_keys)
            self.states.append([_availability(r, b) for r, b in zip(ready, busy, strict=True)])
        self.probed: set[tuple[int, int]] = set()
        self.runs = [self._runs(g) for g in range(len(spans))]

    def _runs(self, g: int) -> list[int]:
        """``runs[i]``: available chunks in a row ending at chunk ``base + i``."""
        out, n = [], 0
        for state in self.states[g]:
            n = 0 if state is Availability.MISSING else n + 1
            out.append(n)
        return out

    def probe(self, chunks: Sequence[tuple[int, int]]) -> None:
        """Ask the lower tiers, tier by tier in one batch each, about missing ``(group, chunk)``."""
        missing = Availability.MISSING
        wanted = [
            gc
            for gc in dict.fromkeys(chunks)
            if gc not in self.probed and self.state(*gc) is missing
        ]
        self.probed.update(wanted)
        touched = set()
        for probe in self.finder.probes:
            if not wanted:
                break
            answers = probe.contains_many([self.keys[g][c] for g, c in wanted])
            for (g, c), yes in zip(wanted, answers, strict=True):
                if yes:
                    self.states[g][c - self.base[g]] = Availability.READY
                    self.finder.found_in[self.keys[g][c]] = probe.name
                    touched.add(g)
            wanted = [w for w, yes in zip(wanted, answers, strict=True) if not yes]
        for g in touched:
            self.runs[g] = self._runs(g)

    def state(self, g: int, c: int) -> Availability:
        i = c - self.base[g]
        return self.states[g][i] if 0 <= i < len(self.states[g]) else Availability.MISSING

    def first_missing(self, g: int) -> int:
        """The first chunk of group ``g`` at or after the base that is missing."""
        states = self.states[g]
        for i, state in enumerate(states):
            if state is Availability.MISSING:
                return self.base[g] + i
        return self.base[g] + len(states)

    def servable(self, g: int, needed: range) -> bool:
        """Whether every chunk in ``needed`` of group ``g`` is available (constant time)."""
        if not needed:
            return True
        i = needed.stop - 1 - self.base[g]
        return 0 <= i < len(self.runs[g]) and self.runs[g][i] >= len(needed)


class HitFinder:
    """Finds the longest prefix every group can serve, over the CPU index and lower tiers."""

    def __init__(
        self,
        layout: KVLayout,
        tokens_per_chunk: Sequence[int],
        index: OffloadIndex,
        probes: Sequence[TierProbe],
    ) -> None:
        self.layout = layout
        self.tokens_per_chunk = tuple(tokens_per_chunk)
        self.index = index
        self.probes = tuple(probes)
        #: Keys the last :meth:`find` found in a lower tier -> that tier's name.
        self.found_in: dict[bytes, str] = {}
        groups = layout.groups
        self._prefix = [g for g, group in enumerate(groups) if group.reuse is Reuse.PREFIX]
        self._sparse = [g for g, group in enumerate(groups) if group.reuse is not Reuse.PREFIX]
        # The sparse group whose last needed chunk best tells a stored hit point: a state.
        states = [g for g in self._sparse if groups[g].reuse is Reuse.STATE]
        telling = states or self._sparse
        self._telling: int | None = telling[0] if telling else None
        coarse = coarse_state_hits(layout, self.tokens_per_chunk)
        if coarse is not None:
            logger.warning(coarse)

    def find(self, keys: Sequence[Sequence[bytes]], local_hit: int, top: int, step: int) -> Hit:
        """The longest hit ``H <= top`` on a multiple of ``step``; ``H <= local_hit`` if none.

        Every chunk ``H`` needs is ready or pending, and the CPU tier has room
        for them all (a chunk loaded from a lower tier is promoted into a
        CPU slot). ``keys[g]`` names group ``g``'s chunks up to ``top``. The
        first chunk missing in a full-prefix group bounds the search from above.
        """
        self.found_in = {}
        if not self._sparse and not self.probes:
            return self._find_prefix(keys, local_hit, top, step)
        search = _Search(self, keys, local_hit, top)
        spans = self.tokens_per_chunk
        if self.probes:
            search.probe([(g, search.base[g] + i) for g in self._prefix
                          for i in range(len(search.states[g]))])  # fmt: skip
        cap = top
        for g in self._prefix:
            cap = min(cap, search.first_missing(g) * spans[g] // step * step)
        candidates = range(cap, local_hit, -step)
        best = next((h for h in candidates if self._servable(search, h)), local_hit)
        if self.probes and self._telling is not None:
            best = self._probe_above(search, [h for h in candidates if h > best], best)
        if best <= local_hit:
            return Hit(local_hit, False, cap)
        return Hit(best, self._pending(search, best), cap)

    def find_tail(self, keys: Sequence[Sequence[bytes]], local_hit: int, point: int) -> Hit | None:
        """The hit at ``point``, a tail (:mod:`~kvoffload.connector._tails`), if it is servable.

        ``keys[g]`` names group ``g``'s chunks before ``point`` and then its tail at
        ``point``: the rules of :func:`needed_tokens` hold as for any hit.
        """
        search = _Search(self, keys, local_hit, point)
        needs = self.needs(local_hit, point)
        if self.probes:
            search.probe([(g, c) for g, needed in enumerate(needs) for c in needed])
        if sum(len(r) for r in needs) > self.index.room():
            return None
        if not all(search.servable(g, needed) for g, needed in enumerate(needs)):
            return None
        return Hit(point, self._pending(search, point))

    def _find_prefix(
        self, keys: Sequence[Sequence[bytes]], local_hit: int, top: int, step: int
    ) -> Hit:
        """:meth:`find` for full-attention groups over the CPU tier alone (a plain transformer,
        no disk or remote tier): each group's run of available chunks from the engine's hit
        on is the whole answer, so no chunk past the first missing one is looked at."""
        spans, room = self.tokens_per_chunk, self.index.room()
        cap, runs = top, []
        for g in self._prefix:
            first = local_hit // spans[g]
            run, _ = self.index.available_run(keys[g][first : top // spans[g]])
            runs.append((g, first))
            cap = min(cap, (first + run) * spans[g] // step * step)
        for hit in range(cap, local_hit, -step):
            needs = [(g, first, -(-hit // spans[g])) for g, first in runs]
            if sum(stop - first for _, first, stop in needs) <= room:
                pending = any(
                    self.index.available_run(keys[g][first:stop])[1] for g, first, stop in needs
                )
                return Hit(hit, pending, cap)
        return Hit(local_hit, False, cap)

    def chunks_needed(self, local: int, hit: int) -> int:
        """How many chunks a hit at ``hit`` needs beyond ``local``, every group together."""
        return sum(len(r) for r in self.needs(local, hit))

    def first_prefix_group(self) -> int | None:
        """The first full-prefix group: its chain tells where the stored prefix ends."""
        return self._prefix[0] if self._prefix else None

    def needs(self, local: int, hit: int) -> list[range]:
        """Per group, the chunks a hit at ``hit`` needs beyond the engine's ``local`` hit."""
        return [
            needed_chunks(group, span, local, hit)
            for group, span in zip(self.layout.groups, self.tokens_per_chunk, strict=True)
        ]

    def _servable(self, search: _Search, hit: int) -> bool:
        """Every chunk of ``hit`` is available (full-prefix ones are, below the cap) and fits."""
        needs = self.needs(search.local, hit)
        if not all(search.servable(g, needs[g]) for g in self._sparse):
            return False
        return sum(len(r) for r in needs) <= self.index.room()

    def _probe_above(self, search: _Search, candidates: list[int], best: int) -> int:
        """A better hit than ``best`` out of the lower tiers: see the module docstring."""
        assert self._telling is not None
        g = self._telling
        last = {h: self.needs(search.local, h)[g] for h in candidates}
        search.probe([(g, needed[-1]) for needed in last.values() if needed])
        passed = [
            h for h in candidates
            if not last[h] or search.state(g, last[h][-1]) is not Availability.MISSING
        ]  # fmt: skip
        for hit in passed[:PROBE_ROUNDS]:
            needs = self.needs(search.local, hit)
            search.probe([(s, c) for s in self._sparse for c in needs[s]])
            if self._servable(search, hit):
                return hit
        return best

    def _pending(self, search: _Search, hit: int) -> bool:
        """Whether a chunk ``hit`` needs is still being stored or promoted (ask again later)."""
        return any(
            search.state(g, c) is Availability.PENDING
            for g, needed in enumerate(self.needs(search.local, hit))
            for c in needed
        )
