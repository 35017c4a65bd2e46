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

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvoffload._checks import checked_int
from kvoffload._key_extras import KEY_BYTES, KeyExtras, MMItem, PromptEmbeds, canonical
from kvoffload.errors import ConfigError

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
]

_SEED_TAG = b"kvoffload/prefix-key/v1\x00"
_NAMESPACE_TAG = b"kvoffload/namespace/v1\x00"
_ENGINE_TAG = b"kvoffload/engine-keys/v1\x00"
#: An empty key hasher, copied for each key of an engine-hash chain.
_BLANK = hashlib.blake2b(digest_size=KEY_BYTES)
_INT64 = np.dtype("<i8")


class _Group(Protocol):
    """What :func:`namespace_of` reads of a ``kvoffload.config.layout.CacheGroup``."""

    @property
    def kind(self) -> str: ...
    @property
    def tokens_per_block(self) -> int: ...
    @property
    def layer_names(self) -> Sequence[str]: ...
    @property
    def page_bytes(self) -> int: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def attention_chunk_size(self) -> int | None: ...
    @property
    def layer_page_bytes(self) -> Sequence[int] | None: ...


class _Layout(Protocol):
    """What :func:`namespace_of` reads of a ``kvoffload.config.layout.KVLayout``."""

    @property
    def groups(self) -> Sequence[_Group]: ...


def short_key(key: bytes) -> str:
    """The first 8 bytes of ``key`` in hex, for error messages and logs."""
    text = key.hex()
    return text if len(text) <= 16 else text[:16] + "..."


def _token_array(token_ids: object) -> npt.NDArray[np.int64]:
    """``token_ids`` as little-endian int64, refusing anything that would be truncated."""
    try:
        values = np.asarray(token_ids)
    except (OverflowError, ValueError, TypeError) as exc:
        raise ConfigError(f"token_ids must be a 1-D sequence of int64: {exc}") from exc
    if values.ndim != 1:
        raise ConfigError(f"token_ids must be 1-D, got shape {values.shape}")
    if values.size == 0:
        return np.empty(0, dtype=_INT64)
    if values.dtype.kind not in "iu":
        raise ConfigError(f"token_ids must be integers that fit in int64, got dtype {values.dtype}")
    if values.dtype.kind == "u" and values.dtype.itemsize >= 8 and int(values.max()) >= 2**63:
        raise ConfigError(f"token id {int(values.max())} does not fit in int64")
    return values.astype(_INT64, copy=False)


@functools.lru_cache(maxsize=64)
def _packer(tokens_per_chunk: int) -> Callable[..., bytes]:
    """Packs one chunk of Python ints into its int64 bytes (one compiled format per span)."""
    return struct.Struct(f"<{tokens_per_chunk}q").pack


def _list_chunks(token_ids: object, first: int, count: int, span: int) -> list[bytes] | None:
    """The int64 bytes of ``count`` chunks of a list of ints from token ``first``, or ``None``.

    vLLM hands a connector Python lists. ``struct`` packs them chunk by chunk
    several times faster than ``array`` or numpy convert them (those parse or
    infer every item), and no copy of the whole prompt is made: this was the
    bulk of a lookup's cost. Anything else (arrays, a bool first, floats,
    values beyond int64) returns ``None`` for :func:`_token_array` to convert
    or refuse.
    """
    if type(token_ids) is not list or (token_ids and type(token_ids[0]) is bool):
        return None
    pack = _packer(span)
    try:
        return [pack(*token_ids[lo : lo + span]) for lo in range(first, first + count * span, span)]
    except struct.error:
        return None


def _chain_seed(
    group_idx: int, tokens_per_chunk: int, namespace: bytes, extras: KeyExtras | None
) -> bytes:
    """The key before chunk 0; a request's salt and adapter are hashed onto it."""
    checked_int("group_idx", group_idx, minimum=0, maximum=2**32 - 1)
    if not isinstance(namespace, bytes):
        raise ConfigError(f"namespace must be bytes, got {type(namespace).__name__}")
    if extras is not None and not isinstance(extras, KeyExtras):
        raise ConfigError(f"extras must be KeyExtras or None, got {type(extras).__name__}")
    seed = _plain_seed(group_idx, tokens_per_chunk, bytes(namespace))
    tag = None if extras is None else extras.request_tag()
    if tag is not None:  # the seed has a fixed length, so seed + tag is unambiguous
        seed = hashlib.blake2b(seed + tag, digest_size=KEY_BYTES).digest()
    return seed


@functools.lru_cache(maxsize=256)
def _plain_seed(group_idx: int, tokens_per_chunk: int, namespace: bytes) -> bytes:
    """The seed before extras: the same few per engine, so hashed once each."""
    header = _SEED_TAG + struct.pack("<IQ", group_idx, tokens_per_chunk)
    return hashlib.blake2b(header + namespace, digest_size=KEY_BYTES).digest()


def _chain(
    previous: bytes,
    chunks: Sequence[bytes | memoryview],
    tokens_per_chunk: int,
    first_chunk: int = 0,
    extras: KeyExtras | None = None,
) -> list[bytes]:
    """Keys of ``chunks`` (their int64 bytes; chunk ``first_chunk`` on), chained onto ``previous``.

    A chunk's token bytes have a fixed length, so the extras appended after
    them (:meth:`KeyExtras.chunk_tag`) can never be mistaken for tokens.
    """
    blake2b = hashlib.blake2b
    keys: list[bytes] = []
    if extras is None or not extras.per_chunk:
        for data in chunks:
            hasher = blake2b(previous, digest_size=KEY_BYTES)
            hasher.update(data)
            previous = hasher.digest()
            keys.append(previous)
        return keys
    tag = extras.chunk_tag
    for i, data in enumerate(chunks):
        hasher = blake2b(previous, digest_size=KEY_BYTES)
        hasher.update(data)
        first = (first_chunk + i) * tokens_per_chunk
        hasher.update(tag(first, first + tokens_per_chunk))
        previous = hasher.digest()
        keys.append(previous)
    return keys


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
    return _engine_seed(_chain_seed(group_idx, tokens_per_chunk, namespace, None), algorithm)


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
        seed = _chain_seed(group_idx, tokens_per_chunk, namespace, extras)
        previous = _engine_seed(seed, engine.algorithm)
    ends = block_hashes[per_chunk * (done + 1) - 1 : per_chunk * count : per_chunk]
    odd = set(map(type, ends)) - {bytes}  # in C: a lookup hands every hash of its prompt
    if odd:
        raise ConfigError(f"block hashes must be bytes, got {min(t.__name__ for t in odd)}")
    if extras is not None and extras.per_chunk:
        return _chain(previous, ends, tokens_per_chunk, done, extras)
    # The plain chain, written out: this loop is most of what a lookup costs (copying a
    # blank hasher is a third cheaper than making one with its parameters).
    keys = []
    for end in ends:
        hasher = _BLANK.copy()
        hasher.update(previous + end)
        previous = hasher.digest()
        keys.append(previous)
    return keys


def _array_chunks(
    tokens: npt.NDArray[np.int64], tokens_per_chunk: int
) -> Sequence[bytes | memoryview]:
    """The int64 bytes of each full chunk of ``tokens``, views of one buffer."""
    count = len(tokens) // tokens_per_chunk
    data = memoryview(tokens[: count * tokens_per_chunk].tobytes())
    step = tokens_per_chunk * _INT64.itemsize
    return [data[start : start + step] for start in range(0, count * step, step)]


def _chunk_bytes(
    token_ids: Sequence[int] | npt.NDArray[np.integer], start: int, stop: int, span: int
) -> Sequence[bytes | memoryview]:
    """The int64 bytes of the full chunks of ``token_ids[start * span : stop]``."""
    first = start * span
    count = max(0, stop - first) // span
    ids: object = token_ids
    if type(ids) is not list and not isinstance(ids, np.ndarray):
        ids, first = token_ids[first : first + count * span], 0  # vLLM's ConstantList -> list
    packed = _list_chunks(ids, first, count, span)
    if packed is not None:
        return packed
    return _array_chunks(_token_array(token_ids[start * span : stop]), span)


def prefix_keys(
    token_ids: Sequence[int] | npt.NDArray[np.integer],
    tokens_per_chunk: int,
    group_idx: int = 0,
    namespace: bytes = b"",
    *,
    extras: KeyExtras | None = None,
) -> list[bytes]:
    """One key per *full* chunk of ``token_ids``; a trailing partial chunk gets none.

    ``key[i]`` names tokens ``[0, (i + 1) * tokens_per_chunk)`` of group
    ``group_idx`` in ``namespace`` (see :func:`namespace_of`), and whatever
    ``extras`` says those tokens depend on.
    """
    tokens_per_chunk = checked_int("tokens_per_chunk", tokens_per_chunk)
    seed = _chain_seed(group_idx, tokens_per_chunk, namespace, extras)
    chunks = _chunk_bytes(token_ids, 0, len(token_ids), tokens_per_chunk)
    return _chain(seed, chunks, tokens_per_chunk, 0, extras)


def extend_prefix_keys(
    keys: Sequence[bytes],
    token_ids: Sequence[int] | npt.NDArray[np.integer],
    tokens_per_chunk: int,
    group_idx: int = 0,
    namespace: bytes = b"",
    *,
    extras: KeyExtras | None = None,
    stop: int | None = None,
) -> list[bytes]:
    """The keys of ``token_ids`` after the ``len(keys)`` already computed by :func:`prefix_keys`.

    ``token_ids`` is the whole sequence (prefix included), so a request that
    grew by some tokens hashes only its new full chunks:
    ``keys + extend_prefix_keys(keys, ...) == prefix_keys(...)``. With
    ``stop``, only ``token_ids[:stop]`` counts (no copy of the rest is made).
    """
    tokens_per_chunk = checked_int("tokens_per_chunk", tokens_per_chunk)
    seed = _chain_seed(group_idx, tokens_per_chunk, namespace, extras)
    done = len(keys)
    length = len(token_ids) if stop is None else min(stop, len(token_ids))
    if done * tokens_per_chunk > length:
        raise ConfigError(
            f"{done} keys of {tokens_per_chunk} tokens need at least "
            f"{done * tokens_per_chunk} token ids, got {length}"
        )
    previous = keys[-1] if done else seed
    # Only the new tokens are converted: a growing request pays for its growth.
    chunks = _chunk_bytes(token_ids, done, length, tokens_per_chunk)
    return _chain(previous, chunks, tokens_per_chunk, done, extras)


def prefix_keys_for_layout(
    token_ids: Sequence[int] | npt.NDArray[np.integer],
    tokens_per_chunk: Sequence[int],
    namespace: bytes = b"",
    *,
    extras: KeyExtras | None = None,
) -> list[list[bytes]]:
    """Keys of every group: ``tokens_per_chunk[g]`` is group ``g``'s chunk span in tokens.

    With several groups, token ids are converted once and shared by all of
    them, which is the cost that matters for hybrid layouts.
    """
    if isinstance(tokens_per_chunk, str | bytes) or not isinstance(tokens_per_chunk, Sequence):
        raise ConfigError(
            f"tokens_per_chunk must be a sequence of ints (one per group), got {tokens_per_chunk!r}"
        )
    spans = [checked_int(f"tokens_per_chunk[{g}]", t) for g, t in enumerate(tokens_per_chunk)]
    if len(spans) == 1:
        return [prefix_keys(token_ids, spans[0], 0, namespace, extras=extras)]
    tokens = _token_array(token_ids)
    seeds = [_chain_seed(g, span, namespace, extras) for g, span in enumerate(spans)]
    return [
        _chain(seed, _array_chunks(tokens, span), span, 0, extras)
        for seed, span in zip(seeds, spans, strict=True)
    ]


def namespace_of(model_id: str, dtype: object, layout: _Layout) -> bytes:
    """A 16-byte fingerprint of everything that makes stored KV bytes reusable.

    Model id, dtype and, per group in order: kind, tokens per block, layer
    names, page bytes, sliding window and, where set, attention chunk and
    per-layer page bytes (absent ones leave older namespaces unchanged).
    ``dtype`` may be a string or a ``torch.dtype``; ``"torch.bfloat16"`` and
    ``"bfloat16"`` agree.
    """
    if not isinstance(model_id, str) or not model_id:
        raise ConfigError(f"model_id must be a non-empty str, got {model_id!r}")
    dtype_name = str(dtype).removeprefix("torch.")
    if not dtype_name:
        raise ConfigError("dtype must name a dtype, got an empty string")
    groups: list[dict[str, object]] = []
    for g in layout.groups:
        fields: dict[str, object] = {
            "kind": str(g.kind),
            "tokens_per_block": int(g.tokens_per_block),
            "layer_names": [str(n) for n in g.layer_names],
            "page_bytes": int(g.page_bytes),
            "sliding_window": None if g.sliding_window is None else int(g.sliding_window),
        }
        if g.attention_chunk_size is not None:
            fields["attention_chunk_size"] = int(g.attention_chunk_size)
        if g.layer_page_bytes is not None:
            fields["layer_page_bytes"] = [int(p) for p in g.layer_page_bytes]
        groups.append(fields)
    document = {"model": model_id, "dtype": dtype_name, "groups": groups}
    return hashlib.blake2b(_NAMESPACE_TAG + canonical(document), digest_size=KEY_BYTES).digest()
