"""Requests in the waiting queue keep the CPU-tier chunks they will hit until they run.

The stand-in engine over kvoffload's real scheduler and worker, every loaded block checked
bit-exact: one request runs at a time, so a request that arrives behind a long one waits
while the long one's stores fill a small CPU tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _turns import run_out, tokens

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.connector.queued import MAX_WAIT_S
from kvoffload.errors import ConfigError
from kvoffload.keys import namespace_of
from kvoffload.standin import KVOffloadSide, KVPages, StandIn
from kvoffload.tiers.disk import DiskProbe
from kvoffload.transfer import allocate_kv_caches

LAYOUT = KVLayout((CacheGroup("full", 16, ("l0", "l1"), 512),))
NAMESPACE = namespace_of("queued-test", "bfloat16", LAYOUT)
#: A 64-chunk CPU tier; a 320-token prompt stores 20 chunks, a 1280-token one 80.
CPU_CHUNKS = 64


def engine(share: float) -> tuple[StandIn, KVOffloadSide]:
    keys = {"cpu_bytes_to_use": CPU_CHUNKS * 1024, "queued_cpu_share": share}  # 1 KiB chunks
    settings = build_offloading_config(keys, LAYOUT)
    assert settings.num_cpu_chunks == CPU_CHUNKS
    kv = allocate_kv_caches(LAYOUT, 256)
    side = KVOffloadSide(settings, NAMESPACE, kv)
    return StandIn(LAYOUT, side, gpu_blocks=256, kv=KVPages(LAYOUT, kv), max_running=1), side


def serve_behind_a_long_request(share: float, long_chunks: int = 40) -> tuple[int, dict[str, Any]]:
    """A conversation's first turn is stored, then another request's 20 chunks; the next
    turn arrives behind a request of ``long_chunks`` chunks, whose stores must evict 16
    (at 40): without holds, the oldest, the first turn's. Returns the next turn's hit and
    the stats."""
    first = tokens(1, 320)
    stand, side = engine(share)
    try:
        stand.run([("turn-1", first), ("other", tokens(4, 320))])
        stand.reset_prefix_cache()  # only the connector can serve the next turn's prefix
        stand.add("long", tokens(2, 16 * long_chunks))
        turn = stand.add("turn-2", [*first, *tokens(3, 40)])
        stats = run_out(stand, side)
        return turn.external, stats
    finally:
        side.close()


def test_a_queued_requests_chunks_outlive_the_stores_of_those_ahead() -> None:
    held_hit, held = serve_behind_a_long_request(0.5)
    assert held_hit == 320  # the whole first turn, loaded from the CPU tier
    assert held["queued_holds"] == 1 and held["queued_held_chunks"] == 20
    assert held["index_held"] == 0  # let go once it ran
    assert held["queued_hold_expiries"] == held["index_spilled"] == 0
    assert held["index_evictions"] >= 16  # the other request's chunks went instead

    # Without holds, the long request's stores evict the first turn's tail (LRU, touched
    # tail first), leaving its first 4 chunks.
    unheld_hit, unheld = serve_behind_a_long_request(0)
    assert unheld_hit == 64 and unheld["queued_holds"] == 0


def test_a_request_its_arrival_step_schedules_holds_nothing() -> None:
    stand, side = engine(0.5)
    try:
        first = tokens(1, 320)
        stand.run([("turn-1", first)])
        stand.reset_prefix_cache()
        turn = stand.add("turn-2", [*first, *tokens(3, 40)])
        stats = run_out(stand, side)
        assert turn.external == 320  # its load pinned what it used
        assert stats["queued_holds"] == stats["queued_held_chunks"] == 0
    finally:
        side.close()


def test_a_long_queue_holds_at_most_its_share() -> None:
    hit, stats = serve_behind_a_long_request(0.125)  # 8 of the 64 chunks
    assert stats["queued_held_chunks"] == 8 and hit == 128  # the held head, no more


def test_the_stores_of_running_requests_come_first() -> None:
    # 64 chunks to store, 24 free and 20 of another request to evict: 20 held ones must go.
    hit, stats = serve_behind_a_long_request(0.5, long_chunks=64)
    assert stats["queued_held_chunks"] == 20 and stats["index_spilled"] == 20
    assert hit == 0 and stats["no_room_chunks"] == 0


def test_a_hold_lapses_when_its_request_waits_too_long() -> None:
    stand, side = engine(0.5)
    clock = [100.0]
    side.scheduler.queued._clock = lambda: clock[0]
    try:
        first = tokens(1, 320)
        stand.run([("turn-1", first)])
        late = [*first, 7]
        side.scheduler.request_queued("stuck", late, None, stand.request_hashes(late))
        side.scheduler.plan_step([])  # a step left it waiting: held from here
        assert side.scheduler.stats()["index_held"] == 20
        side.scheduler.plan_step([])
        assert side.scheduler.stats()["index_held"] == 20  # still in time
        clock[0] += MAX_WAIT_S + 1
        side.scheduler.plan_step([])  # every step lets go of the holds that ran out
        stats = side.scheduler.stats()
        assert stats["queued_hold_expiries"] == 1 and stats["index_held"] == 0
    finally:
        side.close()


def test_an_aborted_request_lets_go() -> None:
    stand, side = engine(0.5)
    try:
        first = tokens(1, 320)
        stand.run([("turn-1", first)])
        late = [*first, 7]
        side.scheduler.request_queued("gone", late, None, stand.request_hashes(late))
        side.scheduler.plan_step([])
        assert side.scheduler.stats()["index_held"] == 20
        side.scheduler.request_finished("gone")
        assert side.scheduler.stats()["index_held"] == 0
    finally:
        side.close()


@pytest.mark.parametrize("share", [-0.1, 1.5, "half", True])
def test_a_bad_share_is_refused_by_name(share: object) -> None:
    with pytest.raises(ConfigError, match="queued_cpu_share") as refused:
        build_offloading_config({"cpu_bytes_to_use": "8MiB", "queued_cpu_share": share}, LAYOUT)
    assert "a fraction from 0 (off) to 1" in str(refused.value)


def with_disk(tmp_path: Path, **extra: object) -> tuple[StandIn, KVOffloadSide]:
    """One running request at a time over a CPU tier and a disk, fetching while queued; the
    first turn of a conversation is on the disk only (another request's 64 chunks pushed it
    out of the CPU tier), and nothing is in the GPU cache."""
    keys = {"cpu_bytes_to_use": CPU_CHUNKS * 1024, "disk_path": str(tmp_path / "kv"),
            "disk_bytes_to_use": "16MiB", "fetch_while_queued": True, **extra}  # fmt: skip
    settings = build_offloading_config(keys, LAYOUT)
    kv = allocate_kv_caches(LAYOUT, 256)
    side = KVOffloadSide(settings, NAMESPACE, kv, [DiskProbe(tmp_path / "kv", NAMESPACE)])
    stand = StandIn(LAYOUT, side, gpu_blocks=256, kv=KVPages(LAYOUT, kv), max_running=1)
    stand.run([("turn-1", tokens(1, 320)), ("other", tokens(4, 1024))])
    stand.reset_prefix_cache()
    return stand, side


def test_a_waiting_requests_disk_chunks_are_fetched_and_load_in_its_step(tmp_path: Path) -> None:
    stand, side = with_disk(tmp_path, queued_cpu_share=0.5)
    try:
        stand.add("long", tokens(2, 640))
        turn = stand.add("turn-2", [*tokens(1, 320), *tokens(3, 40)])
        stats = run_out(stand, side)
        assert turn.external == 320  # the whole first turn
        # Read from disk while the long request ran, held, then loaded from the CPU tier in
        # the step that scheduled it.
        assert stats["queued_fetches"] == 1 and stats["queued_fetched_chunks"] == 20
        assert stats["hit_tokens_by_tier"] == {"disk": 320}  # credited where it came from
        assert stats["in_step_hit_tokens"] == 320 and stats["index_held"] == 0
    finally:
        side.close()


def test_a_request_scheduled_at_once_fetches_nothing(tmp_path: Path) -> None:
    stand, side = with_disk(tmp_path)
    try:
        stand.run([("turn-2", [*tokens(1, 320), 7])])  # nothing ahead: its load reads the disk
        stats = side.scheduler.stats()
        assert stats["queued_fetches"] == 0 and stats["hit_tokens_by_tier"] == {"disk": 320}
        assert stats["in_step_hit_tokens"] == 0  # a disk hit loads over later steps
    finally:
        side.close()


def test_a_fetch_that_could_never_fit_does_not_stall_those_behind_it(tmp_path: Path) -> None:
    """Holds may take 16 chunks (a quarter of 64): the first waiting request's 20 disk
    chunks could never be held whole, so the one behind it, whose 10 could, is fetched."""
    keys = {"cpu_bytes_to_use": CPU_CHUNKS * 1024, "disk_path": str(tmp_path / "kv"),
            "disk_bytes_to_use": "16MiB", "fetch_while_queued": True,
            "queued_cpu_share": 0.25}  # fmt: skip
    kv = allocate_kv_caches(LAYOUT, 256)
    side = KVOffloadSide(build_offloading_config(keys, LAYOUT), NAMESPACE, kv,
                         [DiskProbe(tmp_path / "kv", NAMESPACE)])  # fmt: skip
    stand = StandIn(LAYOUT, side, gpu_blocks=256, kv=KVPages(LAYOUT, kv), max_running=1)
    try:  # two first turns reach the disk only: another request's 64 chunks push them out
        stand.run([("big-1", tokens(1, 320)), ("small-1", tokens(5, 160)),
                   ("other", tokens(4, 1024))])  # fmt: skip
        stand.reset_prefix_cache()
        stand.add("long", tokens(2, 640))
        big = stand.add("big-2", [*tokens(1, 320), *tokens(3, 40)])
        small = stand.add("small-2", [*tokens(5, 160), *tokens(6, 40)])
        stats = run_out(stand, side)
        assert (big.external, small.external) == (320, 160)  # both still hit, from either tier
        assert stats["queued_fetches"] == 1 and stats["queued_fetched_chunks"] == 10
    finally:
        side.close()
