"""The scheduler side's fast paths answer exactly as the general code they stand in for.

Four shortcuts keep the connector's per-step cost low on the common case: a
hit search for full-attention groups over the CPU tier alone (no lower tier
to ask), an admission asked once per store instead of once per chunk, a
request's chunks ranked by the policy in one call, and a one-group step whose
chunks are not made, stored and completed one by one. Each is checked here
against the general path on the same, real, index state.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

import pytest

from kvoffload import build_offloading_config
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.connector._request import add_range
from kvoffload.connector._search import HitFinder
from kvoffload.connector._spans import StorePiece, run_spans, store_spans
from kvoffload.connector.scheduler import OffloadScheduler, StepRequest
from kvoffload.keys import namespace_of
from kvoffload.manager import OffloadIndex
from kvoffload.manager.policies._segmented import SegmentedLRU
from kvoffload.manager.policies.adaptive import GHOST, AdaptivePolicy
from kvoffload.manager.policies.admission import AdmissionFilter
from kvoffload.manager.policies.lru import LRUPolicy
from kvoffload.manager.policy import EvictionPolicy, nothing_protected
from kvoffload.messages import JobReport, TransferOrder
from kvoffload.registry import POLICIES


class NoLowerTier:
    """A lower tier that holds nothing: the finder takes its general path, same answers."""

    name = "empty"

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [False] * len(keys)

    def close(self) -> None:
        return None


def index_with(rng: random.Random, keys: list[bytes], capacity: int) -> OffloadIndex:
    """An index holding a random mix of ``keys``: ready, being stored, pinned or absent."""
    index = OffloadIndex(capacity, LRUPolicy(capacity))
    for key in keys:
        roll = rng.random()
        stored = roll < 0.6 and index.prepare_store([key]) is not None  # None: no room
        if stored and roll < 0.45:
            index.complete_store([key])
            if roll < 0.05:
                index.prepare_load([key])
    return index


@pytest.mark.parametrize("seed", range(40))
def test_the_full_attention_search_finds_what_the_general_one_finds(seed: int) -> None:
    rng = random.Random(seed)
    spans = (rng.choice((4, 8)), 8) if seed % 2 else (rng.choice((4, 8)),)
    layout = KVLayout(tuple(CacheGroup("full", s, (f"l{g}",), 64) for g, s in enumerate(spans)))
    top = 96
    keys = [[os.urandom(16) for _ in range(top // s)] for s in spans]
    index = index_with(rng, [k for group in keys for k in group], rng.choice((6, 20, 60)))
    step = max(spans)
    for local in range(0, top, step):
        fast = HitFinder(layout, spans, index, (), alignment=step).longest(keys, local, top, {})
        general = HitFinder(layout, spans, index, (NoLowerTier(),), alignment=step)
        assert fast == general.longest(keys, local, top, {}), (seed, local)


def test_available_run_stops_at_the_first_missing_key() -> None:
    index = OffloadIndex(8, LRUPolicy(8))
    keys = [bytes([i]) * 16 for i in range(5)]
    assert index.prepare_store(keys[:3]) is not None
    index.complete_store(keys[:2])
    assert index.available_run(keys) == (3, True)  # two ready, one being stored, then none
    assert index.available_run(keys[:2]) == (2, False)
    assert index.available_run(keys[3:]) == (0, False)
    assert index.ready_mask(keys) == [True, True, False, False, False]  # a pure query


class KeyByKey(AdaptivePolicy):
    """The adaptive policy's admission rule as it reads, asked (ranked, inserted) one key at a
    time."""

    touch_many = EvictionPolicy.touch_many
    refresh_many = EvictionPolicy.refresh_many
    insert_many = EvictionPolicy.insert_many

    def admit_many(self, keys: Sequence[bytes]) -> list[bytes]:
        return [key for key in keys if self._admit_one(key)]

    def _admit_one(self, key: bytes) -> bool:
        self._observe(key)
        if key in self._seen:
            del self._seen[key]
            return True
        if not self.filtering or len(self) < self.capacity:
            return True
        self._seen[key] = None
        if len(self._seen) > GHOST * self.capacity:
            self._seen.popitem(last=False)
        return False


class KeyByKeyLRU(LRUPolicy):
    """LRU ranking and inserting one key at a time."""

    touch_many = EvictionPolicy.touch_many
    refresh_many = EvictionPolicy.refresh_many
    insert_many = EvictionPolicy.insert_many


@pytest.mark.parametrize("name", ["adaptive", "admission"])
def test_admitting_a_store_at_once_answers_as_key_by_key(name: str) -> None:
    # Two indexes take the same stores, one asking admission per store, one per key;
    # they must admit, evict and end up alike, shadows and ghosts included.
    rng = random.Random(7)
    capacity = 64
    # Keys from the seeded generator: with os.urandom's, one run in twelve never turned
    # the adaptive filter on, and the check that something was rejected failed.
    pool = [rng.randbytes(16) for _ in range(600)]
    if name == "adaptive":
        batched = OffloadIndex(capacity, AdaptivePolicy(capacity))
        keyed = OffloadIndex(capacity, KeyByKey(capacity))
    else:  # the default admit_many, over the filter's own admit
        batched = OffloadIndex(capacity, AdmissionFilter(LRUPolicy(capacity), sightings=2))
        keyed = OffloadIndex(capacity, AdmissionFilter(KeyByKeyLRU(capacity), sightings=2))
    for _ in range(400):
        store = rng.sample(pool, rng.randint(1, 12))
        results = [index.prepare_store(store) for index in (batched, keyed)]
        assert results[0] == results[1]
        if results[0] is not None:
            for index in (batched, keyed):
                index.complete_store(list(results[0].keys))
        touched, refreshed = rng.sample(pool, 5), rng.sample(pool, 5)
        for index in (batched, keyed):
            index.touch(touched)
            index.refresh(refreshed)
    assert batched.stats() == keyed.stats() and batched.stats().rejected > 0
    assert list(batched._ready) == list(keyed._ready)
    assert list(batched.policy.evict(capacity, lambda k: False)) == list(
        keyed.policy.evict(capacity, lambda k: False)
    )  # the same order, oldest first
    if name == "adaptive":
        a, b = batched.policy, keyed.policy
        assert isinstance(a, AdaptivePolicy) and isinstance(b, AdaptivePolicy)
        modes = [(list(p._seen), p.filtering, p.protecting) for p in (a, b)]
        assert modes[0] == modes[1]


def general_scheduler(sched: OffloadScheduler) -> OffloadScheduler:
    """``sched`` with its one-group shortcuts off: chunks chosen, stored, completed one by one,
    as a layout of several groups has them."""
    sched.retention.plain = False
    return sched


@pytest.mark.parametrize("seed", range(6))
def test_a_one_group_step_stores_and_completes_as_the_general_path(seed: int) -> None:
    # Two schedulers serve the same requests (shared prefixes, a tier too small for them,
    # stores reported late or failing in part); every order and the index's final state,
    # its policy's order and admission ghosts included, must be the same.
    rng = random.Random(seed)
    layout = KVLayout((CacheGroup("full", 4, ("a0",), 64),))
    chunk = layout.groups[0].chunk_bytes(2)
    config = build_offloading_config(
        {"blocks_per_chunk": 2, "cpu_bytes_to_use": 12 * chunk, "eviction_policy": "adaptive"},
        layout,
    )
    namespace = namespace_of("fast-paths", "bfloat16", layout)
    fast, general = (
        OffloadScheduler(config, namespace),
        general_scheduler(OffloadScheduler(config, namespace)),
    )
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.choice((16, 40)))] for _ in range(4)]
    late: list[tuple[TransferOrder, frozenset[bytes]]] = []
    short = False  # whether some step found the tier short of room (its chunks retried)

    def both(call: str, *args: object, **kwargs: object) -> object:
        answers = [getattr(s, call)(*args, **kwargs) for s in (fast, general)]
        assert answers[0] == answers[1], call
        return answers[0]

    def report(orders: list[TransferOrder]) -> None:
        for order in orders:  # some fail in part, some report steps late
            failed = frozenset(k for k in order.keys if rng.random() < 0.1)
            late.append((order, failed))
        if rng.random() < 0.6:  # none this step: stores in flight leave the tier short of room
            return
        rng.shuffle(late)
        for order, failed in [late.pop() for _ in range(rng.randint(0, len(late)))]:
            both("on_report", JobReport(order.job_id, 1, failed, {}, {}))

    for i in range(120):
        req = f"r{i}"
        ids = rng.choice(prefixes) + [rng.randrange(1, 500) for _ in range(rng.randint(0, 40))]
        table = [list(range(1 + i * 50, 1 + i * 50 + -(-len(ids) // 4)))]
        offered = both("lookup", req, ids, 0)
        external = offered or 0
        both("plan_load", req, table, external)
        report(both("take_orders"))  # type: ignore[arg-type]
        done = external
        while done < len(ids):
            n = min(len(ids) - done, rng.choice((4, 8, 13, 40)))
            step = StepRequest(req, ids, done, n, table, len(ids))
            report(both("plan_step", [step]))  # type: ignore[arg-type]
            short = short or any(r.retry[0] for r in fast.requests)
            done += n
        both("request_finished", req)
    report([])
    for order, failed in late:
        both("on_report", JobReport(order.job_id, 1, failed, {}, {}))
    assert fast.stats() == general.stats()
    assert fast.stats()["stored_chunks"] > 12 and fast.stats()["loads"] > 0 and short
    a, b = fast.index, general.index
    assert list(a._ready) == list(b._ready) and list(a._storing) == list(b._storing)
    assert isinstance(a.policy, AdaptivePolicy) and isinstance(b.policy, AdaptivePolicy)
    assert list(a.policy._probation) == list(b.policy._probation)
    assert list(a.policy._protected) == list(b.policy._protected)
    assert list(a.policy._seen) == list(b.policy._seen)


@pytest.mark.parametrize("seed", range(20))
def test_valid_ranges_merge_as_sets_of_tokens_would(seed: int) -> None:
    # add_range extends the last range at once (a step after the previous one); any other
    # range is merged in full. Either way the ranges are the runs of the tokens added.
    rng = random.Random(seed)
    ranges: list[tuple[int, int]] = []
    tokens: set[int] = set()
    end = 0
    for _ in range(60):
        # Mostly the next step (sometimes after a gap, sometimes overlapping), or anywhere.
        start = max(0, end + rng.randint(-3, 2)) if rng.random() < 0.7 else rng.randrange(200)
        stop = start + rng.randint(0, 12)
        add_range(ranges, start, stop)
        tokens.update(range(start, stop))
        end = max(end, stop)
        runs = [(t, t + 1) for t in sorted(tokens)]
        merged: list[tuple[int, int]] = []
        for lo, hi in runs:
            if merged and merged[-1][1] >= lo:
                merged[-1] = (merged[-1][0], hi)
            else:
                merged.append((lo, hi))
        assert ranges == merged


@pytest.mark.parametrize("name", [*POLICIES.names(), "slru"])
def test_evicting_with_nothing_protected_takes_what_asking_each_key_takes(name: str) -> None:
    # The index passes nothing_protected when no key is pinned or found; LRU then pops its
    # oldest at once. Every policy must pick the victims it picks when asked key by key
    # (slru: the adaptive policy's residents with their protected segment on).
    rng = random.Random(3)
    pool = [os.urandom(16) for _ in range(40)]

    def make() -> EvictionPolicy:
        return SegmentedLRU(16, 5) if name == "slru" else POLICIES.create(name, 16)

    fast, asked = make(), make()
    resident: list[bytes] = []
    for _ in range(300):
        key = rng.choice(pool)
        if key in resident:
            for policy in (fast, asked):
                policy.touch(key)
        elif len(resident) < 16:
            resident.append(key)
            for policy in (fast, asked):
                policy.insert(key)
        else:
            n = rng.randint(1, 4)
            victims = fast.evict(n, nothing_protected)
            assert victims == asked.evict(n, lambda key: False) and len(victims) == n
            resident = [k for k in resident if k not in victims]
    assert fast.evict(16, nothing_protected) == asked.evict(16, lambda key: False)


@pytest.mark.parametrize("seed", range(20))
def test_a_run_of_chunks_spans_as_its_pieces_do(seed: int) -> None:
    # run_spans makes a plain store's spans from its chunk indices (one run at once, else
    # cut where a chunk is missing); they must be store_spans' of the same chunks.
    rng = random.Random(seed)
    bpc = rng.choice((1, 2, 4))
    blocks = [rng.randrange(1, 1000) for _ in range(40 * bpc)]
    first = rng.randrange(0, 20)
    chunks = list(range(first, first + rng.randint(1, 20)))
    if seed % 2:  # admission turned some away
        chunks = sorted(rng.sample(chunks, rng.randint(1, len(chunks))))
    keys = [os.urandom(16) for _ in chunks]
    slots = [rng.randrange(100) for _ in chunks]
    pieces = [
        StorePiece(3, c, key, slot, tuple(blocks[c * bpc : (c + 1) * bpc]))
        for c, key, slot in zip(chunks, keys, slots, strict=True)
    ]
    spans = run_spans(3, chunks, keys, slots, blocks, blocks_per_chunk=bpc)
    assert spans == store_spans(pieces)
