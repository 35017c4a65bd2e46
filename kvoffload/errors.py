"""The one exception tree of kvoffload.

Every error kvoffload raises on purpose is a ``KVOffloadError``; callers that
want "anything kvoffload refused" catch that one class::

    KVOffloadError
    ├── ConfigError        (also ValueError)  bad configuration or layout; fix the input
    ├── ProtocolError      (also RuntimeError) a caller broke a protocol: completed a
    │                                          store it never prepared, called a
    │                                          connector method on the wrong side
    ├── IntegrityError                        ``check_integrity`` found bookkeeping that
    │                                          disagrees with itself (a bug); the message
    │                                          carries the numbers
    ├── TransferError                         engine tensors do not match the layout
    └── TierError                             a tier could not store or load a chunk
        └── CorruptChunkError                 stored bytes failed verification

Third-party errors are translated where they occur, chained with
``raise ... from exc`` so the original stays visible, in one place per
library: ``OSError`` in the disk tier, Redis errors in the remote tier, CUDA
in the transfer, vLLM in the connector. ``TierError`` is deliberately not an
``OSError``: an ``except OSError`` meant for a syscall never catches a tier's
verdict by accident.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "CorruptChunkError",
    "IntegrityError",
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
    """The caller used an object out of protocol; the object is left unchanged."""


class IntegrityError(KVOffloadError):
    """Internal bookkeeping disagrees with itself (``check_integrity``); a bug, with numbers."""


class TransferError(KVOffloadError):
    """Engine KV tensors do not match the layout they were registered for."""


class TierError(KVOffloadError):
    """A tier failed to store or load a chunk; the chunk is treated as missing."""


class CorruptChunkError(TierError):
    """A stored chunk failed verification (checksum, size or header) and was dropped."""
