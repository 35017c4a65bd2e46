"""Stores reach the remote tier behind the store job: a bounded queue, counted failures.

A real server throughout. To hold a write in flight without a mock, the
tests pause the server's writes (``CLIENT PAUSE ... WRITE``): the queued
``SET`` waits on the server until ``CLIENT UNPAUSE``, well inside the tier's
(long) timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import test_remote_tier as rt
import torch
from _redis_servers import RedisServer

from kvoffload.engine import ChunkSpan, OffloadEngine
from kvoffload.errors import ConfigError, TierError
from kvoffload.messages import BlockSpan
from kvoffload.tiers._write_behind import WriteBehind
from kvoffload.tiers.cascade import TierCascade
from kvoffload.tiers.cpu import CPUSlab
from kvoffload.tiers.remote import RedisTier
from kvoffload.transfer import KVTransfer, allocate_kv_caches

CHUNK = max(g.chunk_bytes(rt.BPC) for g in rt.layout().groups)


@contextmanager
def writes_paused(server: RedisServer) -> Iterator[None]:
    client = server.client()
    client.execute_command("CLIENT", "PAUSE", 60000, "WRITE")
    try:
        yield
    finally:
        client.execute_command("CLIENT", "UNPAUSE")


def engine(caches: dict[str, torch.Tensor], remote: RedisTier, queue_bytes: int) -> OffloadEngine:
    cpu = CPUSlab(16, CHUNK, pin_memory=False)
    cascade = TierCascade(cpu, [WriteBehind(remote, queue_bytes)])
    return OffloadEngine(KVTransfer(rt.layout(), caches, rt.BPC), cascade)


def test_a_store_job_finishes_before_its_remote_write_and_the_write_lands(
    redis_server: RedisServer,
) -> None:
    remote = RedisTier(redis_server.url, rt.NAMESPACE, timeout_ms=30000)
    e = engine(rt.seeded(3), remote, 64 * CHUNK)
    with writes_paused(redis_server):
        result = rt.store(e, rt.CHUNKS[:1])  # returns although the server takes no writes
        assert result.done_keys == (rt.CHUNKS[0][1],) and not result.errors
        queued = e.stats()["redis"]
        assert queued.counters["queued"] == 1 and queued.stores == 0
        assert queued.gauges["queue_bytes"] == rt.layout().groups[0].chunk_bytes(rt.BPC)
        assert remote.stats().stores == 0
    assert rt.drained(e)
    behind = e.stats()["redis"]
    assert behind.stores == 1 and behind.gauges["queue_bytes"] == 0
    assert behind.gauges["queue_peak_bytes"] == rt.layout().groups[0].chunk_bytes(rt.BPC)
    assert (behind.store_failures, behind.dropped) == (0, 0)
    assert remote.stats().stores == 1  # one record: the tier's, read through the queue
    # What the job staged was a copy: the slot can be reused, the server has the chunk.
    target = allocate_kv_caches(rt.layout(), rt.NUM_BLOCKS, torch.bfloat16)
    other = rt.engine_with(target, [RedisTier(redis_server.url, rt.NAMESPACE, timeout_ms=2000)])
    got = rt.load(other, [ChunkSpan(0, (rt.CHUNKS[0][1],), (0,), BlockSpan((1, 2)))])
    assert got.done_keys == (rt.CHUNKS[0][1],)
    assert torch.equal(rt.pages(target, 0, (1, 2))[0], rt.pages(rt.seeded(3), 0, (4, 5))[0])
    for x in (e, other):
        x.close()


def test_a_full_queue_drops_the_store_counts_it_and_names_it_in_the_job(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    remote = RedisTier(redis_server.url, rt.NAMESPACE, timeout_ms=30000)
    e = engine(rt.seeded(5), remote, CHUNK)  # room for one chunk
    with writes_paused(redis_server), caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert not rt.store(e, rt.CHUNKS[:1]).errors  # queued, its write held by the pause
        dropped = rt.store(e, rt.CHUNKS[1:2])
    assert dropped.done_keys == (rt.CHUNKS[1][1],)  # in CPU all the same
    assert any("queue is full" in line for line in dropped.errors), dropped.errors
    assert sum("store dropped" in r.getMessage() for r in caplog.records) == 1
    assert rt.drained(e)
    behind = e.stats()["redis"]
    assert (behind.dropped, behind.stores, behind.store_failures) == (1, 1, 0)
    assert behind.counters["queued"] == 1
    assert remote.contains_many([rt.CHUNKS[0][1], rt.CHUNKS[1][1]]) == [True, False]
    e.close()


def test_a_write_that_fails_in_the_background_is_counted_and_logged(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    remote = RedisTier(redis_server.url, rt.NAMESPACE, timeout_ms=30000)
    e = engine(rt.seeded(6), remote, 64 * CHUNK)
    redis_server.client().execute_command("CLIENT", "PAUSE", 60000, "WRITE")
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert not rt.store(e, rt.CHUNKS[:1]).errors
        redis_server.kill()  # the SET in flight loses its connection
        assert rt.drained(e)
    behind = e.stats()["redis"]
    assert (behind.store_failures, behind.stores, behind.dropped) == (1, 0, 0)
    assert remote.stats().store_failures == 1
    messages = [r.getMessage() for r in caplog.records]
    assert sum("background write" in m for m in messages) == 1
    e.close()


def test_close_finishes_what_it_can_and_counts_the_rest_as_dropped(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    remote = RedisTier(redis_server.url, rt.NAMESPACE, timeout_ms=30000)
    behind = WriteBehind(remote, 1 << 20)
    data = rt.record(1000)
    with writes_paused(redis_server):
        behind.put(b"first", data)  # the writer takes it and waits on the server
        behind.put(b"second", data)  # waits in the queue
        with caplog.at_level(logging.WARNING, logger="kvoffload"):
            behind.close(timeout=0.2)  # then closes the tier under the write in flight
        with pytest.raises(TierError, match="closed"):
            behind.put(b"third", data)
    assert behind.drain(timeout=60)
    stats = behind.stats()
    assert stats.dropped == 2  # "second" at close, "third" after
    assert stats.counters["queued"] == 2 and stats.gauges["queue_bytes"] == 0
    assert stats.stores + stats.store_failures == 1  # "first": one outcome, whichever it was
    assert any("dropped 1 queued writes" in r.getMessage() for r in caplog.records)
    with pytest.raises(TierError, match="closed"):
        remote.put(b"fourth", data)  # the queue closed its tier


def test_a_server_known_down_refuses_the_store_in_the_job(redis_server: RedisServer) -> None:
    remote = RedisTier(redis_server.url, rt.NAMESPACE, timeout_ms=500, retry_ms=60000)
    e = engine(rt.seeded(8), remote, 64 * CHUNK)
    redis_server.kill()
    assert remote.contains_many([b"x"]) == [False]  # finds the server gone: backoff starts
    # The first reconnection wait is 100 ms, so a store at once is refused without a dial;
    # on a slow machine it may be queued and fail in the background instead. Both count.
    result = rt.store(e, rt.CHUNKS[:1])
    assert result.done_keys == (rt.CHUNKS[0][1],)
    assert rt.drained(e)
    behind = e.stats()["redis"]
    assert (behind.store_failures, behind.stores, behind.dropped) == (1, 0, 0)
    e.close()


def test_the_queue_bound_is_configured_and_checked(redis_server: RedisServer) -> None:
    cfg = rt.config(remote_url=redis_server.url, blocks_per_chunk=rt.BPC, remote_queue_bytes="1MiB")
    assert cfg.remote_queue_bytes == 1 << 20
    assert "write-behind queue 1 MiB" in str(cfg)
    e = OffloadEngine.from_config(cfg, rt.seeded(1), rt.NAMESPACE)
    [behind] = e.cascade.lower
    assert isinstance(behind, WriteBehind) and isinstance(behind.tier, RedisTier)
    assert e.stats()["redis"].gauges["queue_max_bytes"] == 1 << 20
    e.close()
    with pytest.raises(ConfigError, match="'remote_queue_bytes' needs 'remote_url'"):
        rt.config(remote_queue_bytes="1MiB")
    with pytest.raises(ConfigError, match=r"'remote_queue_bytes'=100 holds no chunk.*at least"):
        rt.config(remote_url=redis_server.url, blocks_per_chunk=rt.BPC, remote_queue_bytes=100)
    with pytest.raises(ConfigError, match="remote_queue_bytes"):
        rt.config(remote_url=redis_server.url, remote_queue_bytes="lots")


def test_a_local_tier_is_still_written_through_in_the_job(tmp_path: object) -> None:
    from pathlib import Path

    from kvoffload.tiers.disk import DiskTier

    disk = DiskTier(Path(str(tmp_path)) / "d", 1 << 20, rt.NAMESPACE)
    cascade = TierCascade(CPUSlab(2, 4096, pin_memory=False), [disk])
    cascade.cpu.reserve(0)
    cascade.cpu.slot_array(0, 512)[:] = rt.record(512)
    cascade.cpu.bind(b"k", 0, 512)
    assert cascade.write_through(b"k", 0, 512) == []
    assert disk.contains_many([b"k"]) == [True]  # at once: no queue for a local tier
    with pytest.raises(ConfigError, match="stage_put"):
        WriteBehind(disk, 1 << 20)  # a local tier has nothing to stage: it is written in the job
    assert "queue_bytes" not in cascade.stats()["disk"].gauges
    out = np.empty(512, dtype=np.uint8)
    assert disk.get_into(b"k", out)
    assert np.array_equal(out, rt.record(512))
    cascade.close()
