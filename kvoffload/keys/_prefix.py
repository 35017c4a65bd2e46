"""Token keys: a hash chain over each chunk's token ids (see :mod:`kvoffload.keys`)."""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvoffload._checks import checked_int
from kvoffload.errors import ConfigError
from kvoffload.keys._extras import KEY_BYTES, KeyExtras

__all__ = [
    "chain",
    "chain_seed",
    "extend_prefix_keys",
    "prefix_keys",
    "prefix_keys_for_layout",
    "short_key",
]

_SEED_TAG = b"kvoffload/prefix-key/v1\x00"
_INT64 = np.dtype("<i8")


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


def _list_chunks(
    token_ids: object, first: int, count: int, span: int, lookahead: int = 0
) -> list[bytes] | None:
    """The int64 bytes of ``count`` chunks of a list of ints from token ``first``, or ``None``.

    Each chunk's bytes run ``lookahead`` tokens into the next (see :func:`extend_prefix_keys`).

    vLLM hands a connector Python lists. ``struct`` packs them chunk by chunk
    several times faster than ``array`` or numpy convert them (those parse or
    infer every item), and no copy of the whole prompt is made: this was the
    bulk of a lookup's cost. Anything else (arrays, a bool first, floats,
    values beyond int64) returns ``None`` for :func:`_token_array` to convert
    or refuse.
    """
    if type(token_ids) is not list or (token_ids and type(token_ids[0]) is bool):
        return None
    pack, width = _packer(span + lookahead), span + lookahead
    try:
        starts = range(first, first + count * span, span)
        return [pack(*token_ids[lo : lo + width]) for lo in starts]
    except struct.error:
        return None


def chain_seed(
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


def chain(
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


def _array_chunks(
    tokens: npt.NDArray[np.int64], tokens_per_chunk: int, lookahead: int = 0
) -> Sequence[bytes | memoryview]:
    """The int64 bytes of each full chunk of ``tokens`` and the ``lookahead`` tokens after it,
    views of one buffer."""
    count = max(0, len(tokens) - lookahead) // tokens_per_chunk
    data = memoryview(tokens[: count * tokens_per_chunk + lookahead].tobytes())
    step = tokens_per_chunk * _INT64.itemsize
    width = step + lookahead * _INT64.itemsize
    return [data[start : start + width] for start in range(0, count * step, step)]


def _chunk_bytes(
    token_ids: Sequence[int] | npt.NDArray[np.integer],
    start: int,
    stop: int,
    span: int,
    lookahead: int = 0,
) -> Sequence[bytes | memoryview]:
    """The int64 bytes of the full chunks of ``token_ids[start * span : stop]`` that have
    ``lookahead`` more tokens before ``stop``, each with them."""
    first = start * span
    count = max(0, stop - first - lookahead) // span
    ids: object = token_ids
    if type(ids) is not list and not isinstance(ids, np.ndarray):  # vLLM's ConstantList -> list
        ids, first = token_ids[first : first + count * span + lookahead], 0
    packed = _list_chunks(ids, first, count, span, lookahead)
    if packed is not None:
        return packed
    return _array_chunks(_token_array(token_ids[start * span : stop]), span, lookahead)


def prefix_keys(
    token_ids: Sequence[int] | npt.NDArray[np.integer],
    tokens_per_chunk: int,
    group_idx: int = 0,
    namespace: bytes = b"",
    *,
    extras: KeyExtras | None = None,
    lookahead: int = 0,
) -> list[bytes]:
    """One key per *full* chunk of ``token_ids``; a trailing partial chunk gets none.

    ``key[i]`` names tokens ``[0, (i + 1) * tokens_per_chunk)`` of group
    ``group_idx`` in ``namespace`` (see :func:`namespace_of`), whatever
    ``extras`` says those tokens depend on, and the ``lookahead`` tokens after
    them (see :func:`extend_prefix_keys`).
    """
    return extend_prefix_keys(
        [], token_ids, tokens_per_chunk, group_idx, namespace, extras=extras, lookahead=lookahead
    )


def extend_prefix_keys(
    keys: Sequence[bytes],
    token_ids: Sequence[int] | npt.NDArray[np.integer],
    tokens_per_chunk: int,
    group_idx: int = 0,
    namespace: bytes = b"",
    *,
    extras: KeyExtras | None = None,
    stop: int | None = None,
    lookahead: int = 0,
) -> list[bytes]:
    """The keys of ``token_ids`` after the ``len(keys)`` already computed by :func:`prefix_keys`.

    ``token_ids`` is the whole sequence (prefix included), so a request that
    grew by some tokens hashes only its new full chunks:
    ``keys + extend_prefix_keys(keys, ...) == prefix_keys(...)``. With
    ``stop``, only ``token_ids[:stop]`` counts (no copy of the rest is made).

    ``lookahead``: tokens after a chunk that its KV depends on too (an
    EAGLE-like drafter's KV at a position reads the next token). Each key
    then hashes them after the chunk's own, so a chunk gets its key only
    once they are known, and two prefixes that go on differently right
    after it never share it.
    """
    tokens_per_chunk = checked_int("tokens_per_chunk", tokens_per_chunk)
    lookahead = checked_int("lookahead", lookahead, minimum=0)
    seed = chain_seed(group_idx, tokens_per_chunk, namespace, extras)
    done = len(keys)
    length = len(token_ids) if stop is None else min(stop, len(token_ids))
    if done * tokens_per_chunk > length:
        raise ConfigError(
            f"{done} keys of {tokens_per_chunk} tokens need at least "
            f"{done * tokens_per_chunk} token ids, got {length}"
        )
    previous = keys[-1] if done else seed
    # Only the new tokens are converted: a growing request pays for its growth.
    chunks = _chunk_bytes(token_ids, done, length, tokens_per_chunk, lookahead)
    return chain(previous, chunks, tokens_per_chunk, done, extras)


def prefix_keys_for_layout(
    token_ids: Sequence[int] | npt.NDArray[np.integer],
    tokens_per_chunk: Sequence[int],
    namespace: bytes = b"",
    *,
    extras: KeyExtras | None = None,
    lookahead: int = 0,
) -> list[list[bytes]]:
    """Keys of every group: ``tokens_per_chunk[g]`` is group ``g``'s chunk span in tokens.

    With several groups, token ids are converted once and shared by all of
    them, which is the cost that matters for hybrid layouts. ``lookahead`` as
    in :func:`extend_prefix_keys`.
    """
    if isinstance(tokens_per_chunk, str | bytes) or not isinstance(tokens_per_chunk, Sequence):
        raise ConfigError(
            f"tokens_per_chunk must be a sequence of ints (one per group), got {tokens_per_chunk!r}"
        )
    spans = [checked_int(f"tokens_per_chunk[{g}]", t) for g, t in enumerate(tokens_per_chunk)]
    lookahead = checked_int("lookahead", lookahead, minimum=0)
    if len(spans) == 1:
        return [prefix_keys(token_ids, spans[0], 0, namespace, extras=extras, lookahead=lookahead)]
    tokens = _token_array(token_ids)
    seeds = [chain_seed(g, span, namespace, extras) for g, span in enumerate(spans)]
    return [
        chain(seed, _array_chunks(tokens, span, lookahead), span, 0, extras)
        for seed, span in zip(seeds, spans, strict=True)
    ]
