"""Tail keys: the key of a part-chunk, a whole number of blocks that ends a hit point.

A recurrent hybrid at several blocks per chunk keeps its state where the engine
kept one, at a block boundary that a chunk may cut in two
(:mod:`kvoffload.connector._tails`). The part of that chunk before the boundary,
``[c * span, stop)``, gets a key of its own: chained, like a chunk's, onto the key
before it (``previous``: chunk ``c - 1``'s, or the group's seed), over the tokens
(or the engine's block hash at ``stop``) since. It is hashed with a BLAKE2b
personalisation of its own, so no tail key ever equals a chunk key, and its
length is in it, so two tails of one chunk never share a key.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from kvoffload.keys._engine import EngineHashes, _engine_seed
from kvoffload.keys._extras import KEY_BYTES, KeyExtras
from kvoffload.keys._prefix import chain_seed

__all__ = ["tail_key"]

_PERSON = b"kvoffload/tail1"


def tail_key(
    previous: Sequence[bytes],
    token_ids: Sequence[int],
    tokens_per_chunk: int,
    group_idx: int,
    namespace: bytes,
    *,
    stop: int,
    extras: KeyExtras | None = None,
    engine: EngineHashes | None = None,
    block_hashes: Sequence[bytes] = (),
) -> bytes | None:
    """The key of group ``group_idx``'s tokens ``[len(previous) * tokens_per_chunk, stop)``.

    ``previous`` are the group's keys of the chunks before (exactly
    ``stop // tokens_per_chunk`` of them). With ``engine``, the key is chained
    over ``block_hashes`` at ``stop``; ``None`` where the engine has no hash
    ending there (yet).
    """
    first = len(previous) * tokens_per_chunk
    if not first < stop < first + tokens_per_chunk:
        raise ValueError(f"a tail of chunk {len(previous)} must end inside it, not at {stop}")
    if previous:
        head = previous[-1]
    else:
        head = chain_seed(group_idx, tokens_per_chunk, namespace, extras)
        if engine is not None:
            head = _engine_seed(head, engine.algorithm)
    hasher = hashlib.blake2b(head, digest_size=KEY_BYTES, person=_PERSON)
    hasher.update(struct.pack("<Q", stop - first))
    if engine is None:
        hasher.update(np.asarray(token_ids[first:stop], dtype="<i8").tobytes())
    else:
        if stop % engine.block_size or len(block_hashes) < stop // engine.block_size:
            return None
        hasher.update(block_hashes[stop // engine.block_size - 1])
    if extras is not None and extras.per_chunk:
        hasher.update(extras.chunk_tag(first, stop))
    return hasher.digest()
