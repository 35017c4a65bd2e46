"""The one exception tree of kvoffload.

Every error kvoffload raises on purpose is a ``KVOffloadError``; callers that
want "anything kvoffload refused" catch that one class::

    KVOffloadError
    ├── ConfigError        (also ValueError)  bad configuration or layout; fix the input
    ├── ProtocolError      (also RuntimeError) a caller broke the index protocol,
    │                                          e.g. completed a store it never prepared
    ├── TransferError                         engine tensors do not match the layout
    └── TierError          (also OSError)     a tier could not store or load a chunk
        └── CorruptChunkError                 stored bytes failed their checksum

Third-party errors (``OSError``, CUDA, Redis, vLLM) are translated where they
occur, chained with ``raise ... from exc``, so the original stays visible.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "CorruptChunkError",
    "KVOffloadError",
    "ProtocolError",
    "TierError",
    "TransferError",
]


class KVOffloadError(Exception):
    """Root of every error kvoffload raises on purpose."""


class ConfigError(KVOffloadError, ValueError):
    """A configuration value or layout is invalid; the message names the input and the fix."""


class ProtocolError(KVOffloadError, RuntimeError):
    """The caller used the index out of protocol; the index is left unchanged."""


class TransferError(KVOffloadError):
    """Engine KV tensors do not match the layout they were registered for."""


class TierError(KVOffloadError, OSError):
    """A tier failed to store or load a chunk; the chunk is treated as missing."""


class CorruptChunkError(TierError):
    """A stored chunk failed verification (checksum, size or header) and was dropped."""
