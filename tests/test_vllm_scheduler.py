"""The vLLM connector's logic without vLLM: OffloadScheduler and OffloadWorker on real parts.

The package's stand-in for vLLM (:mod:`kvoffload.standin`) serves the
requests: its GPU prefix cache, vLLM's call order, block 0 as vLLM's null
block, KV written by its "forward" as a function of the token prefix and
every loaded block checked bit-exact. Between requests the GPU cache is
reset (vLLM's ``reset_prefix_cache``), so only the connector can serve a
prefix again. Tests that need a step in pieces (a load in flight, a store
not yet reported) call the connector's two sides directly, with blocks from
the stand-in's allocator. Everything else is real: the index, the engine,
CPU and disk tiers, files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.connector import worker as worker_module
from kvoffload.connector.loads import HitLoading, failures_by_block, loads_in_step
from kvoffload.connector.scheduler import OffloadScheduler, StepRequest
from kvoffload.connector.worker import ForwardPass
from kvoffload.engine import JobKind
from kvoffload.keys import KeyExtras, namespace_of
from kvoffload.messages import JobReport, TransferOrder
from kvoffload.standin import KVOffloadSide, KVPages, PrefixCache, StandIn
from kvoffload.tiers.from_config import lower_probes
from kvoffload.transfer import allocate_kv_caches

PAGE = 64
NUM_BLOCKS = 400


def llama_like() -> KVLayout:
    return KVLayout((CacheGroup("full", 4, ("a0", "a1"), PAGE),))


def gemma_like() -> KVLayout:
    """Two sliding-window groups (8-token blocks, window 12) and one full group (4)."""
    return KVLayout(
        (
            CacheGroup("sliding", 8, ("s0",), PAGE, sliding_window=12),
            CacheGroup("sliding", 8, ("s1",), PAGE, sliding_window=12),
            CacheGroup("full", 4, ("f0",), PAGE),
        )
    )


def sliding_alone() -> KVLayout:
    return KVLayout((CacheGroup("sliding", 4, ("w0", "w1"), PAGE, sliding_window=12),))


def recurrent_like() -> KVLayout:
    return KVLayout((CacheGroup("mamba", 8, ("m0",), 160), CacheGroup("full", 8, ("f0",), PAGE)))


def llama4_like() -> KVLayout:
    """Like Llama-4 with vLLM's hybrid allocator on: chunked local groups (chunk 16), a full one."""
    return KVLayout(
        (
            CacheGroup("chunked_local", 4, ("c0",), PAGE, attention_chunk_size=16),
            CacheGroup("chunked_local", 4, ("c1",), PAGE, attention_chunk_size=16),
            CacheGroup("full", 4, ("f0",), PAGE),
        )
    )


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 1 for i in range(n)]


@dataclass
class Served:
    """What serving one request did, from the stand-in's counters."""

    offered: int  # tokens the connector offered and vLLM took
    loaded: int  # of them, loaded successfully
    failed: int  # of them, lost to failed loads and recomputed
    gpu_hit: int
    verified: int
    mismatched: int


class Rig:
    """kvoffload's connector (one scheduler side, one worker) in the package's stand-in."""

    def __init__(self, layout: KVLayout, tmp: Path | None = None, probes: bool = False,
                 **extra: Any) -> None:  # fmt: skip
        # Every chunk stored (retention_interval 1): these tests are about hits and loads;
        # which chunks retention keeps is tested in test_vllm_retention.py.
        settings: dict[str, Any] = {
            "blocks_per_chunk": 2, "cpu_bytes_to_use": "1MiB", "retention_interval": 1, **extra
        }  # fmt: skip
        if tmp is not None:
            settings.update(disk_path=str(tmp), disk_bytes_to_use="16MiB")
        self.layout = layout
        self.config = build_offloading_config(settings, layout)
        self.namespace = namespace_of("stand-in", "bfloat16", layout)
        kv = allocate_kv_caches(layout, NUM_BLOCKS, torch.bfloat16)
        lower = lower_probes(self.config, self.namespace) if probes else []
        self.side = KVOffloadSide(self.config, self.namespace, kv, lower)
        self.engine = StandIn(layout, self.side, gpu_blocks=NUM_BLOCKS, step_tokens=64,
                              kv=KVPages(layout, kv))  # fmt: skip
        self.scheduler, self.worker = self.side.scheduler, self.side.worker

    def serve(
        self, req_id: str, ids: list[int], *, gpu: bool = False, extras: KeyExtras | None = None
    ) -> Served:
        """One request, alone in the engine; the GPU cache is reset first unless ``gpu``."""
        if not gpu:
            self.engine.reset_prefix_cache()
        s = self.engine.stats
        before = (s.external_tokens, s.loaded_tokens, s.failed_load_tokens, s.gpu_hit_tokens,
                  s.verified_blocks, s.mismatched_blocks)  # fmt: skip
        self.engine.add(req_id, ids, extras)
        self.engine.run([], in_flight=1)
        after = (s.external_tokens, s.loaded_tokens, s.failed_load_tokens, s.gpu_hit_tokens,
                 s.verified_blocks, s.mismatched_blocks)  # fmt: skip
        return Served(*(a - b for a, b in zip(after, before, strict=True)))

    def hashes(self, ids: list[int], extras: KeyExtras | None = None) -> list[bytes]:
        """The stand-in engine's block hashes of ``ids`` (vLLM's ``request.block_hashes``)."""
        return self.engine.request_hashes(ids, extras)

    def lookup(
        self, req_id: str, ids: list[int], local: int = 0, extras: KeyExtras | None = None
    ) -> int | None:
        """The scheduler's lookup, called as the connector calls it (block hashes included)."""
        return self.scheduler.lookup(req_id, ids, local, extras, self.hashes(ids, extras))

    def plan_step(self, req_id: str, ids: list[int], **step: Any) -> list[TransferOrder]:
        """The orders of a step that runs ``req_id`` alone (``build_connector_meta``)."""
        scheduled = StepRequest(req_id, ids, block_hashes=self.hashes(ids), **step)
        return self.scheduler.plan_step([scheduled])

    def table(self, n_tokens: int, computed: int) -> list[list[int]]:
        """Blocks for a request of ``n_tokens`` from the stand-in's allocator (nulls included)."""
        table: list[list[int]] = [[] for _ in self.layout.groups]
        assert self.engine.cache.allocate(table, None, computed, n_tokens)
        return table

    def prime(self, ids: list[int], n: int) -> None:
        """vLLM's own cache holds the first ``n`` tokens of ``ids``, computed without us."""
        cache, kv = self.engine.cache, self.engine.kv
        assert kv is not None
        hashes = self.engine.block_hashes(ids)
        table = self.table(n, 0)
        for g, blocks in enumerate(table):
            for b, block in enumerate(blocks):
                kv.write(g, block, hashes[g][b])
        cache.cache(table, hashes, n)
        cache.free(table)

    def drain(self) -> Any:
        assert self.worker.engine.wait(timeout=60)
        polled = self.worker.poll()
        for report in self.worker.take_reports():
            self.scheduler.on_report(report)
        return polled

    def top_hit(self, n: int) -> int:
        return (n - 1) // self.scheduler.alignment * self.scheduler.alignment

    def close(self) -> None:
        self.side.close()


@pytest.fixture(
    params=[llama_like, gemma_like, llama4_like], ids=["single-group", "hybrid", "chunked-local"]
)
def layout(request: pytest.FixtureRequest) -> KVLayout:
    made: KVLayout = request.param()
    return made


def rig(rigs: list[Rig], *args: Any, **kwargs: Any) -> Rig:
    rigs.append(Rig(*args, **kwargs))
    return rigs[-1]


# -- hits and loads ----------------------------------------------------------------------------
def test_nothing_is_offered_before_anything_is_stored(layout: KVLayout, rigs: list[Rig]) -> None:
    served = rig(rigs, layout).serve("r1", tokens(70))
    assert (served.offered, served.loaded, served.gpu_hit) == (0, 0, 0)


def test_a_stored_prefix_comes_back_bit_exact(layout: KVLayout, rigs: list[Rig]) -> None:
    r = rig(rigs, layout)
    ids = tokens(70)
    r.serve("r1", ids)
    again = r.serve("r2", ids)
    assert again.offered == again.loaded == r.top_hit(70) > 0
    assert again.verified > 0 and again.mismatched == again.failed == 0
    figures = r.scheduler.stats()
    assert figures["loaded_tokens"] == figures["hit_tokens"] == again.offered
    assert figures["index_pinned"] == 0 and figures["jobs_in_flight"] == 0
    r.scheduler.index.check_integrity()
    seconds = r.worker.take_seconds()  # each job's time, for the latency histograms
    assert len(seconds["load"]) == len(seconds["store"]) == 1  # r1 stored, r2 loaded
    assert all(s > 0 for s in seconds["load"] + seconds["store"])
    assert r.worker.take_seconds() == {"load": [], "store": []}


def test_the_gpu_cache_serves_first_and_the_connector_only_beyond_it(
    layout: KVLayout, rigs: list[Rig]
) -> None:
    r = rig(rigs, layout)
    ids = tokens(70)
    r.serve("r1", ids)
    kept = r.serve("r2", ids, gpu=True)  # vLLM's own cache still holds the prompt
    align = r.engine.cache.alignment  # a block of every group, finer than a chunk
    assert kept.gpu_hit == 69 // align * align >= r.top_hit(70)
    assert kept.offered == 0 and kept.mismatched == 0


def test_an_idle_step_waits_for_its_load_and_reports_it(
    layout: KVLayout, rigs: list[Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no forward pass to run, the step's poll waits for the load instead of spinning."""
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 60.0)  # longer than any load here
    r = rig(rigs, layout)
    ids = tokens(70)
    r.serve("r1", ids)
    # A load over later steps, as of a lower tier's hit (or with load_in_step never).
    monkeypatch.setattr(r.scheduler.loads, "mode", HitLoading.LATER)
    offered = r.lookup("r2", ids, 0)
    assert offered
    r.scheduler.plan_load("r2", r.table(len(ids), offered), offered)
    transfer = r.worker.engine.transfer
    scatter = transfer.scatter

    def slow_scatter(*args: Any, **kwargs: Any) -> None:  # done long after poll() is called
        time.sleep(0.2)
        scatter(*args, **kwargs)

    monkeypatch.setattr(transfer, "scatter", slow_scatter)
    r.worker.submit(r.scheduler.take_orders(), JobKind.LOAD)
    polled = r.worker.poll(idle=True)  # no engine.wait() first: the poll itself waits
    assert polled.finished_recving == {"r2"} and not polled.failed_recving
    assert r.worker.poll(idle=True).finished_recving == set()  # nothing in flight: no wait


def test_an_idle_step_waits_for_a_store_in_flight(
    layout: KVLayout, rigs: list[Rig], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A lookup deferred on a chunk being stored: the idle step waits for that store."""
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 60.0)
    r = rig(rigs, layout, tmp_path)
    [disk] = r.worker.engine.cascade.lower
    put = disk.put

    def slow_put(*args: Any) -> None:  # a slow disk: the job runs on after its blocks are read
        time.sleep(0.2)
        put(*args)

    monkeypatch.setattr(disk, "put", slow_put)
    ids = tokens(70)
    r.lookup("r1", ids, 0)
    stores = r.plan_step(
        "r1", ids, computed=0, scheduled=len(ids), block_ids=r.table(70, 0), num_prompt_tokens=70
    )
    r.worker.submit(stores, JobKind.STORE)
    assert r.lookup("r2", ids, 0) is None  # its chunks are being stored
    r.worker.poll(idle=True)
    for report in r.worker.take_reports():
        r.scheduler.on_report(report)
    assert r.lookup("r2", ids, 0) == r.top_hit(70)


def test_lookup_has_no_side_effects(layout: KVLayout, rigs: list[Rig]) -> None:
    r = rig(rigs, layout)
    ids = tokens(70)
    r.serve("r1", ids)
    before = r.scheduler.index.stats()
    answers = {r.lookup("r2", ids, 0) for _ in range(3)}
    assert answers == {r.top_hit(70)}
    assert r.scheduler.index.stats() == before


def test_a_divergent_prompt_hits_only_the_shared_chunks(layout: KVLayout, rigs: list[Rig]) -> None:
    r = rig(rigs, layout)
    ids = tokens(70)
    r.serve("r1", ids)
    span = r.scheduler.alignment
    served = r.serve("r2", ids[: 2 * span + 3] + tokens(40, seed=5))
    assert served.offered == served.loaded == 2 * span and served.mismatched == 0


def test_sliding_groups_need_only_the_window_before_the_hit(rigs: list[Rig]) -> None:
    r = rig(rigs, gemma_like())
    ids = tokens(80)
    span = r.scheduler.alignment
    # vLLM's own cache holds the first 3 chunks' worth, computed without the connector:
    # the sliding groups' blocks before the window are null then, so their early chunks
    # cannot be stored.
    r.prime(ids, 3 * span)
    first = r.serve("r1", ids, gpu=True)
    assert first.gpu_hit == 3 * span and first.offered == 0
    assert r.scheduler.stats()["skipped_store_chunks"] > 0
    second = r.serve("r2", ids)
    assert second.offered == second.loaded == r.top_hit(80)  # early windows absent, no matter
    assert second.mismatched == 0 and second.verified > 0


def test_chunked_local_groups_need_only_the_current_attention_chunk(rigs: list[Rig]) -> None:
    r = rig(rigs, llama4_like())
    ids = tokens(80)
    # vLLM's prefix cache serves two attention chunks (32 tokens): the chunked groups'
    # blocks before them are null, so only the full group can store [0, 32).
    r.prime(ids, 32)
    first = r.serve("r1", ids, gpu=True)
    assert first.gpu_hit == 32 and first.offered == 0
    assert r.scheduler.stats()["skipped_store_chunks"] > 0
    second = r.serve("r2", ids)
    assert second.offered == second.loaded == r.top_hit(80) == 72  # needs [64, 72) of them
    assert second.mismatched == 0 and second.verified > 0


def test_a_hit_on_an_attention_chunk_boundary_needs_nothing_of_the_chunked_groups(
    rigs: list[Rig],
) -> None:
    r = rig(rigs, llama4_like())
    ids = tokens(65)
    r.prime(ids, 64)
    first = r.serve("r1", ids, gpu=True)  # the chunked groups store nothing at all
    assert first.gpu_hit == 64
    assert r.scheduler.stats()["stored_chunks"] == 64 // 8  # the full group's
    second = r.serve("r2", ids)
    assert second.offered == second.loaded == 64 and second.mismatched == 0


def test_a_suspended_worker_fails_orders_and_keeps_the_tiers(rigs: list[Rig]) -> None:
    """vLLM 0.33's sleep mode: no copy touches the released KV memory; the CPU tier stays."""
    r = rig(rigs, gemma_like())
    ids = tokens(70)
    r.serve("r1", ids)
    r.worker.suspend()
    r.worker.suspend()  # idempotent, as vLLM asks
    r.engine.reset_prefix_cache()
    r.engine.add("r2", ids)
    r.engine.step()  # r2's load is ordered, refused and reported failed in this step
    stats = r.engine.stats
    assert stats.external_tokens == r.top_hit(70)  # the chunks are still there...
    assert stats.loaded_tokens == 0 and r.scheduler.stats()["failed_loads"] == 1  # ...not loaded
    assert r.worker.stats()["suspended_orders"] == 1  # r2's load (its chunks are stored)
    r.worker.resume()
    r.engine.run([])  # vLLM starts r2 over: the same hit, loaded this time
    assert stats.failed_load_tokens == stats.loaded_tokens == r.top_hit(70)
    assert stats.mismatched_blocks == 0 and stats.verified_blocks > 0


def test_a_lookup_waits_for_a_promotion_in_flight(rigs: list[Rig], tmp_path: Path) -> None:
    ids = tokens(70)
    rig(rigs, llama_like(), tmp_path).serve("r1", ids)
    reader = rig(rigs, llama_like(), tmp_path, probes=True)
    sched = reader.scheduler
    offered = reader.lookup("a", ids)
    assert offered
    sched.plan_load("a", reader.table(70, offered), offered)  # promotions reserved, not reported
    assert reader.lookup("b", ids) is None  # ask again later: the chunks are on their way
    assert sched.stats()["deferred_lookups"] == 1
    reader.worker.submit(sched.take_orders(), JobKind.LOAD)
    reader.drain()
    assert reader.lookup("b", ids) == offered  # now CPU hits


# -- lower tiers, restarts, failures ---------------------------------------------------------
def test_a_new_process_loads_from_the_disk_the_last_one_wrote(
    layout: KVLayout, rigs: list[Rig], tmp_path: Path
) -> None:
    ids = tokens(70)
    first = rig(rigs, layout, tmp_path)
    first.serve("r1", ids)
    first.close()
    second = rig(rigs, layout, tmp_path, probes=True)
    served = second.serve("r1", ids)
    assert served.loaded == second.top_hit(70) and served.mismatched == 0 and served.verified
    figures = second.scheduler.stats()
    assert figures["lower_hit_chunks"] > 0 and figures["cpu_hit_chunks"] == 0
    assert second.worker.engine.stats()["disk"].loads == figures["lower_hit_chunks"]
    worker = second.worker.stats()["tiers"]  # the connector's worker figures: the same record
    assert worker["disk"]["loads"] == figures["lower_hit_chunks"] == worker["cpu"]["misses"]
    assert second.serve("r2", ids).loaded == served.loaded  # promoted: CPU hits now
    assert second.scheduler.stats()["cpu_hit_chunks"] > 0


def test_corrupt_chunks_are_reported_and_recomputed(
    layout: KVLayout, rigs: list[Rig], tmp_path: Path
) -> None:
    ids = tokens(70)
    first = rig(rigs, layout, tmp_path)
    first.serve("r1", ids)
    first.close()
    for path in tmp_path.rglob("*.kv"):
        with path.open("r+b") as f:
            f.seek(4096 + 10)
            f.write(b"\x00\xff" * 8)
    second = rig(rigs, layout, tmp_path, probes=True)
    served = second.serve("r1", ids)
    # Every chunk is corrupt: nothing is loaded, everything offered is recomputed, and no
    # block the engine computes from is wrong (the forward pass overwrote the failed ones).
    assert served.offered == served.failed == second.top_hit(70) and served.loaded == 0
    assert served.mismatched == 0
    figures = second.scheduler.stats()
    assert figures["failed_loads"] == 1 and figures["loaded_tokens"] == 0
    assert figures["index_pinned"] == 0 and figures["index_storing"] == 0
    assert figures["miss_tokens_by_reason"]["failed_load"] == served.failed  # said why
    failed_blocks = second.worker.stats()["failed_load_blocks"]
    assert failed_blocks > 0
    second.scheduler.index.check_integrity()
    # The recomputed chunks were stored again: the next request loads them, right.
    third = second.serve("r2", ids)
    assert third.loaded == third.offered > 0 and third.mismatched == 0


def test_chunks_that_lost_their_slot_are_failed_at_once(rigs: list[Rig], tmp_path: Path) -> None:
    ids = tokens(70)
    rig(rigs, llama_like(), tmp_path).serve("r1", ids)
    reader = rig(rigs, llama_like(), tmp_path, probes=True)
    sched = reader.scheduler
    offered_a, offered_b = reader.lookup("a", ids), reader.lookup("b", ids)
    assert offered_a and offered_a == offered_b  # asked before either was planned
    assert offered_a is not None and offered_b is not None
    table_a, table_b = reader.table(70, offered_a), reader.table(70, offered_b)
    sched.plan_load("a", table_a, offered_a)
    order = sched.plan_load("b", table_b, offered_b)  # a's promotions hold every key
    assert order is not None and order.unloadable and not order.spans
    reader.worker.submit(sched.take_orders(), JobKind.LOAD)
    reader.drain()
    failed = reader.worker.take_failed_blocks()
    assert failed == set(order.unloadable[0])
    assert sched.stats()["unloadable_chunks"] == len(order.unloadable[0]) // 2


# -- the protocol -----------------------------------------------------------------------------
def test_an_order_completes_when_every_rank_reported_it() -> None:
    layout = llama_like()
    config = build_offloading_config({"blocks_per_chunk": 2, "cpu_bytes_to_use": "1MiB"}, layout)
    sched = OffloadScheduler(config, namespace_of("stand-in", "bfloat16", layout), world_size=2)
    ids = tokens(40)
    table: list[list[int]] = [[]]
    assert PrefixCache(layout, NUM_BLOCKS).allocate(table, None, 0, 40)
    [order] = sched.plan_step([StepRequest("r", ids, 0, 40, table, 40)])
    first_key = order.keys[0]
    sched.on_report(JobReport(order.job_id, 1, frozenset(), {}, {}))
    assert sched.stats()["jobs_in_flight"] == 1  # one rank is not enough
    assert sched.lookup("q", ids, 0) is None  # its chunks are still being stored
    sched.on_report(JobReport(order.job_id, 1, frozenset({first_key}), {}, {}))
    figures = sched.stats()
    assert figures["jobs_in_flight"] == 0
    assert figures["failed_store_chunks"] == 1  # failed on one rank: failed
    assert figures["stored_chunks"] == len(order.keys) - 1
    assert sched.lookup("q", ids, 0) == 0  # the chain starts with the failed chunk


def test_chunks_a_finished_request_never_found_room_for_are_counted() -> None:
    """Stores in flight hold every CPU slot: the rest wait a step, and are counted if they never
    get one (the request finished first); once reports free the slots they are stored."""
    layout = llama_like()
    chunk = layout.groups[0].chunk_bytes(2)
    config = build_offloading_config({"blocks_per_chunk": 2, "cpu_bytes_to_use": 2 * chunk},
                                     layout)  # fmt: skip
    namespace = namespace_of("stand-in", "bfloat16", layout)
    ids = tokens(40)  # 5 chunks of 8 tokens, 2 slots

    def first_step(sched: OffloadScheduler, req: str) -> tuple[list[list[int]], TransferOrder]:
        table: list[list[int]] = [[]]
        assert PrefixCache(layout, NUM_BLOCKS).allocate(table, None, 0, 40)
        [order] = sched.plan_step([StepRequest(req, ids, 0, 40, table, 40)])
        assert len(order.keys) == 2  # the rest wait for room
        return table, order

    busy = OffloadScheduler(config, namespace)
    first_step(busy, "r")
    busy.request_finished("r")  # its two stores are still in flight: 3 chunks never stored
    assert busy.stats()["no_room_chunks"] == 3

    settled = OffloadScheduler(config, namespace)
    table, order = first_step(settled, "r")
    settled.on_report(JobReport(order.job_id, 1, frozenset(), {}, {}))  # the slots are free
    [retried] = settled.plan_step([StepRequest("r", ids, 40, 1, table, 40)])
    assert len(retried.keys) == 2  # the next two, evicting the first (all ready now)
    settled.request_finished("r")
    assert settled.stats()["no_room_chunks"] == 1


def test_reset_drops_cpu_chunks_and_preemption_forgets_validity(rigs: list[Rig]) -> None:
    r = rig(rigs, llama_like())
    sched = r.scheduler
    ids = tokens(40)
    r.serve("r1", ids)
    assert r.lookup("r2", ids)
    assert sched.reset() and r.lookup("r2", ids) == 0
    events = sched.take_events()
    assert {e.kind.value for e in events} == {"stored", "removed"}
    # A preempted request's blocks hold nothing known: nothing below is stored again
    # until it is recomputed.
    table = r.table(40, 0)
    stored = len(
        r.plan_step("p", ids, computed=0, scheduled=16, block_ids=table, num_prompt_tokens=40)
    )
    sched.preempted("p")
    [order] = r.plan_step(
        "p", ids, computed=16, scheduled=24, block_ids=table, num_prompt_tokens=40
    )
    assert stored == 1
    blocks = [b for span in order.spans for b in span.blocks.block_ids]
    assert blocks and not set(blocks) & set(table[0][:4])  # the first 16 tokens' blocks


def test_tokens_are_credited_to_the_tiers_their_chunks_came_from() -> None:
    """A load of chunks from two tiers splits its tokens by chunk count; shares add up."""
    from kvoffload.connector._request import tier_shares

    assert tier_shares(96, ["cpu", "cpu", "disk"]) == {"cpu": 64, "disk": 32}
    assert tier_shares(100, ["cpu", "disk", "redis"]) == {"cpu": 33, "disk": 33, "redis": 34}
    assert tier_shares(10, []) == {} and tier_shares(0, ["cpu"]) == {}
    assert sum(tier_shares(1001, ["cpu"] * 7 + ["disk"] * 5).values()) == 1001


# -- loads in the step that asks for them (load_in_step) ---------------------------------------
def served_in_step(r: Rig, ids: list[int]) -> tuple[Served, int]:
    """Store ``ids``, then serve them again from the CPU tier: what it did, in how many steps."""
    r.serve("first", ids)
    steps = r.engine.stats.steps
    again = r.serve("again", ids)
    return again, r.engine.stats.steps - steps


@pytest.mark.parametrize(
    ("make", "setting", "in_step"),
    [
        (llama_like, "auto", True),
        (llama_like, "never", False),
        (gemma_like, "auto", False),  # several groups: vLLM could not recompute a failure
        (gemma_like, "always", True),
        (recurrent_like, "auto", False),
        (recurrent_like, "always", True),  # the state into the block vLLM runs it in too
    ],
)
def test_a_cpu_tier_hit_loads_in_the_step_that_asks_where_the_setting_allows(
    rigs: list[Rig], make: Any, setting: str, in_step: bool
) -> None:
    r = rig(rigs, make(), load_in_step=setting)
    ids = tokens(70)
    again, steps = served_in_step(r, ids)
    assert again.offered == again.loaded == r.top_hit(70) > 0
    assert again.verified > 0 and again.mismatched == again.failed == 0
    stats, worker = r.scheduler.stats(), r.worker.stats()
    assert stats["hit_tokens"] == again.offered  # counted once, whichever way it loaded
    assert stats["in_step_hit_tokens"] == (again.offered if in_step else 0)
    assert worker["in_step_load_jobs"] == int(in_step)
    # The prompt's last 6 tokens and one decode step: a step less without the wait.
    never = rig(rigs, make(), load_in_step="never")
    assert steps == served_in_step(never, ids)[1] - int(in_step)


@pytest.mark.parametrize("copies", ["layer", "thread"])
def test_a_state_loaded_in_the_step_is_in_place_before_the_forward_pass(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch, copies: str
) -> None:
    """vLLM's recurrent layers read their state without a layer wait: in every copy mode the
    state is copied in ``start_load_kv``, into the block the step runs it in too (the
    stand-in's forward pass checks the state it starts from there)."""
    monkeypatch.setenv("KVOFFLOAD_IN_STEP_COPIES", copies)
    r = rig(rigs, recurrent_like(), load_in_step="always")
    again, _ = served_in_step(r, tokens(70))
    assert again.loaded == r.top_hit(70) > 0
    assert again.verified > 0 and again.mismatched == again.failed == 0
    assert r.worker.stats()["in_step_load_jobs"] == 1


def test_a_hit_in_a_lower_tier_loads_over_later_steps(rigs: list[Rig], tmp_path: Path) -> None:
    r = rig(rigs, llama_like(), tmp_path, probes=True)
    ids = tokens(70)
    r.serve("r1", ids)
    r.scheduler.reset()  # the CPU tier forgets; the disk tier keeps the chunks
    r.drain()
    assert r.lookup("r2", ids, 0) and not r.scheduler.loads_in_step("r2")
    again = r.serve("r3", ids)
    assert again.loaded == r.top_hit(70) and again.mismatched == 0
    assert r.worker.stats()["in_step_load_jobs"] == 0


@pytest.mark.parametrize(
    ("copies", "forward"),
    [("before", ForwardPass.LAYER_BY_LAYER), ("layer", ForwardPass.FULL_GRAPH)],
)
def test_an_in_step_load_fills_the_blocks_before_submit_returns(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch, copies: str, forward: ForwardPass
) -> None:
    """The forward pass reads them right after: nothing waits for a poll, nothing is received.

    A CUDA graph replaying the whole forward pass calls no layer's wait, so
    there the copies all end in ``submit`` whatever the copy mode."""
    monkeypatch.setenv("KVOFFLOAD_IN_STEP_COPIES", copies)
    r = rig(rigs, llama_like())
    ids = tokens(70)
    r.serve("r1", ids)
    offered = r.lookup("r2", ids, 0)
    assert offered and r.scheduler.loads_in_step("r2")
    table = r.table(len(ids), offered)
    order = r.scheduler.plan_load("r2", table, offered)
    assert order is not None and order.in_step
    r.worker.submit(r.scheduler.take_orders(), JobKind.LOAD, forward=forward)
    kv, hashes = r.engine.kv, r.engine.block_hashes(ids)
    assert kv is not None
    assert all(kv.holds(0, table[0][b], hashes[0][b]) for b in range(offered // 4))
    polled = r.worker.poll()
    assert polled.finished_recving == polled.failed_recving == set()  # it never waited
    for report in r.worker.take_reports():
        r.scheduler.on_report(report)
    assert r.scheduler.stats()["loaded_tokens"] == offered


@pytest.mark.parametrize("copies", ["before", "layer", "thread"])
def test_a_failed_in_step_load_hands_back_its_blocks_and_voids_the_steps_stores(
    rigs: list[Rig], monkeypatch: pytest.MonkeyPatch, copies: str
) -> None:
    """The step computed on top of the failed load: what it wrote is not stored.

    Whichever way the load copies, its layers are done and its failure known
    before the step's stores are submitted."""
    monkeypatch.setenv("KVOFFLOAD_FAILPOINTS", "load.fail_last_chunk=1")
    monkeypatch.setenv("KVOFFLOAD_IN_STEP_COPIES", copies)
    r = rig(rigs, llama_like())
    ids = tokens(70)
    r.serve("r1", ids)
    longer = [*ids, *tokens(30, seed=5)]  # its step completes chunks past the hit
    offered = r.lookup("r2", longer, 0)
    assert offered == r.top_hit(70) and r.scheduler.loads_in_step("r2")
    table = r.table(len(longer), offered)
    r.scheduler.plan_load("r2", table, offered)
    loads = r.scheduler.take_orders()
    [store] = r.plan_step(
        "r2",
        longer,
        computed=offered,
        scheduled=len(longer) - offered,
        block_ids=table,
        num_prompt_tokens=len(longer),
    )
    assert store.kind is JobKind.STORE and store.spans
    r.worker.before_forward()
    r.worker.submit(loads, JobKind.LOAD)
    assert r.worker.copies.value == copies
    r.worker.wait_layer(r.config.layout.layer_names[0])
    r.worker.submit([store], JobKind.STORE)
    polled = r.worker.poll()
    assert polled.finished_recving == polled.failed_recving == set()
    chunk = r.config.blocks_per_chunk
    assert r.worker.take_failed_blocks() == set(table[0][offered // 4 - chunk : offered // 4])
    reports = {report.job_id: report for report in r.worker.take_reports()}
    assert not reports[store.job_id].ok and not reports[loads[0].job_id].ok
    worker = r.worker.stats()
    assert worker["voided_store_orders"] == 1 and worker["failpoint_load_fail_last_chunk"] == 1
    for report in reports.values():
        r.scheduler.on_report(report)
    stats = r.scheduler.stats()
    assert stats["failed_loads"] == 1 and stats["stored_chunks"] == r.top_hit(70) // 8


@pytest.mark.parametrize(
    ("make", "engine_groups", "by_block", "auto", "always"),
    [
        (llama_like, 1, True, True, True),
        (sliding_alone, 1, False, False, True),  # vLLM would resume past the window's blocks
        (gemma_like, 3, False, False, True),
        (recurrent_like, 2, False, False, True),
    ],
)
def test_which_layouts_load_in_the_step_and_report_failed_blocks(
    make: Any, engine_groups: int, by_block: bool, auto: bool, always: bool
) -> None:
    layout = make()
    assert failures_by_block(layout, engine_groups) is by_block
    for setting, expected in (("auto", auto), ("always", always), ("never", False)):
        config = build_offloading_config(
            {"cpu_bytes_to_use": "1MiB", "load_in_step": setting}, layout
        )
        assert loads_in_step(config, engine_groups) is expected, setting
