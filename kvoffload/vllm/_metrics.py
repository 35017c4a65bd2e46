"""The connector's stats as vLLM carries them each step, and as Prometheus series.

This is the one place that maps kvoffload's stats (the scheduler side's
counters, each tier's :class:`~kvoffload.tiers.stats.TierStats`, the jobs'
durations) to metrics; :mod:`kvoffload.vllm._prom` only registers and feeds
what :data:`SERIES` lists. It imports neither vLLM nor torch.

**The payload** (``KVConnectorStats.data``) of one step, from each side::

    {"counters": {"name|tier": delta},              # growth since the side's last step
     "gauges": {"name|tier|rank": value},           # the value now, where it changed
     "histograms": {"name|tier": [seconds, ...]}}   # the samples of the step

``tier`` is ``""`` where none applies. vLLM merges the workers' payloads and
the scheduler's with :func:`merge` (counters add, gauges of a rank replace,
samples extend), so each figure is produced by one side only: the logical
token counts by the scheduler (once, whatever the tensor-parallel size),
bytes and usage by the workers that hold them. Gauges keep their rank, and
the exporter combines ranks per series (bytes add up; every rank holds a
shard of the same chunks, so chunk counts do not).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvoffload.tiers.stats import TierStats

if TYPE_CHECKING:
    from kvoffload.connector.worker import OffloadWorker

__all__ = [
    "COUNTERS",
    "GAUGES",
    "HISTOGRAMS",
    "SERIES",
    "Deltas",
    "Series",
    "empty_payload",
    "merge",
    "scheduler_series",
    "worker_series",
    "worker_payload",
]

SEP = "|"
Payload = dict[str, dict[str, Any]]
#: The payload's parts.
COUNTERS, GAUGES, HISTOGRAMS = "counters", "gauges", "histograms"


def empty_payload() -> Payload:
    """A payload with nothing in it (what a step that changed nothing would carry)."""
    return {COUNTERS: {}, GAUGES: {}, HISTOGRAMS: {}}


@dataclass(frozen=True, slots=True)
class Series:
    """One Prometheus series, ``vllm:kvoffload_<name>``, with vLLM's labels and ``label``.

    ``label`` names the payload key's second part (``name|value``): ``tier`` for most,
    ``reason`` for misses, ``""`` for none.
    """

    name: str
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    label: str = "tier"
    #: Gauges: how the tensor-parallel ranks' values combine.
    ranks: Literal["sum", "max"] = "sum"


SERIES: tuple[Series, ...] = (
    Series("hit_tokens", "counter",
           "Prompt tokens of hits vLLM accepted, by the tier their chunks come from"),
    Series("in_step_hit_tokens", "counter",
           "Of hit_tokens, those loaded in the step that asked for them (load_in_step); "
           "the rest loaded one step later", label=""),
    Series("loaded_tokens", "counter", "Prompt tokens loaded into the engine, by tier"),
    Series("stored_bytes", "counter", "Payload bytes stored, by tier"),
    Series("loaded_bytes", "counter", "Payload bytes loaded, by tier"),
    Series("failed_loads", "counter", "Chunk loads that failed (corrupt, I/O, server down)"),
    Series("failed_stores", "counter",
           "Chunk stores a tier failed, or the remote queue dropped"),
    Series("skipped_stores", "counter",
           "Chunk stores a tier skipped: a read-only disk_path serves loads only"),
    Series("evictions", "counter", "Chunks evicted to make room, by tier"),
    Series("usage_bytes", "gauge",
           "Bytes a tier holds now (tiers kvoffload bounds: cpu, disk)"),
    Series("usage_chunks", "gauge", "Chunks a tier holds now (cpu, disk)", ranks="max"),
    Series("remote_queue_bytes", "gauge", "Bytes of stores waiting for the remote tier"),
    Series("load_seconds", "histogram",
           "Load jobs, from submission to result (what a request waits)", label=""),
    Series("store_seconds", "histogram",
           "Store jobs, from submission to result", label=""),
    Series("unkeyable_requests", "counter",
           "Requests served without offloading: their KV inputs cannot be keyed",
           label=""),
    Series("lookup_misses", "counter",
           "Lookups that served less than the request's prefix, by why they stopped "
           "(docs/vllm.md: never_stored, evicted, tenant_share, window_or_state, no_room, "
           "failed_load)", label="reason"),
    Series("lookup_miss_tokens", "counter",
           "Prompt tokens those lookups left unserved, by reason", label="reason"),
    Series("queued_holds", "counter",
           "Requests in vLLM's waiting queue whose CPU-tier chunks were held until they ran "
           "(queued_cpu_share)", label=""),
    Series("queued_held_chunks", "counter", "Chunks held for them", label=""),
    Series("queued_hold_expiries", "counter",
           "Holds let go because their request waited longer than a minute", label=""),
    Series("queued_fetches", "counter",
           "Waiting requests whose disk or remote chunks were read into the CPU tier while "
           "they waited", label=""),
    Series("queued_fetched_chunks", "counter", "The chunks that came in", label=""),
    Series("retention_hints", "counter",
           "Requests whose client sent a retention hint (kv_transfer_params)", label=""),
    Series("retention_hints_ignored", "counter", "Malformed retention hints, ignored",
           label=""),
    Series("retention_kept_chunks", "counter",
           "CPU-tier chunks a hint kept (held for its duration)", label=""),
    Series("retention_dropped_chunks", "counter",
           "CPU-tier chunks a hint dropped when its request ended", label=""),
    Series("handoff_waits", "counter",
           "kv_consumer lookups answered 'ask again' while a producer's stores of chunks "
           "past the hit were on their way", label=""),
    Series("handoff_timeouts", "counter",
           "kv_consumer requests whose wait for a producer's marked chunks ran out "
           "(handoff_wait_ms)", label=""),
    Series("handoff_mark_failures", "counter",
           "kv_producer hand-off marks the shared tier refused (consumers may recompute)",
           label=""),
    Series("reuse_distance_chunks", "gauge",
           "Median chunks stored between an eviction and the lookup that missed it (a CPU "
           "tier that much larger would have kept them)", label="", ranks="max"),
)  # fmt: skip

#: Buckets of the job histograms, in seconds: a CPU-tier load takes milliseconds, a disk
#: or remote load of many chunks up to seconds.
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def key(name: str, tier: str = "", rank: int | None = None) -> str:
    return SEP.join([name, tier] if rank is None else [name, tier, str(rank)])


def scheduler_series(stats: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """Cumulative counters and gauges of the scheduler side, keyed ``name|tier``.

    Every plain counter of ``OffloadScheduler.stats()`` goes in (the log line
    shows them); tokens by tier and the CPU index's evictions become series.
    """
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    for name, value in stats.items():
        if type(value) is dict:  # not isinstance(.., Mapping): an ABC check, slow every step
            base = _BY_LABEL.get(name, name.removesuffix("_by_tier"))
            counters.update({key(base, label): n for label, n in value.items()})
        elif name.removeprefix("index_") in _GAUGES:
            gauges[key(name)] = value
        elif name not in ("hit_tokens", "loaded_tokens"):  # by tier above
            counters[key(name)] = value
    counters[key("evictions", "cpu")] = stats.get("index_evictions", 0)
    return counters, gauges


#: The scheduler side's stats that are current values (of the index, or in flight).
_GAUGES = frozenset(
    (
        "capacity",
        "used",
        "ready",
        "storing",
        "pinned",
        "held",
        "free",
        "orphans",
        "jobs_in_flight",
        "requests_tracked",
        "reuse_distance_chunks",
    )
)
#: The scheduler side's stats by a label other than the tier, and their series.
_BY_LABEL = {
    "miss_lookups_by_reason": "lookup_misses",
    "miss_tokens_by_reason": "lookup_miss_tokens",
}


def worker_series(
    tiers: Mapping[str, TierStats], jobs: Mapping[str, int], rank: int, *, one_copy: bool = False
) -> tuple[dict[str, float], dict[str, float]]:
    """Cumulative counters and gauges of one worker: its tiers and its job counters.

    ``one_copy``: the ranks hold one copy of every chunk (a replicated layout's
    shared tiers), so only rank 0 sends the usage gauges, which the exporter
    would otherwise add up ``world_size`` times.
    """
    counters = {key(name): float(n) for name, n in jobs.items()}
    gauges: dict[str, float] = {}
    for tier, s in tiers.items():
        counters[key("stored_bytes", tier)] = s.store_bytes
        counters[key("loaded_bytes", tier)] = s.load_bytes
        counters[key("failed_loads", tier)] = s.corrupt + s.load_failures
        counters[key("failed_stores", tier)] = s.store_failures + s.dropped
        if "read_only_skips" in s.counters:
            counters[key("skipped_stores", tier)] = s.counters["read_only_skips"]
        if tier != "cpu":  # the CPU tier's evictions are the index's (scheduler side)
            counters[key("evictions", tier)] = s.evictions
        if s.capacity_bytes and not (one_copy and rank):  # a remote server's is not known
            gauges[key("usage_bytes", tier, rank)] = s.used_bytes
            gauges[key("usage_chunks", tier, rank)] = s.chunks
        if "queue_bytes" in s.gauges:
            gauges[key("remote_queue_bytes", tier, rank)] = s.gauges["queue_bytes"]
    return counters, gauges


def worker_payload(worker: OffloadWorker, rank: int, deltas: Deltas) -> Payload | None:
    """One worker's payload of the step: its tiers, its job counters and the jobs' seconds."""
    jobs = worker.job_counts()
    one_copy = worker.engine.cascade.cpu.ranks > 1  # every rank views the same slots
    counters, gauges = worker_series(worker.engine.stats(), jobs, rank, one_copy=one_copy)
    samples = {key(f"{kind}_seconds"): v for kind, v in worker.take_seconds().items()}
    return deltas.take(counters, gauges, samples)


class Deltas:
    """Turns one side's cumulative stats into per-step payloads (changes only)."""

    def __init__(self) -> None:
        self._counters: dict[str, float] = {}
        self._gauges: dict[str, float] = {}

    def take(
        self,
        counters: Mapping[str, float],
        gauges: Mapping[str, float],
        samples: Mapping[str, Iterable[float]] | None = None,
    ) -> Payload | None:
        """What changed since the last call, or ``None`` if nothing did.

        A counter seen for the first time goes out even at 0, so that its
        series exists in ``/metrics`` before anything happens to it.
        """
        last_c, last_g = self._counters, self._gauges
        c = {
            k: v - last_c.get(k, 0)
            for k, v in counters.items()
            if k not in last_c or v != last_c[k]
        }
        g = {k: v for k, v in gauges.items() if last_g.get(k) != v}
        h = {k: list(v) for k, v in (samples or {}).items() if v}
        self._counters, self._gauges = dict(counters), dict(gauges)
        if not (c or g or h):
            return None
        return {COUNTERS: c, GAUGES: g, HISTOGRAMS: h}


def merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> Payload:
    """Two payloads as one: counters add, a rank's gauge takes ``b``'s value, samples extend."""
    counters = dict(a.get(COUNTERS, {}))
    for k, v in b.get(COUNTERS, {}).items():
        counters[k] = counters.get(k, 0) + v
    gauges = {**a.get(GAUGES, {}), **b.get(GAUGES, {})}
    samples = {k: list(v) for k, v in a.get(HISTOGRAMS, {}).items()}
    for k, v in b.get(HISTOGRAMS, {}).items():
        samples.setdefault(k, []).extend(v)
    return {COUNTERS: counters, GAUGES: gauges, HISTOGRAMS: samples}


def log_line(data: Mapping[str, Any]) -> dict[str, int | float]:
    """One interval's payload as the flat figures vLLM logs (``KV Transfer metrics: ...``)."""
    out: dict[str, int | float] = {}
    for k, v in data.get(COUNTERS, {}).items():
        name, tier = k.split(SEP)
        if v:
            out[f"{name}[{tier}]" if tier else name] = v
    for k, v in data.get(GAUGES, {}).items():
        name, tier, *rank = k.split(SEP)
        label = ",".join(x for x in (tier, *(f"rank{r}" for r in rank)) if x)
        out[f"{name}[{label}]" if label else name] = v
    for k, samples in data.get(HISTOGRAMS, {}).items():
        name = k.split(SEP)[0]
        out[f"{name}_count"] = len(samples)
        out[f"{name}_mean_ms"] = round(1000 * sum(samples) / len(samples), 3)
    return out
