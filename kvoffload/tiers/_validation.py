"""Argument checks of the disk tier, kept apart so the tier module reads as the protocol.

Constructor arguments are configuration: a bad one raises ``ConfigError``
naming the key and the fix. Per-call arguments (keys, buffers) fail only that
call, with ``TierError``, so the engine treats the chunk as a miss.
"""

from __future__ import annotations

import hashlib

import numpy as np

from kvoffload._checks import checked_int
from kvoffload.errors import ConfigError, TierError
from kvoffload.tiers._record import MAX_KEY_BYTES
from kvoffload.tiers.base import ChunkBuffer

__all__ = [
    "check_budget",
    "checked_buffer",
    "namespace_fingerprint",
    "valid_key",
]

#: Bytes of the fingerprint that names a namespace's directory and sits in every header.
FINGERPRINT_BYTES = 16


def namespace_fingerprint(namespace: object) -> bytes:
    """The 16-byte fingerprint of ``namespace``: itself if already 16 bytes (a
    ``keys.namespace_of`` digest), else its BLAKE2b digest, so any length names a directory."""
    if not isinstance(namespace, bytes) or not namespace:
        raise ConfigError(f"DiskTier: namespace must be non-empty bytes, got {namespace!r}")
    if len(namespace) == FINGERPRINT_BYTES:
        return namespace
    return hashlib.blake2b(namespace, digest_size=FINGERPRINT_BYTES).digest()


def check_budget(bytes_to_use: object) -> int:
    """``bytes_to_use`` if it is a positive int (not a bool, not a float: no silent truncation)."""
    return checked_int("disk_bytes_to_use (bytes the disk tier may fill)", bytes_to_use)


def valid_key(key: object) -> bool:
    """Whether ``key`` can name a file: non-empty bytes whose hex fits a file name."""
    return isinstance(key, bytes) and 0 < len(key) <= MAX_KEY_BYTES


def checked_buffer(what: str, buf: object) -> ChunkBuffer:
    """``buf`` if it is what the Tier contract allows: 1-D, contiguous, uint8."""
    if not (
        isinstance(buf, np.ndarray)
        and buf.dtype == np.uint8
        and buf.ndim == 1
        and buf.flags.c_contiguous
    ):
        raise TierError(f"DiskTier: {what} must be a 1-D contiguous uint8 array, got {buf!r:.80}")
    return buf
