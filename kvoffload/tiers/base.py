"""The lower-tier seam: where chunk bytes live below the CPU slab.

A lower tier (the disk tier, a shared store such as Redis) stores and returns
whole chunks addressed by key (bytes; tiers that need names use
``key.hex()``). It never decides what the engine keeps: the scheduler-side
index does that for the CPU slab (:class:`~kvoffload.tiers.cpu.CPUSlab`, which
is addressed by slot and is not a ``Tier``); a lower tier may evict on its own
inside its byte budget and counts it in its stats. Nobody is told which keys
it dropped: the scheduler side asks lower tiers what they hold
(``contains_many``) instead of indexing them.

Contract:

* ``put(key, data)`` stores a copy of ``data`` (a 1-D ``uint8`` numpy array)
  atomically: afterwards either the whole chunk is loadable or it is not
  there. Failure raises ``TierError`` and leaves no loadable partial chunk.
* ``get_into(key, out)`` fills ``out`` (1-D ``uint8``, exactly the chunk's
  size) with the stored bytes, verified, and returns ``True``; ``False`` when
  the tier does not hold ``key`` (a miss is an answer, not an error). A wrong
  size or an unreachable store raises ``TierError``; bytes that fail
  verification raise ``CorruptChunkError`` after the tier dropped the chunk.
  ``out`` may be partly written unless ``True`` came back; the caller then
  treats those blocks as not loaded.
* ``contains_many(keys)`` says, per key, whether it is probably loadable now;
  one round trip for a tier behind a network. A hint, not a promise: a chunk
  may vanish before ``get_into``, which then misses.
* ``discard(key)`` forgets a chunk; unknown keys are ignored.
* ``stats()`` returns the tier's :class:`~kvoffload.tiers.stats.TierStats`,
  each event counted once, by the tier. ``check_integrity()`` raises
  ``IntegrityError`` with the numbers if its bookkeeping disagrees with
  itself. ``close()`` releases resources and is idempotent.
* Methods may be called from several threads at once; a tier serialises what
  it must.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvoffload.tiers.stats import TierStats

__all__ = ["ChunkBuffer", "Tier", "TierProbe", "WrappedTier"]

#: A chunk's bytes: a 1-D contiguous uint8 numpy array.
ChunkBuffer = npt.NDArray[np.uint8]


class Tier(ABC):
    """A lower tier: stores whole chunks by key; see the module docstring for the contract."""

    #: Short name used in stats and messages: "disk", "redis".
    name: str = ""

    @abstractmethod
    def put(self, key: bytes, data: ChunkBuffer) -> None:
        """Store a copy of ``data`` under ``key``, atomically; raise ``TierError`` on failure."""

    @abstractmethod
    def get_into(self, key: bytes, out: ChunkBuffer) -> bool:
        """Fill ``out`` with the verified bytes of ``key``; ``False`` if not held."""

    @abstractmethod
    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is probably loadable now."""

    @abstractmethod
    def discard(self, key: bytes) -> None:
        """Forget ``key``; unknown keys are ignored."""

    @abstractmethod
    def stats(self) -> TierStats:
        """The tier's counters and gauges now."""

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` with the numbers if internal state is inconsistent."""

    def close(self) -> None:
        """Release resources; safe to call twice."""


class WrappedTier(Tier):
    """A tier in front of ``tier`` that changes how chunks are written (its ``put``) and
    reads, probes and discards through it unchanged: the write-behind queue, the ranks
    that take turns writing."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.name = tier.name

    def get_into(self, key: bytes, out: ChunkBuffer) -> bool:
        return self.tier.get_into(key, out)

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.tier.contains_many(keys)

    def discard(self, key: bytes) -> None:
        self.tier.discard(key)

    def check_integrity(self) -> None:
        self.tier.check_integrity()


class TierProbe(Protocol):
    """What a scheduler asks a lower tier it does not own: which keys it probably holds.

    Tiers are probes themselves (``contains_many``); :class:`~kvoffload.tiers.disk.DiskProbe`
    answers for a disk tier another process owns.
    """

    name: str

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    def close(self) -> None: ...
