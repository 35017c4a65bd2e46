"""The connector core's load and store plans end to end, on the :mod:`_stand` harness (no vLLM)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from _stand import (
    GEMMA,
    LLAMA,
    MODELS,
    PAGE,
    Model,
    Req,
    Stand,
    block_hashes,
    first_token,
    make_tokens,
    page,
    reference_hit,
)

from kvoffload import build_offloading_config
from kvoffload.config.layout import Reuse
from kvoffload.connector.scheduler import OffloadScheduler, StepRequest
from kvoffload.engine import ChunkSpan, JobStatus, OffloadEngine
from kvoffload.keys import namespace_of, prefix_keys_for_layout
from kvoffload.messages import BlockSpan, JobReport, merge_reports
from kvoffload.standin import NULL_BLOCK, expected_page
from kvoffload.transfer import allocate_kv_caches


def stored_keys(s: Stand, tokens: Sequence[int]) -> list[list[bytes]]:
    """Per group, the keys ``Stand.serve`` stores for ``tokens`` when nothing was stored.

    Every full chunk; of a recurrent group only the states where a step ended
    (vLLM's stop where a state can be kept, and the prompt's end).
    """
    keys = s.keys(tokens)
    out = []
    for g, group in enumerate(s.layout.groups):
        tpb = group.tokens_per_block
        span = tpb * s.model.bpc
        ends = {(len(tokens) - 1) // tpb * tpb, len(tokens)}
        out.append(
            [
                k
                for c, k in enumerate(keys[g])
                if group.reuse is not Reuse.STATE or (c + 1) * span in ends
            ]
        )
    return out


def assert_stored(s: Stand, tokens: Sequence[int]) -> None:
    for want, keys in zip(stored_keys(s, tokens), s.keys(tokens), strict=True):
        assert [k for k in keys if s.ready([k])[0]] == want


def needed_chunks(stand: Stand, req: Req) -> int:
    assert req.load is not None
    return len(req.load.keys) + sum(
        -(-len(ids) // stand.model.bpc) for ids in req.load.unloadable.values()
    )


# -- hits and loads ------------------------------------------------------------------------
@MODELS
@pytest.mark.parametrize(("chunks", "extra"), [(1, 8), (3, 0), (3, 5)])
@pytest.mark.parametrize("with_local", [False, True], ids=["no-local", "local"])
def test_a_stored_prefix_is_offered_aligned_and_loads_bit_exact(
    stand: Callable[..., Stand], model: Model, chunks: int, extra: int, with_local: bool
) -> None:
    s = stand(model)
    spans = [g.tokens_per_block * model.bpc for g in model.layout.groups]
    align = math.lcm(*spans)
    assert s.scheduler.alignment == align
    tokens = make_tokens(1, chunks * align + extra)
    first, _ = s.serve("a", tokens)
    assert first.offered == 0 and first.load is None  # an empty index offers nothing
    assert_stored(s, tokens)  # every full chunk (only the states that existed)

    local = math.lcm(*(g.tokens_per_block for g in model.layout.groups)) if with_local else 0
    want = (len(tokens) - 1) // align * align  # leaves at least one token to compute
    if want <= local:  # the engine's own hit covers every chunk a hit could load
        second, _ = s.serve("b", tokens, local_hit=local)
        assert second.offered == 0 and second.load is None
        return
    second, out = s.serve("b", tokens, local_hit=local)
    assert 0 < want < len(tokens) and second.hit == want
    assert second.offered == want - local
    blocks = sum(len(ids) for ids in second.load_ids.values())
    assert blocks > 0 and second.verified == blocks
    assert out.failed_blocks == set() and out.failed_recving == set()
    fig = s.scheduler.stats()
    assert fig["loaded_tokens"] == fig["hit_tokens"] == want - local
    assert (fig["loads"], fig["failed_loads"], fig["hit_requests"]) == (1, 0, 1)
    assert fig["cpu_hit_chunks"] == needed_chunks(s, second) and fig["lower_hit_chunks"] == 0
    s.check_integrity()


@MODELS
def test_lookup_is_free_of_side_effects(stand: Callable[..., Stand], model: Model) -> None:
    ta, tb, tc = make_tokens(1, 100), make_tokens(2, 100), make_tokens(3, 40)
    s = stand(model, cpu_chunks=1, policy="lru")
    capacity = sum(len(k) for k in [*stored_keys(s, ta), *stored_keys(s, tb)])
    s = stand(model, cpu_chunks=capacity, policy="lru")
    s.serve("a", ta)
    s.serve("b", tb)
    assert s.index.stats().free == 0
    s.scheduler.take_events()
    before = s.index.stats()
    answers = [s.scheduler.lookup("x", ta, 0) for _ in range(2)]
    assert answers[0] == answers[1] == reference_hit(model, len(ta), 0, lambda g, c: True) > 0
    assert s.index.stats() == before and before.pinned == 0
    assert s.scheduler.take_events() == [] and s.scheduler.take_orders() == []
    assert s.scheduler.stats()["jobs_in_flight"] == 0
    s.scheduler.request_finished("x")
    # Nor was the policy told: a's chunks are still the least recent, so c evicts them.
    s.serve("c", tc)
    a_keys, b_keys = stored_keys(s, ta), stored_keys(s, tb)
    assert all(all(s.ready(k)) for k in b_keys)
    assert not all(all(s.ready(k)) for k in a_keys)


def make_keys(model: Model, tokens: Sequence[int]) -> list[list[bytes]]:
    spans = [g.tokens_per_block * model.bpc for g in model.layout.groups]
    return prefix_keys_for_layout(
        tokens, spans, namespace_of("kvoffload-test", "bfloat16", model.layout)
    )


SLIDING = [0, 1, 2]
FULL = 3


@pytest.mark.parametrize(
    "nulled",
    [
        pytest.param({(g, c) for g in SLIDING for c in (0, 1)}, id="sliding-before-window"),
        pytest.param({(1, 2)}, id="sliding-inside-window"),
        pytest.param({(FULL, 5)}, id="full-in-the-middle"),
    ],
)
def test_hybrid_hits_need_the_window_before_the_hit_and_every_full_chunk(
    stand: Callable[..., Stand], nulled: set[tuple[int, int]]
) -> None:
    s = stand(GEMMA)
    tokens = make_tokens(7, 100)
    a = s.admit("a", tokens)
    assert a.offered == 0
    for g, c in nulled:  # the engine holds no KV for these chunks: they must not be stored
        lo, hi = c * GEMMA.bpc, (c + 1) * GEMMA.bpc
        s._free[g] += a.blocks[g][lo:hi]
        a.blocks[g][lo:hi] = [NULL_BLOCK] * (hi - lo)
    s.step([a])
    s.finish(a)
    keys = s.keys(tokens)
    for g, group_keys in enumerate(keys):
        assert s.ready(group_keys) == [(g, c) not in nulled for c in range(len(group_keys))]
    assert s.scheduler.stats()["skipped_store_chunks"] == len(nulled)

    want = reference_hit(GEMMA, len(tokens), 0, lambda g, c: (g, c) not in nulled)
    assert want > 0
    b, _ = s.serve("b", tokens)
    assert b.offered == want
    assert b.verified == sum(len(ids) for ids in b.load_ids.values())
    s.check_integrity()


def test_reference_hit_follows_the_window_rule() -> None:
    """The reference the hybrid test trusts, worked by hand for 100 tokens (hits on 32s).

    A hit at 96 needs sliding tokens [73, 96), i.e. only chunk 2 of each sliding group,
    so losing chunks 0 and 1 there costs nothing; a lost full chunk 5 (tokens [40, 48))
    leaves 32 as the longest hit that does not need it.
    """
    assert reference_hit(GEMMA, 100, 0, lambda g, c: g == FULL or c >= 2) == 96
    assert reference_hit(GEMMA, 100, 0, lambda g, c: (g, c) != (FULL, 5)) == 32


# -- what may be stored ----------------------------------------------------------------------
@pytest.mark.parametrize("local", [0, 16])
def test_stores_skip_sliding_blocks_a_load_did_not_fill(
    stand: Callable[..., Stand], local: int
) -> None:
    s = stand(GEMMA, null_window=False)
    tokens = make_tokens(8, 100)
    a = s.admit("a", tokens)
    early = {(g, c) for g in SLIDING for c in (0, 1)}
    for g, c in early:
        lo, hi = c * GEMMA.bpc, (c + 1) * GEMMA.bpc
        s._free[g] += a.blocks[g][lo:hi]
        a.blocks[g][lo:hi] = [NULL_BLOCK] * (hi - lo)
    s.step([a])
    s.finish(a)
    skipped = s.scheduler.stats()["skipped_store_chunks"]
    assert skipped == len(early)

    b = s.admit("b", tokens, local_hit=local)
    assert b.hit == reference_hit(GEMMA, 100, local, lambda g, c: (g, c) not in early)
    out = s.step()
    s.check_load(b, out)
    # b's sliding blocks between its local hit and the window are real, but hold nothing.
    for g in SLIDING:
        tpb = GEMMA.layout.groups[g].tokens_per_block
        first = first_token(GEMMA.layout.groups[g], local, b.hit) // tpb
        for blk in range(local // tpb, first):
            assert b.blocks[g][blk] != NULL_BLOCK and s.block_state(b, g, blk) == "scrub"
    s.step([b])
    s.finish(b)
    keys = s.keys(tokens)
    # Chunks not wholly inside a known-valid range were skipped, never stored.
    not_valid = 0
    for g in SLIDING:
        group = GEMMA.layout.groups[g]
        span = group.tokens_per_block * GEMMA.bpc
        valid_from = first_token(group, local, b.hit) // group.tokens_per_block
        valid_from *= group.tokens_per_block
        bad = [c for c in range(len(keys[g])) if c * span < valid_from and (c + 1) * span > local]
        not_valid += len(bad)
        assert not any(s.ready([keys[g][c] for c in bad]))
    assert not_valid > 0
    assert s.scheduler.stats()["skipped_store_chunks"] - skipped == not_valid
    s.check_integrity()


@MODELS
def test_preempted_forgets_what_its_blocks_held(stand: Callable[..., Stand], model: Model) -> None:
    s = stand(model)
    groups = model.layout.groups
    span = max(g.tokens_per_block for g in groups) * model.bpc
    cut = 2 * span + min(g.tokens_per_block for g in groups)  # inside some group's chunk
    tokens = make_tokens(9, 100)
    p = s.admit("p", tokens)
    s.step([p], until=cut)
    keys = s.keys(tokens)
    # The chunk that straddles ``cut`` in each group is not stored yet.
    straddling = [(g, cut // (grp.tokens_per_block * model.bpc)) for g, grp in enumerate(groups)]
    assert not any(s.ready([keys[g][c]])[0] for g, c in straddling)

    s.scheduler.preempted("p")
    s.free(p)
    p.blocks = s.alloc(len(tokens))  # new blocks, nothing recomputed into them
    skipped = s.scheduler.stats()["skipped_store_chunks"]
    nxt = min(-(-cut // (g.tokens_per_block * model.bpc)) * g.tokens_per_block * model.bpc
              for g in groups)  # fmt: skip
    step = StepRequest("p", tokens, cut, nxt - cut, p.blocks, len(tokens))
    assert s.scheduler.plan_step([step]) == []
    assert not any(s.ready([keys[g][c]])[0] for g, c in straddling)
    assert s.scheduler.stats()["skipped_store_chunks"] > skipped

    # Recomputed (re-admitted the way vLLM does after a preemption), it is stored again.
    s.scheduler.preempted("p")
    s.free(p)
    again, _ = s.serve("p", tokens)
    assert again.offered == reference_hit(
        model, len(tokens), 0, lambda g, c: (c + 1) * groups[g].tokens_per_block * model.bpc <= cut
    )
    assert all(all(s.ready(k)) for k in stored_keys(s, tokens))
    q, _ = s.serve("q", tokens)
    assert q.verified == sum(len(ids) for ids in q.load_ids.values()) > 0
    s.check_integrity()


# -- lower tiers -------------------------------------------------------------------------------
def serve_and_close(stand: Callable[..., Stand], model: Model, *prompts: list[int]) -> Stand:
    """Pair A: serve ``prompts`` with a disk tier, then shut down (files stay)."""
    a = stand(model, disk=True)
    for i, tokens in enumerate(prompts):
        a.serve(f"a{i}", tokens)
    a.check_integrity()
    a.close()
    return a


@MODELS
def test_warm_restart_serves_hits_from_disk(
    stand: Callable[..., Stand], model: Model, tmp_path: Path
) -> None:
    tokens = make_tokens(11, 100)
    a = serve_and_close(stand, model, tokens)
    assert any((tmp_path / "disk").rglob("*.kv"))
    blind = OffloadScheduler(a.config, a.namespace)  # no probe: the fresh CPU index knows nothing
    assert blind.lookup("x", tokens, 0) == 0

    b = stand(model, disk=True, probe=True)
    req, out = b.serve("b", tokens)
    want = reference_hit(model, len(tokens), 0, lambda g, c: True)
    assert req.offered == want > 0 and out.failed_blocks == set() and not out.failed_recving
    assert req.verified == sum(len(ids) for ids in req.load_ids.values())
    fig = b.scheduler.stats()
    n = needed_chunks(b, req)
    assert (fig["lower_hit_chunks"], fig["cpu_hit_chunks"], fig["loaded_tokens"]) == (n, 0, want)
    assert b.workers[0].engine.stats()["disk"].loads == n
    # Promoted into B's CPU tier: the next request is a CPU hit.
    again, _ = b.serve("c", tokens)
    assert again.offered == want and b.scheduler.stats()["cpu_hit_chunks"] == n
    b.check_integrity()


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(x ^ 0xFF for x in data[mid : mid + 16])
    path.write_bytes(bytes(data))


@MODELS
def test_corrupt_disk_chunks_fail_the_load_and_are_recomputed(
    stand: Callable[..., Stand], model: Model, tmp_path: Path
) -> None:
    tokens = make_tokens(12, 100)
    a = serve_and_close(stand, model, tokens)
    keys = a.keys(tokens)
    hit = reference_hit(model, len(tokens), 0, lambda g, c: True)
    corrupted: dict[int, list[int]] = {}  # group -> chunk indices
    for g, group in enumerate(model.layout.groups):
        span = group.tokens_per_block * model.bpc
        for c in range(first_token(group, 0, hit) // span, hit // span):
            if c % 2:
                [path] = (tmp_path / "disk").rglob(f"{keys[g][c].hex()}.kv")
                corrupt(path)
                corrupted.setdefault(g, []).append(c)
    assert corrupted

    b = stand(model, disk=True, probe=True)
    req = b.admit("b", tokens)
    assert req.offered == hit
    out = b.step()
    assert "b" in out.finished
    b.check_load(req, out)  # good chunks exact, corrupt ones never written
    bpc = model.bpc
    if len(model.layout.groups) == 1:
        want = {req.blocks[0][i] for c in corrupted[0] for i in range(c * bpc, (c + 1) * bpc)}
        assert out.failed_blocks == want and out.failed_recving == set()
    else:
        assert out.failed_recving == {"b"} and out.failed_blocks == set()
    fig = b.scheduler.stats()
    assert (fig["failed_loads"], fig["failed_load_tokens"], fig["loaded_tokens"]) == (1, hit, 0)
    disk = b.workers[0].stats()["tiers"]["disk"]
    assert disk["corrupt"] == sum(len(c) for c in corrupted.values())
    b.check_integrity()  # pins released, corrupt files dropped

    b.recover(req, out)
    b.step([req])
    b.finish(req)
    again, out2 = b.serve("c", tokens)
    assert again.offered == hit and out2.failed_blocks == set() and not out2.failed_recving
    assert again.verified == sum(len(ids) for ids in again.load_ids.values())
    assert b.scheduler.stats()["failed_loads"] == 1
    b.check_integrity()


@MODELS
def test_chunks_with_no_promotion_slot_are_unloadable(
    stand: Callable[..., Stand], model: Model
) -> None:
    t1, t2 = make_tokens(21, 100), make_tokens(22, 100)
    serve_and_close(stand, model, t1, t2)
    probe_only = stand(model, disk=True, probe=True)
    r = probe_only.admit("sizing", t1)
    room = needed_chunks(probe_only, r)
    probe_only.close()

    b = stand(model, disk=True, probe=True, cpu_chunks=room)
    r1, r2 = b.ask("r1", t1), b.ask("r2", t2)  # both offered: the CPU tier has room for one
    assert r1.offered == r2.offered == reference_hit(model, 100, 0, lambda g, c: True)
    b.allocate(r1)
    b.allocate(r2)  # r1's promotions took every slot
    assert r1.load is not None and r2.load is not None
    assert not r1.load.unloadable and r2.load.spans == ()
    assert {g: list(ids) for g, ids in r2.load.unloadable.items()} == r2.load_ids
    assert b.scheduler.stats()["unloadable_chunks"] == room

    first = b.step(wait=False)  # r2 fails at once, whatever r1's load is doing
    assert "r2" in first.finished
    if len(model.layout.groups) == 1:
        assert first.failed_blocks == set(r2.load_ids[0])
    else:
        assert first.failed_recving == {"r2"}
    out = first.merge(b.step())
    assert {"r1", "r2"} <= out.finished
    b.check_load(r1, out)
    assert r1.verified == sum(len(ids) for ids in r1.load_ids.values())
    b.check_load(r2, out)
    fig = b.scheduler.stats()
    assert (fig["loads"], fig["failed_loads"]) == (2, 1)
    for req in (r1, r2):
        b.recover(req, out)
    assert r2.computed == 0
    b.step([r1, r2])
    b.finish(r1)
    b.finish(r2)
    b.check_integrity()


def chunks_needed(model: Model, local: int, hit: int) -> int:
    """Chunks of every group a hit at ``hit`` needs beyond ``local``."""
    count = 0
    for group in model.layout.groups:
        span = group.tokens_per_block * model.bpc
        count += len(range(first_token(group, local, hit) // span, hit // span))
    return count


@pytest.mark.parametrize("model", [LLAMA, GEMMA], ids=lambda m: m.name)  # QWEN: one state
def test_lookup_offers_only_what_the_cpu_tier_can_stage(
    stand: Callable[..., Stand], model: Model
) -> None:
    tokens = make_tokens(23, 100)
    serve_and_close(stand, model, tokens)
    full = reference_hit(model, len(tokens), 0, lambda g, c: True)
    room = chunks_needed(model, 0, full) - 1  # one slot short of the longest hit
    b = stand(model, disk=True, probe=True, cpu_chunks=room)
    align = b.scheduler.alignment
    want = max(h for h in range(0, full, align) if chunks_needed(model, 0, h) <= room)
    assert 0 < want < full
    req, out = b.serve("b", tokens)
    assert req.offered == want and not out.failed_blocks and not out.failed_recving
    assert req.verified == sum(len(ids) for ids in req.load_ids.values())
    assert b.scheduler.stats()["unloadable_chunks"] == 0
    b.check_integrity()


# -- tensor parallel ---------------------------------------------------------------------------
def test_a_job_completes_once_every_rank_reported(stand: Callable[..., Stand]) -> None:
    s = stand(LLAMA, world_size=2)
    tokens = make_tokens(31, 37)
    a = s.admit("a", tokens)
    out = s.step([a], deliver=False)
    [[r0], [r1]] = out.reports
    keys = [k for group in s.keys(tokens) for k in group]
    assert r0.job_id == r1.job_id and r0.ok and r1.ok
    s.scheduler.on_report(r0)
    assert not any(s.ready(keys)) and s.index.stats().storing == len(keys)
    assert s.scheduler.stats()["jobs_in_flight"] == 1
    s.scheduler.on_report(r1)
    assert all(s.ready(keys)) and s.scheduler.stats()["stored_chunks"] == len(keys)
    s.finish(a)
    b, _ = s.serve("b", tokens)  # check_load verifies both ranks' tensors
    assert b.verified == sum(len(ids) for ids in b.load_ids.values()) > 0
    s.check_integrity()


def test_a_key_failed_on_one_rank_is_failed(stand: Callable[..., Stand]) -> None:
    s = stand(LLAMA, world_size=2)
    s.close_rank(1)  # rank 1 refuses every order
    tokens = make_tokens(32, 37)
    a = s.admit("a", tokens)
    out = s.step([a], deliver=False)
    [[r0], [r1]] = out.reports
    keys = [k for group in s.keys(tokens) for k in group]
    assert r0.ok and r1.failed_keys == frozenset(keys)
    merged = merge_reports(r0, r1)
    assert merged.workers == 2 and merged.failed_keys == frozenset(keys) and not merged.ok
    s.scheduler.on_report(r0)
    assert s.scheduler.stats()["jobs_in_flight"] == 1
    s.scheduler.on_report(r1)
    fig = s.scheduler.stats()
    assert (fig["stored_chunks"], fig["failed_store_chunks"]) == (0, len(keys))
    assert not any(s.ready(keys)) and s.scheduler.lookup("b", tokens, 0) == 0
    s.finish(a)
    s.scheduler.request_finished("b")
    s.check_integrity()


def test_merge_reports_unions_failures_and_counts_promotions() -> None:
    a = JobReport(7, 1, frozenset({b"k1"}), {b"p": 1, b"q": 1}, {0: frozenset({3})}, ("x",))
    b = JobReport(7, 1, frozenset({b"k2"}), {b"p": 1}, {0: frozenset({4}), 1: frozenset({5})})
    m = merge_reports(a, b)
    assert (m.job_id, m.workers, m.failed_keys) == (7, 2, frozenset({b"k1", b"k2"}))
    assert dict(m.promoted) == {b"p": 2, b"q": 1}
    assert dict(m.failed_blocks) == {0: frozenset({3, 4}), 1: frozenset({5})}
    assert m.errors == ("x",) and not m.ok


@pytest.mark.parametrize("model", [LLAMA, GEMMA], ids=lambda m: m.name)
def test_a_refused_load_reports_its_blocks(stand: Callable[..., Stand], model: Model) -> None:
    """Invariant 3: a load order the engine refuses still names its blocks (or its request)."""
    s = stand(model)
    tokens = make_tokens(33, 100)
    s.serve("a", tokens)
    b = s.admit("b", tokens)
    assert b.load is not None and b.load.spans
    s.close_rank(0)  # the next load order is refused
    out = s.step()
    assert "b" in out.finished
    if len(model.layout.groups) == 1:
        assert out.failed_blocks == set(b.load_ids[0])
    else:
        assert out.failed_recving == {"b"}
    assert s.scheduler.stats()["failed_loads"] == 1


# -- lifecycle --------------------------------------------------------------------------------
@MODELS
def test_reset_drops_unpinned_chunks_and_keeps_pinned_ones(
    stand: Callable[..., Stand], model: Model
) -> None:
    s = stand(model)
    ta, tc, td = make_tokens(41, 100), make_tokens(42, 100), make_tokens(43, 100)
    s.serve("a", ta)
    s.serve("c", tc)
    b = s.admit("b", ta)  # pins what its hit needs
    assert b.load is not None
    held = s.scheduler.take_orders()
    pinned = set(b.load.keys)
    assert s.index.stats().pinned == len(pinned) > 0
    s.scheduler.take_events()
    assert s.scheduler.reset()
    all_a = {k for group in stored_keys(s, ta) for k in group}
    all_c = {k for group in stored_keys(s, tc) for k in group}
    assert all(s.ready(sorted(pinned))) and not any(s.ready(sorted(all_c)))
    assert not any(s.ready(sorted(all_a - pinned)))
    removed = {e.key for e in s.scheduler.take_events()}
    assert removed == (all_a | all_c) - pinned
    assert s.scheduler.lookup("x", tc, 0) == 0  # no lower tier to fall back on
    s.scheduler.request_finished("x")

    # A store reuses the freed slots before b's load runs; b's pinned slots are not among them.
    d = s.admit("d", td)
    d_orders = s.step([d]).orders
    s.finish(d)
    d_slots = {slot for order in d_orders for span in order.spans for slot in span.slots}
    b_slots = {slot for span in b.load.spans for slot in span.slots}
    assert d_slots and not d_slots & b_slots
    out = s.step(held=held)
    assert "b" in out.finished
    s.check_load(b, out)
    assert b.verified == sum(len(ids) for ids in b.load_ids.values())
    s.step([b])
    s.finish(b)
    assert s.index.stats().pinned == 0 and all(s.ready(sorted(pinned)))
    s.scheduler.reset()  # nothing pinned now: everything goes
    assert s.index.stats().ready == 0 and s.scheduler.lookup("y", ta, 0) == 0
    s.scheduler.request_finished("y")
    s.check_integrity()


def test_lookup_defers_while_a_needed_store_is_in_flight(stand: Callable[..., Stand]) -> None:
    s = stand(LLAMA)
    tokens = make_tokens(51, 37)
    a = s.admit("a", tokens)
    out = s.step([a], deliver=False)  # stored by the worker, not yet reported
    assert s.scheduler.lookup("b", tokens, 0) is None
    assert s.scheduler.stats()["deferred_lookups"] == 1
    s.deliver(out)
    s.finish(a)
    assert s.scheduler.lookup("b", tokens, 0) == reference_hit(LLAMA, 37, 0, lambda g, c: True)
    s.scheduler.request_finished("b")
    s.check_integrity()


# -- engine blocks are free once the store read them ------------------------------------------
def test_wait_for_sources_frees_engine_blocks_before_the_store_ends(tmp_path: Path) -> None:
    layout = LLAMA.layout
    config = build_offloading_config(
        {"cpu_bytes_to_use": 16 * 1024, "blocks_per_chunk": 2, "disk_path": str(tmp_path),
         "disk_bytes_to_use": 1 << 20}, layout)  # fmt: skip
    namespace = namespace_of("kvoffload-test", "bfloat16", layout)
    kv = allocate_kv_caches(layout, 16)
    tokens = make_tokens(61, 16)
    source = [3, 9, 4, 1]
    hashes = block_hashes(layout, tokens)[0]
    for b, block in enumerate(source):
        for i, layer in enumerate(("l0", "l1")):
            page(kv, layer, block).copy_(expected_page(hashes[b], i, PAGE))
    original = {(layer, b): page(kv, layer, b).clone() for layer in ("l0", "l1") for b in source}
    keys = (b"chunk-zero", b"chunk-one")
    engine = OffloadEngine.from_config(config, kv, namespace)
    assert engine.wait_for_sources(timeout=60)  # nothing submitted: nothing to wait for
    engine.submit_store([ChunkSpan(0, keys, (0, 1), BlockSpan(tuple(source)))])
    assert engine.wait_for_sources(timeout=60)
    for layer, b in original:
        page(kv, layer, b).fill_(0x5A)  # the engine reuses the blocks at once
    assert engine.wait(timeout=60)
    [stored] = engine.get_finished()
    assert stored.status is JobStatus.SUCCESS and stored.done_keys == keys
    target = [11, 12, 13, 14]
    engine.submit_load([ChunkSpan(0, keys, (0, 1), BlockSpan(tuple(target)))])
    assert engine.wait(timeout=60)
    [loaded] = engine.get_finished()
    assert loaded.status is JobStatus.SUCCESS
    for layer in ("l0", "l1"):
        for src, dst in zip(source, target, strict=True):
            assert torch.equal(page(kv, layer, dst), original[(layer, src)])
    engine.close()
    # The disk copy was written from the CPU slot, not the reused blocks: a restart reads it.
    kv2 = allocate_kv_caches(layout, 16)
    engine2 = OffloadEngine.from_config(config, kv2, namespace)
    engine2.submit_load([ChunkSpan(0, keys, (5, 6), BlockSpan(tuple(target)))])
    assert engine2.wait(timeout=60)
    [promoted] = engine2.get_finished()
    assert promoted.status is JobStatus.SUCCESS and set(promoted.promoted_keys) == set(keys)
    for layer in ("l0", "l1"):
        for src, dst in zip(source, target, strict=True):
            assert torch.equal(page(kv2, layer, dst), original[(layer, src)])
    engine2.close()


@MODELS
def test_blocks_are_reusable_once_the_step_polled(
    stand: Callable[..., Stand], model: Model
) -> None:
    s = stand(model)
    tokens = make_tokens(62, 100)
    a = s.admit("a", tokens)
    out = s.step([a], wait=False, deliver=False)  # poll waited for the copies only
    used = [set(ids) for ids in a.blocks]
    s.finish(a)
    other = s.alloc(len(tokens) * 4)  # vLLM hands the freed blocks on: scrubbed at once
    assert all(used[g] <= set(ids) for g, ids in enumerate(other))
    rest = s.step(deliver=False)  # the stores' reports
    s.deliver(out.merge(rest))
    b, _ = s.serve("b", tokens)
    assert b.verified == sum(len(ids) for ids in b.load_ids.values()) > 0
    s.check_integrity()
