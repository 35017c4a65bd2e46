"""Why a lookup loaded less than the request could use: misses counted by reason.

The failure users of every offloading system report most is a silent no-op: chunks
stored and never loaded back, found only by reading byte counters. So each lookup that
serves less than the request's keyable prefix names the reason it stopped, and the
tokens it left unserved go to that reason:

* ``never_stored``: the chunk where the stored prefix ends was never stored here: no
  reuse in this workload (or not yet), nothing to tune.
* ``evicted``: it was stored, and the CPU tier evicted it (with no lower tier holding
  it) before this reuse. Its *reuse distance*, the chunks stored between its eviction
  and this lookup, says how much larger the tier would have had to be.
* ``tenant_share``: evicted for its tenant's ``tenant_cpu_share``.
* ``window_or_state``: the full-attention prefix goes further, but a sliding-window
  chunk or a recurrent state that a longer hit needs was not stored there
  (``retention_interval``, or ``blocks_per_chunk`` against the hit points).
* ``no_room``: the prefix is there, but the CPU tier cannot stage it now (pins and
  stores in flight fill it).
* ``failed_load``: counted when a load fails (a damaged chunk, a tier gone): vLLM
  recomputes those tokens.

Eviction records are kept for a bounded number of chunks (a few times the CPU tier):
a chunk evicted longer ago than that counts as ``never_stored``.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from enum import Enum
from itertools import chain, repeat

from kvoffload.config import OffloadConfig
from kvoffload.config.layout import Reuse
from kvoffload.connector._hits import Hit

__all__ = ["MissLedger", "MissReason"]


class MissReason(Enum):
    NEVER_STORED = "never_stored"
    EVICTED = "evicted"
    TENANT_SHARE = "tenant_share"
    WINDOW_OR_STATE = "window_or_state"
    NO_ROOM = "no_room"
    FAILED_LOAD = "failed_load"


#: Eviction records kept per CPU-tier chunk, and at most in all (~150 bytes each).
GHOSTS_PER_CHUNK = 4
MAX_GHOSTS = 1 << 18
#: Reuse distances kept for the median the log line and the warning show.
DISTANCE_SAMPLES = 1024
#: The warning's threshold: chunks stored with none loaded, and misses on evicted chunks.
WARN_AFTER_STORED = 1000
WARN_AFTER_EVICTED_MISSES = 100


class MissLedger:
    """Counts misses by reason and remembers recent evictions (see the module docstring)."""

    def __init__(self, capacity: int, chain: tuple[int, int] | None = None) -> None:
        """``chain``: the group whose keys tell where a request's stored prefix ends (the
        first full-prefix one) and its tokens per chunk; ``None`` where there is none."""
        self.capacity = capacity
        self._chain = chain
        self.lookups: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self._ghosts: OrderedDict[bytes, tuple[int, bool]] = OrderedDict()
        self._max_ghosts = min(MAX_GHOSTS, GHOSTS_PER_CHUNK * max(capacity, 1))
        self._stored = 0  # chunks stored so far: the clock of reuse distances
        self._distances: deque[int] = deque(maxlen=DISTANCE_SAMPLES)
        self.warned = False

    @classmethod
    def from_config(cls, config: OffloadConfig) -> MissLedger:
        """The ledger of a CPU tier of ``num_cpu_chunks``, whose misses the first full-prefix
        group's chain names."""
        groups, spans = config.layout.groups, config.tokens_per_chunk
        chain = next((g for g, group in enumerate(groups) if group.reuse is Reuse.PREFIX), None)
        return cls(config.num_cpu_chunks, None if chain is None else (chain, spans[chain]))

    def count(self, reason: MissReason, tokens: int) -> None:
        if tokens > 0:
            name = reason.value
            self.lookups[name] = self.lookups.get(name, 0) + 1
            self.tokens[name] = self.tokens.get(name, 0) + tokens

    def count_lookup(
        self, keys: Sequence[Sequence[bytes]], local_hit: int, top: int, hit: Hit
    ) -> None:
        """Name why a lookup of a request keyed as ``keys`` serves ``hit`` and not ``top``."""
        served, reach = max(hit.tokens, local_hit), max(hit.prefix_end, local_hit)
        if reach > served:  # the full-attention prefix goes further: windows, states or room
            short = MissReason.WINDOW_OR_STATE if hit.prefix_fits else MissReason.NO_ROOM
            self.count(short, reach - served)
        if reach < top and self._chain is not None:
            g, span = self._chain
            chunk = reach // span
            key = keys[g][chunk] if chunk < len(keys[g]) else None
            self.count(self.stopped_at(key), top - reach)

    def stored(self, keys: Sequence[bytes]) -> None:
        """``keys`` are in the CPU tier now: no longer evicted."""
        self._stored += len(keys)
        ghosts = self._ghosts
        if ghosts:  # at C speed: every completed store comes here
            deque(map(ghosts.pop, keys, repeat(None)), 0)

    def evicted(self, keys: Iterable[bytes], capped: int = 0) -> None:
        """``keys`` left the CPU tier, the first ``capped`` of them for their tenant's share."""
        ghosts, clock = self._ghosts, self._stored
        marks = chain(repeat((clock, True), capped), repeat((clock, False)))
        ghosts.update(zip(keys, marks, strict=False))  # marks never end; at C speed
        excess = len(ghosts) - self._max_ghosts
        if excess > 0:  # the oldest go
            deque(map(ghosts.popitem, repeat(False, excess)), 0)

    def stopped_at(self, key: bytes | None) -> MissReason:
        """Why the stored prefix ends at ``key`` (``None``: past the request's keys)."""
        ghost = None if key is None else self._ghosts.get(key)
        if ghost is None:
            return MissReason.NEVER_STORED
        when, capped = ghost
        self._distances.append(self._stored - when)
        return MissReason.TENANT_SHARE if capped else MissReason.EVICTED

    def reuse_distance(self) -> int | None:
        """The median reuse distance of recent misses on evicted chunks, in chunks stored."""
        return int(statistics.median(self._distances)) if self._distances else None

    def advice(self, stored_chunks: int, loaded_tokens: int) -> str | None:
        """One warning, once, when stores are never loaded back and the misses say why."""
        if self.warned or loaded_tokens or stored_chunks < WARN_AFTER_STORED:
            return None
        evicted = self.lookups.get(MissReason.EVICTED.value, 0)
        windows = self.lookups.get(MissReason.WINDOW_OR_STATE.value, 0)
        if evicted >= WARN_AFTER_EVICTED_MISSES:
            self.warned = True
            distance = self.reuse_distance() or 0
            return (
                f"kvoffload: {stored_chunks} chunks stored and none loaded back; {evicted} "
                f"lookups wanted chunks the CPU tier had evicted (median reuse distance "
                f"{distance} chunks, the tier holds {self.capacity}): raise cpu_bytes_to_use "
                f"to about {(self.capacity + distance) / max(self.capacity, 1):.1f}x, or add a "
                "disk_path"
            )
        if windows >= WARN_AFTER_EVICTED_MISSES:
            self.warned = True
            return (
                f"kvoffload: {stored_chunks} chunks stored and none loaded back; {windows} "
                "lookups found the full-attention prefix but not the window chunks or states "
                "a hit there needs: lower retention_interval (or blocks_per_chunk)"
            )
        return None
