"""The local tiers' rows: the CPU slab against memcpy, the disk tier against O_DIRECT and stat."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvoffload.bench.rows import BenchRow, best_rate
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.errors import ConfigError, TierError
from kvoffload.messages import BlockSpan
from kvoffload.tiers.base import ChunkBuffer, Tier
from kvoffload.tiers.cpu import CPUSlab
from kvoffload.tiers.disk import DiskProbe, DiskTier
from kvoffload.tiers.disk._direct_io import ALIGN, O_DIRECT, aligned_empty, round_up
from kvoffload.transfer import KVTransfer, allocate_kv_caches, fill_blocks

__all__ = ["bench_cpu", "bench_disk", "tier_calls"]

#: Shape of the synthetic model behind the cpu rows: a chunk is this many layers x blocks.
_LAYERS, _BLOCKS_PER_CHUNK, _TOKENS_PER_BLOCK = 8, 4, 16
#: Chunks one engine job moves with one gather or scatter call.
_CHUNKS_PER_JOB = 8
#: Keys a disk lookup measurement asks at least (a row of 16 MiB chunks holds only 16).
_MIN_LOOKUPS = 4096


def _bench_layout(chunk_bytes: int) -> KVLayout:
    page = chunk_bytes // (_LAYERS * _BLOCKS_PER_CHUNK)
    if page * _LAYERS * _BLOCKS_PER_CHUNK != chunk_bytes or page % (4 * _TOKENS_PER_BLOCK):
        unit = _LAYERS * _BLOCKS_PER_CHUNK * 4 * _TOKENS_PER_BLOCK
        raise ConfigError(f"cpu bench: chunk of {chunk_bytes} B must be a multiple of {unit} B")
    names = tuple(f"layer{i}" for i in range(_LAYERS))
    group = CacheGroup(
        kind="full", tokens_per_block=_TOKENS_PER_BLOCK, layer_names=names, page_bytes=page
    )
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
    tier = CPUSlab(chunks, chunk_bytes, pin_memory=False)
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
            rates[j] = best_rate(nbytes, fn, rates[j])
    tier.close()
    return BenchRow.of("cpu", chunk_bytes, rates, direct_io=False)


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
    """``DiskTier`` put/get_into of ``total_bytes`` in chunks vs a sequential O_DIRECT file;
    ``DiskProbe.contains_many`` of the stored keys vs a plain ``os.stat`` of each file."""
    chunks = max(1, total_bytes // chunk_bytes)
    nbytes = chunks * chunk_bytes
    with _scratch_dir(disk_path) as scratch:
        tier = DiskTier(scratch / "tier", chunks * (round_up(chunk_bytes) + 2 * ALIGN), b"bench")
        ref = _ReferenceFile(scratch / "reference.bin", tier.direct_io, chunk_bytes, nbytes)
        data = aligned_empty(chunk_bytes)  # a page-aligned slab slot, as a pinned CPU tier has
        data[:] = np.random.default_rng(2).integers(0, 256, chunk_bytes, dtype=np.uint8)
        out = aligned_empty(chunk_bytes)
        keys = [i.to_bytes(16, "little") for i in range(chunks)]
        probe = DiskProbe(scratch / "tier", b"bench")
        try:
            rates = _measure_disk(tier, ref, keys, data, out, repeat=repeat)
            lookups = _measure_lookups(probe, tier.directory, keys, repeat=repeat)
        finally:
            probe.close()
            tier.close()
    return BenchRow.of("disk", chunk_bytes, rates, direct_io=tier.direct_io, lookups=lookups)


def _measure_lookups(
    probe: DiskProbe, directory: Path, keys: list[bytes], *, repeat: int
) -> list[float]:
    """Keys per second: what the scheduler asks (``DiskProbe``) vs ``os.stat`` of each path.

    Every key is held; the keys are asked in batches of the row's keys, repeated
    to at least ``_MIN_LOOKUPS`` keys, the probe and the reference taking turns.
    """
    trips = -(-_MIN_LOOKUPS // len(keys))
    paths = [str(directory / f"{key.hex()}.kv") for key in keys]
    found: dict[str, list[bool]] = {}

    def ref_lookup() -> None:
        for _ in range(trips):
            found["ref"] = [_exists(path) for path in paths]

    def lookup() -> None:
        for _ in range(trips):
            found["probe"] = probe.contains_many(keys)

    rates = [0.0, 0.0]
    for _ in range(repeat):
        rates[0] = best_rate(trips * len(keys), ref_lookup, rates[0], 1.0)
        rates[1] = best_rate(trips * len(keys), lookup, rates[1], 1.0)
    if not all(found["ref"] + found["probe"]):
        raise TierError("disk bench: a stored chunk was not found by a lookup")
    return rates


def _exists(path: str) -> bool:
    try:
        os.stat(path)
    except FileNotFoundError:
        return False
    return True


def tier_calls(
    tier: Tier, keys: Sequence[bytes], data: ChunkBuffer, out: ChunkBuffer
) -> tuple[Callable[[], None], Callable[[], None]]:
    """A store of ``data`` under every key, and a load of each into ``out``: one timed call each.

    A load that finds no chunk is an error, not a fast miss: the rate would be a lie.
    """

    def store() -> None:
        for key in keys:
            tier.put(key, data)

    def load() -> None:
        for key in keys:
            if not tier.get_into(key, out):
                raise TierError(f"{tier.name} bench: chunk {key.hex()} was not found")

    return store, load


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
    store, load = tier_calls(tier, keys, data, out)
    rates = [0.0] * 4
    for _ in range(repeat):
        for key in keys:
            tier.discard(key)  # every round writes fresh files, as the reference does
        rates[0] = best_rate(nbytes, ref.write, rates[0])
        rates[1] = best_rate(nbytes, store, rates[1])
        if not tier.direct_io:
            _drop_page_cache([ref.path, *tier.directory.iterdir()])
        rates[2] = best_rate(nbytes, ref.read, rates[2])
        rates[3] = best_rate(nbytes, load, rates[3])
    if not np.array_equal(out, data):
        raise TierError("disk bench: a loaded chunk differs from what was stored")
    return rates
