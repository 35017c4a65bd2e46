"""The remote tier on real Redis servers (loopback): sharing, clusters, faults, bad values, AUTH."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from _redis_servers import RedisServer, free_port, need_redis_py

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.engine import ChunkSpan, JobResult, OffloadEngine
from kvoffload.errors import ConfigError, CorruptChunkError, TierError
from kvoffload.keys import namespace_of
from kvoffload.messages import BlockSpan
from kvoffload.tiers._write_behind import WriteBehind
from kvoffload.tiers.cascade import TierCascade
from kvoffload.tiers.cpu import CPUSlab
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.remote import RedisTier
from kvoffload.transfer import KVTransfer, allocate_kv_caches, fill_blocks

NUM_BLOCKS = 32
BPC = 2


def layout() -> KVLayout:
    return KVLayout(
        (
            CacheGroup("sliding", 8, ("s0", "s1"), 256, sliding_window=16),
            CacheGroup("full", 2, ("f0",), 128),
        )
    )


NAMESPACE = namespace_of("remote-test-model", "bfloat16", layout())
#: (group, key, engine blocks) of the chunks the tests store.
CHUNKS: list[tuple[int, bytes, tuple[int, ...]]] = [
    (0, b"chunk-s-0", (4, 5)),
    (0, b"chunk-s-1", (9, 2)),
    (1, b"chunk-f-0", (7, 3)),
    (1, b"chunk-f-1", (12, 13)),
]


def store_spans(chunks: Sequence[tuple[int, bytes, tuple[int, ...]]]) -> list[ChunkSpan]:
    return [
        ChunkSpan(g, (key,), (i,), BlockSpan(blocks)) for i, (g, key, blocks) in enumerate(chunks)
    ]


def engine_with(caches: dict[str, torch.Tensor], lower: Sequence[RedisTier]) -> OffloadEngine:
    """An engine whose remote tiers sit behind write-behind queues, as the configuration builds."""
    cpu = CPUSlab(16, max(g.chunk_bytes(BPC) for g in layout().groups), pin_memory=False)
    behind = [WriteBehind(tier, 64 << 20) for tier in lower]
    return OffloadEngine(KVTransfer(layout(), caches, BPC), TierCascade(cpu, behind))


def drained(engine: OffloadEngine, timeout: float = 60) -> bool:
    """Wait until every write-behind queue of ``engine`` has finished its writes."""
    queues = [tier for tier in engine.cascade.lower if isinstance(tier, WriteBehind)]
    return all(queue.drain(timeout) for queue in queues)


def store(engine: OffloadEngine, chunks: Sequence[tuple[int, bytes, tuple[int, ...]]]) -> JobResult:
    engine.submit_store(store_spans(chunks))
    return finish(engine)


def load(engine: OffloadEngine, spans: Sequence[ChunkSpan]) -> JobResult:
    engine.submit_load(spans)
    return finish(engine)


def finish(engine: OffloadEngine) -> JobResult:
    assert engine.wait(timeout=60)
    [result] = engine.get_finished()
    return result


def pages(caches: dict[str, torch.Tensor], group: int, blocks: Sequence[int]) -> list[torch.Tensor]:
    names = layout().groups[group].layer_names
    return [
        caches[n].view(torch.uint8).reshape(NUM_BLOCKS, -1)[list(blocks)].clone() for n in names
    ]


def seeded(seed: int) -> dict[str, torch.Tensor]:
    caches = allocate_kv_caches(layout(), NUM_BLOCKS, torch.bfloat16)
    fill_blocks(caches, seed=seed)
    return caches


def record(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def tier(redis_server: RedisServer) -> Iterator[RedisTier]:
    t = RedisTier(redis_server.url, NAMESPACE, timeout_ms=2000)
    yield t
    t.close()


# -- sharing -------------------------------------------------------------------------------
def test_a_chunk_stored_by_one_engine_process_loads_bit_exact_in_another(
    redis_server: RedisServer,
) -> None:
    child = Path(__file__).with_name("_remote_child.py")
    subprocess.run([sys.executable, str(child), redis_server.url, "7"], check=True, timeout=120)
    expected = {key: pages(seeded(7), g, blocks) for g, key, blocks in CHUNKS}
    caches = allocate_kv_caches(layout(), NUM_BLOCKS, torch.bfloat16)  # zeros: nothing local
    remote = RedisTier(redis_server.url, NAMESPACE, timeout_ms=2000)
    engine = engine_with(caches, [remote])
    targets = [(g, key, tuple(b + 16 for b in blocks)) for g, key, blocks in CHUNKS]
    result = load(engine, store_spans(targets))
    assert not result.failed_keys, result.errors
    assert set(result.promoted_keys) == {key for _, key, _ in CHUNKS}  # all from the server
    for g, key, blocks in targets:
        for got, want in zip(pages(caches, g, blocks), expected[key], strict=True):
            assert torch.equal(got, want)
    stats = remote.stats()
    assert (stats.loads, stats.misses, stats.load_failures) == (len(CHUNKS), 0, 0)
    assert stats.load_bytes == sum(layout().groups[g].chunk_bytes(BPC) for g, _, _ in CHUNKS)
    engine.close()


def test_a_cluster_spreads_chunks_over_every_master(redis_cluster: list[RedisServer]) -> None:
    url = f"redis+cluster://127.0.0.1:{redis_cluster[0].port}"
    tier = RedisTier(url, NAMESPACE, timeout_ms=2000)
    keys = [f"cluster-chunk-{i}".encode() for i in range(48)]
    for i, key in enumerate(keys):
        tier.put(key, record(1000, seed=i))
    out = np.empty(1000, dtype=np.uint8)
    for i, key in enumerate(keys):
        assert tier.get_into(key, out)
        assert np.array_equal(out, record(1000, seed=i))
    sizes = [node.client().dbsize() for node in redis_cluster]
    assert sum(sizes) == len(keys)
    assert all(size > 0 for size in sizes), sizes
    assert tier.contains_many([*keys[:5], b"never-stored"]) == [True] * 5 + [False]
    tier.close()


# -- faults ------------------------------------------------------------------------------------
def is_up(tier: RedisTier) -> bool:
    return tier.stats().gauges["up"] == 1


def wait_until_up(tier: RedisTier, timeout: float = 30.0) -> None:
    """Call the tier until it has reconnected (each call past the backoff tries once)."""
    deadline = time.monotonic() + timeout
    while not is_up(tier):
        assert time.monotonic() < deadline, "the remote tier did not come back"
        tier.contains_many([b"probe"])
        time.sleep(0.05)


def test_a_server_killed_mid_run_degrades_to_local_tiers_and_resumes(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    writer = engine_with(seeded(1), [RedisTier(redis_server.url, NAMESPACE, timeout_ms=500)])
    assert not store(writer, CHUNKS[:2]).failed_keys
    assert drained(writer)  # on the server now
    caches = seeded(2)
    remote = RedisTier(redis_server.url, NAMESPACE, timeout_ms=500, retry_ms=200)
    reader = engine_with(caches, [remote])
    local = [(1, b"local-only", (20, 21))]
    assert not store(reader, local).failed_keys
    assert drained(reader)

    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        # One job: a chunk only the dead server had, and one in the local CPU tier.
        wanted = [
            ChunkSpan(0, (CHUNKS[0][1],), (5,), BlockSpan((24, 25))),
            ChunkSpan(1, (b"local-only",), (0,), BlockSpan((26, 27))),
        ]
        result = load(reader, wanted)
    assert result.failed_keys == (CHUNKS[0][1],)
    assert dict(result.failed_blocks) == {0: (24, 25)}  # named, so the engine recomputes them
    assert result.done_keys == (b"local-only",)  # the local tier still serves
    assert torch.equal(pages(caches, 1, (26, 27))[0], pages(caches, 1, (20, 21))[0])
    stored = store(reader, [(1, b"while-down", (14, 15))])
    assert stored.done_keys == (b"while-down",)  # in CPU; the remote write failed, counted
    assert drained(reader)
    stats = remote.stats()
    assert stats.gauges["up"] == 0 and stats.store_failures == 1 and stats.counters["outages"] == 1
    assert stats.load_failures == 1  # the chunk only the dead server had
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1  # reported once

    redis_server.start()  # same port, empty
    wait_until_up(remote)
    assert not store(reader, [(1, b"after-restart", (16, 17))]).errors
    assert drained(reader)  # written behind the job
    empty = allocate_kv_caches(layout(), NUM_BLOCKS, torch.bfloat16)
    fresh = engine_with(empty, [RedisTier(redis_server.url, NAMESPACE, timeout_ms=500)])
    back = load(fresh, [ChunkSpan(1, (b"after-restart",), (0,), BlockSpan((2, 3)))])
    assert back.done_keys == (b"after-restart",)
    assert torch.equal(pages(empty, 1, (2, 3))[0], pages(caches, 1, (16, 17))[0])
    assert remote.stats().counters["reconnects"] == 1
    for e in (writer, reader, fresh):
        e.close()


def test_a_server_down_at_start_is_reported_once_and_the_tier_comes_up_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    need_redis_py()
    server = RedisServer(tmp_path / "late")
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        tier = RedisTier(server.url, NAMESPACE, timeout_ms=200, retry_ms=200)
    assert [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert not is_up(tier)
    with pytest.raises(TierError, match="down"):
        tier.put(b"k", record(64))  # fails at once, no dial: the backoff has not expired
    assert tier.contains_many([b"k", b"j"]) == [False, False]
    with pytest.raises(TierError):
        tier.get_into(b"k", np.empty(64, dtype=np.uint8))  # not a miss: the server is gone
    server.start()
    try:
        wait_until_up(tier)
        tier.put(b"k", record(64))
        assert tier.contains_many([b"k"]) == [True]
        stats = tier.stats()
        assert (stats.counters["outages"], stats.counters["reconnects"]) == (1, 1)
        assert (stats.store_failures, stats.stores, stats.load_failures) == (1, 1, 1)
        assert stats.counters["probe_failures"] >= 1 and stats.misses == 0
    finally:
        tier.close()
        server.stop()


def test_a_cluster_down_at_start_is_an_outage_not_a_crash(caplog: pytest.LogCaptureFixture) -> None:
    need_redis_py()
    import redis.exceptions

    url = f"redis+cluster://127.0.0.1:{free_port()}"  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        tier = RedisTier(url, NAMESPACE, timeout_ms=200)  # redis-py raises a cluster error
    # redis-py 8.2 raises RedisClusterUnreachableError, older ones RedisClusterException itself.
    named = re.findall(
        r"is unreachable \((\w+)\)", "\n".join(r.getMessage() for r in caplog.records)
    )
    assert len(named) == 1, named
    assert issubclass(getattr(redis.exceptions, named[0]), redis.exceptions.RedisClusterException)
    assert tier.contains_many([b"k"]) == [False]
    with pytest.raises(TierError):
        tier.get_into(b"k", np.empty(64, dtype=np.uint8))
    stats = tier.stats()
    assert stats.gauges["up"] == 0 and stats.counters["outages"] == 1 and stats.load_failures == 1
    tier.close()


# -- values that must never load ------------------------------------------------------------------
def _overwrite(server: RedisServer, tier: RedisTier, key: bytes, value: bytes) -> None:
    server.client().set(tier._name(key), value)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "header only", "flipped byte"])
def test_a_bad_value_is_a_miss_and_is_dropped(
    redis_server: RedisServer, tier: RedisTier, damage: str
) -> None:
    data = record(5000)
    tier.put(b"victim", data)
    good: bytes = redis_server.client().get(tier._name(b"victim"))
    bad = {
        "garbage": b"not a chunk record at all" * 50,
        "truncated": good[:-100],
        "header only": good[:80],
        "flipped byte": good[:-1] + bytes([good[-1] ^ 0xFF]),
    }[damage]
    _overwrite(redis_server, tier, b"victim", bad)
    out = np.zeros(5000, dtype=np.uint8)
    with pytest.raises(CorruptChunkError):
        tier.get_into(b"victim", out)
    stats = tier.stats()
    assert (stats.corrupt, stats.load_failures, stats.misses, stats.loads) == (1, 0, 0, 0)
    assert tier.contains_many([b"victim"]) == [False]  # dropped, not served again
    tier.put(b"victim", data)  # and a good store heals it
    assert tier.get_into(b"victim", out)
    assert np.array_equal(out, data)


def test_a_value_of_another_namespace_is_a_miss(redis_server: RedisServer, tier: RedisTier) -> None:
    other_ns = namespace_of("another-model", "bfloat16", layout())
    other = RedisTier(redis_server.url, other_ns, timeout_ms=2000)
    other.put(b"shared-key", record(256, seed=3))
    assert tier.contains_many([b"shared-key"]) == [False]  # names carry the namespace
    foreign = redis_server.client().get(other._name(b"shared-key"))
    _overwrite(redis_server, tier, b"shared-key", foreign)  # a value copied under our name
    with pytest.raises(CorruptChunkError, match="namespace"):
        tier.get_into(b"shared-key", np.empty(256, dtype=np.uint8))
    other.close()


def test_a_value_of_another_size_is_refused_but_kept(tier: RedisTier) -> None:
    tier.put(b"sized", record(300))
    with pytest.raises(TierError, match="300"):
        tier.get_into(b"sized", np.empty(200, dtype=np.uint8))
    assert tier.contains_many([b"sized"]) == [True]


def test_a_vanished_chunk_is_a_failed_load_not_an_exception_to_the_engine(
    redis_server: RedisServer,
) -> None:
    caches = seeded(4)
    remote = RedisTier(redis_server.url, NAMESPACE, timeout_ms=2000)
    engine = engine_with(caches, [remote])
    assert not store(engine, CHUNKS[:1]).failed_keys
    assert drained(engine)
    engine.cascade.cpu.release(0)  # only the server has it now
    redis_server.client().flushall()  # the server evicted it (maxmemory) after the lookup
    result = load(engine, [ChunkSpan(0, (CHUNKS[0][1],), (3,), BlockSpan((30, 31)))])
    assert result.failed_keys == (CHUNKS[0][1],)
    assert dict(result.failed_blocks) == {0: (30, 31)}
    assert remote.stats().misses == 1
    assert result.errors[0].endswith("(no tier holds it)")  # a miss is no tier error
    engine.close()


# -- AUTH ----------------------------------------------------------------------------------------
SECRET = "s3cr3t-Pa55word"


def test_auth_with_the_password_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = RedisServer(tmp_path / "auth", password=SECRET).start()
    try:
        monkeypatch.setenv("KVO_TEST_REDIS_PASSWORD", SECRET)
        tier = RedisTier(server.url, NAMESPACE, password_env="KVO_TEST_REDIS_PASSWORD")
        tier.put(b"k", record(64))
        assert tier.contains_many([b"k"]) == [True]
        assert SECRET not in repr(tier) and SECRET not in str(tier.stats())
        assert tier.stats().stores == 1
        tier.close()

        monkeypatch.setenv("KVO_TEST_REDIS_PASSWORD", "wrong-password")
        with pytest.raises(ConfigError, match="refused the credentials") as info:
            RedisTier(server.url, NAMESPACE, password_env="KVO_TEST_REDIS_PASSWORD")
        assert "wrong-password" not in str(info.value) and SECRET not in str(info.value)
        assert "$KVO_TEST_REDIS_PASSWORD" in str(info.value)

        monkeypatch.delenv("KVO_TEST_REDIS_PASSWORD")
        with pytest.raises(ConfigError, match="refused the credentials"):
            RedisTier(server.url, NAMESPACE)  # no password at all
    finally:
        server.stop()


# -- the cascade asks once per lookup -------------------------------------------------------------
def test_lower_prefix_asks_the_remote_tier_once_for_what_disk_lacks(
    tmp_path: Path, tier: RedisTier
) -> None:
    disk = DiskTier(tmp_path / "disk", 1 << 20, NAMESPACE)
    cpu = CPUSlab(4, 4096, pin_memory=False)
    cascade = TierCascade(cpu, [disk, tier])
    keys = [f"prefix-{i}".encode() for i in range(10)]
    for key in keys[:3]:
        disk.put(key, record(512))
    for key in keys[3:7]:
        tier.put(key, record(512))
    before = tier.stats().counters
    assert cascade.lower_prefix(keys) == 7
    after = tier.stats().counters
    assert after["probes"] == before["probes"] + 1  # one pipelined round trip for the request
    assert after["probed_keys"] == before["probed_keys"] + 7  # only the keys disk lacks
    assert after["probe_hits"] == before["probe_hits"] + 4
    assert cascade.lower_prefix(keys[:3]) == 3  # all on disk: the server is not asked
    assert tier.stats().counters["probes"] == before["probes"] + 1
    disk.close()


# -- configuration ---------------------------------------------------------------------------------
def config(**extra: object):  # type: ignore[no-untyped-def]
    return build_offloading_config({"cpu_bytes_to_use": "1MiB", **extra}, layout())


@pytest.mark.parametrize(
    ("url", "canonical"),
    [
        ("redis://cache.local", "redis://cache.local:6379/0"),
        ("redis://cache.local:6380/2", "redis://cache.local:6380/2"),
        ("rediss://user@cache.local", "rediss://user@cache.local:6379/0"),
        ("redis+cluster://10.0.0.1:7000", "redis+cluster://10.0.0.1:7000"),
    ],
)
def test_remote_urls_are_checked_and_normalised(url: str, canonical: str) -> None:
    cfg = config(remote_url=url)
    assert cfg.remote_url == canonical
    assert canonical in str(cfg)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://cache.local", "scheme 'http' is not supported"),
        ("cache.local:6379", "is not supported"),
        ("redis://:hunter2@cache.local", "must not carry a password"),
        ("redis://", "no host"),
        ("redis://cache.local/x", "database number"),
        ("redis+cluster://cache.local/3", "only database 0"),
        ("redis://cache.local:99999", "not a valid URL"),
        ("redis://cache.local?db=1", "query strings"),
        ("", "a URL such as"),
        (42, "a URL such as"),
    ],
)
def test_bad_remote_urls_fail_with_the_fix(url: object, message: str) -> None:
    with pytest.raises(ConfigError, match="remote_url") as info:
        config(remote_url=url)
    assert message in str(info.value)
    assert "hunter2" not in str(info.value)


def test_remote_keys_need_a_url_and_a_set_password_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in [
        ("remote_password_env", "X"),
        ("remote_timeout_ms", 50),
        ("remote_retry_ms", 9),
    ]:
        with pytest.raises(ConfigError, match=f"'{key}' needs 'remote_url'"):
            config(**{key: value})
    with pytest.raises(ConfigError, match="environment variable"):
        config(remote_url="redis://h", remote_password_env="not a name")
    monkeypatch.delenv("KVO_UNSET_PASSWORD", raising=False)
    with pytest.raises(ConfigError, match=r"\$KVO_UNSET_PASSWORD, which is not set"):
        config(remote_url="redis://h", remote_password_env="KVO_UNSET_PASSWORD")
    monkeypatch.setenv("KVO_SET_PASSWORD", SECRET)
    cfg = config(remote_url="redis://h", remote_password_env="KVO_SET_PASSWORD")
    assert "$KVO_SET_PASSWORD" in str(cfg) and SECRET not in str(cfg) and SECRET not in repr(cfg)
    with pytest.raises(ConfigError, match="greater than 0"):
        config(remote_url="redis://h", remote_timeout_ms=0)


def test_engines_built_from_one_configuration_share_chunks_through_the_server(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    from kvoffload.tiers.from_config import lower_probes

    cfg = config(remote_url=redis_server.url, blocks_per_chunk=BPC, disk_path=str(tmp_path / "d"),
                 disk_bytes_to_use="4MiB", remote_timeout_ms=2000)  # fmt: skip
    source = seeded(9)
    first = OffloadEngine.from_config(cfg, source, NAMESPACE)
    assert [t.name for t in first.cascade.lower] == ["disk", "redis"]
    assert not store(first, CHUNKS).failed_keys
    first.close()
    probes = lower_probes(cfg, NAMESPACE)
    assert [p.name for p in probes] == ["disk", "redis"]
    keys = [key for _, key, _ in CHUNKS]
    assert all(all(p.contains_many(keys)) for p in probes)
    # Another engine, on another machine: no disk tier, only the server in common.
    remote_only = config(remote_url=redis_server.url, blocks_per_chunk=BPC)
    target = allocate_kv_caches(layout(), NUM_BLOCKS, torch.bfloat16)
    second = OffloadEngine.from_config(remote_only, target, NAMESPACE)
    result = load(second, store_spans(CHUNKS))
    assert result.done_keys == tuple(keys)
    for g, _, blocks in CHUNKS:
        got, want = pages(target, g, blocks), pages(source, g, blocks)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    second.close()
    for probe in probes:
        probe.close()
