"""Which sliding-window chunks and recurrent states a request stores: those a hit can use.

A hit at ``H`` needs every full-attention chunk below ``H`` but only the
window before ``H`` of a sliding-window group and only the state taken at
``H`` of a recurrent one (:func:`~kvoffload.connector._hits.needed_tokens`). So
storing every window chunk and every state is mostly wasted: on a layout of
five sliding-window layers per full-attention layer, five sixths of the bytes.
Full-prefix chunks are all stored; window chunks and states only for these
*hit points* of a request, all multiples of the hit alignment ``A``:

* the aligned end of its prompt, ``(P - 1) // A * A``: the same prompt again;
* where the chunks its lookup found in the full-prefix groups end (the
  junction where it left what was stored before), and the engine's own hit:
  the next request sharing that prefix;
* every ``retention_interval`` tokens (rounded up to a multiple of ``A``):
  prefixes shared in other places;
* the aligned end of what it computed when it finishes: the next turn of a
  conversation. That point is known only at the end, and by then vLLM has
  freed the window blocks before it and the states are gone, so from its
  prompt's end on a request keeps a *trailing* point at the aligned end of
  what it computed so far: its chunks are stored as it moves on, and those
  of the previous trailing point that no other point needs are dropped from
  the index (:class:`Trails`). When the request finishes, its last trailing
  point stays.

A window chunk no point wants yet, but that a later point may (it lies in
the window of the next multiple of ``A``), waits in the request's blocks: the
window of any later point starts after what vLLM frees. A state exists only
in the step whose forward pass reached its boundary (vLLM overwrites the
running state), so a state is stored then or never; with speculative decoding,
only if no accepted draft moved it (:mod:`kvoffload.connector._drafts`). What each
step stores, by these rules, is chosen in :mod:`kvoffload.connector._selection`.
"""

from __future__ import annotations

from collections.abc import Collection
from enum import Enum

from kvoffload.config import OffloadConfig
from kvoffload.config.layout import Reuse
from kvoffload.connector._hits import needed_chunks
from kvoffload.connector._request import RequestState

__all__ = ["Choice", "Retention"]


class Choice(Enum):
    """What becomes of one window chunk or state a step could store."""

    #: A hit point of the request needs it for good.
    KEEP = "keep"
    #: Only the request's trailing point needs it (for now).
    TRAIL = "trail"
    #: No point needs it yet, a later one may: look again at the next step.
    WAIT = "wait"
    #: No point ever will.
    SKIP = "skip"


class Retention:
    """The hit points of each request, and what they want of each window or state group."""

    def __init__(self, config: OffloadConfig, *, trail_step: int = 0) -> None:
        """``trail_step``: tokens a trailing point moves by (a tail's block where tails
        apply, :mod:`~kvoffload.connector._tails`); 0: the hit alignment."""
        self.layout = config.layout
        self.spans = config.tokens_per_chunk
        self.align = config.hit_alignment
        self.step = config.retention_step
        self.trailing = not config.offload_prompt_only
        self.trail_step = trail_step or self.align
        #: One full-attention group (a plain transformer): a request's keys are its chain.
        self.plain = len(self.layout.groups) == 1 and self.layout.groups[0].reuse is Reuse.PREFIX

    def prompt_end(self, req: RequestState) -> int:
        return max(req.prompt_tokens - 1, 0) // self.align * self.align

    def is_point(self, req: RequestState, point: int) -> bool:
        """Whether ``point`` is one of the request's lasting hit points (not the trailing one)."""
        if point <= 0 or point % self.align:
            return False
        if point in (self.prompt_end(req), req.junction, req.local_hit):
            return True
        return self.step > 0 and point % self.step == 0

    def advance(self, req: RequestState, end: int) -> bool:
        """Move the trailing point to ``end``'s aligned end (``trail_step``) once the prompt
        is computed.

        Returns whether it moved (the previous point's chunks may be released).
        """
        if not self.trailing or end < req.prompt_tokens:
            return False
        point = end // self.trail_step * self.trail_step
        if point <= req.trail:
            return False
        req.trail = point
        return True

    def window_choice(self, req: RequestState, g: int, chunk: int, end: int) -> Choice:
        """What to do with chunk ``chunk`` of window group ``g``, ``end`` tokens computed."""
        group, span = self.layout.groups[g], self.spans[g]
        first = (chunk + 1) * span
        width = group.sliding_window or group.attention_chunk_size or 0  # a window's reach
        points = range(-(-first // self.align) * self.align, first + width, self.align)
        wants = [p for p in points if chunk in needed_chunks(group, span, 0, p)]
        if any(self.is_point(req, p) for p in wants):
            return Choice.KEEP
        if req.trail in wants:
            return Choice.TRAIL
        # Windows only move right: the next multiple of A is the last chance.
        later = (end // self.align + 1) * self.align
        if chunk in needed_chunks(group, span, 0, later):
            return Choice.WAIT
        return Choice.SKIP

    def state_choice(self, req: RequestState, point: int) -> Choice:
        """What to do with the state at ``point`` (a state group's chunk boundary)."""
        if self.is_point(req, point):
            return Choice.KEEP
        return Choice.TRAIL if point == req.trail else Choice.SKIP

    def point_chunks(self, req: RequestState, point: int) -> set[bytes]:
        """Keys of the window chunks and states ``point`` needs, as far as the request knows."""
        out: set[bytes] = set()
        for g, group in enumerate(self.layout.groups):
            if group.reuse is Reuse.PREFIX:
                continue
            keys = req.keys[g]
            needed = needed_chunks(group, self.spans[g], 0, point)
            out.update(keys[c] for c in needed if c < len(keys))
        return out

    def used(self, req: RequestState) -> tuple[list[bytes], int]:
        """What a request's prompt used, in chain order, and how many of those vLLM served.

        For :func:`~kvoffload.manager.usage.record_use`: every full-prefix chunk
        (a prompt vLLM's GPU cache keeps serving must not look cold to the
        tiers); of window and state groups, what a hit at the point it was
        served to, or at its prompt's end, needs. Window chunks and states kept
        for other hit points were not used: they age and go first.
        """
        if self.plain:  # its chain is its keys (the request's own list, to read only)
            keys = req.keys[0]
            return keys, min(len(keys), req.local_hit // self.spans[0])
        top = min(len(keys) * span for keys, span in zip(req.keys, self.spans, strict=True))
        points = {max(req.offered, req.local_hit), top}
        wanted = [
            None
            if group.reuse is Reuse.PREFIX
            else {c for p in points for c in needed_chunks(group, span, 0, p)}
            for group, span in zip(self.layout.groups, self.spans, strict=True)
        ]
        ends = req.chain_ends(self.spans, wanted)
        served = sum(1 for end, _, _ in ends if end <= req.local_hit)
        return [req.keys[g][c] for _, g, c in ends], served

    def chain(self, req: RequestState, keys: Collection[bytes]) -> list[bytes]:
        """The request's chain that a store of ``keys`` completes in (``record_stores``).

        Every full-prefix chunk, and of window and state groups only ``keys``:
        ranking the chain ahead of them recent must not refresh what the
        request keeps for its other hit points.
        """
        if self.plain:  # its chain is its keys (the request's own list, to read only)
            return req.keys[0]
        mine = set(keys)
        wanted = [
            None
            if group.reuse is Reuse.PREFIX
            else {c for c, key in enumerate(group_keys) if key in mine}
            for group, group_keys in zip(self.layout.groups, req.keys, strict=True)
        ]
        return req.chain(self.spans, wanted)

    def parents(self, req: RequestState, keys: Collection[bytes]) -> list[bytes | None]:
        """Each of ``keys`` 's parent, for the index's prefix order: the chunk before it
        in its full-prefix group (``None``: a head, a window chunk, a state, a tail)."""
        mine, parent = set(keys), dict[bytes, bytes]()
        for group, chain in zip(self.layout.groups, req.keys, strict=True):
            if group.reuse is Reuse.PREFIX:
                parent.update((k, chain[c - 1]) for c, k in enumerate(chain) if c and k in mine)
        return [parent.get(key) for key in keys]
