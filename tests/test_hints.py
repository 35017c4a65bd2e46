"""Retention hints: a client's token ranges with a priority keep chunks in the CPU tier or drop
them from it, through kvoffload's real scheduler and worker under the stand-in engine."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from _turns import run_out, tokens

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.connector.hints import MAX_KEEP_S, TokenRange, parse_hint
from kvoffload.keys import namespace_of
from kvoffload.standin import KVOffloadSide, KVPages, StandIn
from kvoffload.tiers.disk import DiskProbe
from kvoffload.transfer import allocate_kv_caches

LAYOUT = KVLayout((CacheGroup("full", 16, ("l0", "l1"), 512),))
NAMESPACE = namespace_of("hints-test", "bfloat16", LAYOUT)
CPU_CHUNKS = 64


def hint(*ranges: dict[str, Any]) -> dict[str, Any]:
    return {"kv_retention": {"token_ranges": list(ranges)}}


def serve(first_hint: dict[str, Any] | None, clock: list[float] | None = None) -> tuple[int, Any]:
    """A first turn (with ``first_hint``), another request's 20 chunks, then one of 40 whose
    stores evict 16 (the oldest: the first turn's tail); then the next turn. Returns the
    next turn's hit and the scheduler's stats."""
    keys = {"cpu_bytes_to_use": CPU_CHUNKS * 1024, "queued_cpu_share": 0.5}
    side = KVOffloadSide(build_offloading_config(keys, LAYOUT), NAMESPACE,
                         kv := allocate_kv_caches(LAYOUT, 256))  # fmt: skip
    if clock is not None:
        side.scheduler.hints._clock = lambda: clock[0]
    stand = StandIn(LAYOUT, side, gpu_blocks=256, kv=KVPages(LAYOUT, kv), max_running=1)
    try:
        first = tokens(1, 320)
        stand.add("turn-1", first)
        if first_hint is not None:
            side.scheduler.read_hint("turn-1", first_hint)
        while stand.waiting or stand.running:
            stand.step()
        stand.run([("other", tokens(4, 320))])
        if clock is not None:
            clock[0] += 61
        stand.run([("long", tokens(2, 640))])
        stand.reset_prefix_cache()
        turn = stand.add("turn-2", [*first, *tokens(3, 40)])
        stats = run_out(stand, side)
        return turn.external, stats
    finally:
        side.close()


def test_without_a_hint_the_oldest_go_first() -> None:
    hit, stats = serve(None)
    assert hit == 64 and stats["retention_hints"] == 0  # LRU took the first turn's tail


def test_a_kept_range_outlives_younger_chunks() -> None:
    hit, stats = serve(hint({"token_start": 0, "token_end": None, "priority": 90}))
    assert hit == 320 and stats["retention_kept_chunks"] == 20


def test_a_kept_range_ages_normally_once_its_time_is_up() -> None:
    kept = hint({"token_start": 0, "priority": 90, "duration_ms": 60_000})
    hit, stats = serve(kept, clock=[0.0])  # 61 s pass before the long request's stores
    assert hit == 64 and stats["retention_kept_chunks"] == 20 and stats["index_held"] == 0


def test_a_dropped_range_leaves_the_cpu_tier_when_its_request_ends() -> None:
    hit, stats = serve(hint({"token_start": 0, "token_end": 160, "priority": 0}))
    assert stats["retention_dropped_chunks"] == 10  # the first 10 chunks, not the rest
    assert hit == 0  # the next turn's prefix is gone from the head


def test_the_default_priority_changes_nothing() -> None:
    hit, stats = serve(hint({"token_start": 0, "priority": 35}))
    assert hit == 64 and stats["retention_hints"] == 1
    assert stats["retention_kept_chunks"] == stats["retention_dropped_chunks"] == 0


MALFORMED = [
    ({"kv_retention": []}, "'kv_retention' needs 'token_ranges': a list of 1 to 64 ranges"),
    (hint({"priority": 101}), "range 0: priority must be an integer from 0 to 100, got 101"),
    (hint({"priority": 50, "token_start": -1}), "token_start must be an integer >= 0"),
    (hint({"priority": 50, "token_start": 8, "token_end": 8}), "token_end must be null or an"),
    (hint({"priority": 50, "duration_ms": 0}), "duration_ms must be null or an integer above 0"),
    (hint({"priority": 50, "scope": "x"}), "range 0: unknown field(s) ['scope']"),
    (hint({"priority": True}), "priority must be an integer from 0 to 100, got True"),
]


@pytest.mark.parametrize(("params", "why"), MALFORMED)
def test_a_malformed_hint_says_why(params: dict[str, Any], why: str) -> None:
    parsed = parse_hint(params)
    assert isinstance(parsed, str) and why in parsed


def test_a_well_formed_hint_parses_and_none_is_none() -> None:
    kept = {"token_start": 0, "token_end": 64, "priority": 80, "duration_ms": 5000}
    ranges = parse_hint(hint(kept, {"token_start": 64, "priority": 5}))
    assert ranges == (TokenRange(0, 64, 80, 5.0), TokenRange(64, None, 5, MAX_KEEP_S))
    assert parse_hint({"do_remote_prefill": True}) is None and parse_hint(None) is None


def test_a_malformed_hint_is_ignored_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    keys = {"cpu_bytes_to_use": CPU_CHUNKS * 1024}
    side = KVOffloadSide(build_offloading_config(keys, LAYOUT), NAMESPACE,
                         kv := allocate_kv_caches(LAYOUT, 256))  # fmt: skip
    stand = StandIn(LAYOUT, side, gpu_blocks=256, kv=KVPages(LAYOUT, kv))
    try:
        with caplog.at_level(logging.WARNING, logger="kvoffload"):
            for n in range(3):
                stand.add(f"r{n}", tokens(n, 64))
                side.scheduler.read_hint(f"r{n}", hint({"priority": "high"}))
        assert side.scheduler.stats()["retention_hints_ignored"] == 3
        [record] = [r for r in caplog.records if "retention hint" in r.getMessage()]
        assert "priority must be an integer from 0 to 100, got 'high'" in record.getMessage()
    finally:
        side.close()


def two_turns(extra: dict[str, Any], first_hint: dict[str, Any] | None,
              tmp_path: Path | None = None) -> tuple[int, Any]:  # fmt: skip
    """A first turn (with ``first_hint``, sent with the request as a client sends it), then
    its next turn with the GPU cache emptied: the next turn's hit and the stats."""
    keys = {"cpu_bytes_to_use": CPU_CHUNKS * 1024, **extra}
    probes = []
    if tmp_path is not None:
        keys |= {"disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": "16MiB"}
        probes = [DiskProbe(tmp_path / "kv", NAMESPACE)]
    side = KVOffloadSide(build_offloading_config(keys, LAYOUT), NAMESPACE,
                         kv := allocate_kv_caches(LAYOUT, 256), probes)  # fmt: skip
    stand = StandIn(LAYOUT, side, gpu_blocks=256, kv=KVPages(LAYOUT, kv))
    try:
        first = tokens(1, 320)
        stand.add("turn-1", first, kv_transfer_params=first_hint)
        stand.run([])  # to the end
        stand.reset_prefix_cache()
        turn = stand.add("turn-2", [*first, *tokens(3, 40)])
        stats = run_out(stand, side)
        return turn.external, stats
    finally:
        side.close()


def test_a_kept_range_is_admitted_past_the_policys_filter() -> None:
    """Storing on a second sighting turns a first turn away; a kept range goes in at once."""
    filtered = {"store_threshold": 2}
    hit, _ = two_turns(filtered, None)
    assert hit == 0  # seen once: not stored
    hit, stats = two_turns(filtered, hint({"token_start": 0, "priority": 90}))
    assert hit == 320 and stats["retention_kept_chunks"] == 20


def test_a_dropped_range_never_enters_the_cpu_tier_but_reaches_the_disk(tmp_path: Path) -> None:
    """What a client drops is turned away from the CPU tier as it is stored (it evicts
    nothing there), and still written to the disk behind it, which serves the next turn."""
    dropped = hint({"token_start": 0, "priority": 10})
    hit, stats = two_turns({}, dropped, tmp_path)
    assert hit == 320 and stats["hit_tokens_by_tier"] == {"disk": 320}
    assert stats["retention_dropped_chunks"] == 20
    hit, stats = two_turns({}, dropped)  # no disk: the next turn recomputes it
    assert hit == 0 and stats["retention_dropped_chunks"] == 20


def test_a_full_share_makes_room_for_the_range_read_again_sooner() -> None:
    """The kept ranges may hold a quarter of the tier (16 chunks): a range kept for an hour
    holds 16 of its 20; one kept for ten seconds then takes the room, since the client
    said it is read again sooner. A third, kept for two hours, does not displace it."""
    keys = {"cpu_bytes_to_use": CPU_CHUNKS * 1024, "retention_cpu_share": 0.25}
    side = KVOffloadSide(build_offloading_config(keys, LAYOUT), NAMESPACE,
                         kv := allocate_kv_caches(LAYOUT, 256))  # fmt: skip
    stand = StandIn(LAYOUT, side, gpu_blocks=256, kv=KVPages(LAYOUT, kv))
    index = side.scheduler.index
    try:
        held = []  # after each request: how many of its chunks are held
        for n, ms in enumerate((3_600_000, 10_000, 7_200_000)):
            prompt = tokens(10 + n, 320)
            kept = hint({"token_start": 0, "priority": 90, "duration_ms": ms})
            stand.add(f"r{n}", prompt, kv_transfer_params=kept)
            stand.run([])
            chain = side.scheduler.keys_for(prompt, None, stand.request_hashes(prompt))[0]
            held.append(sum(key in index._held for key in chain))
        assert held[0] == 16 and index.held == 16
        prompts = [tokens(10 + n, 320) for n in range(3)]
        chains = [side.scheduler.keys_for(p, None, stand.request_hashes(p))[0] for p in prompts]
        assert [sum(key in index._held for key in c) for c in chains] == [0, 16, 0]
    finally:
        side.close()
