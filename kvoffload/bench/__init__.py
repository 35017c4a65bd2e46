"""Tier throughput against a same-run reference: what ``kvoffload bench`` measures.

Every row pairs a tier's store and load rate with a plain reference moving
the same bytes in the same run, because absolute GB/s say little on a shared
machine while the ratio says how much the tier's path costs:

* **cpu**: the engine's path into the CPU tier (``KVTransfer.gather`` of
  engine KV blocks of a synthetic 8-layer model straight into ``CPUSlab``
  slab slots, ``scatter`` back) against ``numpy.copyto`` of one contiguous
  buffer of the chunk's size (memcpy).
* **disk**: ``DiskTier.put`` / ``get_into`` against a sequential O_DIRECT
  writer and reader of one file in the same directory, in chunk-sized calls.
  Both sides bypass the page cache (O_DIRECT); where the file system refuses
  O_DIRECT both fall back to buffered I/O, drop the written pages with
  ``posix_fadvise(DONTNEED)`` before reading, and the row says so. A store
  includes the shared index's two transactions (reserve, then rename and
  record), so the small-chunk rows show what sharing a directory costs. Its
  lookups are ``DiskProbe.contains_many`` (what the scheduler asks) against a
  plain ``os.stat`` of each chunk file's path, all keys held, at least 4096 keys.
* **redis**: ``RedisTier`` stores (write-behind) / ``get_into`` / ``contains_many`` against
  plain redis-py ``SET`` / ``GET`` of values of the chunk's size and one
  pipelined ``EXISTS`` of the same keys, on the server ``--remote-url`` names.
  Its ``lookups_per_s`` / ``ref_lookups_per_s`` are keys asked per second,
  all of a row's keys in one round trip as a request's lookup is, repeated to
  at least 1024 keys (the disk rows fill them too; the cpu rows leave them
  ``None``, JSON ``null``). Stores take the engine's path: the write-behind
  queue packs each record in the caller and a writer thread ``SET``s it; a
  row's store time runs until the queue has drained. The bench
  writes under a namespace of its own (a random run id) and deletes every key
  it wrote, so a shared server keeps nothing of it.

Each measurement is repeated and the best rate kept, tier and reference
interleaved, so a noisy neighbour hurts both alike.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvoffload.bench.rows import BenchRow
from kvoffload.config.remote_url import RemoteURL, parse_remote_url
from kvoffload.errors import ConfigError
from kvoffload.registry import TIERS

__all__ = ["BENCH_TIERS", "LOCAL_TIERS", "BenchRow", "run_bench"]

#: What can be measured: the CPU slab (always there, so in no registry) and every lower tier.
BENCH_TIERS = ("cpu", *TIERS.names())
#: What ``--tier all`` means without ``--remote-url`` (the tiers that need no server).
LOCAL_TIERS = ("cpu", "disk")


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
    from kvoffload.bench.local import bench_cpu, bench_disk
    from kvoffload.bench.redis import bench_redis, reference_client

    unknown = [tier for tier in tiers if tier not in BENCH_TIERS]
    if unknown:
        raise ConfigError(f"bench: unknown tier {unknown[0]!r}; use one of {BENCH_TIERS}")
    if "redis" in tiers:
        if remote_url is None:
            raise ConfigError(
                "bench --tier redis needs --remote-url, e.g. --remote-url redis://127.0.0.1:6379/0"
            )
        if isinstance(remote_url, str):
            remote_url = parse_remote_url("--remote-url", remote_url)
        reference_client(remote_url).close()  # unreachable: fail before measuring anything
    rows = []
    for tier in tiers:
        for size in chunk_sizes:
            if progress is not None:
                progress(f"{tier} {size} B")
            if tier == "cpu":
                rows.append(bench_cpu(size, total_bytes, repeat))
            elif tier == "disk":
                rows.append(bench_disk(size, total_bytes, disk_path, repeat))
            elif remote_url is not None:
                rows.append(bench_redis(remote_url, size, total_bytes, repeat))
    return rows
