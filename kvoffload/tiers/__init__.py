"""Where chunk bytes live: the CPU slab, the lower tiers (disk, remote), and their cascade.

* :class:`~kvoffload.tiers.cpu.CPUSlab`: host slab of slots the index hands
  out (pinned where CUDA is present); always first, addressed by slot, never
  evicts on its own. Not a ``Tier``.
* :class:`~kvoffload.tiers.disk.DiskTier`: checksummed chunk files under
  ``<disk_path>/<namespace>/``, with its own byte budget.
* :class:`~kvoffload.tiers.remote.RedisTier`: a Redis / Valkey server or a
  Redis Cluster shared by a fleet; the server evicts. Written behind the
  store jobs through a :class:`~kvoffload.tiers._write_behind.WriteBehind`
  queue, itself a ``Tier``.
* :class:`~kvoffload.tiers.cascade.TierCascade`: the order they are written
  and read in (write-through to every lower tier, promotion into the CPU slot
  on a lower-tier hit).

The contract every lower tier keeps is :class:`~kvoffload.tiers.base.Tier`
(``put``, ``get_into``, ``contains_many``, ``discard``, ``stats``, ``close``);
the scheduler side only ever sees a :class:`~kvoffload.tiers.base.TierProbe`.
Every tier counts its events in one :class:`~kvoffload.tiers.stats.TierStats`
record (``stats()``). :mod:`kvoffload.tiers.from_config` builds tiers and
probes from an ``OffloadConfig``. The CPU slab needs torch, so the tier
classes are imported on first use and the scheduler side imports this
package without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvoffload.tiers.base import ChunkBuffer, Tier, TierProbe
from kvoffload.tiers.stats import TierStats

if TYPE_CHECKING:
    from kvoffload.tiers._write_behind import WriteBehind
    from kvoffload.tiers.cascade import TierCascade
    from kvoffload.tiers.cpu import CPUSlab
    from kvoffload.tiers.disk import DiskProbe, DiskTier
    from kvoffload.tiers.remote import RedisTier

_LAZY = {
    "CPUSlab": "kvoffload.tiers.cpu",
    "DiskProbe": "kvoffload.tiers.disk",
    "DiskTier": "kvoffload.tiers.disk",
    "RedisTier": "kvoffload.tiers.remote",
    "TierCascade": "kvoffload.tiers.cascade",
    "WriteBehind": "kvoffload.tiers._write_behind",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CPUSlab",
    "ChunkBuffer",
    "DiskProbe",
    "DiskTier",
    "RedisTier",
    "Tier",
    "TierCascade",
    "TierProbe",
    "TierStats",
    "WriteBehind",
]
