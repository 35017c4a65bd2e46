"""``as_dict``: the figures the metrics read every step, as ``asdict`` gives them."""

from __future__ import annotations

from dataclasses import asdict

from kvoffload._records import as_dict
from kvoffload.connector.stats import SchedulerStats, WorkerStats
from kvoffload.manager.stats import IndexStats


def test_a_snapshot_equals_asdict_and_owns_its_dicts() -> None:
    stats = SchedulerStats(lookups=3, hit_tokens=64)
    stats.add_by_tier(stats.hit_tokens_by_tier, {"cpu": 32, "disk": 32})
    snap = stats.snapshot()
    assert snap == asdict(stats) and list(snap) == list(asdict(stats))
    snap["hit_tokens_by_tier"]["cpu"] = 0  # a reader's change never reaches the record
    assert stats.hit_tokens_by_tier == {"cpu": 32, "disk": 32}
    for record in (WorkerStats(load_jobs=2), IndexStats(hits=5, capacity=9)):
        assert as_dict(record) == asdict(record)
