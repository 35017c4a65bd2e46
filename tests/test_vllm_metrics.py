"""The connector's figures as vLLM carries them: deltas, gauges by rank, samples, one log line.

(The series in a real ``vllm serve``'s ``/metrics`` are checked in
``tests_e2e/test_prometheus.py``.)
"""

from __future__ import annotations

from kvoffload._records import as_dict
from kvoffload.connector.stats import SchedulerStats
from kvoffload.tiers.stats import TierCounters
from kvoffload.vllm._metrics import (
    SERIES,
    Deltas,
    key,
    log_line,
    merge,
    scheduler_series,
    worker_series,
)


def test_counters_travel_as_deltas_and_gauges_only_when_they_change() -> None:
    deltas = Deltas()
    first = deltas.take({"a|": 5, "b|cpu": 0}, {"used|cpu|0": 3})
    assert first == {  # 0: it exists
        "counters": {"a|": 5, "b|cpu": 0},
        "gauges": {"used|cpu|0": 3},
        "histograms": {},
    }
    assert deltas.take({"a|": 5, "b|cpu": 0}, {"used|cpu|0": 3}) is None  # nothing moved
    second = deltas.take({"a|": 7, "b|cpu": 1}, {"used|cpu|0": 3}, {"load_seconds|": [0.1]})
    assert second == {
        "counters": {"a|": 2, "b|cpu": 1},
        "gauges": {},
        "histograms": {"load_seconds|": [0.1]},
    }
    assert deltas.take({"a|": 7, "b|cpu": 1}, {"used|cpu|0": 0}) == {
        "counters": {},
        "gauges": {"used|cpu|0": 0},
        "histograms": {},
    }


def test_merge_adds_counters_keeps_each_ranks_gauge_and_extends_samples() -> None:
    rank0 = {"counters": {"x|disk": 2}, "gauges": {"u|disk|0": 10}, "histograms": {"s|": [0.1]}}
    rank1 = {"counters": {"x|disk": 3}, "gauges": {"u|disk|1": 12}, "histograms": {"s|": [0.2]}}
    merged = merge(rank0, rank1)
    assert merged == {
        "counters": {"x|disk": 5},
        "gauges": {"u|disk|0": 10, "u|disk|1": 12},
        "histograms": {"s|": [0.1, 0.2]},
    }
    assert merge(merged, {"gauges": {"u|disk|0": 11}})["gauges"]["u|disk|0"] == 11
    assert rank0["histograms"]["s|"] == [0.1]  # the inputs are not changed


def test_scheduler_series_split_tokens_by_tier_and_index_gauges() -> None:
    figures = {"lookups": 4, "hit_tokens": 96, "loaded_tokens": 96,
               "hit_tokens_by_tier": {"cpu": 64, "disk": 32},
               "loaded_tokens_by_tier": {"cpu": 64, "disk": 32},
               "index_evictions": 3, "index_used": 7, "index_capacity": 10,
               "index_held": 5, "jobs_in_flight": 1, "unkeyable_requests": 2}  # fmt: skip
    counters, gauges = scheduler_series(figures)
    assert counters[key("hit_tokens", "disk")] == 32
    assert counters[key("loaded_tokens", "cpu")] == 64
    assert counters[key("evictions", "cpu")] == 3
    assert counters[key("unkeyable_requests")] == 2 and counters[key("lookups")] == 4
    assert key("hit_tokens") not in counters  # only by tier
    assert gauges == {"index_used|": 7, "index_capacity|": 10, "index_held|": 5,
                      "jobs_in_flight|": 1}  # fmt: skip


def test_misses_travel_by_reason_and_the_reuse_distance_as_a_gauge() -> None:
    figures = {"miss_lookups_by_reason": {"never_stored": 3, "evicted": 1},
               "miss_tokens_by_reason": {"never_stored": 168, "evicted": 56},
               "reuse_distance_chunks": 16}  # fmt: skip
    counters, gauges = scheduler_series(figures)
    assert counters == {key("lookup_misses", "never_stored"): 3,
                        key("lookup_misses", "evicted"): 1,
                        key("lookup_miss_tokens", "never_stored"): 168,
                        key("lookup_miss_tokens", "evicted"): 56,
                        key("evictions", "cpu"): 0}  # fmt: skip
    assert gauges == {key("reuse_distance_chunks"): 16}
    reasons = {s.name: s.label for s in SERIES if s.name.startswith("lookup_miss")}
    assert reasons == {"lookup_misses": "reason", "lookup_miss_tokens": "reason"}


def test_worker_series_read_each_tiers_stats_record() -> None:
    cpu, redis = TierCounters("cpu"), TierCounters("redis", ["queued"])
    disk = TierCounters("disk", ["read_only_skips"])
    cpu.add(stores=2, store_bytes=200, loads=1, load_bytes=100)
    disk.add(stores=2, store_bytes=200, corrupt=1, load_failures=1, evictions=1, dropped=0)
    disk.add(read_only_skips=4)
    redis.add(store_failures=1, dropped=2)
    tiers = {
        "cpu": cpu.snapshot(used_bytes=200, chunks=2, capacity_bytes=1000),
        "disk": disk.snapshot(used_bytes=8192, chunks=1, capacity_bytes=10**6),
        "redis": redis.snapshot(gauges={"queue_bytes": 300, "up": 1}),
    }
    counters, gauges = worker_series(tiers, {"load_jobs": 1}, rank=1)
    assert counters[key("stored_bytes", "cpu")] == 200
    assert counters[key("loaded_bytes", "cpu")] == 100
    assert counters[key("failed_loads", "disk")] == 2
    assert counters[key("failed_stores", "redis")] == 3
    assert counters[key("evictions", "disk")] == 1 and key("evictions", "cpu") not in counters
    assert counters[key("skipped_stores", "disk")] == 4
    assert key("skipped_stores", "redis") not in counters  # a tier that never skips
    assert counters[key("load_jobs")] == 1
    assert gauges == {
        "usage_bytes|cpu|1": 200,
        "usage_chunks|cpu|1": 2,
        "usage_bytes|disk|1": 8192,
        "usage_chunks|disk|1": 1,
        "remote_queue_bytes|redis|1": 300,
    }  # fmt: skip  (no usage for the remote server: kvoffload does not know it)
    # The ranks of a replicated layout share one copy: rank 0 alone reports its usage.
    assert worker_series(tiers, {}, rank=1, one_copy=True)[1] == {"remote_queue_bytes|redis|1": 300}
    assert worker_series(tiers, {}, rank=0, one_copy=True)[1]["usage_bytes|cpu|0"] == 200


def test_the_log_line_names_tiers_ranks_and_job_latency() -> None:
    data = {
        "counters": {"hit_tokens|cpu": 64, "lookups|": 2, "zero|": 0},
        "gauges": {"usage_bytes|disk|0": 10, "index_used|": 3},
        "histograms": {"load_seconds|": [0.001, 0.003]},
    }
    assert log_line(data) == {
        "hit_tokens[cpu]": 64, "lookups": 2, "usage_bytes[disk,rank0]": 10, "index_used": 3,
        "load_seconds_count": 2, "load_seconds_mean_ms": 2.0,
    }  # fmt: skip


def test_every_series_has_a_producer() -> None:
    """Each exported series is filled by one side's figures (a typo would be a dead series)."""
    tiers = {"disk": TierCounters("disk", ["read_only_skips"]).snapshot(capacity_bytes=1)}
    redis = {"redis": TierCounters("redis").snapshot(gauges={"queue_bytes": 0})}
    scheduler = scheduler_series(
        {"hit_tokens_by_tier": {"cpu": 1}, "loaded_tokens_by_tier": {"cpu": 1},
         "unkeyable_requests": 0, "in_step_hit_tokens": 0,
         "miss_lookups_by_reason": {"evicted": 1},
         "miss_tokens_by_reason": {"evicted": 8}, "reuse_distance_chunks": 3,
         **{name: 0 for name in as_dict(SchedulerStats())
            if name.startswith(("handoff_", "queued_", "retention_"))}}
    )  # fmt: skip
    names = {k.split("|")[0] for part in scheduler for k in part}
    for part in (*worker_series(tiers, {}, 0), *worker_series(redis, {}, 0)):
        names |= {k.split("|")[0] for k in part}
    names |= {"load_seconds", "store_seconds"}  # the worker's job samples
    assert {s.name for s in SERIES} <= names
