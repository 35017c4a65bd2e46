"""The connector's stats in vLLM's log line and its Prometheus ``/metrics``.

:class:`KVOffloadStats` is the payload vLLM carries from the engine to the
frontend each step (its format: :mod:`kvoffload.vllm._metrics`);
:class:`KVOffloadPromMetrics` is what ``build_prom_metrics`` returns. vLLM
builds it in the frontend process (the API server), where no connector
exists, from ``vllm_config`` alone: so every series of
:data:`~kvoffload.vllm._metrics.SERIES` is registered up front, named
``vllm:kvoffload_<name>`` with vLLM's labels (``model_name``, ``engine``)
and ``tier`` where one applies, and each labelled child is made on first use.
Gauges use ``multiprocess_mode="mostrecent"``, as vLLM's own do, for API
servers that run Prometheus in multiprocess mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvoffload.vllm._metrics import (
    BUCKETS,
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    SEP,
    SERIES,
    Series,
    empty_payload,
    log_line,
    merge,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVOffloadPromMetrics", "KVOffloadStats"]

PREFIX = "vllm:kvoffload_"


@dataclass
class KVOffloadStats(KVConnectorStats):
    """One step's (or, in the log, one interval's) stats; see :mod:`kvoffload.vllm._metrics`."""

    def reset(self) -> None:
        self.data: dict[str, Any] = empty_payload()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return KVOffloadStats(data=merge(self.data, other.data))

    def reduce(self) -> dict[str, int | float]:
        return log_line(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.get(part) for part in (COUNTERS, GAUGES, HISTOGRAMS))


class KVOffloadPromMetrics(KVConnectorPromMetrics):
    """Feeds each step's :class:`KVOffloadStats` payload into the series of ``SERIES``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._series = {s.name: s for s in SERIES}
        self._metrics = {s.name: self._register(s, labelnames) for s in SERIES}
        self._children: dict[tuple[int, str, str], Any] = {}
        #: (engine, series, tier) -> rank -> the rank's last value of a gauge.
        self._ranks: dict[tuple[int, str, str], dict[str, float]] = {}

    def _register(self, series: Series, labelnames: list[str]) -> Any:
        labels = [*labelnames, series.label] if series.label else list(labelnames)
        name, doc = PREFIX + series.name, series.help
        if series.kind == "counter":
            return self._counter_cls(name=name, documentation=doc, labelnames=labels)
        if series.kind == "gauge":
            return self._gauge_cls(
                name=name, documentation=doc, labelnames=labels, multiprocess_mode="mostrecent"
            )
        return self._histogram_cls(
            name=name, documentation=doc, labelnames=labels, buckets=list(BUCKETS)
        )

    def _child(self, engine: int, name: str, tier: str) -> Any:
        child = self._children.get((engine, name, tier))
        if child is None:
            values = list(self.per_engine_labelvalues[engine])
            if self._series[name].label:
                values.append(tier or "none")
            child = self._metrics[name].labels(*values)
            self._children[(engine, name, tier)] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for k, delta in data.get(COUNTERS, {}).items():
            name, tier = k.split(SEP)
            if name in self._series:  # a first 0 creates the series, so it shows
                child = self._child(engine_idx, name, tier)
                if delta > 0:
                    child.inc(delta)
        for k, value in data.get(GAUGES, {}).items():
            name, tier, *rank = k.split(SEP)
            series = self._series.get(name)
            if series is not None:
                ranks = self._ranks.setdefault((engine_idx, name, tier), {})
                ranks[rank[0] if rank else ""] = value
                combined = sum(ranks.values()) if series.ranks == "sum" else max(ranks.values())
                self._child(engine_idx, name, tier).set(combined)
        for k, samples in data.get(HISTOGRAMS, {}).items():
            name = k.split(SEP)[0]
            if name in self._series:
                child = self._child(engine_idx, name, "")
                for seconds in samples:
                    child.observe(seconds)
