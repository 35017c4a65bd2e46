"""Chunk keys: chained prefix hashes of token ids, inside a layout namespace.

A chunk's key must name *all* tokens up to the chunk's end, because KV of a
token depends on every token before it. Hashing each chunk's tokens onto the
previous key (a hash chain) gives that in O(chunk) work per key, and lets a
growing request extend its keys without rehashing its prefix
(:func:`extend_prefix_keys`).

Keys are 16-byte BLAKE2b digests of a fixed byte encoding (token ids as
little-endian int64), so they are equal across processes, machines and
Python versions; Python's ``hash()`` is salted per process and never used.
The chain seed mixes a version tag, the group index, the chunk size and the
namespace, so two groups, two chunk sizes or two namespaces never share a key.

Token ids may be any int64 value, negative included: engines do not produce
them, but hashing them is well defined and refusing them would cost a pass
over every request. Floats, bools and out-of-range values are refused.

**More than tokens** (DESIGN.md, invariant 6). A request's KV also depends on
its tenant's cache salt, its LoRA adapter, its multimodal inputs and prompt
embeddings; :class:`KeyExtras` carries them into the chain. Salt and adapter
apply to every position, so they go into the chain's seed (every key of the
request differs from an unsalted one's). A multimodal item or embeddings
apply to the positions they cover, so they go into exactly the chunks that
overlap them, after the chunk's token ids; the chain carries them forward,
as vLLM's block hashes do. A request without extras hashes exactly as
before, so chunks stored by earlier versions stay valid. Everything mixed in
is content, never a per-process id, so keys stay equal across processes and
machines: the disk and remote tiers are shared by restarts and by engines.

**From the engine's block hashes** (:func:`extend_engine_keys`). vLLM hashes
every request's tokens itself, for its prefix cache, before a connector sees
the request. Hashing them again here was half of the connector's scheduler
time, so a chunk's key can instead be chained over the engine's hash at the
chunk's end (which names every token up to there), with the same seed and
extras as above plus the engine's hash algorithm. Such keys are exactly as
stable as the engine's hashes: equal across processes and machines that run
the same vLLM with a reproducible hash (its default, sha256, is), different
(never wrong) across vLLM versions that hash differently. Token keys and
engine keys never coincide, so a tier holding both only misses.
"""

from __future__ import annotations

from kvoffload.keys._engine import EngineHashes, extend_engine_keys
from kvoffload.keys._extras import KEY_BYTES, KeyExtras, MMItem, PromptEmbeds
from kvoffload.keys._namespace import namespace_of
from kvoffload.keys._prefix import (
    extend_prefix_keys,
    prefix_keys,
    prefix_keys_for_layout,
    short_key,
)
from kvoffload.keys._tail import tail_key

__all__ = [
    "KEY_BYTES",
    "EngineHashes",
    "KeyExtras",
    "MMItem",
    "PromptEmbeds",
    "extend_engine_keys",
    "extend_prefix_keys",
    "namespace_of",
    "prefix_keys",
    "prefix_keys_for_layout",
    "short_key",
    "tail_key",
]
