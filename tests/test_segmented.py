"""Segmented LRU, the adaptive policy's residents: LRU exactly without a segment, and what
the protected segment keeps with one (the protocol itself: tests/test_policies.py)."""

from __future__ import annotations

import random

import pytest

from kvoffload.errors import ConfigError, IntegrityError
from kvoffload.manager import LRUPolicy
from kvoffload.manager.policies._segmented import SegmentedLRU
from kvoffload.replay import block_key

K = [block_key(i) for i in range(40)]


def never(key: bytes) -> bool:
    return False


def eviction_order(policy: SegmentedLRU | LRUPolicy) -> list[bytes]:
    return policy.evict(len(policy), never)


def fill(policy: SegmentedLRU, keys: list[bytes]) -> None:
    for key in keys:
        policy.insert(key)


@pytest.mark.parametrize("seed", range(8))
def test_without_a_segment_it_is_lru_exactly(seed: int) -> None:
    rng = random.Random(seed)
    segmented, lru = SegmentedLRU(12), LRUPolicy(12)
    resident: set[bytes] = set()
    for _ in range(500):
        key, op = rng.choice(K), rng.random()
        if op < 0.3 and key not in resident and len(resident) < 12:
            resident.add(key)
            for p in (segmented, lru):
                p.insert(key)
        elif op < 0.55:
            for p in (segmented, lru):
                p.touch(key)
        elif op < 0.7:
            keys = [key, rng.choice(K)]
            for p in (segmented, lru):
                p.refresh_many(keys)
        elif op < 0.75:
            resident.discard(key)
            for p in (segmented, lru):
                p.remove(key)
        else:
            n, pinned = rng.randint(0, 3), set(rng.sample(K, 5))
            victims = segmented.evict(n, pinned.__contains__)
            assert victims == lru.evict(n, pinned.__contains__)
            resident -= set(victims)
        segmented.check_integrity(resident)
    assert eviction_order(segmented) == eviction_order(lru)


def test_a_key_that_was_hit_outlives_a_stream_of_new_ones() -> None:
    policy, lru = SegmentedLRU(10, protected_limit=3), LRUPolicy(10)
    for p in (policy, lru):
        p.insert(K[0])
        p.insert(K[1])
        p.touch(K[0])  # a hit: protected
        for key in K[2:20]:  # a stream longer than the cache, one key evicted per key stored
            if len(p) == 10:
                p.evict(1, never)
            p.insert(key)
    assert K[0] in eviction_order(policy)
    assert K[0] not in eviction_order(lru) and K[1] not in eviction_order(lru)


def test_the_segment_overflows_oldest_first_into_the_newest_end_of_probation() -> None:
    policy = SegmentedLRU(8, protected_limit=2)
    fill(policy, K[:4])
    for key in K[:3]:
        policy.touch(key)  # K[0] is pushed out of the segment by K[2]
    assert eviction_order(policy) == [K[3], K[0], K[1], K[2]]


def test_a_chain_touched_tail_first_keeps_its_head_longest() -> None:
    # A request's chunks are touched tail first (kvoffload.manager.usage): when the segment
    # cannot hold the chain, its tail goes back to probation and is evicted first.
    policy = SegmentedLRU(8, protected_limit=2)
    chain = K[:4]
    fill(policy, chain)
    policy.touch_many(chain[::-1])
    assert eviction_order(policy) == [chain[3], chain[2], chain[1], chain[0]]


def test_refresh_and_insert_never_protect() -> None:
    policy = SegmentedLRU(8, protected_limit=4)
    fill(policy, K[:3])
    policy.refresh(K[0])
    policy.refresh_many([K[1], K[30]])  # an unknown key is ignored
    assert policy._protected == {}
    policy.touch(K[2])
    policy.refresh(K[2])  # stays in its segment
    assert list(policy._protected) == [K[2]]
    assert eviction_order(policy) == [K[0], K[1], K[2]]


def test_turning_the_segment_off_sends_every_key_back_to_probation_oldest_first() -> None:
    policy = SegmentedLRU(8, protected_limit=4)
    fill(policy, K[:4])
    policy.touch(K[1])
    policy.touch(K[0])
    policy.protect(0)
    assert policy._protected == {}
    policy.touch(K[2])  # LRU from here: a hit moves within probation
    assert policy._protected == {}
    assert eviction_order(policy) == [K[3], K[1], K[0], K[2]]


def test_eviction_takes_probation_first_and_skips_pinned_keys_in_both() -> None:
    policy = SegmentedLRU(8, protected_limit=3)
    fill(policy, K[:6])
    for key in K[:3]:
        policy.touch(key)
    pinned = {K[3], K[1]}
    assert policy.evict(3, pinned.__contains__) == [K[4], K[5], K[0]]
    assert policy.evict(5, pinned.__contains__) == [K[2]]
    policy.check_integrity(pinned)


def test_a_bad_limit_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"protected_limit must be in \[0, 4\], got 5"):
        SegmentedLRU(4, protected_limit=5)
    with pytest.raises(ConfigError, match="got -1"):
        SegmentedLRU(4).protect(-1)


def test_check_integrity_reports_an_overfull_or_doubled_segment() -> None:
    policy = SegmentedLRU(4, protected_limit=1)
    fill(policy, K[:2])
    policy.touch(K[0])
    policy._protected[K[1]] = None  # what a bug would leave: over the limit and in both
    with pytest.raises(IntegrityError, match=r"2 protected keys \(limit 1\), 1 also on probation"):
        policy.check_integrity(K[:2])
