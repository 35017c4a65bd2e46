"""Misses by reason (kvoffload.connector.misses) on the connector core in the stand-in.

Each test builds the situation a reason names, with real parts (the index, the worker,
the stand-in's engine), and checks that the lookups' unserved tokens go to that reason
and to no other, and that the advice an operator gets names the setting to change.
"""

from __future__ import annotations

import logging

import pytest
from test_vllm_scheduler import Rig, gemma_like, llama_like, tokens

from kvoffload.connector.misses import MissLedger, MissReason
from kvoffload.keys import KeyExtras

PROMPT = 64  # tokens: 7 full chunks of 8 below the last token (one token is computed)
TOP = (PROMPT - 1) // 8 * 8


def misses(rig: Rig) -> tuple[dict[str, int], dict[str, int]]:
    figures = rig.scheduler.stats()
    return figures["miss_lookups_by_reason"], figures["miss_tokens_by_reason"]  # type: ignore[return-value]


def test_a_prompt_never_seen_misses_as_never_stored_and_a_full_hit_misses_nothing() -> None:
    rig = Rig(llama_like())
    rig.serve("a", tokens(PROMPT))
    assert misses(rig) == ({"never_stored": 1}, {"never_stored": TOP})
    served = rig.serve("again", tokens(PROMPT))
    assert served.loaded == TOP
    assert misses(rig) == ({"never_stored": 1}, {"never_stored": TOP})  # nothing new


def test_chunks_evicted_before_reuse_name_the_reuse_distance() -> None:
    # 8 CPU chunks, LRU: A's 7 chunks are gone once B and C are stored.
    rig = Rig(llama_like(), cpu_bytes_to_use=2048, eviction_policy="lru")
    assert rig.config.num_cpu_chunks == 8
    for seed in (1, 2, 3):
        rig.serve(f"r{seed}", tokens(PROMPT, seed))
    served = rig.serve("r1-again", tokens(PROMPT, 1))
    assert served.loaded == 0
    lookups, tokens_lost = misses(rig)
    assert lookups == {"never_stored": 3, "evicted": 1}
    assert tokens_lost["evicted"] == TOP
    # Evicted while B was stored, so at least the rest of B and all of C came after it:
    # a tier that much larger would have kept it.
    distance = rig.scheduler.stats()["reuse_distance_chunks"]
    assert 7 < distance <= 14 + 7  # type: ignore[operator]


def test_a_tenant_at_its_share_misses_as_tenant_share() -> None:
    rig = Rig(llama_like(), cpu_bytes_to_use=4096, eviction_policy="lru", tenant_cpu_share=0.5)
    salt = KeyExtras(salt="tenant-a")
    rig.serve("a1", tokens(PROMPT, 1), extras=salt)
    rig.serve("a2", tokens(PROMPT, 2), extras=salt)  # a's share (8 chunks) evicts a1's
    rig.serve("a1-again", tokens(PROMPT, 1), extras=salt)
    lookups, _ = misses(rig)
    assert lookups.get("tenant_share") == 1 and "evicted" not in lookups


def test_a_missing_window_chunk_misses_as_window_or_state() -> None:
    # No periodic hit points: the window chunks at the shared prefix's end were never kept,
    # though the full-attention chunks there were.
    rig = Rig(gemma_like(), retention_interval=0)
    shared = tokens(96, 1)
    rig.serve("a", shared + tokens(40, 2))
    rig.serve("b", shared + tokens(40, 3))
    lookups, lost = misses(rig)
    assert lookups == {"never_stored": 2, "window_or_state": 1}
    assert lost["window_or_state"] == 96
    # Stored at every boundary, the same prompts hit instead.
    every = Rig(gemma_like(), retention_interval=1)
    every.serve("a", shared + tokens(40, 2))
    assert every.serve("b", shared + tokens(40, 3)).loaded == 96
    assert "window_or_state" not in misses(every)[0]


def test_stores_never_loaded_back_warn_once_with_the_setting_to_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig(llama_like(), cpu_bytes_to_use=2048, eviction_policy="lru")
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        for i in range(160):  # three prompts in turn: each is evicted before it comes back
            rig.serve(f"r{i}", tokens(PROMPT, i % 3))
    warnings = [r.getMessage() for r in caplog.records if "none loaded back" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "raise cpu_bytes_to_use" in warnings[0] and "disk_path" in warnings[0]
    assert rig.scheduler.stats()["loaded_tokens"] == 0


def test_a_served_workload_never_warns(caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(llama_like())
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        for i in range(160):
            rig.serve(f"r{i}", tokens(PROMPT, i % 3))
    assert not [r for r in caplog.records if "none loaded back" in r.getMessage()]


def test_the_ledger_forgets_old_evictions_and_counts_nothing_for_nothing() -> None:
    ledger = MissLedger(capacity=2)  # keeps 8 eviction records
    ledger.evicted([bytes([i]) * 16 for i in range(20)], capped=1)
    assert ledger.stopped_at(bytes([0]) * 16) is MissReason.NEVER_STORED  # forgotten
    assert ledger.stopped_at(bytes([19]) * 16) is MissReason.EVICTED
    ledger.stored([bytes([19]) * 16])
    assert ledger.stopped_at(bytes([19]) * 16) is MissReason.NEVER_STORED  # stored again
    ledger.count(MissReason.EVICTED, 0)
    assert ledger.lookups == {} and ledger.tokens == {}
