"""Which prefix the tiers can serve: the hit rules of every group kind, and availability.

A hit of ``H`` tokens must be servable by every group at once, and vLLM only
resumes a hybrid request at a multiple of every group's block, so ``H`` is a
multiple of the least common multiple of the groups' chunk spans. What a
group must supply for ``H`` depends on its kind (:func:`needed_tokens`):

* full attention (MLA, compressed MLA) attends to everything: every chunk
  from the engine's own hit up to ``H``;
* sliding window ``W`` (plain or MLA) attends to the last ``W - 1`` tokens
  only (vLLM frees the blocks before them): only the chunks covering
  ``[H - W + 1, H)``;
* chunked local attention of chunk ``C`` attends within its attention chunk
  only (vLLM nulls the blocks of earlier chunks): the tokens since the start
  of the current one, ``[H // C * C, H)``, nothing at all when ``H`` is a
  multiple of ``C``.

So a long prompt whose sliding-window chunks were evicted early still hits,
as long as the window before the hit point is there. Availability is the
CPU index (exact) or a lower-tier probe (a hint: disk files, the remote
server, one batched query per tier and request). A hint that proves wrong is
a failed load, which vLLM recomputes (invariant 3).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import NamedTuple

from kvoffload.config.layout import CacheGroup, KVLayout, Reuse
from kvoffload.errors import ConfigError
from kvoffload.manager.offload_manager import OffloadManager
from kvoffload.tiers.base import TierProbe

__all__ = ["Availability", "Hit", "HitFinder", "needed_tokens"]


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


def needed_tokens(group: CacheGroup, local_hit: int, hit: int) -> tuple[int, int]:
    """``[first, stop)``: the tokens of ``group`` a hit at ``hit`` needs beyond ``local_hit``.

    The one place that says what each :class:`Reuse` needs; groups whose rule
    is not written here are refused at engine start, never served wrongly.
    """
    if group.reuse is Reuse.PREFIX:
        return local_hit, hit
    if group.reuse is Reuse.WINDOW and group.sliding_window is not None:
        return max(local_hit, hit - group.sliding_window + 1), hit
    if group.reuse is Reuse.WINDOW and group.attention_chunk_size is not None:
        chunk = group.attention_chunk_size
        return max(local_hit, hit // chunk * chunk), hit
    raise ConfigError(f"no hit rule for KV cache groups of kind {group.kind!r} yet")


class HitFinder:
    """Finds the longest prefix every group can serve, over the CPU index and lower tiers."""

    def __init__(
        self,
        layout: KVLayout,
        tokens_per_chunk: Sequence[int],
        index: OffloadManager,
        probes: Sequence[TierProbe],
    ) -> None:
        self.layout = layout
        self.tokens_per_chunk = tuple(tokens_per_chunk)
        self.index = index
        self.probes = tuple(probes)
        #: Keys the last :meth:`availability` found in a lower tier -> that tier's name.
        self.found_in: dict[bytes, str] = {}

    def find(self, keys: Sequence[Sequence[bytes]], local_hit: int, top: int, step: int) -> Hit:
        """The longest hit ``H <= top``, stepping down by ``step``; ``H <= local_hit`` if none.

        Every chunk ``H`` needs is ready or pending, and the CPU tier has room
        for them all (a chunk loaded from a lower tier is promoted into a
        CPU slot). ``keys[g]`` names group ``g``'s chunks up to ``top``.
        """
        available = self.availability(keys, local_hit, top)
        hit = self._prefix_cap(available, local_hit, top, step)
        while hit > local_hit and not self._servable(available, local_hit, hit):
            hit -= step
        if hit <= local_hit:
            return Hit(local_hit, pending=False)
        return Hit(hit, Availability.PENDING in self._needed(available, local_hit, hit))

    def _prefix_cap(
        self, available: list[dict[int, Availability]], local_hit: int, top: int, step: int
    ) -> int:
        """``top``, lowered to where the first chunk missing in a group that needs every chunk
        from ``local_hit`` on (full attention; a window still longer than the hit).

        Only a shortcut: ``find`` would step down to the same point one ``step``
        at a time, checking every group each time (quadratic in long prompts).
        It relies on the first token a group needs never falling as the hit
        point grows, which holds for every kind :func:`needed_tokens` knows.
        """
        hit = top
        for g, (group, span) in enumerate(
            zip(self.layout.groups, self.tokens_per_chunk, strict=True)
        ):
            if needed_tokens(group, local_hit, top)[0] != local_hit:
                continue
            c, states = local_hit // span, available[g]
            while states.get(c, Availability.MISSING) is not Availability.MISSING:
                c += 1
            hit = min(hit, c * span // step * step)
        return max(hit, local_hit)

    def availability(
        self, keys: Sequence[Sequence[bytes]], local_hit: int, top: int
    ) -> list[dict[int, Availability]]:
        """Per group: chunk index -> :class:`Availability` of the chunks a hit up to ``top`` needs.

        The CPU index answers first; each lower tier is asked once, in one
        batch, for what the tiers above it lack.
        """
        out: list[dict[int, Availability]] = []
        wanted: list[tuple[int, int, bytes]] = []
        self.found_in = {}
        for g, span in enumerate(self.tokens_per_chunk):
            first, stop = local_hit // span, top // span
            group_keys = keys[g][first:stop]
            ready = self.index.ready_mask(group_keys)
            storing = self.index.storing_mask(group_keys)
            states: dict[int, Availability] = {}
            for c, key, yes, busy in zip(
                range(first, stop), group_keys, ready, storing, strict=True
            ):
                if yes:
                    states[c] = Availability.READY
                elif busy:
                    states[c] = Availability.PENDING
                else:
                    states[c] = Availability.MISSING
                    wanted.append((g, c, key))
            out.append(states)
        for probe in self.probes:
            if not wanted:
                break
            answers = probe.contains_many([key for _, _, key in wanted])
            for (g, c, key), yes in zip(wanted, answers, strict=True):
                if yes:
                    out[g][c] = Availability.READY
                    self.found_in[key] = probe.name
            wanted = [w for w, yes in zip(wanted, answers, strict=True) if not yes]
        return out

    def _needed(
        self, available: list[dict[int, Availability]], local_hit: int, hit: int
    ) -> list[Availability]:
        """The states of every chunk a hit at ``hit`` needs, all groups together."""
        states: list[Availability] = []
        for g, (group, span) in enumerate(
            zip(self.layout.groups, self.tokens_per_chunk, strict=True)
        ):
            first, stop = needed_tokens(group, local_hit, hit)
            states += [
                available[g].get(c, Availability.MISSING)
                for c in range(first // span, stop // span)
            ]
        return states

    def _servable(self, available: list[dict[int, Availability]], local_hit: int, hit: int) -> bool:
        states = self._needed(available, local_hit, hit)
        return Availability.MISSING not in states and len(states) <= self.index.room()
