"""The default policy: protocol, bounds, and that its admission filter and segment adapt.

Behaviour is checked on synthetic traces built so the right answer is known
(a scan that LRU cannot survive, a recency-friendly stream that a filter
hurts, reused keys behind a stream that only a protected segment keeps) and
on the real Mooncake trace against LRU.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import NamedTuple

import pytest

from kvoffload.errors import ConfigError, IntegrityError
from kvoffload.manager import OffloadIndex
from kvoffload.manager.policies._segmented import SegmentedLRU
from kvoffload.manager.policies.adaptive import GHOST, AdaptivePolicy, _Shadow
from kvoffload.manager.policies.admission import AdmissionFilter
from kvoffload.manager.policies.lru import LRUPolicy
from kvoffload.manager.policy import nothing_protected
from kvoffload.registry import DEFAULT_POLICY
from kvoffload.replay import Trace, block_key, drive, load_trace, replay

#: The first 3,000 requests of the Mooncake conversation trace (see tests/data/README.md).
CONVERSATION = Path(__file__).resolve().parent / "data" / "mooncake_conversation_3000.jsonl"


def scan_heavy(rounds: int = 30) -> Trace:
    """40 hot 4-block prefixes per round, interleaved with 400 never-reused blocks.

    A round touches 560 distinct blocks, so a 400-chunk LRU loses every hot
    prefix before its reuse; a filter keeps the 160 hot blocks.
    """
    requests: list[tuple[bytes, ...]] = []
    fresh = 10_000
    for _ in range(rounds):
        for conv in range(40):
            requests.append(tuple(block_key(conv * 10 + j) for j in range(4)))
            requests.append(tuple(block_key(fresh + j) for j in range(10)))
            fresh += 10
    return Trace("scan", tuple(requests))


def recency_friendly(conversations: int = 600) -> Trace:
    """Conversations of 6 turns, 3 open at a time, each turn adding 2 blocks.

    Every block is reused on the next turn, well inside a 400-chunk cache:
    LRU hits all but the new blocks, a second-sighting filter misses each once more.
    """
    rng = random.Random(7)
    requests: list[tuple[bytes, ...]] = []
    open_: list[list[int]] = []
    next_id, started = 0, 0
    while started < conversations or open_:
        if len(open_) < 3 and started < conversations:
            open_.append([])
            started += 1
        chain = rng.choice(open_)
        chain.extend((next_id, next_id + 1))
        next_id += 2
        requests.append(tuple(block_key(i) for i in chain))
        if len(chain) >= 12:
            open_.remove(chain)
    return Trace("recency", tuple(requests))


def hot_behind_a_stream(rounds: int = 12, hot: int = 120) -> Trace:
    """Each round reads every hot block twice, 9 requests apart, between 8 fresh blocks.

    Between two rounds 1,000+ other blocks pass, so an 800-chunk LRU hits each
    hot block's second read only; a protected segment keeps the hot blocks (hit
    once, they are protected) and hits both. One hot read in four also has a
    fresh block read twice around it, which a second-sighting filter misses and
    LRU and the segment's probation hit: so the segment beats the filter too.
    """
    rng = random.Random(3)
    requests: list[tuple[bytes, ...]] = []
    fresh = 1_000_000
    for _ in range(rounds):
        order = list(range(hot))
        rng.shuffle(order)
        for i, h in enumerate(order):
            requests.append((block_key(h),))
            requests.extend((block_key(fresh + j),) for j in range(8))
            fresh += 8
            twice = [(block_key(fresh),)] if i % 4 == 0 else []
            fresh += 1
            requests.extend([*twice, (block_key(h),), *twice])
    return Trace("hot", tuple(requests))


# -- protocol --------------------------------------------------------------------
def test_it_is_the_registered_default() -> None:
    assert DEFAULT_POLICY == "adaptive"
    assert isinstance(OffloadIndex(8).policy, AdaptivePolicy)


@pytest.mark.parametrize("capacity", [0, -1, True, 2.0])
def test_a_bad_capacity_is_refused(capacity: object) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        AdaptivePolicy(capacity)  # type: ignore[arg-type]


def test_evict_never_returns_protected_keys_and_stops_when_none_are_left() -> None:
    policy = AdaptivePolicy(8)
    keys = [block_key(i) for i in range(6)]
    for key in keys:
        policy.insert(key)
    protected = set(keys[::2])
    victims = policy.evict(10, protected.__contains__)
    assert victims == keys[1::2]  # oldest first, protected skipped, no more than exist
    assert len(policy) == 3
    assert policy.evict(1, protected.__contains__) == []
    assert policy.evict(0, lambda key: False) == []


def test_unknown_keys_are_ignored_and_reset_forgets_everything() -> None:
    policy = AdaptivePolicy(4)
    policy.touch(b"nope")
    policy.remove(b"nope")
    policy.insert(b"a")
    policy.touch(b"a")
    policy.remove(b"a")
    assert len(policy) == 0
    policy.insert(b"b")
    policy.reset()
    assert len(policy) == 0 and not policy.filtering
    policy.check_integrity(())


@pytest.mark.parametrize("seed", range(5))
def test_random_use_through_the_index_keeps_it_consistent(seed: int) -> None:
    """Pins, failed stores and evictions at every step; integrity checked after each."""
    rng = random.Random(seed)
    manager = OffloadIndex(12, "adaptive")
    for _ in range(400):
        keys = [block_key(rng.randrange(60)) for _ in range(rng.randrange(1, 6))]
        n = manager.lookup(keys)
        held = manager.prepare_load(keys[:n])
        store = manager.prepare_store(keys[n:])
        if store is not None:
            assert not set(store.evicted) & set(held.keys)  # pinned chunks survive
            if rng.random() > 0.1:
                manager.complete_store(store.keys)
            else:
                manager.abort_store(store.keys)
        manager.complete_load(keys[:n])
        manager.touch(keys[::-1])
        if rng.random() < 0.01:
            manager.reset()
        assert len(manager.policy) <= 12
        manager.check_integrity()


def test_ghosts_and_shadows_stay_bounded() -> None:
    policy = AdaptivePolicy(400)
    manager = OffloadIndex(400, policy, record_events=False)
    drive(manager, scan_heavy(10).requests)
    assert len(policy) <= 400
    assert len(policy._seen) <= GHOST * 400
    manager.check_integrity()  # the shadows' bounds, and the policy tracks the index's keys


@pytest.mark.parametrize("limit", [0, 5])
def test_a_shadow_hits_and_evicts_as_the_real_residents_would(limit: int) -> None:
    # The shadows write SegmentedLRU's rules out for speed: they must not drift from them.
    rng = random.Random(limit)
    shadow, real = _Shadow(20, protected_limit=limit), SegmentedLRU(20, limit)
    hits = 0
    for _ in range(3000):
        key = block_key(int(rng.paretovariate(1.2)) % 200)  # some keys far more often
        if real.hit(key):
            hits += 1
        else:
            if len(real) == 20:
                real.evict(1, nothing_protected)
            real.insert(key)
        shadow.request(key)
        assert (list(shadow.resident), list(shadow.protected)) == (
            list(real._probation),
            list(real._protected),
        )
    assert shadow.hits == hits > 0 and (limit == 0 or len(shadow.protected) == limit)


def test_check_integrity_reports_a_mismatch() -> None:
    policy = AdaptivePolicy(4)
    policy.insert(b"a")
    with pytest.raises(IntegrityError, match="tracks 1 keys"):
        policy.check_integrity(())


# -- behaviour ------------------------------------------------------------------------
class Served(NamedTuple):
    """Blocks hit by the adaptive policy, LRU and an always-on filter, and the policy."""

    adaptive: int
    lru: int
    always_filter: int
    policy: AdaptivePolicy


def serve(trace: Trace, capacity: int) -> Served:
    policy = AdaptivePolicy(capacity)
    filtered = AdmissionFilter(LRUPolicy(capacity), window=GHOST * capacity)
    return Served(
        drive(OffloadIndex(capacity, policy, record_events=False), trace.requests),
        replay(trace, capacity, "lru").hit_blocks,
        drive(OffloadIndex(capacity, filtered, record_events=False), trace.requests),
        policy,
    )


def test_on_a_scan_it_turns_the_filter_on_and_beats_lru() -> None:
    served = serve(scan_heavy(), 400)
    hot = 30 * 40 * 4
    assert served.policy.filtering and not served.policy.protecting
    assert served.lru == 0 and served.adaptive > 0.9 * hot


def test_on_a_recency_friendly_stream_it_stays_lru() -> None:
    served = serve(recency_friendly(), 400)
    assert not served.policy.filtering and not served.policy.protecting
    assert served.adaptive >= 0.98 * served.lru
    assert served.always_filter < 0.8 * served.lru  # the trace does punish a fixed filter


def test_where_reuse_hides_behind_a_stream_it_protects_and_beats_lru_and_the_filter() -> None:
    served = serve(hot_behind_a_stream(), 800)
    assert served.policy.protecting and not served.policy.filtering
    assert served.adaptive > 1.3 * served.lru and served.adaptive > 1.1 * served.always_filter
    assert served.always_filter > 1.1 * served.lru  # the filter would beat plain LRU


def test_on_the_real_trace_it_beats_lru_small_and_in_between_and_matches_it_large() -> None:
    trace = load_trace(CONVERSATION)
    ratios = {
        capacity: {p: replay(trace, capacity, p).hit_ratio for p in ("lru", "adaptive")}
        for capacity in (1000, 12000, 16000)
    }
    assert ratios[1000]["adaptive"] >= 1.5 * ratios[1000]["lru"]  # the filter
    assert ratios[12000]["adaptive"] >= 1.02 * ratios[12000]["lru"]  # the segment
    assert ratios[16000]["adaptive"] >= ratios[16000]["lru"]
