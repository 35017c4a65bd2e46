"""Promotions: a hit's lower-tier chunks read into the CPU tier first, then loaded in its step.

A hit that needs a chunk only the disk or remote tier holds cannot load in the
step that asks for it: a read takes longer than a step. There are two ways to
serve it, and which one runs is ``KVOFFLOAD_LOWER_TIER_HITS``:

* ``load`` (the default, measured: docs/benchmarks.md, "Time to first token"):
  vLLM allocates the request's blocks at once and the request waits while its
  load reads the lower tier and copies into those blocks (``load_kv_async``);
  vLLM schedules it at the step after the load is reported.
* ``promote``: the lookup reserves CPU slots for those chunks, orders them
  read in (a :attr:`~kvoffload.messages.JobKind.PROMOTE` job: verified reads
  into the slots, nothing copied into the engine) and answers "ask again"
  (``None``; :meth:`~kvoffload.connector.loads.LoadPlanner.promote`). vLLM asks at
  every step; the lookup after the promotion finds
  every chunk in the CPU tier and the hit loads in that step, as any CPU-tier
  hit does. The request holds no engine blocks while its chunks are read.

A request promotes once: if a chunk did not come in (a damaged file, say), or
left the CPU tier again before the next lookup, that lookup takes the ``load``
way, whose failures vLLM recomputes. Promotions run only where CPU-tier hits load
in the step (:func:`~kvoffload.connector.loads.loads_in_step`); elsewhere the
second lookup would load a step later anyway.
"""

from __future__ import annotations

import os

from kvoffload.errors import ConfigError

__all__ = ["LOWER_TIER_HITS_ENV", "promotes_lower_hits"]

LOWER_TIER_HITS_ENV = "KVOFFLOAD_LOWER_TIER_HITS"
_WAYS = ("load", "promote")


def promotes_lower_hits(loads_in_step: bool) -> bool:
    """Whether lower-tier hits are promoted first (``KVOFFLOAD_LOWER_TIER_HITS``; see above)."""
    value = os.environ.get(LOWER_TIER_HITS_ENV, "").strip().lower() or "load"
    if value not in _WAYS:
        raise ConfigError(
            f"{LOWER_TIER_HITS_ENV}={value!r} is not a way to serve lower-tier hits; use "
            f"{' or '.join(_WAYS)}, or leave it unset for the measured default (load)"
        )
    return value == "promote" and loads_in_step
