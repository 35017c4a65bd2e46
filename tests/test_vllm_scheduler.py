"""The vLLM connector's logic without vLLM: OffloadScheduler and OffloadWorker on real parts.

A small stand-in drives them the way vLLM's scheduler and model runner do,
one request at a time: lookup, block allocation (block id 0 is vLLM's null
block; a sliding-window group gets null blocks before its window), the
load, the "forward pass" that writes KV for the tokens not loaded, the store
after it, the reports back. KV is a function of the token prefix, so a
loaded block is right exactly when it equals what prefill would write.
Everything else is real: the index, the engine, CPU and disk tiers, files.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.engine import JobKind, OffloadEngine
from kvoffload.keys import KeyExtras, namespace_of
from kvoffload.messages import JobReport
from kvoffload.tiers.from_config import lower_probes
from kvoffload.transfer import allocate_kv_caches
from kvoffload.vllm import worker as worker_module
from kvoffload.vllm.scheduler import NULL_BLOCK, OffloadScheduler
from kvoffload.vllm.worker import OffloadWorker

PAGE = 64
NUM_BLOCKS = 400
GARBAGE = 0xEE


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


def llama4_like() -> KVLayout:
    """Like Llama-4 with vLLM's hybrid allocator on: chunked local groups (chunk 16), a full one."""
    return KVLayout(
        (
            CacheGroup("chunked_local", 4, ("c0",), PAGE, attention_chunk_size=16),
            CacheGroup("chunked_local", 4, ("c1",), PAGE, attention_chunk_size=16),
            CacheGroup("full", 4, ("f0",), PAGE),
        )
    )


def first_needed(group: CacheGroup, hit: int) -> int:
    """The first token whose KV the next token after ``hit`` attends to (vLLM's managers)."""
    if group.sliding_window is not None:
        return max(0, hit - group.sliding_window + 1)
    if group.attention_chunk_size is not None:
        return hit // group.attention_chunk_size * group.attention_chunk_size
    return 0


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + i * 104729) % 1000 + 1 for i in range(n)]


def expected_page(g: int, layer: str, prefix: list[int]) -> torch.Tensor:
    """The KV "prefill" writes for a block whose last token ends ``prefix``."""
    digest = hashlib.blake2b(repr((g, layer, prefix)).encode(), digest_size=PAGE).digest()
    return torch.frombuffer(bytearray(digest), dtype=torch.uint8)


@dataclass
class Served:
    """What serving one request did."""

    offered: int | None
    loaded_ok: bool
    failed_blocks: set[int]
    finished: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    mismatched: int = 0


class Engine:
    """vLLM stand-in: one engine (tiers, worker side) and one scheduler side."""

    def __init__(self, layout: KVLayout, tmp: Path | None = None, probes: bool = False,
                 world_size: int = 1, **extra: Any) -> None:  # fmt: skip
        settings: dict[str, Any] = {"blocks_per_chunk": 2, "cpu_bytes_to_use": "1MiB", **extra}
        if tmp is not None:
            settings.update(disk_path=str(tmp), disk_bytes_to_use="16MiB")
        self.layout = layout
        self.config = build_offloading_config(settings, layout)
        ns = namespace_of("stand-in", "bfloat16", layout)
        self.caches = allocate_kv_caches(layout, NUM_BLOCKS, torch.bfloat16)
        self.pages = {
            n: t.view(torch.uint8).reshape(NUM_BLOCKS, PAGE) for n, t in self.caches.items()
        }
        engine = OffloadEngine.from_config(self.config, self.caches, ns)
        self.worker = OffloadWorker(engine, report_blocks=len(layout.groups) == 1)
        lower = lower_probes(self.config, ns) if probes else []
        self.scheduler = OffloadScheduler(self.config, ns, lower, world_size=world_size)
        self.free = list(range(NUM_BLOCKS - 1, 0, -1))  # block 0 is the null block

    def close(self) -> None:
        self.worker.close()

    # -- the pieces of one request ------------------------------------------------------
    def allocate(self, n_tokens: int, hit: int) -> list[list[int]]:
        """Blocks per group; a window group's blocks wholly before its window are null."""
        table = []
        for group in self.layout.groups:
            tpb = group.tokens_per_block
            first_live = first_needed(group, hit) // tpb
            count = -(-n_tokens // tpb)
            table.append([NULL_BLOCK if b < first_live else self.free.pop() for b in range(count)])
        for g, ids in enumerate(table):
            for layer in self.layout.groups[g].layer_names:
                live = [b for b in ids if b != NULL_BLOCK]
                self.pages[layer][live] = GARBAGE
        return table

    def compute(self, table: list[list[int]], ids: list[int], start: int, stop: int) -> None:
        """Prefill of tokens [start, stop): every block holding one of them gets its KV."""
        for g, group in enumerate(self.layout.groups):
            tpb = group.tokens_per_block
            for b in range(start // tpb, -(-stop // tpb)):
                if table[g][b] == NULL_BLOCK:
                    continue
                prefix = ids[: min((b + 1) * tpb, len(ids))]
                for layer in group.layer_names:
                    self.pages[layer][table[g][b]] = expected_page(g, layer, prefix)

    def mismatches(self, table: list[list[int]], ids: list[int], start: int, stop: int) -> int:
        """Blocks in [start, stop) whose KV differs from what prefill writes."""
        bad = 0
        for g, group in enumerate(self.layout.groups):
            tpb = group.tokens_per_block
            first = max(start, first_needed(group, stop))
            for b in range(first // tpb, stop // tpb):
                block = table[g][b]
                for layer in group.layer_names:
                    want = expected_page(g, layer, ids[: (b + 1) * tpb])
                    bad += block == NULL_BLOCK or not torch.equal(self.pages[layer][block], want)
        return bad

    def drain(self) -> Any:
        assert self.worker.engine.wait(timeout=60)
        polled = self.worker.poll()
        for report in self.worker.take_reports():
            self.scheduler.on_report(report)
        return polled

    def serve(
        self, req_id: str, ids: list[int], local_hit: int = 0, extras: KeyExtras | None = None
    ) -> Served:
        """One request through lookup, load, prefill, store and finish."""
        offered = self.scheduler.lookup(req_id, ids, local_hit, extras)
        hit = local_hit + (offered or 0)
        table = self.allocate(len(ids), hit)
        self.compute(table, ids, 0, local_hit)  # vLLM's own prefix cache had these
        self.scheduler.plan_load(req_id, table, offered or 0)
        self.worker.submit(self.scheduler.take_orders(), JobKind.LOAD)
        polled = self.drain()
        failed = self.worker.take_failed_blocks()
        ok = req_id not in polled.failed_recving and not failed
        mismatched = self.mismatches(table, ids, local_hit, hit) if ok else 0
        start = hit if ok else local_hit  # a failed load is recomputed
        self.compute(table, ids, start, len(ids))
        self.scheduler.plan_store(req_id, ids, computed=start, scheduled=len(ids) - start,
                                  block_ids=table, num_prompt_tokens=len(ids))  # fmt: skip
        self.worker.submit(self.scheduler.take_orders(), JobKind.STORE)
        self.drain()
        self.scheduler.request_finished(req_id)
        self.free += [b for ids_ in table for b in ids_ if b != NULL_BLOCK]
        return Served(offered, ok, failed, polled.finished_recving, polled.failed_recving,
                      mismatched)  # fmt: skip


@pytest.fixture(
    params=[llama_like, gemma_like, llama4_like], ids=["single-group", "hybrid", "chunked-local"]
)
def layout(request: pytest.FixtureRequest) -> KVLayout:
    made: KVLayout = request.param()
    return made


def top_hit(engine: Engine, n: int) -> int:
    return (n - 1) // engine.scheduler.alignment * engine.scheduler.alignment


# -- hits and loads ----------------------------------------------------------------------------
def test_nothing_is_offered_before_anything_is_stored(layout: KVLayout) -> None:
    engine = Engine(layout)
    assert engine.serve("r1", tokens(70)).offered == 0
    engine.close()


def test_a_stored_prefix_comes_back_bit_exact(layout: KVLayout) -> None:
    engine = Engine(layout)
    ids = tokens(70)
    engine.serve("r1", ids)
    again = engine.serve("r2", ids)
    assert again.offered == top_hit(engine, 70) > 0
    assert again.loaded_ok and again.mismatched == 0
    assert again.finished == {"r2"}
    figures = engine.scheduler.figures()
    assert figures["loaded_tokens"] == figures["hit_tokens"] == again.offered
    assert figures["index_pinned"] == 0 and figures["jobs_in_flight"] == 0
    engine.scheduler.index.check_integrity()
    seconds = engine.worker.take_seconds()  # each job's time, for the latency histograms
    assert len(seconds["load"]) == len(seconds["store"]) == 1  # r1 stored, r2 loaded
    assert all(s > 0 for s in seconds["load"] + seconds["store"])
    assert engine.worker.take_seconds() == {"load": [], "store": []}
    engine.close()


def test_an_idle_step_waits_for_its_load_and_reports_it(
    layout: KVLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no forward pass to run, the step's poll waits for the load instead of spinning."""
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 60.0)  # longer than any load here
    engine = Engine(layout)
    ids = tokens(70)
    engine.serve("r1", ids)
    offered = engine.scheduler.lookup("r2", ids, 0)
    assert offered
    engine.scheduler.plan_load("r2", engine.allocate(len(ids), offered), offered)
    transfer = engine.worker.engine.transfer
    scatter = transfer.scatter

    def slow_scatter(*args: Any) -> None:  # a slow copy: done long after poll() is called
        time.sleep(0.2)
        scatter(*args)

    monkeypatch.setattr(transfer, "scatter", slow_scatter)
    engine.worker.submit(engine.scheduler.take_orders(), JobKind.LOAD)
    polled = engine.worker.poll(idle=True)  # no engine.wait() first: the poll itself waits
    assert polled.finished_recving == {"r2"} and not polled.failed_recving
    assert engine.worker.poll(idle=True).finished_recving == set()  # nothing in flight: no wait
    engine.close()


def test_an_idle_step_waits_for_a_store_in_flight(
    layout: KVLayout, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A lookup deferred on a chunk being stored: the idle step waits for that store."""
    monkeypatch.setattr(worker_module, "IDLE_WAIT_S", 60.0)
    engine = Engine(layout, tmp_path)
    [disk] = engine.worker.engine.cascade.lower
    put = disk.put

    def slow_put(*args: Any) -> None:  # a slow disk: the job runs on after its blocks are read
        time.sleep(0.2)
        put(*args)

    monkeypatch.setattr(disk, "put", slow_put)
    ids = tokens(70)
    engine.scheduler.lookup("r1", ids, 0)
    table = engine.allocate(len(ids), 0)
    engine.compute(table, ids, 0, len(ids))
    engine.scheduler.plan_store("r1", ids, computed=0, scheduled=len(ids), block_ids=table,
                                num_prompt_tokens=len(ids))  # fmt: skip
    engine.worker.submit(engine.scheduler.take_orders(), JobKind.STORE)
    assert engine.scheduler.lookup("r2", ids, 0) is None  # its chunks are being stored
    engine.worker.poll(idle=True)
    for report in engine.worker.take_reports():
        engine.scheduler.on_report(report)
    assert engine.scheduler.lookup("r2", ids, 0) == top_hit(engine, 70)
    engine.close()


def test_lookup_has_no_side_effects(layout: KVLayout) -> None:
    engine = Engine(layout)
    ids = tokens(70)
    engine.serve("r1", ids)
    before = engine.scheduler.index.stats()
    answers = {engine.scheduler.lookup("r2", ids, 0) for _ in range(3)}
    assert answers == {top_hit(engine, 70)}
    assert engine.scheduler.index.stats() == before
    engine.close()


def test_a_divergent_prompt_hits_only_the_shared_chunks(layout: KVLayout) -> None:
    engine = Engine(layout)
    ids = tokens(70)
    engine.serve("r1", ids)
    span = engine.scheduler.alignment
    other = ids[: 2 * span + 3] + tokens(40, seed=5)
    served = engine.serve("r2", other)
    assert served.offered == 2 * span and served.mismatched == 0
    engine.close()


def test_sliding_groups_need_only_the_window_before_the_hit() -> None:
    engine = Engine(gemma_like())
    ids = tokens(80)
    span = engine.scheduler.alignment
    # vLLM's prefix cache serves the first 3 chunks' worth: the sliding groups' blocks
    # before the window are null then, so their early chunks cannot be stored.
    first = engine.serve("r1", ids, local_hit=3 * span)
    assert first.offered == 0
    assert engine.scheduler.figures()["skipped_store_chunks"] > 0
    second = engine.serve("r2", ids)
    assert second.offered == top_hit(engine, 80)  # the whole prefix, early windows absent
    assert second.loaded_ok and second.mismatched == 0
    engine.close()


def test_chunked_local_groups_need_only_the_current_attention_chunk() -> None:
    engine = Engine(llama4_like())
    ids = tokens(80)
    # vLLM's prefix cache serves two attention chunks (32 tokens): the chunked groups'
    # blocks before them are null, so only the full group can store [0, 32).
    first = engine.serve("r1", ids, local_hit=32)
    assert first.offered == 0
    assert engine.scheduler.figures()["skipped_store_chunks"] > 0
    second = engine.serve("r2", ids)
    assert second.offered == top_hit(engine, 80) == 72  # needs [64, 72) of the chunked groups
    assert second.loaded_ok and second.mismatched == 0
    engine.close()


def test_a_hit_on_an_attention_chunk_boundary_needs_nothing_of_the_chunked_groups() -> None:
    engine = Engine(llama4_like())
    ids = tokens(65)
    engine.serve("r1", ids, local_hit=64)  # the chunked groups store nothing at all
    assert engine.scheduler.figures()["stored_chunks"] == 64 // 8  # the full group's
    second = engine.serve("r2", ids)
    assert second.offered == 64
    assert second.loaded_ok and second.mismatched == 0
    engine.close()


def test_a_suspended_worker_fails_orders_and_keeps_the_tiers() -> None:
    """vLLM 0.33's sleep mode: no copy touches the released KV memory; the CPU tier stays."""
    engine = Engine(gemma_like())
    ids = tokens(70)
    engine.serve("r1", ids)
    engine.worker.suspend()
    engine.worker.suspend()  # idempotent, as vLLM asks
    asleep = engine.serve("r2", ids)
    assert asleep.offered == top_hit(engine, 70)  # the chunks are still there...
    assert not asleep.loaded_ok and asleep.failed_recving == {"r2"}  # ...but not loaded now
    assert engine.worker.figures()["suspended_orders"] == 1  # r2's load (its chunks are stored)
    engine.worker.resume()
    awake = engine.serve("r3", ids)
    assert awake.offered == top_hit(engine, 70)
    assert awake.loaded_ok and awake.mismatched == 0
    engine.close()


def test_a_lookup_waits_for_a_promotion_in_flight(tmp_path: Path) -> None:
    writer = Engine(llama_like(), tmp_path)
    ids = tokens(70)
    writer.serve("r1", ids)
    writer.close()
    reader = Engine(llama_like(), tmp_path, probes=True)
    sched = reader.scheduler
    offered = sched.lookup("a", ids, 0)
    assert offered
    table = reader.allocate(len(ids), offered)
    sched.plan_load("a", table, offered)  # promotions reserved, not yet reported
    assert sched.lookup("b", ids, 0) is None  # ask again later: the chunks are on their way
    assert sched.figures()["deferred_lookups"] == 1
    reader.worker.submit(sched.take_orders(), JobKind.LOAD)
    reader.drain()
    assert sched.lookup("b", ids, 0) == offered  # now CPU hits
    reader.close()


# -- lower tiers, restarts, failures ---------------------------------------------------------
def test_a_new_process_loads_from_the_disk_the_last_one_wrote(
    layout: KVLayout, tmp_path: Path
) -> None:
    ids = tokens(70)
    first = Engine(layout, tmp_path)
    first.serve("r1", ids)
    first.close()
    second = Engine(layout, tmp_path, probes=True)
    served = second.serve("r1", ids)
    assert served.offered == top_hit(second, 70) and served.loaded_ok and served.mismatched == 0
    figures = second.scheduler.figures()
    assert figures["lower_hit_chunks"] > 0 and figures["cpu_hit_chunks"] == 0
    assert second.worker.engine.stats()["disk"].loads == figures["lower_hit_chunks"]
    worker = second.worker.figures()["tiers"]  # the connector's worker figures: the same record
    assert worker["disk"]["loads"] == figures["lower_hit_chunks"] == worker["cpu"]["misses"]
    assert second.serve("r2", ids).offered == served.offered  # promoted: CPU hits now
    assert second.scheduler.figures()["cpu_hit_chunks"] > 0
    second.close()


def test_corrupt_chunks_are_reported_and_recomputed(layout: KVLayout, tmp_path: Path) -> None:
    ids = tokens(70)
    first = Engine(layout, tmp_path)
    first.serve("r1", ids)
    first.close()
    for path in tmp_path.rglob("*.kv"):
        with path.open("r+b") as f:
            f.seek(4096 + 10)
            f.write(b"\x00\xff" * 8)
    second = Engine(layout, tmp_path, probes=True)
    served = second.serve("r1", ids)
    assert served.offered and not served.loaded_ok
    assert served.finished == {"r1"}  # reported finished, so vLLM resumes it
    if len(layout.groups) == 1:
        assert served.failed_blocks  # by block id: vLLM recomputes from the first one
        assert not served.failed_recving
    else:
        assert served.failed_recving == {"r1"} and not served.failed_blocks
    figures = second.scheduler.figures()
    assert figures["failed_loads"] == 1 and figures["loaded_tokens"] == 0
    assert figures["index_pinned"] == 0 and figures["index_storing"] == 0
    second.scheduler.index.check_integrity()
    # The recomputed chunks were stored again: the next request hits them, right.
    third = second.serve("r2", ids)
    assert third.loaded_ok and third.mismatched == 0
    second.close()


def test_chunks_that_lost_their_slot_are_failed_at_once(tmp_path: Path) -> None:
    ids = tokens(70)
    first = Engine(llama_like(), tmp_path)
    first.serve("r1", ids)
    first.close()
    reader = Engine(llama_like(), tmp_path, probes=True)
    sched = reader.scheduler
    offered_a, offered_b = sched.lookup("a", ids, 0), sched.lookup("b", ids, 0)
    assert offered_a and offered_a == offered_b  # asked before either was planned
    table_a, table_b = reader.allocate(70, offered_a), reader.allocate(70, offered_b)
    sched.plan_load("a", table_a, offered_a)
    order = sched.plan_load("b", table_b, offered_b)  # a's promotions hold every key
    assert order is not None and order.unloadable and not order.spans
    reader.worker.submit(sched.take_orders(), JobKind.LOAD)
    reader.drain()
    failed = reader.worker.take_failed_blocks()
    assert failed == set(order.unloadable[0])
    assert sched.figures()["unloadable_chunks"] == len(order.unloadable[0]) // 2
    reader.close()


# -- the protocol -----------------------------------------------------------------------------
def test_an_order_completes_when_every_rank_reported_it() -> None:
    engine = Engine(llama_like(), world_size=2)
    sched = engine.scheduler
    ids = tokens(40)
    table = engine.allocate(40, 0)
    engine.compute(table, ids, 0, 40)
    sched.plan_store("r", ids, computed=0, scheduled=40, block_ids=table, num_prompt_tokens=40)
    [order] = sched.take_orders()
    first_key = order.keys[0]
    sched.on_report(JobReport(order.job_id, 1, frozenset(), {}, {}))
    assert sched.figures()["jobs_in_flight"] == 1  # one rank is not enough
    assert sched.lookup("q", ids, 0) is None  # its chunks are still being stored
    sched.on_report(JobReport(order.job_id, 1, frozenset({first_key}), {}, {}))
    figures = sched.figures()
    assert figures["jobs_in_flight"] == 0
    assert figures["failed_store_chunks"] == 1  # failed on one rank: failed
    assert figures["stored_chunks"] == len(order.keys) - 1
    assert sched.lookup("q", ids, 0) == 0  # the chain starts with the failed chunk
    engine.close()


def test_reset_drops_cpu_chunks_and_preemption_forgets_validity() -> None:
    engine = Engine(llama_like())
    sched = engine.scheduler
    ids = tokens(40)
    engine.serve("r1", ids)
    assert sched.lookup("r2", ids, 0)
    assert sched.reset() and sched.lookup("r2", ids, 0) == 0
    events = sched.take_events()
    assert {e.kind.value for e in events} == {"stored", "removed"}
    # A preempted request's blocks hold nothing known: nothing below is stored again
    # until it is recomputed.
    table = engine.allocate(40, 0)
    engine.compute(table, ids, 0, 40)
    sched.plan_store("p", ids, computed=0, scheduled=16, block_ids=table, num_prompt_tokens=40)
    stored = len(sched.take_orders())
    sched.preempted("p")
    sched.plan_store("p", ids, computed=16, scheduled=24, block_ids=table, num_prompt_tokens=40)
    [order] = sched.take_orders()
    assert stored == 1
    blocks = [b for span in order.spans for b in span.blocks.block_ids]
    assert blocks and not set(blocks) & set(table[0][:4])  # the first 16 tokens' blocks
    engine.close()


def test_tokens_are_credited_to_the_tiers_their_chunks_came_from() -> None:
    """A load of chunks from two tiers splits its tokens by chunk count; shares add up."""
    from kvoffload.vllm._request import tier_shares

    assert tier_shares(96, ["cpu", "cpu", "disk"]) == {"cpu": 64, "disk": 32}
    assert tier_shares(100, ["cpu", "disk", "redis"]) == {"cpu": 33, "disk": 33, "redis": 34}
    assert tier_shares(10, []) == {} and tier_shares(0, ["cpu"]) == {}
    assert sum(tier_shares(1001, ["cpu"] * 7 + ["disk"] * 5).values()) == 1001
