"""The remote tier's rows: ``RedisTier`` against plain redis-py on the same server."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from kvoffload.bench.rows import BenchRow, best_rate
from kvoffload.config.remote_url import RemoteURL, parse_remote_url
from kvoffload.errors import TierError
from kvoffload.tiers._write_behind import WriteBehind
from kvoffload.tiers.remote import RedisTier, client_factory

__all__ = ["bench_redis", "reference_client"]


#: Socket timeout of the bench's clients: a busy machine must not turn a slow SET into an outage.
_REDIS_TIMEOUT_MS = 30_000
#: Keys one lookup measurement asks at least, in round trips of all the row's keys: the first
#: round trip after a burst of large loads costs ~0.3 ms more, which would swamp a row of 16 keys.
_MIN_LOOKUPS = 1024


def reference_client(url: RemoteURL) -> Any:
    """A plain redis-py client of ``url``, checked with a ``PING``; ``TierError`` if unreachable."""
    connect = client_factory(url, None, _REDIS_TIMEOUT_MS / 1000)  # ConfigError without redis
    import redis

    try:
        client = connect()
        client.ping()
    except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
        raise TierError(
            f"--remote-url {url}: cannot reach the server ({type(exc).__name__}: {exc}); "
            "start one there (e.g. redis-server --port 6390 --save '' --appendonly no) "
            "or point --remote-url at a running one"
        ) from exc
    return client


def bench_redis(
    remote_url: str | RemoteURL, chunk_bytes: int, total_bytes: int, repeat: int = 3
) -> BenchRow:
    """``RedisTier`` put/get_into/contains_many vs redis-py SET/GET/pipelined EXISTS.

    Tier and reference write the same number of values of the chunk's size
    to the same server under names of this run's own, and every one is
    deleted before this returns, whatever happens.
    """
    url = remote_url
    if isinstance(url, str):
        url = parse_remote_url("--remote-url", url)
    chunks = max(1, total_bytes // chunk_bytes)
    run_id = os.urandom(8).hex()
    client = reference_client(url)
    remote = RedisTier(url, f"kvoffload-bench:{run_id}".encode(), timeout_ms=_REDIS_TIMEOUT_MS)
    tier = WriteBehind(remote, (chunks + 1) * chunk_bytes)  # the engine's path for stores
    keys = [i.to_bytes(16, "little") for i in range(chunks)]
    names = [f"kvoffload-bench:{run_id}:ref:{i}".encode() for i in range(chunks)]
    try:
        rates = _measure_redis(tier, client, keys, names, chunk_bytes, repeat=repeat)
    finally:
        _delete(tier, client, keys, names)
        tier.close()  # the remote tier too
        client.close()
    return BenchRow.of("redis", chunk_bytes, rates, direct_io=False, lookups=rates[4:6])


def _delete(tier: WriteBehind, client: Any, keys: list[bytes], names: list[bytes]) -> None:
    """Remove this run's values: the tier's through the tier, the reference's in one pipeline."""
    for key in keys:
        tier.discard(key)
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.delete(name)
    pipe.execute()


def _measure_redis(
    tier: WriteBehind,
    client: Any,
    keys: list[bytes],
    names: list[bytes],
    chunk_bytes: int,
    *,
    repeat: int,
) -> list[float]:
    data = np.random.default_rng(3).integers(0, 256, chunk_bytes, dtype=np.uint8)
    value = data.tobytes()
    out = np.empty_like(data)
    nbytes = len(keys) * chunk_bytes
    trips = -(-_MIN_LOOKUPS // len(keys))
    found: dict[str, list[Any]] = {}

    def ref_store() -> None:
        for name in names:
            client.set(name, value)

    def store() -> None:  # the engine's path: pack in the store job, SET from the writer thread
        for key in keys:
            tier.put(key, data)
        tier.drain()

    def ref_load() -> None:
        for name in names:
            client.get(name)

    def load() -> None:
        for key in keys:
            tier.get_into(key, out)  # a miss is counted, and fails the row below

    def ref_lookup() -> None:
        for _ in range(trips):
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            found["ref"] = pipe.execute()

    def lookup() -> None:
        for _ in range(trips):
            found["tier"] = tier.contains_many(keys)

    lookups = trips * len(keys)
    pairs = (
        (ref_store, store, nbytes, 1e9),
        (ref_load, load, nbytes, 1e9),
        (ref_lookup, lookup, lookups, 1.0),
    )
    fresh = partial(_delete, tier, client, keys, names)  # every round stores fresh values
    rates = _taking_turns(pairs, repeat, before_round=fresh)
    if _lost(tier) or not np.array_equal(out, data) or not all(found["ref"] + found["tier"]):
        raise TierError("redis bench: a stored value was not found or loaded back intact")
    return rates


def _taking_turns(
    pairs: Sequence[tuple[Callable[[], None], Callable[[], None], int, float]],
    repeat: int,
    *,
    before_round: Callable[[], None],
) -> list[float]:
    """The best rate of each side of each ``(reference, tier, amount, unit)`` pair over
    ``repeat`` rounds, in that order (ref store, store, ref load, load, ...).

    Whichever side stores first in a round was up to 1.5x faster here, so the sides take
    turns going first (and the best of each is kept)."""
    rates = [0.0] * (2 * len(pairs))
    for round_ in range(repeat):
        before_round()
        for step, (ref_fn, tier_fn, amount, unit) in enumerate(pairs):
            sides = ((0, ref_fn), (1, tier_fn))
            for side, fn in sides if round_ % 2 == 0 else sides[::-1]:
                rates[2 * step + side] = best_rate(amount, fn, rates[2 * step + side], unit)
    return rates


def _lost(tier: WriteBehind) -> int:
    """Stores and loads of the tier that did not succeed, by its own count."""
    s = tier.stats()
    return s.store_failures + s.dropped + s.misses + s.corrupt + s.load_failures
