"""The one stats record: every call ends in exactly one outcome, and exporters can read it."""

from __future__ import annotations

import threading
from dataclasses import FrozenInstanceError, fields

import pytest

from kvoffload.errors import CorruptChunkError, TierError
from kvoffload.tiers.stats import TierCounters, TierStats


def fail(exc: Exception) -> bool:
    raise exc


def test_each_store_and_load_ends_in_exactly_one_outcome() -> None:
    counters = TierCounters("disk")
    counters.store(lambda: 100)
    with pytest.raises(TierError):
        counters.store(lambda: fail(TierError("full")))  # type: ignore[arg-type, return-value]
    with pytest.raises(ZeroDivisionError):  # a bug is a failed store too, and is raised on
        counters.store(lambda: 1 // 0)
    assert counters.load(40, lambda: True) is True
    assert counters.load(40, lambda: False) is False
    with pytest.raises(CorruptChunkError):
        counters.load(40, lambda: fail(CorruptChunkError("checksum")))
    with pytest.raises(TierError):
        counters.load(40, lambda: fail(TierError("EIO")))
    stats = counters.snapshot()
    assert (stats.stores, stats.store_bytes, stats.store_failures, stats.dropped) == (1, 100, 2, 0)
    assert (stats.loads, stats.load_bytes) == (1, 40)
    assert (stats.misses, stats.corrupt, stats.load_failures) == (1, 1, 1)
    assert stats.store_seconds > 0 and stats.load_seconds > 0  # successful calls only, summed


def test_tier_specific_counters_must_be_declared() -> None:
    counters = TierCounters("redis", ("outages",))
    counters.add(outages=2, evictions=1)
    with pytest.raises(KeyError):
        counters.add(outage=1)  # a typo is a bug, not a new figure
    stats = counters.snapshot(gauges={"up": 0})
    assert stats.counters == {"outages": 2} and stats.gauges == {"up": 0}
    assert stats.evictions == 1


def test_metrics_name_every_figure_with_its_kind() -> None:
    counters = TierCounters("redis", ("outages",))
    counters.add(stores=3, store_bytes=3000, outages=1)
    stats = counters.snapshot(used_bytes=10, chunks=2, capacity_bytes=100, gauges={"up": 1})
    kinds = {name: kind for name, kind, _ in stats.metrics()}
    assert kinds["stores"] == kinds["store_seconds"] == kinds["outages"] == "counter"
    gauges = [name for name, kind in kinds.items() if kind == "gauge"]
    assert gauges == ["used_bytes", "chunks", "capacity_bytes", "up"]
    shared = [f for f in fields(TierStats) if f.metadata]
    assert len(kinds) == len(shared) + 2 and all(f.metadata["help"] for f in shared)
    plain = stats.snapshot()
    assert plain["stores"] == 3 and plain["up"] == 1 and plain["used_bytes"] == 10
    assert all(isinstance(v, int | float) for v in plain.values())
    assert "tier" not in plain  # the tier is a label, not a figure


def test_a_snapshot_is_frozen_and_rates_come_from_it() -> None:
    stats = TierStats("cpu", store_bytes=2_000_000_000, store_seconds=0.5)
    assert stats.store_gbps == 4.0 and stats.load_gbps == 0.0
    with pytest.raises(FrozenInstanceError):
        stats.stores = 1  # type: ignore[misc]


def test_concurrent_updates_are_not_lost() -> None:
    counters = TierCounters("disk")

    def work() -> None:
        for _ in range(2000):
            counters.store(lambda: 1)
            counters.load(1, lambda: True)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = counters.snapshot()
    assert stats.stores == stats.loads == stats.store_bytes == stats.load_bytes == 8000
