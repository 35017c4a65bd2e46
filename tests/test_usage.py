"""The order a request's uses and stores reach the index (``kvoffload.manager.usage``).

The index's own order is read back through eviction: what goes first is the
least recent. ``refresh`` ranks like ``touch`` for recency, and is no hit for
the policies that count hits.
"""

from __future__ import annotations

import pytest

from kvoffload.errors import ProtocolError
from kvoffload.manager import ARCPolicy, OffloadIndex
from kvoffload.manager.policies.adaptive import AdaptivePolicy
from kvoffload.manager.usage import record_stores, record_use


def key(i: int) -> bytes:
    return i.to_bytes(8, "big")


def stored(m: OffloadIndex, keys: list[bytes]) -> None:
    result = m.prepare_store(keys)
    assert result is not None and result.keys == tuple(keys)
    m.complete_store(keys)


def eviction_order(m: OffloadIndex) -> list[bytes]:
    """Every ready key, least recent first, without changing anything that stays."""
    order = m.policy.evict(len(m.policy), lambda _: False)
    for k in order:
        m.policy.insert(k)
    return order


def test_a_request_ends_head_newest_however_many_steps_its_stores_took() -> None:
    m = OffloadIndex(8, "lru", record_events=False)
    chain = [key(i) for i in range(6)]
    stored(m, [key(100), key(101)])  # older chunks of another request
    stored(m, chain[:2])  # the request's hit prefix, already there
    record_use(m, chain)
    for batch in (chain[2:4], chain[4:]):  # two steps of chunked prefill
        reserved = m.prepare_store(batch)
        assert reserved is not None
        record_stores(m, chain, list(reserved.keys))
    assert eviction_order(m) == [key(100), key(101), *chain[::-1]]


def test_a_store_that_knows_its_place_in_the_chain_ranks_alike() -> None:
    # The connector passes where the first stored chunk stands instead of searching the
    # chain for it; the order must be the same, and a wrong place is refused, not used.
    orders = []
    for known in (False, True):
        m = OffloadIndex(8, "lru", record_events=False)
        chain = [key(i) for i in range(6)]
        stored(m, [key(100), *chain[:2]])
        reserved = m.prepare_store(chain[2:5])
        assert reserved is not None
        record_stores(m, chain, list(reserved.keys), first=2 if known else None)
        orders.append(eviction_order(m))
    assert orders[0] == orders[1] == [key(100), *chain[4::-1]]
    reserved = m.prepare_store(chain[5:])
    assert reserved is not None
    with pytest.raises(ProtocolError, match="not chunk 4 of the chain"):
        record_stores(m, chain, list(reserved.keys), first=4)
    assert m.stats().storing == 1  # nothing completed


def test_failed_stores_free_their_slots_and_change_no_order() -> None:
    m = OffloadIndex(4, "lru", record_events=False)
    chain = [key(i) for i in range(3)]
    reserved = m.prepare_store(chain)
    assert reserved is not None
    record_stores(m, chain, chain[:2], [chain[2]])
    assert m.stats().free == 2 and eviction_order(m) == [chain[1], chain[0]]


def test_the_engines_own_hits_rank_as_recent_but_are_no_hits_of_the_tier() -> None:
    policy = AdaptivePolicy(64)
    m = OffloadIndex(64, policy, record_events=False)
    chain = [key(i) for i in range(8)]  # crc32 samples some of them into the shadows
    stored(m, chain)
    stored(m, [key(50)])

    def shadow_hits() -> list[float]:
        return [s.hits for s in (policy._lru, policy._filtered, policy._segmented)]

    shadows = shadow_hits()
    record_use(m, chain, served=len(chain))  # all served by the engine's prefix cache
    assert shadow_hits() == shadows
    assert eviction_order(m) == [key(50), *chain[::-1]]
    record_use(m, chain)  # loaded from this tier: hits
    assert all(after > before for after, before in zip(shadow_hits(), shadows, strict=True))


def test_refresh_moves_an_arc_key_to_the_front_of_its_own_list_only() -> None:
    arc = ARCPolicy(4)
    for k in (key(1), key(2)):
        arc.insert(k)
    arc.refresh(key(1))
    assert arc.sizes()["t2"] == 0  # no promotion: a refresh is not a second use
    assert arc.evict(1, lambda _: False) == [key(2)]
    arc.touch(key(1))
    assert arc.sizes()["t2"] == 1
