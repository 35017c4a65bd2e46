"""Disk-tier hits promoted into the CPU tier first, then loaded in their step, on a real engine.

With ``KVOFFLOAD_LOWER_TIER_HITS=promote`` a lookup whose hit needs chunks only
the disk holds orders them read into the CPU tier and answers "ask again"
(``None``); vLLM skips the request and asks at its next steps, and once the
chunks are in, the hit loads in the step that finds them, as a CPU-tier hit
(``kvoffload/connector/promotions.py``). A fresh process reads what an earlier
one stored: the tokens are vLLM's own cache's on the same prompts sent one at a
time, and every hit went that way. With every file damaged the promotion fails,
nothing damaged reaches vLLM, and vLLM computes the prompts itself.
"""

from __future__ import annotations

from pathlib import Path

from _harness import (
    ALONE,
    LLAMA_ENGINE,
    LLAMA_PROMPTS,
    Engine,
    Reference,
    alone_oracle,
    assert_same_output,
    connector_hit,
    llama_stored_on_disk,
    own_cache_alone_oracle,
)

PROMOTE = {"KVOFFLOAD_LOWER_TIER_HITS": "promote"}


def test_disk_hits_are_promoted_then_loaded_in_their_step(
    engine: Engine, reference: Reference, llama: str, tmp_path: Path
) -> None:
    spec, _ = llama_stored_on_disk(engine, reference, llama, tmp_path / "kv", 2)
    # A new process: only the disk has the chunks. A promotion is a timing, so the prompts
    # go one at a time (what a batch computes together would be one too).
    second = engine(**spec, passes=[ALONE], env=PROMOTE)
    assert_same_output(second, own_cache_alone_oracle(engine, llama, LLAMA_ENGINE, LLAMA_PROMPTS))
    assert second["passes"][0]["cached"] == [connector_hit(p, 64) for p in LLAMA_PROMPTS]
    scheduler, worker = second["stats"]["scheduler"], second["stats"]["worker"]
    assert scheduler["promotions"] > 0 and scheduler["failed_promoted_chunks"] == 0
    assert scheduler["promoted_chunks"] == worker["promoted_chunks"] > 0
    assert worker["tiers"]["disk"]["loads"] == worker["promoted_chunks"]
    # Every hit loaded in its step, counted once, and for the disk it came from.
    assert scheduler["in_step_hit_tokens"] == scheduler["hit_tokens"] == scheduler["loaded_tokens"]
    assert scheduler["hit_tokens_by_tier"].get("disk", 0) > 0
    assert worker["in_step_load_jobs"] == worker["load_jobs"] > 0
    assert scheduler["deferred_lookups"] >= scheduler["promotions"]
    assert scheduler["failed_loads"] == 0


def test_a_failed_promotion_leaves_vllm_to_compute(
    engine: Engine, reference: Reference, llama: str, tmp_path: Path
) -> None:
    spec, _ = llama_stored_on_disk(engine, reference, llama, tmp_path / "kv", 1)
    # The first prompt alone: computed when its promotion fails, a timing, it has no batch
    # to differ by (ALONE).
    first = LLAMA_PROMPTS[:1]
    passes = [{"corrupt": str(tmp_path / "kv"), "prompts": first}]
    result = engine(**spec, passes=passes, env=PROMOTE, failure_policy="recompute")
    assert result["passes"][0]["acted"]["corrupted_files"] > 0
    assert_same_output(result, alone_oracle(engine, llama, LLAMA_ENGINE, first))
    scheduler, worker = result["stats"]["scheduler"], result["stats"]["worker"]
    assert scheduler["promotions"] > 0 and scheduler["failed_promoted_chunks"] > 0
    assert worker["tiers"]["disk"]["corrupt"] > 0
    assert scheduler["loaded_tokens"] == 0  # every file was damaged: nothing was loaded
    assert result["passes"][0]["cached"][0] == 0
