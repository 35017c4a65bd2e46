"""Prefix order, kept by the index whatever the policy (``kvoffload.manager._chains``).

A chunk whose descendants are present is not evicted before them, and a chunk that can no
longer be reached (its parent left the CPU tier) gives its room first. Every scenario runs
on a real index with every registered policy and admission-wrapped ones; the index-only
replay of the Mooncake slice keeps LRU's figures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from _stand import GEMMA, LLAMA, Model, Stand, make_tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.manager import (
    AdmissionFilter,
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    OffloadIndex,
    S3FIFOPolicy,
)
from kvoffload.manager._chains import NONE
from kvoffload.manager.policies.adaptive import AdaptivePolicy
from kvoffload.manager.usage import chain_parents, record_stores, record_use
from kvoffload.registry import POLICIES
from kvoffload.replay.loop import drive
from kvoffload.replay.trace import load_trace

SLICE = Path(__file__).parent / "data" / "mooncake_conversation_3000.jsonl"

FACTORIES: dict[str, Callable[[int], EvictionPolicy]] = {
    name: (lambda c, n=name: POLICIES.create(n, c)) for name in POLICIES.names()
}
FACTORIES["admit+lru"] = lambda c: AdmissionFilter(LRUPolicy(c))
FACTORIES["admit+arc"] = lambda c: AdmissionFilter(ARCPolicy(c))
FACTORIES["admit+s3fifo"] = lambda c: AdmissionFilter(S3FIFOPolicy(c))
FACTORIES["admit+adaptive"] = lambda c: AdmissionFilter(AdaptivePolicy(c))


@pytest.fixture(params=sorted(FACTORIES))
def make(request: pytest.FixtureRequest) -> Callable[[int], EvictionPolicy]:
    return FACTORIES[request.param]


def chain(name: int, n: int) -> list[bytes]:
    """``n`` chunks of one chain: each one's parent is the one before it."""
    return [bytes([name, i]) * 8 for i in range(n)]


def stored(m: OffloadIndex, keys: Sequence[bytes], whole: Sequence[bytes] | None = None) -> None:
    """Store ``keys`` (a run of the chain ``whole``, all of it by default) as the
    connector does: the index told each chunk's parent. Offered twice if an admission
    filter turns them away the first time."""
    whole = list(keys) if whole is None else list(whole)
    first = whole.index(keys[0])
    parents = chain_parents(whole, list(keys), first)
    for _ in range(2):
        result = m.prepare_store(list(keys), parents=parents)
        assert result is not None
        if result.keys:
            assert result.keys == tuple(keys)
            record_stores(m, whole, list(result.keys), first=first, linked=True)
            m.check_integrity()
            return
    raise AssertionError("the store was turned away twice")


def evict(m: OffloadIndex, name: int) -> tuple[bytes, ...]:
    """Store one new chunk of a chain of its own; what it evicted to make room."""
    new = chain(name, 1)
    for _ in range(2):
        result = m.prepare_store(new, parents=[None])
        assert result is not None
        if result.keys:
            m.complete_store(list(result.keys))
            m.check_integrity()
            return result.evicted
    raise AssertionError("the store was turned away twice")


def test_a_chain_whose_head_the_policy_ranks_first_loses_its_tail_first(
    make: Callable[[int], EvictionPolicy],
) -> None:
    # The tail is hit again and again (frequent for ARC, S3-FIFO and the adaptive
    # policy's shadows, newest for LRU); the head was used once. Every policy would
    # evict from the head; the index takes the tail, then the chunk that is a leaf next.
    m = OffloadIndex(3, make(3))
    a = chain(1, 3)
    stored(m, a)
    for _ in range(4):
        m.touch([a[2]])
    assert evict(m, 10) == (a[2],)
    assert evict(m, 11) == (a[1],)
    assert m.ready_mask(a) == [True, False, False]
    assert m.stats().interior_evictions == 0


def test_an_orphan_gives_its_room_before_any_reachable_chunk(
    make: Callable[[int], EvictionPolicy],
) -> None:
    m = OffloadIndex(5, make(5))
    a, b = chain(1, 3), chain(2, 2)
    stored(m, a)
    stored(m, b)
    assert m.discard([a[0]]) == [a[0]]  # a retention hint dropped the head: a[1:] orphaned
    for _ in range(4):  # the policy would keep them: hit again and again, and recent
        m.touch(a[:0:-1])
    m.check_integrity()
    assert evict(m, 10) == ()  # the free slot
    assert evict(m, 11) == (a[1],)  # the oldest orphan, before any chunk a hit reaches
    assert evict(m, 12) == (a[2],)  # an orphan in its turn, once its parent left
    assert m.stats().orphan_evictions == 2
    assert m.ready_mask(b) == [True, True]


def test_a_chunk_stored_after_an_absent_parent_is_an_orphan_from_the_start(
    make: Callable[[int], EvictionPolicy],
) -> None:
    m = OffloadIndex(3, make(3))
    a = chain(1, 3)
    stored(m, a[:1])
    stored(m, chain(2, 1))
    stored(m, a[2:], whole=a)  # a[1] is not in the CPU tier (the engine's cache held it)
    for _ in range(4):
        m.touch(a[:1:-1])
    assert m.stats().orphans == 1
    assert evict(m, 10) == (a[2],)
    assert m.stats().orphans == 0


def test_an_orphan_whose_parent_comes_back_is_reachable_again(
    make: Callable[[int], EvictionPolicy],
) -> None:
    m = OffloadIndex(4, make(4))
    a = chain(1, 3)
    stored(m, a)
    m.discard([a[1]])
    assert m.stats().orphans == 1
    stored(m, a[1:2], whole=a)  # stored again (a later request computed it)
    assert m.stats().orphans == 0
    m.check_integrity()


def test_with_every_leaf_pinned_the_fallback_still_makes_room(
    make: Callable[[int], EvictionPolicy],
) -> None:
    m = OffloadIndex(4, make(4))
    a = chain(1, 4)
    stored(m, a)
    m.prepare_load([a[3]])  # the only leaf is being loaded: it protects its ancestors
    evicted = evict(m, 10)
    assert len(evicted) == 1 and evicted[0] in a[:3]
    stats = m.stats()
    assert stats.interior_evictions == 1 and stats.orphans >= 1  # below it, unreachable
    m.complete_load([a[3]])
    assert evict(m, 11)[0] in a  # an orphan, before any other chunk
    assert m.stats().orphan_evictions == 1


def test_a_protected_leaf_does_not_expose_its_ancestors_while_another_leaf_can_go(
    make: Callable[[int], EvictionPolicy],
) -> None:
    m = OffloadIndex(5, make(5))
    a, b = chain(1, 3), chain(2, 2)
    stored(m, a)  # the older chain: what LRU would take first
    stored(m, b)
    held = m.hold([a[2]], limit=5)  # a queued request holds the tail
    assert held == [a[2]]
    evicted = evict(m, 10)
    assert evicted == (b[1],)  # the only leaf that can go; a[1] would orphan a[2]
    assert m.stats().interior_evictions == 0


def test_the_parent_of_a_chunk_in_flight_is_no_leaf(make: Callable[[int], EvictionPolicy]) -> None:
    # The connector links a store's chunks when it reserves them: their parent, already
    # here, is not evicted while they are copied, nor by their own store.
    m = OffloadIndex(4, make(4))
    a, b = chain(1, 3), chain(2, 1)
    stored(m, a[:2], whole=a)
    stored(m, b)
    for _ in range(4):
        m.touch([b[0]])
    evicted = ()
    for _ in range(2):
        result = m.prepare_store([a[2]], parents=[a[1]])
        assert result is not None
        if result.keys:
            evicted = result.evicted
            break
    assert evicted == ()  # a free slot
    assert evict(m, 10) == (b[0],)  # a[1] has a child in flight; a[0] a child
    m.check_integrity()


def test_record_stores_links_runs_and_stores_with_gaps() -> None:
    a = chain(1, 6)
    assert chain_parents(a, a[2:5], 2) == [a[1], a[2], a[3]]
    assert chain_parents(a, [a[0], a[2], a[5]], 0) == [None, a[1], a[4]]
    m = OffloadIndex(8, "lru", record_events=False)
    reserved = m.prepare_store(a[:2])
    assert reserved is not None
    record_stores(m, a, list(reserved.keys))
    reserved = m.prepare_store([a[3], a[4]])  # a[2] was turned away: a[3] is an orphan
    assert reserved is not None
    record_stores(m, a, list(reserved.keys))
    assert m.stats().orphans == 1
    m.check_integrity()


def test_the_index_only_replay_keeps_lrus_figures_on_the_mooncake_slice() -> None:
    # Measured before prefix order was kept by the index (kvoffload replay --index-only):
    # LRU keeps it on its own under the usage rules, so nothing of it may move.
    trace = load_trace(SLICE)
    for capacity, hits in ((4000, 7081), (16000, 20464)):
        m = OffloadIndex(capacity, "lru", record_events=False)
        assert drive(m, trace.requests) == hits
        stats = m.stats()
        assert stats.orphan_evictions == stats.interior_evictions == 0


def test_lru_ranks_each_parent_after_its_children_on_the_replays_loop() -> None:
    """Why LRU's victims are leaves: the usage rules rank a parent after its children."""
    trace = load_trace(SLICE, limit=600)
    m = OffloadIndex(300, "lru", record_events=False)
    for i, keys in enumerate(trace.requests):
        drive(m, [keys])
        if i % 25 == 0:
            assert_parents_newer(m)


#: Chain ``c`` shares its first ``SHARED[c]`` chunks with chain 0 (a prefix tree).
SHARED = (8, 2, 5, 0)


def chunk(c: int, i: int) -> bytes:
    return bytes([0 if i < SHARED[c] else c + 1, i]) * 8


#: A request: its chain and length, the chunks the engine's cache served, where its
#: stores split in two, whether the second completes first, whether one chunk's store
#: fails, whether its hit is pinned meanwhile, and a chunk of it a hint drops after.
REQUEST = st.tuples(
    st.integers(0, 3),
    st.integers(1, 8),
    st.integers(0, 8),
    st.integers(0, 8),
    st.booleans(),
    st.sampled_from([None, 0, 1, 2]),
    st.booleans(),
    st.sampled_from([None, 1, 3, 6]),
)


def serve(
    m: OffloadIndex, request: tuple[int, int, int, int, bool, int | None, bool, int | None]
) -> None:
    """One request through the usage rules, as the connector drives them."""
    c, length, served, split, reverse, fail, pin, drop = request
    keys = [chunk(c, i) for i in range(length)]
    n = m.ready_run(keys)
    if pin and n:
        m.prepare_load(keys[:n])
    record_use(m, keys, min(served, length))
    stores = []
    for part in (keys[n : max(n, split)], keys[max(n, split) :]):
        if not part:
            continue
        at = keys.index(part[0])
        result = m.prepare_store(part, parents=chain_parents(keys, part, at))
        if result is not None and result.keys:
            stores.append(list(result.keys))
    for done in stores[::-1] if reverse else stores:
        failed = [done[fail]] if fail is not None and fail < len(done) else []
        good = [k for k in done if k not in failed]
        record_stores(
            m, keys, good, failed, first=keys.index(good[0]) if good else None, linked=True
        )
    if pin and n:
        m.complete_load(keys[:n])
    if drop is not None and drop < length:
        m.discard([keys[drop]])
    m.check_integrity()


@pytest.mark.parametrize("name", ["lru", "admit+lru"])
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(REQUEST, min_size=1, max_size=40))
def test_an_order_keeping_policy_ranks_each_parent_after_its_children(
    name: str, requests: list[tuple[int, int, int, int, bool, int | None, bool, int | None]]
) -> None:
    """LRU under the usage rules, whatever happens between: stores over two steps,
    completed in either order, failed chunks, pins, the engine's own hits, chunks
    dropped by hints. So the index gives none of its victims back (``takes_back``)
    unless something protects a child."""
    m = OffloadIndex(10, FACTORIES[name](10), record_events=False)
    for request in requests:
        serve(m, request)
        assert_parents_newer(m)


def order_of(policy: EvictionPolicy) -> list[bytes]:
    """The order LRU evicts in, oldest first (changing nothing)."""
    inner = policy.inner if isinstance(policy, AdmissionFilter) else policy
    assert isinstance(inner, LRUPolicy)
    return list(inner._order)


def assert_parents_newer(m: OffloadIndex) -> None:
    """Every ready chunk whose parent is ready is older than it."""
    rank = {key: i for i, key in enumerate(order_of(m.policy))}
    chains, ready = m._chains, m._ready
    slot_key = {slot: key for key, slot in ready.items()}
    for key, slot in ready.items():
        above = chains.up[slot]
        if above >= 0 and above in slot_key:
            assert rank[slot_key[above]] > rank[key], "a parent older than its child"


def test_the_policies_that_take_a_victim_back_say_so() -> None:
    """``takes_back``: an insert after an eviction only ranks the key newest (LRU and the
    segmented LRU of the adaptive policy); ARC and S3-FIFO remember evicted keys."""
    names = {name for name, make in FACTORIES.items() if make(8).takes_back}
    assert names == {"lru", "adaptive", "admit+lru", "admit+adaptive"}


def test_use_then_store_keeps_a_request_ordered_for_any_policy(
    make: Callable[[int], EvictionPolicy],
) -> None:
    # The replay's loop on a request larger than the room left: its own head is not
    # what its store evicts (the lookup told the index where the chain continues).
    m = OffloadIndex(6, make(6))
    a, b = chain(1, 6), chain(2, 2)
    stored(m, b)
    stored(m, a[:3], whole=a)
    for _ in range(2):
        n = m.lookup(a)
        assert n == 3
        record_use(m, a)
        result = m.prepare_store(a[n:])
        assert result is not None
        if result.keys:
            assert set(result.evicted) <= set(b)
            record_stores(m, a, list(result.keys))
            break
    assert m.ready_mask(a) == [True] * 6
    m.check_integrity()


# -- through the connector: which chunks it links ----------------------------------------
@pytest.mark.parametrize("model", [LLAMA, GEMMA], ids=lambda m: m.name)
def test_the_connector_links_full_prefix_chains_and_no_window_chunk(
    stand: Callable[..., Stand], model: Model
) -> None:
    s = stand(model, retention_interval=0)
    prompt = make_tokens(1, 200)
    req, _ = s.serve("a", prompt)
    keys, ready, up = s.keys(req.tokens), s.index._ready, s.index._chains.up
    full = len(model.layout.groups) - 1  # the full-attention group: the last one
    chain_keys = keys[full]
    linked = [
        up[ready[key]] == ready[chain_keys[c - 1]]
        for c, key in enumerate(chain_keys)
        if c and key in ready and chain_keys[c - 1] in ready
    ]
    assert linked and all(linked)  # each stored chunk of the chain, to the one before it
    for group in range(full):  # window chunks: none is linked
        assert all(up[ready[key]] == NONE for key in keys[group] if key in ready)
    s.check_integrity()
