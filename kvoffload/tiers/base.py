"""The tier seam of the data plane: where chunk bytes live.

A tier stores and returns whole chunks addressed by key (bytes; tiers that
need names use ``key.hex()``). It never decides what the engine keeps: the
scheduler-side index does that for the first tier; lower tiers (disk, a shared
store) may evict on their own inside their byte budget and report it.

Contract, for every tier (cpu, disk, and a remote store such as Redis):

* ``put(key, data)`` stores a copy of ``data`` (a 1-D ``uint8`` numpy array)
  atomically: afterwards either the whole chunk is loadable or it is not
  there. Failure raises ``TierError`` and leaves no loadable partial chunk.
* ``get_into(key, out)`` fills ``out`` (1-D ``uint8``, exactly the chunk's
  size) with the stored bytes, verified. A missing key, wrong size or a
  checksum mismatch raises ``TierError`` (``CorruptChunkError`` for the
  latter, after dropping the chunk). ``out`` may be partly written on error;
  the caller must then treat those blocks as not loaded.
* ``contains(key)`` is a cheap hint, not a promise: a lower tier may lose a
  chunk between ``contains`` and ``get_into``, which then raises.
* ``discard(key)`` forgets a chunk; unknown keys are ignored.
* Methods may be called from several threads at once; a tier serialises what
  it must. ``stats()`` returns counters for reports; ``close()`` releases
  resources and is idempotent.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

__all__ = ["ChunkBuffer", "Tier", "TierProbe"]

#: A chunk's bytes: a 1-D contiguous uint8 numpy array.
ChunkBuffer = npt.NDArray[np.uint8]


class Tier(ABC):
    """Stores whole chunks by key; see the module docstring for the contract."""

    #: Short name used in reports: "cpu", "disk", "redis".
    name: str = ""
    #: Whether ``contains`` is cheap (an in-memory lookup). When it is not (a round
    #: trip to a server), a load asks for the chunk directly and a miss raises.
    cheap_contains: bool = True
    #: Whether the cascade writes this tier behind the store job (a network tier): the job
    #: only stages a copy (``stage_put``) and a background writer stores it later, so a slow
    #: server never holds the engine's workers (see :mod:`kvoffload.tiers.cascade`).
    write_behind: bool = False

    @abstractmethod
    def put(self, key: bytes, data: ChunkBuffer) -> None:
        """Store a copy of ``data`` under ``key``, atomically; raise ``TierError`` on failure."""

    @abstractmethod
    def get_into(self, key: bytes, out: ChunkBuffer) -> None:
        """Fill ``out`` with the verified bytes of ``key``; raise ``TierError`` if unavailable."""

    @abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is probably loadable now."""

    @abstractmethod
    def discard(self, key: bytes) -> None:
        """Forget ``key``; unknown keys are ignored."""

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """``contains`` for each key; tiers behind a network answer in one round trip."""
        return [self.contains(key) for key in keys]

    def stage_put(self, key: bytes, data: ChunkBuffer) -> Callable[[], None]:
        """Copy ``data`` now; return the call that stores the copy later (may raise ``TierError``).

        For write-behind: ``data`` may be overwritten as soon as this returns.
        A tier may raise ``TierError`` here already, when it knows the store
        cannot succeed (a server known to be down). Default: a numpy copy, then ``put``.
        """
        copy = data.copy()
        return lambda: self.put(key, copy)

    def take_evicted(self) -> list[bytes]:
        """Keys the tier dropped on its own since the last call (budget, corruption).

        Tiers that never drop chunks by themselves return nothing, the default.
        """
        return []

    def stats(self) -> dict[str, Any]:
        """Counters for reports (stores, loads, failures, bytes). Default: none."""
        return {}

    def check_integrity(self) -> None:
        """Raise ``TierError`` with the numbers if internal state is inconsistent."""

    def close(self) -> None:
        """Release resources; safe to call twice."""


class TierProbe(Protocol):
    """What a scheduler asks a lower tier it does not own: which keys it probably holds.

    Tiers are probes themselves (``contains_many``); :class:`~kvoffload.tiers.disk.DiskProbe`
    answers for a disk tier another process owns.
    """

    name: str

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]: ...

    def close(self) -> None: ...
