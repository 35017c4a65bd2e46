"""Plain result records of the offload index.

They are what the scheduler side hands to the worker side and to event
publishers, so they are small immutable tuples: no behaviour, cheap to build,
easy to log.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

__all__ = ["EventKind", "IndexEvent", "LoadResult", "Steer", "StoreResult"]


class LoadResult(NamedTuple):
    """Chunks pinned for a load: ``slots[i]`` holds ``keys[i]`` until ``complete_load``."""

    keys: tuple[bytes, ...]
    slots: tuple[int, ...]


class StoreResult(NamedTuple):
    """Slots reserved by ``prepare_store``.

    ``keys`` are the chunks to write now (already stored, in-flight and
    admission-rejected keys are left out), ``slots[i]`` is where ``keys[i]``
    goes, and ``evicted`` are the chunks removed to make room, oldest first; the first
    ``capped`` of them went for their tenant's share (``tenant_cpu_share``).
    """

    keys: tuple[bytes, ...]
    slots: tuple[int, ...]
    evicted: tuple[bytes, ...]
    capped: int = 0


class Steer(NamedTuple):
    """What a client's retention hint asks of a store (``prepare_store``): ``keep`` chunks
    are admitted whatever the policy's admission says, ``drop`` chunks are not kept in
    this tier (with a tier behind it they pass through a slot to reach it, as admission's
    rejects do)."""

    keep: frozenset[bytes]
    drop: frozenset[bytes]


class EventKind(Enum):
    """What happened to a chunk, for KV-cache event publishers."""

    #: ``complete_store``: the chunk is loadable from now on.
    STORED = "stored"
    #: Evicted by ``prepare_store`` or dropped by ``reset``: no longer loadable.
    REMOVED = "removed"


class IndexEvent(NamedTuple):
    """One change of the set of loadable chunks, in the order it happened."""

    kind: EventKind
    key: bytes
    slot: int
