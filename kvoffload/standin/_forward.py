"""The stand-in's forward pass: which KV each step writes, final or not yet, and the check of loads.

Without a drafter a block's KV is a function of the tokens up to its end, and
the step that computes its last token writes it for good. An EAGLE-like
drafter (``KVLayout.lookahead = k``) reads the target's hidden state at a
position with the embedding of the token after it (a multi-module MTP: the
``k`` tokens after it), so a block's KV is a function of the tokens up to
its end *and* the ``k`` after it (its hash names them: a lookahead block
hash, as vLLM 0.34 makes them). It is final only once the drafter's KV of
the block's last position ``p`` is: vLLM computes it again from the next
step's tokens until the request's computed tokens exceed ``p + k - 1``, and
it never exists without the ``k`` tokens after ``p``. Until then the step
writes a *provisional* KV (other bytes, :func:`provisional_key`), and the
step in which it becomes final writes the final one. A connector that
stores a block before then, or keys it without the tokens after it, hands a
later request bytes other than the final ones, and the check after every
load (:func:`verify_blocks`) counts the block as mismatched.
"""

from __future__ import annotations

import hashlib

from kvoffload.config.layout import KVLayout, Reuse
from kvoffload.connector._hits import needed_tokens
from kvoffload.errors import ConfigError
from kvoffload.standin._kv import KVPages
from kvoffload.standin._prefix_cache import NULL_BLOCK
from kvoffload.standin._state import state_key
from kvoffload.standin._types import SimRequest

__all__ = [
    "carry_states",
    "check_lookahead",
    "final_after",
    "final_tokens",
    "provisional_key",
    "verify_blocks",
    "write_step",
]


def check_lookahead(layout: KVLayout) -> None:
    """A lookahead beside a recurrent state group is refused: the stand-in has no drafts.

    Its requests generate known tokens one decode step after another and never
    verify draft tokens, so it cannot show what vLLM does to a recurrent state
    that accepted drafts reached (the scheduler side's rule for it,
    :mod:`kvoffload.connector._drafts`, is proven on vLLM itself and by unit tests).
    """
    if layout.lookahead and any(g.reuse is Reuse.STATE for g in layout.groups):
        raise ConfigError(
            f"a lookahead of {layout.lookahead} beside recurrent state groups: the stand-in "
            "verifies no draft tokens, so it has no speculative decoding to show there"
        )


def final_tokens(lookahead: int, computed: int, num_tokens: int) -> int:
    """Tokens at the start of a request of ``num_tokens`` whose KV is final once ``computed``
    are computed: position ``p`` is when ``computed > p + lookahead - 1`` and the ``lookahead``
    tokens after it exist (vLLM's rule; the request's whole token list is known here)."""
    if not lookahead:
        return computed
    return max(0, min(computed - lookahead + 1, num_tokens - lookahead))


def final_after(layout: KVLayout, req: SimRequest, computed: int) -> int:
    """Tokens of ``req`` whose KV is final once ``computed`` are: what was final stays so."""
    return max(req.final, final_tokens(layout.lookahead, computed, req.num_tokens))


def provisional_key(block_hash: bytes) -> bytes:
    """What a block's KV is a function of before it is final (``block_hash``: its hash without
    the lookahead): bytes that differ from the final ones."""
    return hashlib.blake2b(b"provisional" + block_hash, digest_size=16).digest()


def carry_states(kv: KVPages, layout: KVLayout, req: SimRequest, n: int) -> None:
    """vLLM's ``preprocess_mamba``, before the connector's ``start_load_kv``: a step of ``n``
    tokens runs ``req`` 's state in the block it ends in, copied from the block the state
    before it is in (the last step's, or a hit's) where they differ."""
    if not (req.computed and n):
        return
    end = min(req.computed + n, req.num_tokens)
    for g, group in enumerate(layout.groups):
        tpb, blocks = group.tokens_per_block, req.blocks[g]
        source, target = blocks[(req.computed - 1) // tpb], blocks[(end - 1) // tpb]
        if group.reuse is Reuse.STATE and NULL_BLOCK not in (source, target) and source != target:
            kv.copy(g, source, target)


def write_step(kv: KVPages, layout: KVLayout, req: SimRequest, n: int) -> int:
    """Write the KV of every full block a step of ``n`` tokens of ``req`` computes, and with a
    lookahead the final KV of those it makes final (``req.final``: final before the step).

    Returns the states the step ran from that were wrong: a recurrent layer
    reads the state after ``req.computed`` tokens from the block it writes
    the next one into (:func:`carry_states` put it there).
    """
    end = min(req.computed + n, req.num_tokens)
    final = final_after(layout, req, end)
    wrong = 0
    for g, group in enumerate(layout.groups):
        tpb, blocks, hashes = group.tokens_per_block, req.blocks[g], req.hashes[g]
        if group.reuse is Reuse.STATE:  # the state after the step, in its last block
            running = blocks[(end - 1) // tpb] if n else NULL_BLOCK
            if running == NULL_BLOCK:
                continue
            before = state_key(hashes, req.tokens, req.computed, tpb)
            wrong += bool(req.computed) and not kv.holds(g, running, before)
            kv.write(g, running, state_key(hashes, req.tokens, end, tpb))
            continue
        # Blocks whose KV turns final this step, then those it computes (never a hit's).
        for b in range(min(req.final, req.computed) // tpb, end // tpb):
            if blocks[b] == NULL_BLOCK:
                continue
            if (b + 1) * tpb <= final:
                kv.write(g, blocks[b], hashes[b])
            else:
                kv.write(g, blocks[b], provisional_key(req.provisional[g][b]))
    return wrong


def verify_blocks(
    kv: KVPages, layout: KVLayout, req: SimRequest, start: int, stop: int
) -> tuple[int, int]:
    """``(exact, wrong)``: the full blocks a load of tokens ``[start, stop)`` filled, checked
    bit-exact against their final KV. A block that cannot be final (the tokens after it do
    not exist) is wrong whatever it holds."""
    exact = wrong = 0
    for g, group in enumerate(layout.groups):
        tpb, hashes = group.tokens_per_block, req.hashes[g]
        first, _ = needed_tokens(group, start, stop)
        for b in range(first // tpb, stop // tpb):
            block = req.blocks[g][b]
            if block == NULL_BLOCK:
                continue
            if b < len(hashes) and kv.holds(g, block, hashes[b]):
                exact += 1
            else:
                wrong += 1
    return exact, wrong
