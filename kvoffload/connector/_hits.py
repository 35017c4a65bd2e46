"""What a hit needs of every group kind (the hit rules), and the hit a lookup finds.

A hit of ``H`` tokens must be servable by every group at once, and vLLM only
resumes a hybrid request at a multiple of every group's block, so ``H`` is a
multiple of the least common multiple of the groups' chunk spans (or a
tail's block boundary inside a chunk, :mod:`kvoffload.connector._tails`). What a
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
:mod:`kvoffload.connector._search` finds the longest one the tiers can serve, as a
:class:`Hit`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

from kvoffload.config.layout import CacheGroup, KVLayout, Reuse
from kvoffload.errors import ConfigError

__all__ = ["Hit", "HitNeeds", "coarse_state_hits", "needed_chunks", "needed_tokens"]


class Hit(NamedTuple):
    """The longest prefix the tiers can serve now, and what the lookup learned finding it."""

    #: The hit point: the engine's own hit where the tiers add nothing to it.
    tokens: int
    #: Whether a chunk it needs is being stored or promoted right now: a CPU hit a step
    #: from now, so the lookup asks again rather than plan a load that would fail.
    pending: bool
    #: Where the full-prefix groups' available chunks end (aligned): past the hit, the
    #: junction where this prompt left the history stored so far.
    prefix_end: int = 0
    #: Keys the lookup found in a lower tier -> that tier's name: the hit's own, and any
    #: other it asked the lower tiers about.
    found_in: Mapping[bytes, str] = MappingProxyType({})
    #: Every group's tail key where the hit is at a tail (:mod:`~kvoffload.connector._tails`).
    tail: tuple[bytes, ...] = ()
    #: Whether a hit at ``prefix_end`` would fit the CPU tier's room: then what stops this
    #: one short of it is a window chunk or a state not stored
    #: (:mod:`~kvoffload.connector.misses`).
    prefix_fits: bool = False


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


class HitNeeds:
    """What a hit needs of every group of one layout: :func:`needed_chunks` per group."""

    def __init__(self, groups: Sequence[CacheGroup], tokens_per_chunk: Sequence[int]) -> None:
        self.groups = tuple(groups)
        self.tokens_per_chunk = tuple(tokens_per_chunk)

    def chunks(self, local: int, hit: int) -> list[range]:
        """Per group, the chunks a hit at ``hit`` needs beyond the engine's ``local`` hit."""
        return [
            needed_chunks(group, span, local, hit)
            for group, span in zip(self.groups, self.tokens_per_chunk, strict=True)
        ]

    def count(self, local: int, hit: int) -> int:
        """How many chunks a hit at ``hit`` needs beyond ``local``, every group together."""
        return sum(len(r) for r in self.chunks(local, hit))
