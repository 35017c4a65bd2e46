"""Speculative decoding with the connector on a real engine: the drafter's KV is offloaded too.

With ``method: draft_model`` vLLM keeps the draft model's layers beside the
target's, in the target's KV cache group (the runner's engines show one
group); the connector stores and loads them in the same chunks. A store
covers only tokens the target computed, and vLLM runs the drafter before the
connector's ``wait_for_save``, so the drafter's KV of those tokens is final;
the positions a rejected draft rewrites lie past them.

The oracle is vLLM's own prefix cache with the same speculative settings:
after ``reset_prefix_cache()`` the connector must serve the history
(``num_cached_tokens > 0``), the tokens must be the reference's, and with a
drafter that agrees with the target, vLLM's accepted draft tokens must be
those of the reference too, which a drafter KV missing or stale after a hit
would lower.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _harness import (
    LLAMA_ENGINE,
    LLAMA_PROMPTS,
    Engine,
    assert_loaded_tokens_match,
    connector_hit,
    delta,
    own_cache_oracle,
    random_prompts,
)
from _models import LLAMA, build, build_draft

ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFTED = "vllm:spec_decode_num_draft_tokens"


@pytest.fixture(scope="module")
def drafts(models: Path) -> dict[str, str]:
    """Draft models for LLAMA: its own weights (``agreeing``), and a smaller random one."""
    return {
        "agreeing": str(build_draft(LLAMA, models / "draft_agreeing", same_weights=True)),
        "small": str(build_draft(LLAMA, models / "draft_small", same_weights=False)),
    }


def draft_engine(draft: str) -> dict[str, Any]:
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    return {**LLAMA_ENGINE, "speculative_config": spec, "disable_log_stats": False}


#: Prefill in steps of 128 tokens: the drafter runs on each step's part of the prompt too.
CHUNKED = {"max_num_batched_tokens": 128}


#: (drafter, blocks_per_chunk, more engine arguments).
CASES = [("agreeing", 1, {}), ("agreeing", 2, {}), ("small", 1, {}), ("agreeing", 1, CHUNKED)]


@pytest.mark.parametrize("case", CASES, ids=["bpc1", "bpc2", "small", "chunked-prefill"])
def test_draft_model_kv_is_offloaded_with_the_targets(
    engine: Engine, llama: str, drafts: dict[str, str], case: tuple[str, int, dict[str, Any]]
) -> None:
    draft, bpc, more = case
    args = {**draft_engine(drafts[draft]), **more}
    expected = own_cache_oracle(engine, llama, args)
    connector = {"blocks_per_chunk": bpc, "cpu_bytes_to_use": "64MiB"}
    result = engine(model=llama, engine=args, prompts=LLAMA_PROMPTS,
                    passes=[{}, {"reset": True}], connector=connector, max_tokens=32)  # fmt: skip
    assert result["error"] is None, result["error"]
    assert result["kv_cache_groups"] == [32], "the drafter's layers joined the target's group"
    for n in (0, 1):
        assert result["passes"][n]["tokens"] == expected["passes"][n]["tokens"], f"pass {n}"
    cached = result["passes"][1]["cached"]
    assert cached[0] == connector_hit(LLAMA_PROMPTS[0], 32 * bpc) > 0, cached
    assert_loaded_tokens_match(result, 1)
    assert result["stats"]["scheduler"]["failed_loads"] == 0
    drafted, accepted = result["metrics"].get(DRAFTED, 0), result["metrics"].get(ACCEPTED, 0)
    assert drafted > 0
    if draft == "agreeing":  # both passes: the first alike, so the second's are equal
        assert accepted == expected["metrics"][ACCEPTED] > 0.9 * drafted, (accepted, drafted)


def test_the_drafter_changes_the_key_namespace(
    engine: Engine, llama: str, drafts: dict[str, str], models: Path, tmp_path: Path
) -> None:
    """Chunks stored on disk with one drafter miss with another of the same shape."""
    other = str(build(LLAMA, models / "draft_other", seed=2))
    disk = {"cpu_bytes_to_use": "64MiB", "disk_path": str(tmp_path / "kv"),
            "disk_bytes_to_use": "64MiB"}  # fmt: skip
    prompts = LLAMA_PROMPTS[:1]
    first = engine(model=llama, engine=draft_engine(drafts["agreeing"]), prompts=prompts,
                   connector=disk, max_tokens=8)  # fmt: skip
    assert first["error"] is None, first["error"]
    assert first["stats"]["scheduler"]["stored_chunks"] > 0
    for draft, hit in ((drafts["agreeing"], connector_hit(prompts[0], 32)), (other, 0)):
        again = engine(model=llama, engine=draft_engine(draft), prompts=prompts,
                       connector=disk, max_tokens=8)  # fmt: skip
        assert again["error"] is None, again["error"]
        assert again["passes"][0]["cached"] == [hit], draft


def test_ngram_drafting_hits_and_generates_the_same_tokens(engine: Engine, llama: str) -> None:
    """ngram drafting keeps no drafter KV: the same hits and tokens as without it."""
    motif = random_prompts(1, 20, 512, seed=9)[0]
    prompt = (motif * 15)[:290]  # repetitive: the n-gram drafter finds proposals
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}  # fmt: skip
    args = {**LLAMA_ENGINE, "speculative_config": spec, "disable_log_stats": False}
    connector = {"blocks_per_chunk": 1, "cpu_bytes_to_use": "64MiB"}
    result = engine(model=llama, engine=args, prompts=[prompt], passes=[{}, {"reset": True}],
                    connector=connector, max_tokens=32)  # fmt: skip
    assert result["error"] is None, result["error"]
    base = engine(model=llama, engine=LLAMA_ENGINE, prompts=[prompt], max_tokens=32)
    assert base["error"] is None, base["error"]  # no connector, no speculative decoding
    for done in result["passes"]:
        assert done["tokens"] == base["passes"][0]["tokens"]
    assert result["passes"][1]["cached"] == [connector_hit(prompt, 32)]
    assert delta(result, 1, "scheduler", "loaded_tokens") == connector_hit(prompt, 32)
    assert result["metrics"].get(DRAFTED, 0) > 0 and result["metrics"].get(ACCEPTED, 0) > 0
