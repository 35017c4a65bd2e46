"""Trace replay: hit ratio and throughput of the offload index, with Belady's bound.

``load_trace`` reads a Mooncake-format JSON-lines trace into chunk keys,
``replay`` drives an :class:`~kvoffload.manager.OffloadIndex` with it the
way vLLM's connector drives its manager, ``belady_hits`` is the clairvoyant
bound under the same prefix-hit semantics, and ``sweep`` runs policy x
capacity grids for the ``kvoffload replay`` command.
"""

from __future__ import annotations

from kvoffload.replay.belady import belady_hits
from kvoffload.replay.loop import ReplayResult, drive, replay
from kvoffload.replay.plot import plot_hit_ratio
from kvoffload.replay.report import Row, format_table, sweep
from kvoffload.replay.trace import Trace, block_key, load_trace

__all__ = [
    "ReplayResult",
    "Row",
    "Trace",
    "belady_hits",
    "block_key",
    "drive",
    "format_table",
    "load_trace",
    "plot_hit_ratio",
    "replay",
    "sweep",
]
