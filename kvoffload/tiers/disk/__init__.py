"""The disk tier: checksummed chunk files under ``disk_path``, shared by processes in one budget.

* :class:`DiskTier` (:mod:`~kvoffload.tiers.disk.tier`): stores and loads chunk files; why it
  is built this way is in that module's docstring.
* :class:`DiskProbe` (:mod:`~kvoffload.tiers.disk._probe`): the scheduler side's view of a
  ``disk_path``; it asks the directory, so it imports no SQLite.
* The rest is private: the shared SQLite index (``_index``, ``_schema``), file handling,
  temp files' owners and clean-up (``_files``, ``_owners``, ``_repair``), and the one
  syscall that moves a chunk file (``_chunk_io``, ``_direct_io``; the format is
  :mod:`kvoffload.tiers._record`).

``DiskTier`` is imported on first use, so the scheduler side reads ``DiskProbe`` from here
without loading the tier's machinery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvoffload.tiers.disk._probe import DiskProbe

if TYPE_CHECKING:
    from kvoffload.tiers.disk.tier import DiskTier

__all__ = ["DiskProbe", "DiskTier"]


def __getattr__(name: str) -> Any:
    if name == "DiskTier":
        from kvoffload.tiers.disk.tier import DiskTier

        return DiskTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
