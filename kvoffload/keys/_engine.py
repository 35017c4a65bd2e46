"""Engine keys: a hash chain over the engine's own block hashes (see :mod:`kvoffload.keys`)."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload._checks import checked_int
from kvoffload.errors import ConfigError
from kvoffload.keys._extras import KEY_BYTES, KeyExtras
from kvoffload.keys._prefix import chain, chain_seed

__all__ = ["EngineHashes", "extend_engine_keys"]

_ENGINE_TAG = b"kvoffload/engine-keys/v1\x00"
#: An empty key hasher, copied for each key of an engine-hash chain.
_BLANK = hashlib.blake2b(digest_size=KEY_BYTES)


@dataclass(frozen=True, slots=True)
class EngineHashes:
    """How the engine names prefixes: one hash per ``block_size`` tokens, by ``algorithm``.

    vLLM's ``request.block_hashes``: hash ``i`` names tokens
    ``[0, (i + 1) * block_size)`` and what they depend on (salt, adapter name,
    multimodal items, embeddings). ``algorithm`` (vLLM's
    ``prefix_caching_hash_algo``) goes into every key's seed, so hashes of two
    algorithms never meet.
    """

    block_size: int
    algorithm: str

    def __post_init__(self) -> None:
        checked_int("EngineHashes.block_size", self.block_size)
        if not isinstance(self.algorithm, str) or not self.algorithm:
            raise ConfigError(f"EngineHashes.algorithm must be a non-empty str: {self.algorithm!r}")

    def check_span(self, tokens_per_chunk: int) -> None:
        """Refuse a chunk span that does not end on the engine's hashes."""
        if tokens_per_chunk % self.block_size:
            raise ConfigError(
                f"a chunk of {tokens_per_chunk} tokens does not end on the engine's block "
                f"hashes (one per {self.block_size} tokens); use key_source='tokens'"
            )


@functools.lru_cache(maxsize=256)
def _engine_seed(seed: bytes, algorithm: str) -> bytes:
    return hashlib.blake2b(_ENGINE_TAG + seed + algorithm.encode(), digest_size=KEY_BYTES).digest()


@functools.lru_cache(maxsize=256)
def _plain_engine_seed(
    group_idx: int, tokens_per_chunk: int, namespace: bytes, algorithm: str
) -> bytes:
    """The seed of an engine-hash chain without extras: the same few per engine, made once
    each (a lookup's fixed cost was a third of its keys' cost)."""
    return _engine_seed(chain_seed(group_idx, tokens_per_chunk, namespace, None), algorithm)


@functools.lru_cache(maxsize=256)
def _hashes_per_chunk(tokens_per_chunk: int, engine: EngineHashes) -> int:
    """Engine hashes per chunk, once the span is checked (checked once per span and engine)."""
    engine.check_span(checked_int("tokens_per_chunk", tokens_per_chunk))
    return tokens_per_chunk // engine.block_size


def extend_engine_keys(
    keys: Sequence[bytes],
    block_hashes: Sequence[bytes],
    tokens_per_chunk: int,
    group_idx: int = 0,
    namespace: bytes = b"",
    *,
    engine: EngineHashes,
    extras: KeyExtras | None = None,
    stop: int,
) -> list[bytes]:
    """Keys of the full chunks in tokens ``[len(keys) * tokens_per_chunk, stop)``, from hashes.

    The counterpart of :func:`extend_prefix_keys` for a request the engine
    has hashed: chunk ``c``'s key is chained over ``block_hashes`` at its end
    (the module docstring says when to use which). Chunks past the hashes
    given get no key yet.
    """
    if type(tokens_per_chunk) is not int:  # a bool or 2.0 must not hit the cache of 1 or 2
        tokens_per_chunk = checked_int("tokens_per_chunk", tokens_per_chunk)
    per_chunk = _hashes_per_chunk(tokens_per_chunk, engine)
    done = len(keys)
    count = min(stop // tokens_per_chunk, len(block_hashes) // per_chunk)
    if done >= count:
        return []
    if done:
        previous = keys[-1]
    elif extras is None and type(group_idx) is int and type(namespace) is bytes:
        previous = _plain_engine_seed(group_idx, tokens_per_chunk, namespace, engine.algorithm)
    else:
        seed = chain_seed(group_idx, tokens_per_chunk, namespace, extras)
        previous = _engine_seed(seed, engine.algorithm)
    ends = block_hashes[per_chunk * (done + 1) - 1 : per_chunk * count : per_chunk]
    odd = set(map(type, ends)) - {bytes}  # in C: a lookup hands every hash of its prompt
    if odd:
        raise ConfigError(f"block hashes must be bytes, got {min(t.__name__ for t in odd)}")
    if extras is not None and extras.per_chunk:
        return chain(previous, ends, tokens_per_chunk, done, extras)
    # The plain chain, written out: this loop is most of what a lookup costs (copying a
    # blank hasher is a third cheaper than making one with its parameters).
    keys = []
    for end in ends:
        hasher = _BLANK.copy()
        hasher.update(previous + end)
        previous = hasher.digest()
        keys.append(previous)
    return keys
