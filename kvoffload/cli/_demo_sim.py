"""The demo's replay: requests through index, engine, CPU and disk tiers, real bytes, verified.

A stand-in for the inference engine: per-layer KV tensors in the CPU
backend's layout, a block allocator per group (shuffled free lists, so block
ids are often not consecutive), and "prefill" that writes every computed
chunk's KV as a function of its key (:func:`expected_chunk`). Because KV is
a function of the key, a loaded block is correct exactly when it equals that
function, so verification needs no copy of what was stored.

Per request and group: look the chunk keys up in the index (CPU hits), then
the disk (further hits, promoted into CPU slots reserved by the index);
sometimes pretend the engine's own prefix cache already holds the first
blocks, so loads start inside a chunk; load, verify, "compute" the rest and
store the new chunks. One load job and one store job per request.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.config import OffloadConfig
from kvoffload.engine import ChunkSpan, JobResult, OffloadEngine
from kvoffload.keys import namespace_of, prefix_keys_for_layout
from kvoffload.manager.offload_manager import OffloadManager
from kvoffload.messages import BlockSpan
from kvoffload.tiers.stats import TierStats
from kvoffload.transfer import allocate_kv_caches

__all__ = ["DemoStats", "DemoReplay", "expected_chunk"]

#: Share of requests whose first blocks the engine "already holds" (unaligned loads).
GPU_PREFIX_SHARE = 0.3
_TILE_WORDS = 512


def expected_chunk(key: bytes, nbytes: int) -> npt.NDArray[np.uint8]:
    """The KV bytes of chunk ``key``: a keyed random tile plus the word's position.

    Any swapped, shifted, stale or torn block differs from it, and it costs a
    vectorised add per byte instead of a random generator per byte.
    """
    seed = int.from_bytes(key[:8], "little")
    tile = np.frombuffer(np.random.Generator(np.random.PCG64(seed)).bytes(8 * _TILE_WORDS), "<u8")
    words = -(-nbytes // 8)
    data = np.resize(tile, words) + np.arange(words, dtype=np.uint64)
    return data.view(np.uint8)[:nbytes]


@dataclass(slots=True)
class GroupStats:
    chunks: int = 0
    cpu_hits: int = 0
    disk_hits: int = 0
    gpu_cached_blocks: int = 0
    loaded_blocks: int = 0


@dataclass(slots=True)
class DemoStats:
    """What the demo reports."""

    requests: int = 0
    groups: list[GroupStats] = field(default_factory=list)
    verified_blocks: int = 0
    mismatched_blocks: int = 0
    failed_load_blocks: int = 0
    failed_stores: int = 0
    seconds: float = 0.0
    traffic: dict[str, TierStats] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.mismatched_blocks == 0 and self.failed_stores == 0


@dataclass(slots=True)
class _Plan:
    """One group's part of one request."""

    group: int
    keys: list[bytes]
    blocks: list[int]
    cached: int = 0  # leading blocks the engine already holds
    hits: int = 0  # leading chunks loadable from the tiers
    cpu_keys: tuple[bytes, ...] = ()
    disk_keys: tuple[bytes, ...] = ()
    span: ChunkSpan | None = None
    failed: set[int] = field(default_factory=set)  # loaded chunks that failed: recompute


class DemoReplay:
    """Replays requests (token id arrays) against one engine and one index."""

    def __init__(self, config: OffloadConfig, num_blocks: int, seed: int = 0) -> None:
        self.config = config
        self.layout = config.layout
        self.bpc = config.blocks_per_chunk
        self.namespace = namespace_of("kvoffload-demo", "bfloat16", self.layout)
        caches = allocate_kv_caches(self.layout, num_blocks, torch.bfloat16)
        self.engine = OffloadEngine.from_config(config, caches, self.namespace)
        self.index = OffloadManager.from_config(config, record_events=False)
        self.rng = random.Random(seed)
        self.free = [list(range(num_blocks)) for _ in self.layout.groups]
        self.stats = DemoStats(groups=[GroupStats() for _ in self.layout.groups])

    def close(self) -> None:
        self.stats.traffic = self.engine.stats()
        self.engine.close()

    # -- one request ---------------------------------------------------------------
    def serve(self, tokens: npt.NDArray[np.int64]) -> None:
        start = time.perf_counter()
        keys = prefix_keys_for_layout(tokens, self.config.tokens_per_chunk, self.namespace)
        plans = []
        for g, group in enumerate(self.layout.groups):
            blocks = self._alloc(g, -(-len(tokens) // group.tokens_per_block))
            plans.append(self._plan(g, keys[g], blocks))
        self._load(plans)
        self._compute(plans)
        self._store(plans)
        for plan in plans:
            self._release(plan.group, plan.blocks)
        self.stats.requests += 1
        self.stats.seconds += time.perf_counter() - start

    def _plan(self, g: int, keys: list[bytes], blocks: list[int]) -> _Plan:
        plan = _Plan(g, keys, blocks)
        cpu = self.index.lookup(keys)
        hits = cpu + self.engine.cascade.lower_prefix(keys[cpu:])
        if hits and self.rng.random() < GPU_PREFIX_SHARE:
            plan.cached = self.rng.randrange(hits * self.bpc)
        first = plan.cached // self.bpc
        self.index.touch(keys[: min(first, cpu)])
        cpu_keys, disk_keys = keys[first:cpu], keys[max(first, cpu) : hits]
        slots: tuple[int, ...] = self.index.prepare_load(cpu_keys).slots if cpu_keys else ()
        if disk_keys:
            disk_keys, promoted = self._reserve_promotion(disk_keys)
            slots += promoted
            hits = max(first, cpu) + len(disk_keys)
        plan.cpu_keys, plan.disk_keys, plan.hits = tuple(cpu_keys), tuple(disk_keys), hits
        if hits * self.bpc > plan.cached:
            span = BlockSpan(tuple(blocks[plan.cached : hits * self.bpc]), plan.cached % self.bpc)
            plan.span = ChunkSpan(g, tuple(keys[first:hits]), slots, span)
        return plan

    def _reserve_promotion(self, keys: list[bytes]) -> tuple[list[bytes], tuple[int, ...]]:
        """CPU slots for the longest prefix of disk hits the index can make room for."""
        n = len(keys)
        while n:
            promote = self.index.prepare_store(keys[:n])
            if promote is not None and promote.keys == tuple(keys[:n]):
                return keys[:n], promote.slots
            if promote is not None:  # some key is in flight elsewhere: give the slots back
                self.index.complete_store(promote.keys, success=False)
            n //= 2
        return [], ()

    def _load(self, plans: list[_Plan]) -> None:
        spans = [p.span for p in plans if p.span is not None]
        result = self._run(self.engine.submit_load(spans)) if spans else None
        for plan in plans:
            stats = self.stats.groups[plan.group]
            stats.chunks += len(plan.keys)
            stats.gpu_cached_blocks += plan.cached
            if plan.cpu_keys:
                self.index.complete_load(plan.cpu_keys)
            if result is None or plan.span is None:
                continue
            promoted = set(result.promoted_keys)
            ok = [k for k in plan.disk_keys if k in promoted]
            self.index.complete_store(ok, success=True)
            self.index.complete_store([k for k in plan.disk_keys if k not in promoted], False)
            failed = set(result.failed_blocks.get(plan.group, ()))
            self.stats.failed_load_blocks += len(failed)
            plan.failed = {i // self.bpc for i, b in enumerate(plan.blocks) if b in failed}
            stats.cpu_hits += sum(k in set(result.done_keys) for k in plan.cpu_keys)
            stats.disk_hits += len(ok)
            self._verify(plan, stats)

    def _verify(self, plan: _Plan, stats: GroupStats) -> None:
        first = plan.cached // self.bpc
        for c in range(first, plan.hits):
            lo = plan.cached % self.bpc if c == first else 0
            blocks = plan.blocks[c * self.bpc + lo : (c + 1) * self.bpc]
            if c in plan.failed:
                continue
            good = self._matches(plan.group, plan.keys[c], lo, blocks)
            stats.loaded_blocks += len(blocks)
            self.stats.verified_blocks += good
            self.stats.mismatched_blocks += len(blocks) - good

    def _compute(self, plans: list[_Plan]) -> None:
        """Write the KV of every chunk the tiers did not provide (prefill)."""
        for plan in plans:
            first = plan.cached // self.bpc
            for c, key in enumerate(plan.keys):
                loaded = plan.span is not None and first <= c < plan.hits and c not in plan.failed
                if loaded and c == first:
                    self._write(plan.group, key, plan.blocks[c * self.bpc : plan.cached])
                elif not loaded:
                    self._write(plan.group, key, plan.blocks[c * self.bpc : (c + 1) * self.bpc])

    def _store(self, plans: list[_Plan]) -> None:
        spans = []
        for plan in plans:
            store = self.index.prepare_store(plan.keys[plan.hits :])
            if store is None:
                continue
            where = {k: c for c, k in enumerate(plan.keys)}
            chunks = [where[k] for k in store.keys]
            start = 0
            while start < len(chunks):  # one span per run of consecutive chunks
                stop = start + 1
                while stop < len(chunks) and chunks[stop] == chunks[stop - 1] + 1:
                    stop += 1
                lo, hi = chunks[start] * self.bpc, (chunks[stop - 1] + 1) * self.bpc
                spans.append(ChunkSpan(plan.group, store.keys[start:stop],
                                       store.slots[start:stop],
                                       BlockSpan(tuple(plan.blocks[lo:hi]))))  # fmt: skip
                start = stop
        if not spans:
            return
        result = self._run(self.engine.submit_store(spans))
        self.index.complete_store(result.done_keys, success=True)
        self.index.complete_store(result.failed_keys, success=False)
        self.stats.failed_stores += len(result.failed_keys)

    # -- engine stand-in --------------------------------------------------------------
    def _run(self, job_id: int) -> JobResult:
        self.engine.wait()
        [result] = self.engine.get_finished()
        assert result.job_id == job_id  # one job in flight at a time
        return result

    def _pages(self, g: int) -> list[torch.Tensor]:
        return [view.pages for view in self.engine.transfer.groups[g]]

    def _chunk_pages(self, g: int, key: bytes) -> torch.Tensor:
        group = self.layout.groups[g]
        data = expected_chunk(key, group.chunk_bytes(self.bpc))
        return torch.from_numpy(data).view(group.num_layers, self.bpc, group.page_bytes)

    def _write(self, g: int, key: bytes, blocks: list[int]) -> None:
        """Prefill stand-in: ``blocks`` are chunk positions ``0..`` of ``key``."""
        if not blocks:
            return
        expected = self._chunk_pages(g, key)
        index = torch.tensor(blocks)
        for layer, pages in enumerate(self._pages(g)):
            pages.index_copy_(0, index, expected[layer, : len(blocks)])

    def _matches(self, g: int, key: bytes, lo: int, blocks: list[int]) -> int:
        """How many of ``blocks`` (chunk positions ``lo..``) hold exactly the expected KV."""
        expected = self._chunk_pages(g, key)
        index = torch.tensor(blocks)
        good = torch.ones(len(blocks), dtype=torch.bool)
        for layer, pages in enumerate(self._pages(g)):
            got = pages.index_select(0, index)
            good &= (got == expected[layer, lo : lo + len(blocks)]).all(dim=1)
        return int(good.sum())

    def _alloc(self, g: int, n: int) -> list[int]:
        free = self.free[g]
        if n > len(free):
            raise RuntimeError(f"demo engine out of blocks in group {g}: {n} > {len(free)}")
        taken, self.free[g] = free[-n:], free[:-n]
        return taken

    def _release(self, g: int, blocks: list[int]) -> None:
        self.free[g].extend(blocks)
        if self.rng.random() < 0.5:
            self.rng.shuffle(self.free[g])  # fragmented: index_select paths
        else:
            self.free[g].sort(reverse=True)  # consecutive: single-copy paths
