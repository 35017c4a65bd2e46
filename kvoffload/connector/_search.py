"""The search for the longest hit the tiers can serve, tails included.

The hit rules (:mod:`kvoffload.connector._hits`) make the hits a request can get
sparse, so the search checks each candidate hit point in constant time per group
(runs of available chunks), never chunk by chunk. Availability is the CPU index
(exact) or a lower-tier probe (a hint: disk files, the remote server). Lower tiers
are asked in a few batches: every chunk the full-prefix groups need, then one chunk
per candidate hit point of one window or state group (the last it needs), then, for
the best candidates that passed, the rest of what they need. A hint that proves
wrong is a failed load, which vLLM recomputes (invariant 3).

Where the full-prefix chain stops inside a chunk of a recurrent hybrid, the block
boundaries there are tried next, as tails (:mod:`kvoffload.connector._tails`): the
same rules over the keys with the tail's put at the boundary.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import Enum

from kvoffload.config.layout import KVLayout, Reuse
from kvoffload.connector._hits import Hit, HitNeeds, coarse_state_hits
from kvoffload.connector._tails import Tails, with_tail
from kvoffload.connector.requests import Lookup
from kvoffload.manager.index import OffloadIndex
from kvoffload.tiers.base import TierProbe

__all__ = ["Availability", "HitFinder"]

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


def _availability(ready: bool, storing: bool) -> Availability:
    if ready:
        return Availability.READY
    return Availability.PENDING if storing else Availability.MISSING


class _Search:
    """One search's availability, per group, from chunk ``base[g]`` up to the top.

    What the lower tiers answer goes into ``found_in`` (key -> tier name).
    """

    def __init__(
        self,
        finder: HitFinder,
        keys: Sequence[Sequence[bytes]],
        local: int,
        top: int,
        found_in: dict[bytes, str],
    ) -> None:
        self.finder, self.keys, self.local, self.found_in = finder, keys, local, found_in
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
                    self.found_in[self.keys[g][c]] = probe.name
                    touched.add(g)
            wanted = [w for w, yes in zip(wanted, answers, strict=True) if not yes]
        for g in touched:
            self.runs[g] = self._runs(g)

    def chunks_of(self, groups: Sequence[int]) -> list[tuple[int, int]]:
        """``(group, chunk)`` of every chunk of ``groups`` the search covers."""
        return [(g, self.base[g] + i) for g in groups for i in range(len(self.states[g]))]

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
    """Finds the longest prefix every group can serve, over the CPU index and lower tiers.

    Hits land on multiples of ``alignment`` tokens, or at a tail where ``tails`` apply.
    """

    def __init__(
        self,
        layout: KVLayout,
        tokens_per_chunk: Sequence[int],
        index: OffloadIndex,
        probes: Sequence[TierProbe],
        *,
        alignment: int,
        tails: Tails | None = None,
    ) -> None:
        self.layout = layout
        self.tokens_per_chunk = tuple(tokens_per_chunk)
        self.index = index
        self.probes = tuple(probes)
        self.alignment = alignment
        self.tails = tails if tails else None
        self.needs = HitNeeds(layout.groups, self.tokens_per_chunk)
        groups = layout.groups
        self._prefix = [g for g, group in enumerate(groups) if group.reuse is Reuse.PREFIX]
        self._sparse = [g for g, group in enumerate(groups) if group.reuse is not Reuse.PREFIX]
        # The sparse group whose last needed chunk best tells a stored hit point: a state.
        states = [g for g in self._sparse if groups[g].reuse is Reuse.STATE]
        telling = states or self._sparse
        self._telling: int | None = telling[0] if telling else None
        #: One full-attention group (a plain transformer): only room stops a hit short of
        #: where its chain ends.
        self._plain = len(groups) == 1 and groups[0].reuse is Reuse.PREFIX
        coarse = coarse_state_hits(layout, self.tokens_per_chunk)
        if coarse is not None:
            logger.warning(coarse)

    def find(self, lookup: Lookup) -> Hit | None:
        """The longest hit beyond the engine's own that the tiers can serve, tails included.

        ``None`` where no hit point lies beyond the engine's hit: nothing was searched.
        A free query, as vLLM needs of a lookup: it changes nothing in the index.
        """
        req, local, top = lookup.req, lookup.local_hit, lookup.top
        tails = self.tails
        if top <= local and (tails is None or not tails.candidates(lookup.keyable, top, local)):
            return None
        found_in: dict[bytes, str] = {}
        hit = self.longest(req.keys, local, top, found_in)
        if tails is not None:
            hit = self._better_at_tail(lookup, tails, hit, found_in)
        served, reach = max(hit.tokens, local), max(hit.prefix_end, local)
        fits = (
            reach > served
            and not self._plain
            and self.needs.count(local, reach) <= self.index.room()
        )
        return hit._replace(found_in=found_in, prefix_fits=fits)

    def longest(
        self, keys: Sequence[Sequence[bytes]], local: int, top: int, found_in: dict[bytes, str]
    ) -> Hit:
        """The longest hit ``H <= top`` on a multiple of the alignment; ``H <= local`` if none.

        Every chunk ``H`` needs is ready or pending, and the CPU tier has room
        for them all (a chunk loaded from a lower tier is promoted into a
        CPU slot). ``keys[g]`` names group ``g``'s chunks up to ``top``. The
        first chunk missing in a full-prefix group bounds the search from above.
        What the lower tiers hold goes into ``found_in``.
        """
        if not self._sparse and not self.probes:
            return self._longest_prefix(keys, local, top)
        search = _Search(self, keys, local, top, found_in)
        spans, step = self.tokens_per_chunk, self.alignment
        if self.probes:
            search.probe(search.chunks_of(self._prefix))
        cap = top
        for g in self._prefix:
            cap = min(cap, search.first_missing(g) * spans[g] // step * step)
        candidates = range(cap, local, -step)
        best = next((h for h in candidates if self._servable(search, h)), local)
        if self.probes and self._telling is not None:
            best = self._probe_above(search, [h for h in candidates if h > best], best)
        if best <= local:
            return Hit(local, False, cap)
        return Hit(best, self._pending(search, best), cap)

    def _better_at_tail(
        self, lookup: Lookup, tails: Tails, hit: Hit, found_in: dict[bytes, str]
    ) -> Hit:
        """A better hit than ``hit`` at a tail, if one is stored: the block boundaries inside
        the chunk where the full-prefix chain stops, best first."""
        req, local = lookup.req, lookup.local_hit
        for point in tails.candidates(lookup.keyable, hit.prefix_end, max(hit.tokens, local)):
            keys = tails.keys(req, lookup.token_ids, lookup.block_hashes, point)
            if keys is None:
                continue
            with_tails = with_tail(req.keys, keys, point, self.tokens_per_chunk)
            found = self._tail_hit(with_tails, local, point, found_in)
            if found is not None:
                return found._replace(prefix_end=hit.prefix_end, tail=keys)
        return hit

    def _tail_hit(
        self, keys: Sequence[Sequence[bytes]], local: int, point: int, found_in: dict[bytes, str]
    ) -> Hit | None:
        """The hit at ``point``, a tail, if it is servable.

        ``keys[g]`` names group ``g``'s chunks before ``point`` and then its tail at
        ``point``: the hit rules hold as for any hit.
        """
        search = _Search(self, keys, local, point, found_in)
        needs = self.needs.chunks(local, point)
        if self.probes:
            search.probe([(g, c) for g, needed in enumerate(needs) for c in needed])
        if sum(len(r) for r in needs) > self.index.room():
            return None
        if not all(search.servable(g, needed) for g, needed in enumerate(needs)):
            return None
        return Hit(point, self._pending(search, point))

    def _longest_prefix(self, keys: Sequence[Sequence[bytes]], local: int, top: int) -> Hit:
        """:meth:`longest` for full-attention groups over the CPU tier alone (a plain
        transformer, no disk or remote tier): each group's run of available chunks from the
        engine's hit on is the whole answer, so no chunk past the first missing one is
        looked at."""
        spans, step, room = self.tokens_per_chunk, self.alignment, self.index.room()
        cap, runs = top, []
        for g in self._prefix:
            first = local // spans[g]
            run, _ = self.index.available_run(keys[g][first : top // spans[g]])
            runs.append((g, first))
            cap = min(cap, (first + run) * spans[g] // step * step)
        for hit in range(cap, local, -step):
            needs = [(g, first, -(-hit // spans[g])) for g, first in runs]
            if sum(stop - first for _, first, stop in needs) <= room:
                pending = any(
                    self.index.available_run(keys[g][first:stop])[1] for g, first, stop in needs
                )
                return Hit(hit, pending, cap)
        return Hit(local, False, cap)

    def _servable(self, search: _Search, hit: int) -> bool:
        """Every chunk of ``hit`` is available (full-prefix ones are, below the cap) and fits."""
        needs = self.needs.chunks(search.local, hit)
        if not all(search.servable(g, needs[g]) for g in self._sparse):
            return False
        return sum(len(r) for r in needs) <= self.index.room()

    def _probe_above(self, search: _Search, candidates: list[int], best: int) -> int:
        """A better hit than ``best`` out of the lower tiers: see the module docstring."""
        assert self._telling is not None
        g = self._telling
        last = {h: self.needs.chunks(search.local, h)[g] for h in candidates}
        search.probe([(g, needed[-1]) for needed in last.values() if needed])
        passed = [
            h
            for h in candidates
            if not last[h] or search.state(g, last[h][-1]) is not Availability.MISSING
        ]
        for hit in passed[:PROBE_ROUNDS]:
            needs = self.needs.chunks(search.local, hit)
            search.probe([(s, c) for s in self._sparse for c in needs[s]])
            if self._servable(search, hit):
                return hit
        return best

    def _pending(self, search: _Search, hit: int) -> bool:
        """Whether a chunk ``hit`` needs is still being stored or promoted (ask again later)."""
        return any(
            search.state(g, c) is Availability.PENDING
            for g, needed in enumerate(self.needs.chunks(search.local, hit))
            for c in needed
        )
