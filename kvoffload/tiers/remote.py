"""The remote tier: chunks in Redis or Valkey, so a fleet of engines shares one KV cache.

One machine's RAM and disk hold one engine's history; a conversation's next
turn often lands on another node. This tier puts every stored chunk on a
shared server (one server, or a Redis Cluster through any of its nodes), so
what one engine computed, every engine can load.

**Names and values.** A chunk lives under ``kvoffload:<namespace hex>:<key
hex>``: the namespace fingerprints model, dtype and layout, so engines of
different models share a server safely. The value is one record (the disk
tier's chunk header without its padding, then the payload; see
:func:`kvoffload.tiers._record.pack_record`), written with one ``SET``,
so it is there whole or not at all. A load checks magic, namespace, key,
length and checksum: a wrong, truncated or foreign value is a miss (it is
deleted and counted), never handed on.

**The server owns eviction.** Run it with ``maxmemory`` and an LRU or LFU
policy. The tier never reports evictions: ``contains_many`` is a hint, and a
chunk that vanished between lookup and load is a miss of those blocks, which
the engine recomputes.

**Faults never reach the engine as exceptions.** Every call has a timeout
(``remote_timeout_ms``) and redis-py's own retries are off, so no call waits
longer. Redis errors become ``TierError`` in one place (:meth:`RedisTier._call`).
A server that is down at start is reported once (a warning on the
``kvoffload`` logger) and the tier starts anyway; while it is down, calls
fail at once (stores and loads raise ``TierError``, counted; probes answer
"not here") and a reconnection is tried after a wait that doubles from 100 ms
up to ``remote_retry_ms``. When the server answers again the tier resumes,
and says so. A wrong password is not an outage: it fails at start with
``ConfigError``. The password comes from the environment variable
``remote_password_env`` names and appears in no message, ``repr`` or stat.

**Asynchronous stores.** :meth:`RedisTier.put` is one synchronous ``SET``.
The engine does not call it in its store jobs: the tier sits behind a
:class:`~kvoffload.tiers._write_behind.WriteBehind` queue, which calls
:meth:`RedisTier.stage_put` in the job (it packs the record: the one copy out
of the CPU slot, which may be reused once the job is done) and runs the
returned ``SET`` from its writer thread. A write counts in this tier's stats
where it ends (``stores`` or ``store_failures``); what the queue refuses
counts in the queue's ``dropped``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvoffload.config.offload_config import OffloadConfig
from kvoffload.config.remote_url import RemoteURL, parse_remote_url
from kvoffload.errors import ConfigError, CorruptChunkError, TierError
from kvoffload.tiers._record import pack_record, unpack_record_into
from kvoffload.tiers._validation import checked_buffer, namespace_fingerprint, valid_key
from kvoffload.tiers.base import ChunkBuffer, Tier
from kvoffload.tiers.stats import TierCounters, TierStats

__all__ = ["RedisTier"]

logger = logging.getLogger("kvoffload")

_T = TypeVar("_T")
_FIRST_RETRY_S = 0.1
#: The hash of key cards (:mod:`kvoffload.tiers.cards`), beside every namespace's chunks.
_CARDS = b"kvoffload:cards"


#: The remote tier's own counters beside the shared ones (see :mod:`kvoffload.tiers.stats`).
_EXTRA = (
    "probes",
    "probed_keys",
    "probe_hits",
    "probe_failures",
    "discard_failures",
    "outages",
    "reconnects",
)


def _redis() -> Any:
    try:
        import redis
    except ImportError:  # pragma: no cover - installed wherever the tests run
        raise ConfigError(
            "the remote tier needs the redis package: pip install 'kvoffload[redis]'"
        ) from None
    return redis


def client_factory(url: RemoteURL, password: str | None, timeout_s: float) -> Callable[[], Any]:
    """A function that opens a redis-py client of ``url`` (a cluster client for a cluster).

    The password lives only in its closure. Every call times out after
    ``timeout_s`` and is never retried by redis-py: the tier decides what a
    failure means. ``ConfigError`` if the redis package is missing.
    """
    redis = _redis()
    options: dict[str, Any] = {
        "username": url.username,
        "password": password,
        "ssl": url.tls,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": redis.retry.Retry(redis.backoff.NoBackoff(), 0),
    }
    if url.cluster:
        from redis.cluster import RedisCluster

        return lambda: RedisCluster(host=url.host, port=url.port, **options)
    return lambda: redis.Redis(host=url.host, port=url.port, db=url.db, **options)


class RedisTier(Tier):
    """Chunks as checksummed values on a Redis / Valkey server or cluster; see the module docstring.

    ``url`` is a ``remote_url`` (text or parsed); ``namespace`` the layout
    fingerprint (``kvoffload.keys.namespace_of``). Cheap to build: a second
    instance with its own connection is how a scheduler probes the server.
    """

    name = "redis"

    def __init__(
        self,
        url: str | RemoteURL,
        namespace: bytes,
        *,
        password_env: str | None = None,
        timeout_ms: int = OffloadConfig.remote_timeout_ms,
        retry_ms: int = OffloadConfig.remote_retry_ms,
    ) -> None:
        self._url = parse_remote_url("remote_url", url) if isinstance(url, str) else url
        self._namespace = namespace_fingerprint(namespace)
        self._prefix = f"kvoffload:{self._namespace.hex()}:".encode()
        self._password_env = password_env
        password = os.environ.get(password_env) if password_env else None
        if password_env and not password:
            raise ConfigError(f"'remote_password_env' names ${password_env}, which is not set")
        self._timeout = timeout_ms / 1000
        self._retry_max = max(retry_ms / 1000, _FIRST_RETRY_S)
        self._redis = _redis()
        self._lock = threading.Lock()
        self._client: Any = None
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._wait = _FIRST_RETRY_S
        self._counters = TierCounters(self.name, _EXTRA)
        self._closed = False
        self._connect = self._client_factory(password)
        # Down at start: reported once by _down; the tier serves misses and retries.
        with contextlib.suppress(TierError):
            self._call(lambda client: client.ping(), starting=True)

    def __repr__(self) -> str:
        return f"RedisTier({self._url}, namespace={self._namespace.hex()[:12]})"

    # -- connection ---------------------------------------------------------
    def _client_factory(self, password: str | None) -> Callable[[], Any]:
        return client_factory(self._url, password, self._timeout)

    def _call(self, op: Callable[[Any], _T], *, starting: bool = False) -> _T:
        """Run ``op`` on a live client; any failure becomes ``TierError`` (and maybe an outage).

        Refused credentials are ``ConfigError`` while ``starting`` (a wrong
        password is a configuration error, not an outage); later, say after a
        password rotation on the server, they make the tier down like any
        other failure, so the engine keeps serving.
        """
        self._check_open()
        errors = self._redis.exceptions
        with self._lock:
            now = time.monotonic()
            if self._down_since is not None and now < self._retry_at:
                raise TierError(
                    f"remote tier {self._url} is down; next attempt in {self._retry_at - now:.1f} s"
                )
            client = self._client
        try:
            if client is None:
                client = self._connect()
            result = op(client)
        except (errors.RedisError, errors.RedisClusterException) as exc:
            refused = isinstance(exc, errors.AuthenticationError | errors.AuthorizationError) or (
                isinstance(exc, errors.ResponseError)
                and str(exc).startswith(("WRONGPASS", "NOAUTH"))
            )
            if refused and starting:
                self._auth_failed(exc)
            if refused or not isinstance(exc, errors.ResponseError):
                self._down(exc)
                raise TierError(f"remote tier {self._url} failed: {exc}") from exc
            raise TierError(f"remote tier {self._url}: {exc}") from exc
        except OSError as exc:  # a socket error redis-py did not wrap
            self._down(exc)
            raise TierError(f"remote tier {self._url} failed: {exc}") from exc
        self._up(client)
        return result

    def _up(self, client: Any) -> None:
        with self._lock:
            self._client = client
            if self._down_since is None:
                return
            outage = time.monotonic() - self._down_since
            self._down_since, self._wait = None, _FIRST_RETRY_S
        self._counters.add(reconnects=1)
        logger.warning("kvoffload: remote tier %s is back after %.1f s", self._url, outage)

    def _down(self, exc: BaseException) -> None:
        with self._lock:
            first = self._down_since is None
            now = time.monotonic()
            if first:
                self._down_since = now
                self._counters.add(outages=1)
            else:
                self._wait = min(2 * self._wait, self._retry_max)
            self._retry_at = now + self._wait
            stale, self._client = self._client, None
        if stale is not None:
            self._close_client(stale)
        if first:
            logger.warning(
                "kvoffload: remote tier %s is unreachable (%s); serving from local tiers and "
                "retrying with backoff up to %.1f s",
                self._url,
                type(exc).__name__,
                self._retry_max,
            )

    def _auth_failed(self, exc: BaseException) -> typing.NoReturn:
        source = f"${self._password_env}" if self._password_env else "no password"
        raise ConfigError(
            f"remote tier {self._url} refused the credentials ({source}): "
            f"{type(exc).__name__}; check remote_password_env and the server's requirepass/ACL"
        ) from None

    @staticmethod
    def _close_client(client: Any) -> None:
        try:
            client.close()
        except Exception:
            logger.debug("kvoffload: closing a remote client failed", exc_info=True)

    # -- the Tier contract --------------------------------------------------
    def _name(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    def put(self, key: bytes, data: ChunkBuffer) -> None:
        """One ``SET`` of the chunk's record; ``TierError`` (counted) if it fails or is refused."""
        self._counters.store(lambda: self._set(key, self._record(key, data), data.nbytes))

    def stage_put(self, key: bytes, data: ChunkBuffer) -> Callable[[], None]:
        """Pack the record now (the one copy out of ``data``); the returned call ``SET``s it.

        For :class:`~kvoffload.tiers._write_behind.WriteBehind`. Raises
        ``TierError`` (counted as a failed store) at once for a bad key or
        buffer, or while the server is known to be down and the next
        reconnection attempt is not due, so the store job reports the failure
        itself and no memory is queued for it.
        """
        try:
            with self._lock:
                waiting = self._down_since is not None and time.monotonic() < self._retry_at
            if waiting:
                raise TierError(f"remote tier {self._url} is down")
            record, nbytes = self._record(key, data), data.nbytes
        except TierError:
            self._counters.add(store_failures=1)
            raise
        return lambda: self._counters.store(lambda: self._set(key, record, nbytes))

    def _record(self, key: bytes, data: ChunkBuffer) -> ChunkBuffer:
        payload = checked_buffer("data", data)
        if not valid_key(key):
            raise TierError(f"RedisTier: key must be 1 to 120 bytes, got {key!r:.80}")
        return pack_record(self._namespace, key, payload)

    def _set(self, key: bytes, record: ChunkBuffer, nbytes: int) -> int:
        """``SET`` a packed record of ``nbytes`` payload bytes; return ``nbytes``."""
        self._call(lambda client: client.set(self._name(key), record.data))
        return nbytes

    def get_into(self, key: bytes, out: ChunkBuffer) -> bool:
        """Fill ``out`` with the verified chunk; ``False`` if the server does not hold it.

        A bad value (garbage, truncated, another namespace's) is deleted and
        raises ``CorruptChunkError``; an intact one of another size raises ``TierError``.
        """
        return self._counters.load(out.nbytes, lambda: self._get(key, out))

    def _get(self, key: bytes, out: ChunkBuffer) -> bool:
        buf = checked_buffer("out", out)
        value = self._call(lambda client: client.get(self._name(key)))
        if value is None:
            return False
        try:
            unpack_record_into(value, (self._namespace, key), buf)
        except CorruptChunkError:
            self.discard(key)
            raise
        return True

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """One pipelined round trip of ``EXISTS`` per key; all ``False`` if the server is down."""
        if not keys:
            return []

        def ask(client: Any) -> list[bool]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            return [bool(n) for n in pipe.execute()]

        try:
            found = self._call(ask)
        except TierError:
            self._counters.add(probes=1, probed_keys=len(keys), probe_failures=1)
            return [False] * len(keys)
        self._counters.add(probes=1, probed_keys=len(keys), probe_hits=sum(found))
        return found

    # -- hand-off marks (kvoffload.tiers.handoff) --------------------------------------
    def _mark(self, key: bytes) -> bytes:
        return self._prefix + b"handoff:" + key.hex().encode()

    def announce(self, keys: Sequence[bytes], lifetime_ms: int) -> None:
        """Mark ``keys`` as on their way for ``lifetime_ms``: one pipelined round trip of
        ``SET ... PX``; ``TierError`` if the server is down."""
        if not keys:
            return

        def mark(client: Any) -> None:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.set(self._mark(key), b"", px=lifetime_ms)
            pipe.execute()

        self._call(mark)

    def announced(self, keys: Sequence[bytes]) -> bool:
        """Whether some key of ``keys`` is marked: one ``EXISTS`` of them all."""
        if not keys:
            return False
        names = [self._mark(key) for key in keys]
        if self._url.cluster:  # keys of one EXISTS must share a slot in a cluster

            def count(client: Any) -> int:
                pipe = client.pipeline(transaction=False)
                for name in names:
                    pipe.exists(name)
                return sum(pipe.execute())

            return self._call(count) > 0
        return int(self._call(lambda client: client.exists(*names))) > 0

    # -- key cards (kvoffload.tiers.cards): one hash for every namespace ------------------
    def put_card(self, name: str, text: str) -> None:
        """``HSET kvoffload:cards name text``; ``TierError`` if the server is down."""
        self._call(lambda client: client.hset(_CARDS, name, text))

    def cards(self) -> list[bytes]:
        """Every card's text (``HVALS kvoffload:cards``); ``TierError`` if the server is down."""
        return list(self._call(lambda client: client.hvals(_CARDS)))

    def discard(self, key: bytes) -> None:
        """``DEL`` the value; a failure is counted, and the value is verified again on a load."""
        try:
            self._call(lambda client: client.delete(self._name(key)))
        except TierError:
            self._counters.add(discard_failures=1)

    def stats(self) -> TierStats:
        """Counters, and whether the server is up (a gauge, 1 or 0); the server owns sizes."""
        with self._lock:
            up = self._down_since is None
        return self._counters.snapshot(gauges={"up": int(up)})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            self._close_client(client)

    def _check_open(self) -> None:
        if self._closed:
            raise TierError("the remote tier is closed")
