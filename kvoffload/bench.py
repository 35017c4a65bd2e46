"""Tier throughput against a same-run reference: what ``kvoffload bench`` measures.

Every row pairs a tier's store and load rate with a plain reference moving
the same bytes in the same run, because absolute GB/s say little on a shared
machine while the ratio says how much the tier's path costs:

* **cpu**: the engine's path into the CPU tier (``KVTransfer.gather`` of
  engine KV blocks of a synthetic 8-layer model straight into ``CPUTier``
  slab slots, ``scatter`` back) against ``numpy.copyto`` of one contiguous
  buffer of the chunk's size (memcpy).
* **disk**: ``DiskTier.put`` / ``get_into`` against a sequential O_DIRECT
  writer and reader of one file in the same directory, in chunk-sized calls.
  Both sides bypass the page cache (O_DIRECT); where the file system refuses
  O_DIRECT both fall back to buffered I/O, drop the written pages with
  ``posix_fadvise(DONTNEED)`` before reading, and the row says so.
* **redis**: ``RedisTier`` stores (write-behind) / ``get_into`` / ``contains_many`` against
  plain redis-py ``SET`` / ``GET`` of values of the chunk's size and one
  pipelined ``EXISTS`` of the same keys, on the server ``--remote-url`` names.
  Only these rows fill ``lookups_per_s`` / ``ref_lookups_per_s``: keys asked
  per second, all of a row's keys in one round trip as a request's lookup
  is, repeated to at least 1024 keys; the cpu and disk rows leave them
  ``None`` (JSON ``null``). Stores take the engine's path: the write-behind
  queue packs each record in the caller and a writer thread ``SET``s it; a
  row's store time runs until the queue has drained. The bench
  writes under a namespace of its own (a random run id) and deletes every key
  it wrote, so a shared server keeps nothing of it.

Each measurement is repeated and the best rate kept, tier and reference
interleaved, so a noisy neighbour hurts both alike.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload._write_behind import WriteBehind
from kvoffload.config.remote_url import RemoteURL, parse_remote_url
from kvoffload.errors import ConfigError, TierError
from kvoffload.layout import CacheGroup, KVLayout
from kvoffload.tiers._direct_io import ALIGN, O_DIRECT, aligned_empty, round_up
from kvoffload.tiers.base import ChunkBuffer
from kvoffload.tiers.cpu import CPUTier
from kvoffload.tiers.disk import DiskTier
from kvoffload.tiers.remote import RedisTier, client_factory
from kvoffload.transfer import BlockSpan, KVTransfer, allocate_kv_caches, fill_blocks

__all__ = ["BENCH_TIERS", "LOCAL_TIERS", "BenchRow", "bench_cpu", "bench_disk", "bench_redis",
           "run_bench"]  # fmt: skip

#: Tiers ``kvoffload bench`` can measure.
BENCH_TIERS = ("cpu", "disk", "redis")
#: What ``--tier all`` means without ``--remote-url`` (the tiers that need no server).
LOCAL_TIERS = ("cpu", "disk")

#: Shape of the synthetic model behind the cpu rows: a chunk is this many layers x blocks.
_LAYERS, _BLOCKS_PER_CHUNK, _TOKENS_PER_BLOCK = 8, 4, 16
#: Chunks one engine job moves with one gather or scatter call.
_CHUNKS_PER_JOB = 8


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One tier at one chunk size; ``ref_*`` is the same-run reference (GB/s = 1e9 B/s).

    ``lookups_per_s`` and ``ref_lookups_per_s`` (keys per second) are
    measured for tiers whose lookup is a round trip (redis) and ``None``
    for the others.
    """

    tier: str
    chunk_bytes: int
    store_gbps: float
    load_gbps: float
    ref_store_gbps: float
    ref_load_gbps: float
    direct_io: bool
    lookups_per_s: float | None = None
    ref_lookups_per_s: float | None = None

    @property
    def store_ratio(self) -> float:
        return self.store_gbps / self.ref_store_gbps

    @property
    def load_ratio(self) -> float:
        return self.load_gbps / self.ref_load_gbps

    @property
    def lookup_ratio(self) -> float | None:
        if self.lookups_per_s is None or not self.ref_lookups_per_s:
            return None
        return self.lookups_per_s / self.ref_lookups_per_s

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _best_rate(amount: int, fn: Callable[[], None], best: float, unit: float = 1e9) -> float:
    """The larger of ``best`` and ``amount / unit`` per second of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return max(best, amount / max(elapsed, 1e-9) / unit)


# -- cpu ---------------------------------------------------------------------


def _bench_layout(chunk_bytes: int) -> KVLayout:
    page = chunk_bytes // (_LAYERS * _BLOCKS_PER_CHUNK)
    if page * _LAYERS * _BLOCKS_PER_CHUNK != chunk_bytes or page % (4 * _TOKENS_PER_BLOCK):
        unit = _LAYERS * _BLOCKS_PER_CHUNK * 4 * _TOKENS_PER_BLOCK
        raise ConfigError(f"cpu bench: chunk of {chunk_bytes} B must be a multiple of {unit} B")
    names = tuple(f"layer{i}" for i in range(_LAYERS))
    group = CacheGroup(kind="full", tokens_per_block=_TOKENS_PER_BLOCK, layer_names=names,
                       page_bytes=page)  # fmt: skip
    return KVLayout(groups=(group,))


def bench_cpu(chunk_bytes: int, total_bytes: int, repeat: int = 3) -> BenchRow:
    """Engine blocks -> CPU tier slots and back, as the engine's jobs do it, vs memcpy.

    A store job reserves its slots, gathers ``_CHUNKS_PER_JOB`` chunks of
    consecutive engine blocks with one ``KVTransfer.gather`` and binds them;
    a load job scatters them back with one ``scatter``. The reference copies
    the same bytes chunk by chunk between two plain buffers of the same size.
    """
    chunks = max(1, total_bytes // chunk_bytes)
    nbytes = chunks * chunk_bytes
    layout = _bench_layout(chunk_bytes)
    caches = allocate_kv_caches(layout, chunks * _BLOCKS_PER_CHUNK)
    fill_blocks(caches)
    transfer = KVTransfer(layout, caches, _BLOCKS_PER_CHUNK)
    tier = CPUTier(chunks, chunk_bytes, pin_memory=False)
    jobs = [range(i, min(i + _CHUNKS_PER_JOB, chunks)) for i in range(0, chunks, _CHUNKS_PER_JOB)]
    spans = [
        BlockSpan(tuple(range(job.start * _BLOCKS_PER_CHUNK, job.stop * _BLOCKS_PER_CHUNK)))
        for job in jobs
    ]
    keys = [i.to_bytes(16, "little") for i in range(chunks)]

    def store() -> None:
        for job, span in zip(jobs, spans, strict=True):
            for slot in job:
                tier.reserve(slot)
            transfer.gather(0, span, [tier.slot(slot, chunk_bytes) for slot in job])
            for slot in job:
                tier.bind(keys[slot], slot, chunk_bytes)

    def load() -> None:
        for job, span in zip(jobs, spans, strict=True):
            transfer.scatter(0, span, [tier.slot(slot, chunk_bytes) for slot in job])

    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)

    def ref_store() -> None:
        for i in range(0, nbytes, chunk_bytes):
            np.copyto(dst[i : i + chunk_bytes], src[i : i + chunk_bytes])

    def ref_load() -> None:
        for i in range(0, nbytes, chunk_bytes):
            np.copyto(src[i : i + chunk_bytes], dst[i : i + chunk_bytes])

    rates = [0.0] * 4
    for _ in range(repeat):
        for j, fn in enumerate((ref_store, store, ref_load, load)):
            rates[j] = _best_rate(nbytes, fn, rates[j])
    tier.close()
    return BenchRow("cpu", chunk_bytes, rates[1], rates[3], rates[0], rates[2], direct_io=False)


# -- disk --------------------------------------------------------------------


def _drop_page_cache(paths: Sequence[Path]) -> None:
    """Flush and evict ``paths`` from the page cache (buffered fallback only)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _ReferenceFile:
    """Sequential O_DIRECT (else buffered) write and read of one file, chunk by chunk."""

    def __init__(self, path: Path, direct: bool, chunk_bytes: int, total_bytes: int) -> None:
        self.path, self.direct = path, direct
        self.step = round_up(chunk_bytes)
        self.total = total_bytes // chunk_bytes * self.step
        self.buf = aligned_empty(self.step)
        self.buf[:] = np.random.default_rng(1).integers(0, 256, self.step, dtype=np.uint8)

    def _open(self, flags: int) -> int:
        return os.open(self.path, flags | os.O_CLOEXEC | (O_DIRECT if self.direct else 0), 0o600)

    def write(self) -> None:
        self.path.unlink(missing_ok=True)
        fd = self._open(os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            for offset in range(0, self.total, self.step):
                os.pwrite(fd, self.buf.data, offset)
        finally:
            os.close(fd)

    def read(self) -> None:
        fd = self._open(os.O_RDONLY)
        try:
            for offset in range(0, self.total, self.step):
                os.preadv(fd, [self.buf.data], offset)
        finally:
            os.close(fd)


@contextmanager
def _scratch_dir(parent: str | None) -> Iterator[Path]:
    try:
        path = Path(tempfile.mkdtemp(prefix="kvoffload-bench-", dir=parent))
    except OSError as exc:
        raise ConfigError(f"--disk-path {parent!r} is not a writable directory: {exc}") from exc
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def bench_disk(
    chunk_bytes: int, total_bytes: int, disk_path: str | None = None, repeat: int = 3
) -> BenchRow:
    """``DiskTier`` put/get_into of ``total_bytes`` in chunks vs a sequential O_DIRECT file."""
    chunks = max(1, total_bytes // chunk_bytes)
    nbytes = chunks * chunk_bytes
    with _scratch_dir(disk_path) as scratch:
        tier = DiskTier(scratch / "tier", chunks * (round_up(chunk_bytes) + 2 * ALIGN), b"bench")
        ref = _ReferenceFile(scratch / "reference.bin", tier.direct_io, chunk_bytes, nbytes)
        data = aligned_empty(chunk_bytes)  # a page-aligned slab slot, as a pinned CPU tier has
        data[:] = np.random.default_rng(2).integers(0, 256, chunk_bytes, dtype=np.uint8)
        out = aligned_empty(chunk_bytes)
        keys = [i.to_bytes(16, "little") for i in range(chunks)]
        try:
            rates = _measure_disk(tier, ref, keys, data, out, repeat=repeat)
        finally:
            tier.close()
    return BenchRow("disk", chunk_bytes, rates[1], rates[3], rates[0], rates[2], tier.direct_io)


def _measure_disk(
    tier: DiskTier,
    ref: _ReferenceFile,
    keys: list[bytes],
    data: ChunkBuffer,
    out: ChunkBuffer,
    *,
    repeat: int,
) -> list[float]:
    nbytes = len(keys) * data.nbytes

    def store() -> None:
        for key in keys:
            tier.put(key, data)

    def load() -> None:
        for key in keys:
            tier.get_into(key, out)

    rates = [0.0] * 4
    for _ in range(repeat):
        for key in keys:
            tier.discard(key)  # every round writes fresh files, as the reference does
        rates[0] = _best_rate(nbytes, ref.write, rates[0])
        rates[1] = _best_rate(nbytes, store, rates[1])
        if not tier.direct_io:
            _drop_page_cache([ref.path, *tier.directory.iterdir()])
        rates[2] = _best_rate(nbytes, ref.read, rates[2])
        rates[3] = _best_rate(nbytes, load, rates[3])
    if not np.array_equal(out, data):
        raise TierError("disk bench: a loaded chunk differs from what was stored")
    return rates


# -- redis -------------------------------------------------------------------

#: Socket timeout of the bench's clients: a busy machine must not turn a slow SET into an outage.
_REDIS_TIMEOUT_MS = 30_000
#: Keys one lookup measurement asks at least, in round trips of all the row's keys: the first
#: round trip after a burst of large loads costs ~0.3 ms more, which would swamp a row of 16 keys.
_MIN_LOOKUPS = 1024


def _reference_client(url: RemoteURL) -> Any:
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
    client = _reference_client(url)
    tier = RedisTier(url, f"kvoffload-bench:{run_id}".encode(), timeout_ms=_REDIS_TIMEOUT_MS)
    keys = [i.to_bytes(16, "little") for i in range(chunks)]
    names = [f"kvoffload-bench:{run_id}:ref:{i}".encode() for i in range(chunks)]
    try:
        rates = _measure_redis(tier, client, keys, names, chunk_bytes, repeat=repeat)
    finally:
        _delete(tier, client, keys, names)
        tier.close()
        client.close()
    return BenchRow("redis", chunk_bytes, rates[1], rates[3], rates[0], rates[2], direct_io=False,
                    lookups_per_s=rates[5], ref_lookups_per_s=rates[4])  # fmt: skip


def _delete(tier: RedisTier, client: Any, keys: list[bytes], names: list[bytes]) -> None:
    """Remove this run's values: the tier's through the tier, the reference's in one pipeline."""
    for key in keys:
        tier.discard(key)
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.delete(name)
    pipe.execute()


def _measure_redis(
    tier: RedisTier,
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

    failed: list[int] = []

    def report(ok: bool, nbytes: int, seconds: float) -> None:
        if not ok:
            failed.append(nbytes)

    queue = WriteBehind(tier, nbytes + chunk_bytes, report)

    def store() -> None:  # the engine's path: pack in the store job, SET from the writer thread
        for key in keys:
            queue.submit(key, data)
        queue.drain()

    def ref_load() -> None:
        for name in names:
            client.get(name)

    def load() -> None:
        for key in keys:
            tier.get_into(key, out)

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
    pairs = ((ref_store, store, nbytes, 1e9), (ref_load, load, nbytes, 1e9),
             (ref_lookup, lookup, lookups, 1.0))  # fmt: skip
    rates = [0.0] * 6  # ref store, store, ref load, load, ref lookups, lookups
    for round_ in range(repeat):
        _delete(tier, client, keys, names)  # every round stores fresh values
        for step, (ref_fn, tier_fn, amount, unit) in enumerate(pairs):
            # Whichever side stores first in a round was up to 1.5x faster here, so the
            # sides take turns going first (and the best of each is kept).
            sides = ((0, ref_fn), (1, tier_fn))
            for side, fn in sides if round_ % 2 == 0 else sides[::-1]:
                rates[2 * step + side] = _best_rate(amount, fn, rates[2 * step + side], unit)
    queue.close()
    if failed or not np.array_equal(out, data) or not all(found["ref"] + found["tier"]):
        raise TierError("redis bench: a stored value was not found or loaded back intact")
    return rates


def run_bench(
    tiers: Sequence[str],
    chunk_sizes: Sequence[int],
    total_bytes: int,
    *,
    disk_path: str | None = None,
    remote_url: str | RemoteURL | None = None,
    repeat: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[BenchRow]:
    """Measure every tier at every chunk size, in that order; redis needs ``remote_url``."""
    if "redis" in tiers:
        if remote_url is None:
            raise ConfigError("bench --tier redis needs --remote-url, e.g. "
                              "--remote-url redis://127.0.0.1:6379/0")  # fmt: skip
        if isinstance(remote_url, str):
            remote_url = parse_remote_url("--remote-url", remote_url)
        _reference_client(remote_url).close()  # unreachable: fail before measuring anything
    rows = []
    for tier in tiers:
        for size in chunk_sizes:
            if progress is not None:
                progress(f"{tier} {size} B")
            if tier == "cpu":
                rows.append(bench_cpu(size, total_bytes, repeat))
            elif tier == "disk":
                rows.append(bench_disk(size, total_bytes, disk_path, repeat))
            elif tier == "redis" and remote_url is not None:
                rows.append(bench_redis(remote_url, size, total_bytes, repeat))
            else:
                raise ConfigError(f"bench: unknown tier {tier!r}; use one of {BENCH_TIERS}")
    return rows
