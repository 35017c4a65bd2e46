"""Fault points (``KVOFFLOAD_FAILPOINTS``): each damages what it says, silently, and only that.

The stand-in writes every block's KV from its hash and checks every byte a
load filled, so a damaged block is counted exactly (``mismatched_blocks``)
while the connector's own figures still report clean loads.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import pytest
from test_standin import GEMMA, LLAMA, make, tokens

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.connector.scheduler import MAX_FAILED_LOADS
from kvoffload.engine.failpoints import ENV, POINTS, FailPoints
from kvoffload.errors import ConfigError
from kvoffload.keys import namespace_of
from kvoffload.standin import KVOffloadSide, KVPages, StandIn
from kvoffload.tiers.disk import DiskProbe
from kvoffload.transfer import allocate_kv_caches


def serve(
    layout: KVLayout, tmp_path: Path, *, seed: int = 10, **extra: object
) -> tuple[Any, dict[str, Any]]:
    """Four prompts, evicted from a small GPU cache, then asked again: loads from the CPU."""
    engine, side = make(layout, tmp_path, cpu_chunks=200, gpu_blocks=80, **extra)
    try:
        first = [(f"a{i}", tokens(100, seed + i)) for i in range(4)]
        again = [(f"b{i}", ids) for i, (_, ids) in enumerate(first)]
        stats = engine.run([*first, *again])
        assert side.worker is not None
        return stats, {**side.scheduler.stats(), **side.worker.stats()}
    finally:
        side.close()


def fired(figures: dict[str, Any]) -> dict[str, int]:
    """The worker figures' fault counters, by point."""
    return {
        point: figures[f"failpoint_{point.replace('.', '_')}"]
        for point in POINTS
        if f"failpoint_{point.replace('.', '_')}" in figures
    }


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[KVLayout, tuple[Any, dict[str, Any]]]:
    """The runs without fault points, per layout, for the counters a silent fault keeps."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv(ENV, raising=False)
        return {
            layout: serve(layout, tmp_path_factory.mktemp("clean")) for layout in (LLAMA, GEMMA)
        }


def test_off_by_default_and_on_only_when_named(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert FailPoints.from_env() is None
    monkeypatch.setenv(ENV, " ")
    assert FailPoints.from_env() is None and not caplog.records
    monkeypatch.setenv(ENV, "load.corrupt_block=2, store.drop=0.5")
    with caplog.at_level(logging.WARNING, "kvoffload"):
        points = FailPoints.from_env()
    assert points is not None and len(caplog.records) == 1
    assert "fault points ON" in caplog.text and "load.corrupt_block=2" in caplog.text


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("load.corupt_block", "unknown fault point 'load.corupt_block'; the points are load."),
        ("store.drop=0", "store.drop='0' is not a count (an integer > 0) or a rate"),
        ("store.drop=1.5", "store.drop='1.5' is not a count"),
        ("store.drop=x", "write store.drop, store.drop=3 or store.drop=0.5"),
        ("store.slow_lower", "store.slow_lower='' is not a duration; write store.slow_lower=3s"),
        ("store.slow_lower=3", "store.slow_lower='3' is not a duration"),
        ("store.slow_lower=0s", "or store.slow_lower=250ms"),
        ("load.slow_lower", "load.slow_lower='' is not a read rate; write load.slow_lower=200MB/s"),
        ("load.slow_lower=200MB", "load.slow_lower='200MB' is not a read rate"),
        ("load.slow_lower=0MB/s", "(a size a second, at least 1B/s)"),
        ("load.slow_lower=fast/s", "or load.slow_lower=1.5GiB/s"),
    ],
)
def test_a_bad_point_is_a_config_error_naming_it(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match="KVOFFLOAD_FAILPOINTS") as error:
        FailPoints(spec)
    assert message in str(error.value)


def test_a_slow_lower_tier_waits_its_duration_at_every_chance(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr("kvoffload.engine.failpoints.time.sleep", slept.append)
    points = FailPoints("store.slow_lower=250ms")
    points.slow_lower()
    points.slow_lower()
    assert slept == [0.25, 0.25] and points.stats() == {"failpoint_store_slow_lower": 2}
    FailPoints("store.slow_lower=1.5s").slow_lower()
    assert slept[-1] == 1.5


def test_a_slow_read_waits_for_its_bytes_after_the_reads_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``load.slow_lower``: a chunk read takes at least its bytes at the rate, the time of
    the read itself included, and reads share the rate (the second waits for the first)."""
    slept: list[float] = []
    monkeypatch.setattr("kvoffload.engine.failpoints.time.sleep", slept.append)
    points = FailPoints("load.slow_lower=2MB/s")
    now = time.perf_counter()
    points.slow_read(1_000_000, now)  # 0.5 s of reading at 2 MB/s
    points.slow_read(1_000_000, now)  # read at once too: it waits for the first one
    assert 0.45 < slept[0] <= 0.5 and 0.95 < slept[1] <= 1.0
    assert points.stats() == {"failpoint_load_slow_lower": 2}
    idle = FailPoints("load.slow_lower=2MB/s")
    idle.slow_read(1_000_000, now - 10)  # its read alone took longer than the rate asks
    assert len(slept) == 2 and idle.stats() == {"failpoint_load_slow_lower": 1}
    assert FailPoints("load.slow_lower=1.5GiB/s")._rates["load.slow_lower"] == 1.5 * 2**30


def test_counts_limit_firing_and_rates_repeat() -> None:
    counted = FailPoints("load.wrong_block=2")
    assert [counted.fires("load.wrong_block") for _ in range(4)] == [True, True, False, False]
    assert not counted.fires("store.drop") and counted.fired == {"load.wrong_block": 2}
    rated = [FailPoints("store.drop=0.5") for _ in "ab"]
    runs = [[p.fires("store.drop") for _ in range(200)] for p in rated]
    assert runs[0] == runs[1] and 60 < sum(runs[0]) < 140  # a fixed seed: runs repeat


@pytest.mark.parametrize("layout", [LLAMA, GEMMA], ids=["llama", "gemma"])
@pytest.mark.parametrize(
    "point",
    # Count 1: the first load's last block; blocks_per_chunk 1, so a skipped chunk is a block.
    ["load.corrupt_block=1", "load.wrong_block=1", "load.skip_last_chunk=1"],
)
def test_a_load_point_damages_one_block_and_reports_success(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    clean: dict[KVLayout, tuple[Any, dict[str, Any]]],
    layout: KVLayout,
    point: str,
) -> None:
    monkeypatch.setenv(ENV, point)
    stats, figures = serve(layout, tmp_path)
    clean_stats, clean_figures = clean[layout]
    assert clean_stats.mismatched_blocks == 0
    assert fired(figures) == {point.removesuffix("=1"): 1}
    assert stats.mismatched_blocks == 1
    # Silent: the same loads, all reported done, as in the clean run.
    assert stats.loaded_tokens == clean_stats.loaded_tokens > 0
    assert stats.verified_blocks == clean_stats.verified_blocks - 1
    for name in ("loaded_tokens", "failed_loads", "load_chunks", "failed_load_chunks"):
        assert figures[name] == clean_figures[name], name


@pytest.mark.parametrize("layout", [LLAMA, GEMMA], ids=["llama", "gemma"])
def test_every_chance_fires_without_a_count(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    clean: dict[KVLayout, tuple[Any, dict[str, Any]]],
    layout: KVLayout,
) -> None:
    monkeypatch.setenv(ENV, "load.corrupt_block")
    stats, figures = serve(layout, tmp_path)
    times = fired(figures)["load.corrupt_block"]
    assert times > 1 and stats.mismatched_blocks == times  # one block a scatter
    assert stats.loaded_tokens == clean[layout][0].loaded_tokens


@pytest.mark.parametrize("layout", [LLAMA, GEMMA], ids=["llama", "gemma"])
def test_a_failed_load_is_reported_and_recomputed(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    clean: dict[KVLayout, tuple[Any, dict[str, Any]]],
    layout: KVLayout,
) -> None:
    """``load.fail_last_chunk`` is not silent: the engine learns of it and recomputes."""
    monkeypatch.setenv(ENV, "load.fail_last_chunk=1")
    stats, figures = serve(layout, tmp_path)
    assert fired(figures) == {"load.fail_last_chunk": 1}
    assert stats.mismatched_blocks == 0  # nothing wrong reached the engine
    assert figures["failed_loads"] == 1 and figures["failed_load_chunks"] == 1
    assert 0 < stats.failed_load_tokens <= stats.external_tokens - stats.loaded_tokens
    # Llama loads in the step that asks (one group) and recomputes from the failed block,
    # voiding the stores of that step; Gemma's request starts over, lookup included.
    assert (figures["in_step_load_jobs"] > 0) == (layout is LLAMA)
    assert figures["voided_store_orders"] == 0 or layout is LLAMA


def test_a_chunk_that_fails_every_time_is_not_offered_forever(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Gemma's failed request starts over, lookup included: after MAX_FAILED_LOADS failed
    loads the request is offered nothing more, and the engine computes it."""
    monkeypatch.setenv(ENV, "load.fail_last_chunk")  # every load, every time
    stats, figures = serve(GEMMA, tmp_path)
    assert stats.requests == 8 and stats.mismatched_blocks == 0
    hits = figures["hit_requests"]
    assert 0 < figures["failed_loads"] == hits <= 4 * MAX_FAILED_LOADS  # 4 prompts hit
    assert figures["miss_lookups_by_reason"]["failed_load"] > 0


def test_a_dropped_store_is_loaded_later_as_wrong_bytes(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    clean: dict[KVLayout, tuple[Any, dict[str, Any]]],
) -> None:
    # A dropped store leaves its slots' older bytes. A slab may come back from the
    # allocator holding a freed slab's bytes, and the clean runs stored these very chunks
    # at these very slots: so prompts of their own, and their clean run after this one.
    monkeypatch.setenv(ENV, "store.drop=1")
    stats, figures = serve(LLAMA, tmp_path / "dropped", seed=110)
    monkeypatch.delenv(ENV)
    clean_stats, clean_figures = serve(LLAMA, tmp_path / "clean", seed=110)
    assert fired(figures) == {"store.drop": 1}
    assert stats.mismatched_blocks > 0 and stats.loaded_tokens == clean_stats.loaded_tokens
    assert stats.verified_blocks + stats.mismatched_blocks == clean_stats.verified_blocks
    for name in ("stored_chunks", "index_store_failures", "failed_store_chunks", "failed_loads"):
        assert figures[name] == clean_figures[name], name


#: One group of 16-token blocks, 1 KiB a block: a 320-token prompt is 20 chunks.
DISK_LAYOUT = KVLayout((CacheGroup("full", 16, ("l0", "l1"), 512),))


def from_disk(tmp_path: Path, *, fetch: bool) -> tuple[Any, dict[str, Any]]:
    """A prompt's 20 chunks on disk only (another prompt pushed them out of a 64-chunk CPU
    tier, the GPU cache emptied), then its next turn behind a long request, one running at a
    time: the turn fetches them while it waits (``fetch``) or loads them from disk."""
    namespace = namespace_of("failpoint-test", "bfloat16", DISK_LAYOUT)
    keys = {"cpu_bytes_to_use": 64 * 1024, "disk_path": str(tmp_path / "kv"),
            "disk_bytes_to_use": "16MiB", "fetch_while_queued": fetch,
            "queued_cpu_share": 0.5}  # fmt: skip
    kv = allocate_kv_caches(DISK_LAYOUT, 256)
    probes = [DiskProbe(tmp_path / "kv", namespace)]
    config = build_offloading_config(keys, DISK_LAYOUT)
    side = KVOffloadSide(config, namespace, kv, probes)
    stand = StandIn(DISK_LAYOUT, side, gpu_blocks=256, kv=KVPages(DISK_LAYOUT, kv), max_running=1)
    try:
        stand.run([("turn-1", tokens(320, 100)), ("other", tokens(1024, 101))])
        stand.reset_prefix_cache()
        stand.add("long", tokens(640, 102))
        stand.add("turn-2", [*tokens(320, 100), *tokens(40, 103)])
        while stand.waiting or stand.running:
            stand.step()
        stand.step()
        assert side.worker is not None
        return stand.stats, {**side.scheduler.stats(), **side.worker.stats()}
    finally:
        side.close()


def counters(figures: dict[str, Any]) -> dict[str, Any]:
    """The figures a delay must not change: every counter but the fault's, no timings."""
    out = {k: v for k, v in figures.items() if not k.startswith("failpoint_") and k != "tiers"}
    for tier, record in figures["tiers"].items():
        out |= {f"{tier}.{k}": v for k, v in record.items() if "seconds" not in k}
    return out


@pytest.mark.parametrize("fetch", [False, True], ids=["load", "fetch_while_queued"])
def test_a_slow_lower_tier_delays_every_chunk_read_from_it_and_nothing_else(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fetch: bool
) -> None:
    """``load.slow_lower`` on a real disk tier: each chunk read from the disk, by a load or
    by a fetch while queued, waits its bytes at the rate; CPU-tier reads do not; nothing is
    damaged, and every counter but its own equals a clean run's."""
    monkeypatch.delenv(ENV, raising=False)
    clean_stats, clean = from_disk(tmp_path / "clean", fetch=fetch)
    monkeypatch.setenv(ENV, "load.slow_lower=10MB/s")  # 0.1 ms a 1 KiB chunk
    stats, slow = from_disk(tmp_path / "slow", fetch=fetch)
    assert clean["queued_fetched_chunks"] == (20 if fetch else 0)
    assert clean["hit_tokens_by_tier"] == {"disk": 320}
    # Every chunk the disk served was delayed, once: the 20 of the first turn.
    assert fired(slow) == {"load.slow_lower": 20} and slow["tiers"]["disk"]["loads"] == 20
    assert stats.mismatched_blocks == clean_stats.mismatched_blocks == 0
    assert stats.loaded_tokens == clean_stats.loaded_tokens == 320
    assert counters(slow) == counters(clean)


def test_loads_from_the_cpu_tier_are_not_delayed(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    clean: dict[KVLayout, tuple[Any, dict[str, Any]]],
) -> None:
    monkeypatch.setenv(ENV, "load.slow_lower=1B/s")  # a chunk would take days
    stats, figures = serve(LLAMA, tmp_path)
    clean_stats, clean_figures = clean[LLAMA]
    assert fired(figures) == {"load.slow_lower": 0}
    assert stats.loaded_tokens == clean_stats.loaded_tokens > 0
    assert stats.mismatched_blocks == 0
    assert counters(figures) == counters(clean_figures)


def test_every_point_is_documented() -> None:
    docs = (Path(__file__).resolve().parents[1] / "docs" / "failpoints.md").read_text()
    assert all(f"`{point}`" in docs for point in POINTS)
