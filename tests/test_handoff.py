"""The hand-off from a prefill engine to a decode engine: a producer marks the chunks it is
storing, in the shared tier, before its step's output can leave; a consumer whose lookup
finds marked chunks past its hit asks again instead of missing, for a bounded time.

Marks on a real disk and a real Redis server on loopback; the two sides are kvoffload's
real schedulers, and the chunks land through the stand-in engine's real stores.
"""

from __future__ import annotations

import math
import os
import random
import time
from pathlib import Path
from typing import Any

import pytest
from _redis_servers import RedisServer

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.connector._request import RequestState
from kvoffload.connector.handoffs import Handoffs
from kvoffload.connector.scheduler import OffloadScheduler, StepRequest
from kvoffload.connector.stats import SchedulerStats
from kvoffload.errors import ConfigError
from kvoffload.keys import namespace_of
from kvoffload.messages import JobKind, JobReport
from kvoffload.standin import KVOffloadSide, KVPages, StandIn
from kvoffload.tiers.disk import DiskProbe
from kvoffload.tiers.handoff import HANDOFF_DIR, DiskMarkers, HandoffBoard, handoff_board
from kvoffload.tiers.remote import RedisTier
from kvoffload.transfer import allocate_kv_caches

LAYOUT = KVLayout((CacheGroup("full", 16, ("l0", "l1"), 512),))
NAMESPACE = namespace_of("handoff-test", "bfloat16", LAYOUT)
#: A prompt of 20 full blocks (one chunk each): 19 whole chunks a consumer can load.
PROMPT = random.Random(7).choices(range(1, 30000), k=320)
KEYS = [bytes([i]) * 16 for i in range(1, 5)]


def config(tmp_path: Path, kv_role: str, layout: KVLayout = LAYOUT, **extra: object) -> Any:
    """Keys from token ids: the bare schedulers below and the stand-in's name chunks alike."""
    keys = {"cpu_bytes_to_use": "8MiB", "disk_path": str(tmp_path / "kv"), "key_source": "tokens"}
    keys |= {"disk_bytes_to_use": "64MiB", **extra}
    return build_offloading_config(keys, layout, kv_role=kv_role)


def side(
    tmp_path: Path, kv_role: str, layout: KVLayout = LAYOUT, **extra: object
) -> OffloadScheduler:
    """A scheduler side of ``kv_role`` on the shared disk, with its marks, and no worker."""
    settings = config(tmp_path, kv_role, layout, **extra)
    namespace = namespace_of("handoff-test", "bfloat16", layout)
    probes = [DiskProbe(tmp_path / "kv", namespace)]
    board = handoff_board(settings, [namespace])
    return OffloadScheduler(settings, namespace, probes, handoff=board)


def plan_prefill(producer: OffloadScheduler, req_id: str = "p") -> list[Any]:
    """The producer looks the prompt up and plans the stores of its prefill step."""
    assert producer.lookup(req_id, PROMPT, 0) == 0
    step = StepRequest(req_id, PROMPT, 0, len(PROMPT), [list(range(1, 21))], len(PROMPT))
    return producer.plan_step([step])


def produce(tmp_path: Path) -> None:
    """A producer engine (the stand-in over the real worker) stores the prompt on the disk."""
    settings = config(tmp_path, "kv_producer")
    kv = allocate_kv_caches(LAYOUT, 128)
    board = handoff_board(settings, [NAMESPACE])
    producer = KVOffloadSide(settings, NAMESPACE, kv, handoff=board)
    try:
        StandIn(LAYOUT, producer, gpu_blocks=128, kv=KVPages(LAYOUT, kv)).run([("p", PROMPT)])
    finally:
        producer.close()


def marks(tmp_path: Path) -> list[str]:
    return sorted(os.listdir(tmp_path / "kv" / HANDOFF_DIR))


# -- the two sides --------------------------------------------------------------------------
def test_a_consumer_asks_again_while_the_producer_stores_then_loads(tmp_path: Path) -> None:
    producer = side(tmp_path, "kv_producer")
    orders = plan_prefill(producer)
    stored = [key for order in orders if order.kind is JobKind.STORE for key in order.keys]
    assert len(stored) == 20 and len(marks(tmp_path)) == 20
    assert producer.stats()["handoff_marked_chunks"] == 20

    consumer = side(tmp_path, "kv_consumer")
    assert consumer.lookup("c", PROMPT, 0) is None  # on their way: not a miss
    assert consumer.lookup("c", PROMPT, 0) is None
    produce(tmp_path)  # the chunks land (another producer process, the same keys)
    assert consumer.lookup("c", PROMPT, 0) == 304  # every whole chunk but the last
    stats = consumer.stats()
    assert (stats["handoff_waits"], stats["handoff_waited_requests"]) == (2, 1)
    assert stats["handoff_timeouts"] == 0 and stats["handoff_marked_chunks"] == 0


def test_a_store_that_reports_takes_its_marks_back(tmp_path: Path) -> None:
    producer = side(tmp_path, "kv_producer")
    (order,) = plan_prefill(producer)
    consumer = side(tmp_path, "kv_consumer")
    assert consumer.lookup("c", PROMPT, 0) is None
    # The store failed on every rank: nothing will land, so nobody waits for it.
    producer.on_report(JobReport(order.job_id, 1, frozenset(order.keys), {}, {}))
    assert marks(tmp_path) == []
    assert consumer.lookup("c", PROMPT, 0) == 0
    assert consumer.stats()["handoff_timeouts"] == 0


def test_a_real_producer_leaves_no_marks_and_the_consumer_never_waits(tmp_path: Path) -> None:
    produce(tmp_path)
    assert marks(tmp_path) == []  # every store reported, every mark taken back
    consumer = side(tmp_path, "kv_consumer")
    assert consumer.lookup("c", PROMPT, 0) == 304
    assert consumer.stats()["handoff_waits"] == 0


def test_a_prompt_nobody_stores_is_a_miss_at_once(tmp_path: Path) -> None:
    plan_prefill(side(tmp_path, "kv_producer"))
    other = [t + 1 for t in PROMPT]
    consumer = side(tmp_path, "kv_consumer")
    assert consumer.lookup("c", other, 0) == 0
    assert consumer.stats()["handoff_waits"] == 0


def test_no_marks_with_handoff_wait_ms_0(tmp_path: Path) -> None:
    producer = side(tmp_path, "kv_producer", handoff_wait_ms=0)
    assert producer.handoffs is None
    plan_prefill(producer)
    assert not (tmp_path / "kv" / HANDOFF_DIR).exists()
    consumer = side(tmp_path, "kv_consumer", handoff_wait_ms=0)
    assert consumer.handoffs is None and consumer.lookup("c", PROMPT, 0) == 0


def test_kv_both_has_no_board_and_refuses_the_key(tmp_path: Path) -> None:
    assert handoff_board(config(tmp_path, "kv_both"), [NAMESPACE]) is None
    with pytest.raises(ConfigError) as refused:
        config(tmp_path, "kv_both", handoff_wait_ms=100)
    assert "'handoff_wait_ms' applies to kv_role 'kv_producer' and 'kv_consumer' only" in str(
        refused.value
    )


# -- a recurrent hybrid's tail --------------------------------------------------------------
#: Qwen3-Next's groups (three gated-DeltaNet, one full attention, one block size) at two
#: blocks per chunk: a 1370-token prompt's states sit at 1280 tokens, inside its third
#: 512-token chunk, so its hit is a tail (kvoffload.connector._tails) under keys of its own.
QWEN = KVLayout(
    (
        *(CacheGroup("mamba", 256, (f"m{i}",), 160) for i in range(3)),
        CacheGroup("full", 256, ("a0",), 1024),
    )
)
QWEN_NAMESPACE = namespace_of("handoff-test", "bfloat16", QWEN)


def qwen_producer(tmp_path: Path) -> tuple[KVOffloadSide, StandIn]:
    """A producer's connector side over QWEN on the shared disk, with its marks, and the
    stand-in engine around it."""
    settings = config(tmp_path, "kv_producer", QWEN, blocks_per_chunk=2)
    probes = [DiskProbe(tmp_path / "kv", QWEN_NAMESPACE)]
    board = handoff_board(settings, [QWEN_NAMESPACE])
    kv = allocate_kv_caches(QWEN, 64)
    side = KVOffloadSide(settings, QWEN_NAMESPACE, kv, probes, handoff=board)
    return side, StandIn(QWEN, side, gpu_blocks=64, step_tokens=4096, kv=KVPages(QWEN, kv))


def test_a_consumer_waits_for_a_tail_on_its_way_past_chunks_already_there(
    tmp_path: Path,
) -> None:
    """The chunks a prompt's hit needs that are on their way may be its tail alone: a
    producer that stored a first prompt stores, for a second sharing its first two chunks,
    only the second's tail at 1280 (attention part-chunk and states). The consumer's hit
    needs that tail (no state sits on a chunk end), so it waits for it, then loads it."""
    rng = random.Random(44)
    first = [rng.randrange(1, 512) for _ in range(1370)]
    second = first[:1100] + [rng.randrange(1, 512) for _ in range(270)]
    (producer, engine), (another, its_engine) = qwen_producer(tmp_path), qwen_producer(tmp_path)
    consumer = side(tmp_path, "kv_consumer", QWEN, blocks_per_chunk=2)
    try:
        engine.run([("first", first)])  # on the disk now, its marks taken back
        assert marks(tmp_path) == [] and consumer.lookup("c1", first, 0) == 1280
        scheduler = producer.scheduler
        assert scheduler.lookup("second", second, 0) == 0
        blocks = [list(range(1, 7))] * 4
        orders = scheduler.plan_step([StepRequest("second", second, 0, 1280, blocks, 1370)])
        (store,) = [order for order in orders if order.kind is JobKind.STORE]
        assert len(store.keys) == 4 == len(marks(tmp_path))  # the tail alone, marked
        assert consumer.lookup("c2", second, 0) is None  # on its way: not a miss
        other = first[:1100] + [t + 1 for t in second[1100:]]
        assert consumer.lookup("c3", other, 0) == 0  # nobody stores its tail: a miss at once
        its_engine.run([("second", second)])  # another producer's store of it lands
        assert consumer.lookup("c2", second, 0) == 1280
        stats = consumer.stats()
        assert (stats["handoff_waits"], stats["handoff_waited_requests"]) == (1, 1)
    finally:
        producer.close()
        another.close()
        consumer.close()


# -- the bounded wait -----------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_wait_runs_out_once_and_never_starts_again(tmp_path: Path) -> None:
    writer = DiskMarkers(tmp_path, NAMESPACE, 3600, writer=True)
    writer.announce(KEYS[2:])
    stats, clock = SchedulerStats(), Clock()
    board = HandoffBoard([DiskMarkers(tmp_path, NAMESPACE, 3600, writer=False)])
    waits = Handoffs(board, [16], 2.0, stats, marks=False, clock=clock)
    req = RequestState([list(KEYS)], [[]], [0], [set()])
    assert waits.should_wait(req, 32, 64)  # chunks 2 and 3 are marked
    clock.now += 2.0
    assert waits.should_wait(req, 32, 64)
    clock.now += 0.5
    assert not waits.should_wait(req, 32, 64)  # 2.5 s > 2 s: computes the rest
    assert req.handoff_since == -math.inf
    assert not waits.should_wait(req, 32, 64)  # a later lookup of it (preempted) goes on
    assert (stats.handoff_waits, stats.handoff_waited_requests, stats.handoff_timeouts) == (2, 1, 1)
    assert not waits.should_wait(RequestState([list(KEYS)], [[]], [0], [set()]), 0, 32)


# -- the marks ------------------------------------------------------------------------------
def test_disk_marks_live_for_their_lifetime_and_go_with_withdraw(tmp_path: Path) -> None:
    producer = DiskMarkers(tmp_path, NAMESPACE, 60, writer=True)
    consumer = DiskMarkers(tmp_path, NAMESPACE, 60, writer=False)
    other = DiskMarkers(tmp_path, namespace_of("other", "bfloat16", LAYOUT), 60, writer=False)
    assert producer.announce(KEYS[:2]) == 0
    assert consumer.announced([KEYS[1]]) and not consumer.announced(KEYS[2:])
    assert not other.announced(KEYS[:2])  # another model's marks are its own
    producer.withdraw([KEYS[0]])
    assert not consumer.announced([KEYS[0]]) and consumer.announced(KEYS)
    old = time.time() - 61
    os.utime(tmp_path / HANDOFF_DIR / marks_of(tmp_path)[0], (old, old))
    assert not consumer.announced(KEYS)  # lapsed: its producer stopped mid-store
    producer.announce([KEYS[1]])  # announced again: it counts from now
    assert consumer.announced(KEYS)


def marks_of(tmp_path: Path) -> list[str]:
    return sorted(os.listdir(tmp_path / HANDOFF_DIR))


def test_a_starting_producer_sweeps_its_namespaces_lapsed_marks(tmp_path: Path) -> None:
    DiskMarkers(tmp_path, NAMESPACE, 60, writer=True).announce(KEYS)
    DiskMarkers(tmp_path, b"x" * 16, 60, writer=True).announce(KEYS)
    old = time.time() - 120
    for name in marks_of(tmp_path)[:4]:
        os.utime(tmp_path / HANDOFF_DIR / name, (old, old))
    lapsed = set(marks_of(tmp_path)[:4])
    DiskMarkers(tmp_path, NAMESPACE, 60, writer=True)
    DiskMarkers(tmp_path, b"x" * 16, 60, writer=True)
    assert not lapsed & set(marks_of(tmp_path)) and len(marks_of(tmp_path)) == 4


def test_a_consumer_creates_nothing_and_a_bad_entry_only_fails_its_mark(tmp_path: Path) -> None:
    consumer = DiskMarkers(tmp_path, NAMESPACE, 60, writer=False)
    assert not consumer.announced(KEYS) and not (tmp_path / HANDOFF_DIR).exists()
    producer = DiskMarkers(tmp_path, NAMESPACE, 60, writer=True)
    (tmp_path / HANDOFF_DIR / f"{NAMESPACE.hex()}.{KEYS[0].hex()}").mkdir()
    assert producer.announce(KEYS[:2]) == 1  # the directory in the mark's place
    assert not consumer.announced(KEYS[:1]) and consumer.announced(KEYS[:2])


def test_redis_marks_expire_on_the_server(redis_server: RedisServer) -> None:
    tier = RedisTier(redis_server.url, NAMESPACE)
    try:
        tier.announce(KEYS[:2], 30_000)
        assert tier.announced(KEYS) and not tier.announced(KEYS[2:])
        name = f"kvoffload:{NAMESPACE.hex()}:handoff:{KEYS[0].hex()}"
        assert 0 < redis_server.client().pttl(name) <= 30_000
        assert tier.contains_many(KEYS) == [False] * 4  # a mark is never a chunk
    finally:
        tier.close()


def test_redis_marks_fail_soft_when_the_server_is_down(redis_server: RedisServer) -> None:
    settings = build_offloading_config(
        {"cpu_bytes_to_use": "8MiB", "remote_url": redis_server.url}, LAYOUT, kv_role="kv_producer"
    )
    board = handoff_board(settings, [NAMESPACE])
    assert board is not None
    try:
        redis_server.kill()
        assert board.announce(KEYS) == 4  # counted by the scheduler, never raised
        assert not board.announced(KEYS)
    finally:
        board.close()
