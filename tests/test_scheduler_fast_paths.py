"""The scheduler side's fast paths answer exactly as the general code they stand in for.

Three shortcuts keep the connector's per-step cost low on the common case: a
hit search for full-attention groups over the CPU tier alone (no lower tier
to ask), an admission asked once per store instead of once per chunk, and a
one-group step whose chunks are not made one by one. Each is checked here
against the general path on the same, real, index state.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence

import pytest

from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.manager import OffloadManager
from kvoffload.manager.policies.adaptive import GHOST, AdaptivePolicy
from kvoffload.manager.policies.admission import AdmissionFilter
from kvoffload.manager.policies.lru import LRUPolicy
from kvoffload.vllm._hits import HitFinder


class NoLowerTier:
    """A lower tier that holds nothing: the finder takes its general path, same answers."""

    name = "empty"

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return [False] * len(keys)

    def close(self) -> None:
        return None


def index_with(rng: random.Random, keys: list[bytes], capacity: int) -> OffloadManager:
    """An index holding a random mix of ``keys``: ready, being stored, pinned or absent."""
    index = OffloadManager(capacity, LRUPolicy(capacity))
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
        fast = HitFinder(layout, spans, index, ()).find(keys, local, top, step)
        general = HitFinder(layout, spans, index, (NoLowerTier(),)).find(keys, local, top, step)
        assert fast == general, (seed, local)


def test_available_run_stops_at_the_first_missing_key() -> None:
    index = OffloadManager(8, LRUPolicy(8))
    keys = [bytes([i]) * 16 for i in range(5)]
    assert index.prepare_store(keys[:3]) is not None
    index.complete_store(keys[:2])
    assert index.available_run(keys) == (3, True)  # two ready, one being stored, then none
    assert index.available_run(keys[:2]) == (2, False)
    assert index.available_run(keys[3:]) == (0, False)
    assert index.ready_mask(keys) == [True, True, False, False, False]  # a pure query


class KeyByKey(AdaptivePolicy):
    """The adaptive policy's admission rule as it reads, asked one key at a time."""

    def admit_many(self, keys: Sequence[bytes]) -> list[bytes]:
        return [key for key in keys if self._admit_one(key)]

    def _admit_one(self, key: bytes) -> bool:
        self._observe(key)
        if key in self._seen:
            del self._seen[key]
            return True
        if not self.filtering or len(self._order) < self.capacity:
            return True
        self._seen[key] = None
        if len(self._seen) > GHOST * self.capacity:
            self._seen.popitem(last=False)
        return False


@pytest.mark.parametrize("name", ["adaptive", "admission"])
def test_admitting_a_store_at_once_answers_as_key_by_key(name: str) -> None:
    # Two indexes take the same stores, one asking admission per store, one per key;
    # they must admit, evict and end up alike, shadows and ghosts included.
    rng = random.Random(7)
    capacity = 64
    pool = [os.urandom(16) for _ in range(600)]
    if name == "adaptive":
        batched = OffloadManager(capacity, AdaptivePolicy(capacity))
        keyed = OffloadManager(capacity, KeyByKey(capacity))
    else:  # the default admit_many, over the filter's own admit
        batched = OffloadManager(capacity, AdmissionFilter(LRUPolicy(capacity), sightings=2))
        keyed = OffloadManager(capacity, AdmissionFilter(LRUPolicy(capacity), sightings=2))
    for _ in range(400):
        store = rng.sample(pool, rng.randint(1, 12))
        results = [index.prepare_store(store) for index in (batched, keyed)]
        assert results[0] == results[1]
        if results[0] is not None:
            for index in (batched, keyed):
                index.complete_store(list(results[0].keys))
        touched = rng.sample(pool, 5)
        for index in (batched, keyed):
            index.touch(touched)
    assert batched.stats() == keyed.stats() and batched.stats()["rejected"] > 0
    assert list(batched._ready) == list(keyed._ready)
    if name == "adaptive":
        a, b = batched.policy, keyed.policy
        assert isinstance(a, AdaptivePolicy) and isinstance(b, AdaptivePolicy)
        assert (list(a._seen), a.filtering) == (list(b._seen), b.filtering)
