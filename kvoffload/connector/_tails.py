"""Tails: hits at a recurrent state that a chunk cuts in two (issue 29).

A recurrent group's state exists only where the engine kept one: vLLM (align
mode) keeps it where a prefill step ended, for a prompt computed in one step
at its last block boundary before its last token, ``T = (P - 1) // B * B``.
Hits land on chunk ends (:mod:`kvoffload.connector._hits`), so at several
blocks per chunk ``T`` is often no hit point: chunk ``c = T // span`` is never
complete (the prompt ends inside it) and no state sits on a chunk end below.

So such a prompt stores a *tail* at ``T``, and so does a request at each block
boundary its output passes that a chunk cuts (its trailing point, which moves
block by block on these layouts: the next turn of a conversation resumes at its
output's last one; each is dropped when the trailing point moves on, the last
kept, as :mod:`kvoffload.connector._retention` trails chunk ends). A tail is: for
each full-attention group the part-chunk ``[c * span, T)`` (its ``T // B - c * bpc``
blocks; stored as a whole chunk slot whose positions past ``T`` repeat its last
block, never loaded), and for each state group the state at ``T``, each under its
own tail key
(:func:`~kvoffload.keys.tail_key`, chained onto chunk ``c - 1``'s key). A
lookup that finds the full-prefix chain stopping inside chunk ``c`` tries the
block boundaries inside it (at most ``bpc - 1``, best first): a hit at ``T``
needs the chain's chunks below ``c``, the full-attention tails and the states
at ``T``, which are exactly index ``c`` of each group's keys with the tails put
there (:func:`with_tail`), so the hit rules and load plans read them as any
hit's. The engine accepts the hit: ``T`` is a multiple of every group's block.

Tails apply to layouts of state and full-attention groups of one block size
(vLLM's recurrent hybrids) at more than one block per chunk; elsewhere
:class:`Tails` is falsy and nothing changes, keys and trailing points included.
States vLLM keeps where a chunked prefill step ends inside a chunk get no tail.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.config import OffloadConfig
from kvoffload.config.layout import Reuse
from kvoffload.connector._drafts import DraftedStates
from kvoffload.connector._request import RequestState, StepRequest, covered
from kvoffload.connector._retention import Choice
from kvoffload.connector._selection import Chosen
from kvoffload.connector._spans import NULL_BLOCK
from kvoffload.keys import EngineHashes, tail_key
from kvoffload.messages import ChunkSpan

__all__ = ["Tails", "whole_chunks", "with_tail"]


def with_tail(
    keys: Sequence[Sequence[bytes]], tails: Sequence[bytes], point: int, spans: Sequence[int]
) -> list[list[bytes]]:
    """Per group, the keys of the chunks before ``point`` and then the tail's key at ``point``."""
    return [
        [*group_keys[: point // span], tail]
        for group_keys, tail, span in zip(keys, tails, spans, strict=True)
    ]


def whole_chunks(span: ChunkSpan, blocks_per_chunk: int) -> list[bool]:
    """Per key of ``span``, whether its blocks there run to the chunk's end, each its own:
    not a tail (whose slot's padding repeats its last block, and whose load ends inside
    the chunk). Only such chunks are the engine's blocks a router may be told of."""
    ids, out = span.blocks.block_ids, []
    for start, stop, position in span.blocks.chunk_ranges(blocks_per_chunk):
        part = ids[start:stop]
        out.append(position + len(part) == blocks_per_chunk and len(set(part)) == len(part))
    return out


class Tails:
    """Where a layout's tails are, their keys, and the tail chunks a step stores."""

    def __init__(
        self, config: OffloadConfig, namespace: bytes, engine: EngineHashes | None = None
    ) -> None:
        groups = config.layout.groups
        sizes = {g.tokens_per_block for g in groups}
        kinds = {g.reuse for g in groups}
        on = (
            config.blocks_per_chunk > 1
            and len(sizes) == 1
            and Reuse.STATE in kinds
            and kinds <= {Reuse.STATE, Reuse.PREFIX}
        )
        #: Tokens per block where tails apply, 0 where they do not.
        self.block = sizes.pop() if on else 0
        self.bpc = config.blocks_per_chunk
        self.span = self.block * self.bpc
        self.groups = groups
        self.namespace = namespace
        self.engine = engine

    def __bool__(self) -> bool:
        return self.block > 0

    def is_tail(self, point: int) -> bool:
        return bool(self.block) and point > 0 and point % self.block == 0 and point % self.span != 0

    def candidates(self, top: int, cap: int, above: int) -> list[int]:
        """Tail points a lookup tries, best first: the block boundaries up to ``top`` inside
        the chunk where the full-prefix chain stops (at ``cap``), above ``above``."""
        if not self.block:
            return []
        block, span = self.block, self.span
        first = min(top, cap + span - block) // block * block
        return [t for t in range(first, max(above, cap), -block) if t % span]

    def keys(
        self,
        req: RequestState,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes] | None,
        point: int,
    ) -> tuple[bytes, ...] | None:
        """Every group's tail key at ``point``; ``None`` where ``req``'s keys or the engine's
        hashes do not reach it yet."""
        c, out = point // self.span, []
        for g, group_keys in enumerate(req.keys):
            if len(group_keys) < c:
                return None
            key = tail_key(
                group_keys[:c],
                token_ids,
                self.span,
                g,
                self.namespace,
                stop=point,
                extras=req.extras,
                engine=self.engine,
                block_hashes=block_hashes or (),
            )
            if key is None:
                return None
            out.append(key)
        return tuple(out)

    def point(self, req: RequestState) -> int:
        """The request's tail point: its prompt's last block boundary, if a chunk cuts it."""
        if not self.block:
            return 0
        point = max(req.prompt_tokens - 1, 0) // self.block * self.block
        return point if self.is_tail(point) else 0

    def chosen(self, req: RequestState, step: StepRequest, bounds: tuple[int, int]) -> list[Chosen]:
        """The tails ``step`` stores: at the request's prompt tail point, for good, and at its
        trailing point where that is a tail (a decoded output's end: the next turn), while it
        trails (:class:`~kvoffload.connector._trails.Trails`; ``req.trail_tail`` names it)."""
        prompt = self.point(req)
        out = self._at(req, step, bounds, prompt, Choice.KEEP) if prompt else []
        trail = req.trail if req.trail != prompt and self.is_tail(req.trail) else 0
        trailing = self._at(req, step, bounds, trail, Choice.TRAIL) if trail else []
        req.trail_tail = tuple(c.key_in(req) for c in trailing)
        return out + trailing

    def _at(
        self,
        req: RequestState,
        step: StepRequest,
        bounds: tuple[int, int],
        point: int,
        choice: Choice,
    ) -> list[Chosen]:
        """The tail at ``point``, every group's, if the step finds the states there
        (``bounds`` and ``step.states`` as in
        :meth:`~kvoffload.connector._selection.Selector.select`) and every full-attention
        block before it holds valid KV; all or nothing (a tail hit needs every group's)."""
        handed = {g: block for g, block, b in step.states if b == point}
        if (point not in bounds and not handed) or DraftedStates.moved(req, point):
            return []
        keys = self.keys(req, step.token_ids, step.block_hashes, point)
        if keys is None:
            return []
        c, last, out = point // self.span, point // self.block, []
        for g, group in enumerate(self.groups):
            blocks = step.block_ids[g]
            if group.reuse is Reuse.STATE:
                ids = (handed[g],) if g in handed else tuple(blocks[last - 1 : last])
                lo = point - 1
            else:
                ids = tuple(blocks[c * self.bpc : last])
                lo = c * self.span
            if len(ids) != last - lo // self.block or NULL_BLOCK in ids:
                return []
            if not covered(req.valid[g], lo, point):
                return []
            if group.reuse is Reuse.PREFIX:  # a whole chunk's slot: pad with its last block
                ids += (ids[-1],) * (self.bpc - len(ids))
            out.append(Chosen(g, c, ids, choice, keys[g]))
        return out
