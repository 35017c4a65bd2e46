"""One stats record per tier: what it stored, loaded, lost and holds, each event counted once.

Every tier (the CPU slab, the disk tier, the remote tier, and the write-behind
queue in front of the remote tier) owns one :class:`TierCounters` and counts
each event where it happens, once. Readers (the cascade, the engine, the
connector's ``stats()``, a metrics exporter) call the tier's ``stats()`` and
get a frozen :class:`TierStats`.

Outcomes are disjoint, so totals add up:

* a store ends in exactly one of ``stores``, ``store_failures`` or ``dropped``
  (refused or abandoned by a write-behind queue before it reached the tier);
* a load ends in exactly one of ``loads``, ``misses`` (the tier does not hold
  the chunk), ``corrupt`` (it failed verification and was dropped) or
  ``load_failures`` (anything else: an I/O error, a size mismatch, a server
  that is down).

For an exporter (:meth:`TierStats.metrics`): counters only grow (Prometheus
``*_total``, one ``tier`` label per record); ``store_seconds`` and
``load_seconds`` sum the time of successful calls, so ``store_seconds /
stores`` is the mean latency and ``store_bytes / store_seconds`` the rate;
gauges are current values. Each shared field's ``metadata`` holds its
``kind`` and a ``help`` line. Per-tier figures beyond the shared ones
(a remote tier's ``outages``, a queue's ``queue_bytes``) sit in ``counters`` and
``gauges`` with the same meaning.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Literal

from kvoffload.errors import CorruptChunkError

__all__ = ["MetricKind", "TierCounters", "TierStats"]

#: How an exporter publishes a figure: a monotonically growing total or a current value.
MetricKind = Literal["counter", "gauge"]


def _counter(help_text: str) -> int:
    return field(default=0, metadata={"kind": "counter", "help": help_text})


def _seconds(help_text: str) -> float:
    return field(default=0.0, metadata={"kind": "counter", "help": help_text})


def _gauge(help_text: str) -> int:
    return field(default=0, metadata={"kind": "gauge", "help": help_text})


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of one tier's counters and gauges; see the module docstring."""

    tier: str
    stores: int = _counter("chunks stored")
    store_bytes: int = _counter("payload bytes stored")
    store_seconds: float = _seconds("seconds spent in successful stores")
    store_failures: int = _counter("stores the tier refused or failed")
    dropped: int = _counter("stores a write-behind queue refused or abandoned")
    loads: int = _counter("chunks loaded, verified")
    load_bytes: int = _counter("payload bytes loaded")
    load_seconds: float = _seconds("seconds spent in successful loads")
    misses: int = _counter("loads of chunks the tier did not hold")
    corrupt: int = _counter("loads that failed verification (the chunk was dropped)")
    load_failures: int = _counter("loads that failed otherwise (I/O, size, server down)")
    evictions: int = _counter("chunks the tier evicted on its own to stay in its budget")
    evicted_bytes: int = _counter("bytes the tier evicted on its own")
    used_bytes: int = _gauge("bytes the tier holds now")
    chunks: int = _gauge("chunks the tier holds now")
    capacity_bytes: int = _gauge("bytes the tier may hold (0: not bounded by kvoffload)")
    #: Tier-specific totals (a remote tier's ``outages``): counters like the fields above.
    counters: Mapping[str, float] = field(default_factory=dict)
    #: Tier-specific current values (a remote tier's ``up``, a queue's ``queue_bytes``).
    gauges: Mapping[str, float] = field(default_factory=dict)

    @property
    def store_gbps(self) -> float:
        return self.store_bytes / self.store_seconds / 1e9 if self.store_seconds else 0.0

    @property
    def load_gbps(self) -> float:
        return self.load_bytes / self.load_seconds / 1e9 if self.load_seconds else 0.0

    def metrics(self) -> list[tuple[str, MetricKind, float]]:
        """``(name, kind, value)`` of every figure, shared fields first: what an exporter reads."""
        out: list[tuple[str, MetricKind, float]] = [
            (f.name, f.metadata["kind"], getattr(self, f.name)) for f in fields(self) if f.metadata
        ]
        out += [(name, "counter", value) for name, value in self.counters.items()]
        out += [(name, "gauge", value) for name, value in self.gauges.items()]
        return out

    def snapshot(self) -> dict[str, float]:
        """Every figure by name, as plain numbers (for logs, JSON and the connector's stats)."""
        return {name: value for name, _, value in self.metrics()}


#: The shared counters and their zero (``0`` or ``0.0``), in field order.
_SHARED: dict[str, float] = {
    f.name: f.default  # type: ignore[misc]
    for f in fields(TierStats)
    if f.metadata.get("kind") == "counter"
}


class TierCounters:
    """The counters one tier updates; thread-safe, each call one atomic update.

    ``extra`` names the tier-specific counters it may add to (a typo is a
    ``KeyError``, not a silent new figure). :meth:`store` and :meth:`load`
    run one call and count its one outcome, so a tier counts a verb in one place.
    """

    def __init__(self, tier: str, extra: Iterable[str] = ()) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict(_SHARED)
        self._extra: dict[str, float] = dict.fromkeys(extra, 0)

    def add(self, **deltas: float) -> None:
        """Add to shared or tier-specific counters at once (one event, several figures)."""
        with self._lock:
            for name, delta in deltas.items():
                if name in self._values:
                    self._values[name] += delta
                else:
                    self._extra[name] += delta  # KeyError for an undeclared name: a bug

    def store(self, put: Callable[[], int]) -> None:
        """Run ``put`` (it returns the payload bytes it stored) and count its outcome.

        Any exception is a failed store: counted, then raised on.
        """
        start = time.perf_counter()
        try:
            nbytes = put()
        except Exception:
            self.add(store_failures=1)
            raise
        self.add(stores=1, store_bytes=nbytes, store_seconds=time.perf_counter() - start)

    def load(self, nbytes: int, get: Callable[[], bool]) -> bool:
        """Run ``get`` (``False``: not held) and count its outcome; return what it returned.

        ``CorruptChunkError`` counts as ``corrupt``, any other exception as a
        load failure; both are raised on.
        """
        start = time.perf_counter()
        try:
            found = get()
        except CorruptChunkError:
            self.add(corrupt=1)
            raise
        except Exception:
            self.add(load_failures=1)
            raise
        if found:
            self.add(loads=1, load_bytes=nbytes, load_seconds=time.perf_counter() - start)
        else:
            self.add(misses=1)
        return found

    def snapshot(
        self,
        *,
        used_bytes: int = 0,
        chunks: int = 0,
        capacity_bytes: int = 0,
        gauges: Mapping[str, float] | None = None,
    ) -> TierStats:
        """The counters now, with the gauges the tier reads from its own state."""
        with self._lock:
            values, extra = dict(self._values), dict(self._extra)
        return TierStats(
            self.tier,
            **values,  # type: ignore[arg-type]
            used_bytes=used_bytes,
            chunks=chunks,
            capacity_bytes=capacity_bytes,
            counters=MappingProxyType(extra),
            gauges=MappingProxyType(dict(gauges or {})),
        )
