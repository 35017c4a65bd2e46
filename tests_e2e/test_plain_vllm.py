"""The harness itself on plain vLLM (no connector): the references the other tests compare to.

The reference fixture checks that vLLM's prefix cache serves a repeated pass
and that ``llm.reset_prefix_cache()`` empties it; these tests add what the
scenarios rely on about each model.
"""

from __future__ import annotations

from _harness import (
    GEMMA_ENGINE,
    GEMMA_GROUPS,
    GEMMA_PROMPTS,
    LLAMA_ENGINE,
    LLAMA_PROMPTS,
    Engine,
    Reference,
)


def test_plain_llama_reference(reference: Reference, llama: str) -> None:
    result = reference(llama, LLAMA_ENGINE, LLAMA_PROMPTS)
    assert result["kv_cache_groups"] == [32]
    first, again, after_reset = result["passes"]
    # Prompts 1 and 2 share 9 full blocks with prompt 0; prompt 0 is all cached but one token.
    assert first["cached"] == [0, 288, 288]
    assert again["cached"][0] == 288
    assert after_reset["cached"] == [0, 288, 288]
    assert all(f == "length" for p in result["passes"] for f in p["finish"])


def test_plain_gemma4_reference(reference: Reference, gemma4: str) -> None:
    result = reference(gemma4, GEMMA_ENGINE, GEMMA_PROMPTS)
    # Four KV cache groups: three sliding-window ones, one full-attention one.
    assert result["kv_cache_groups"] == GEMMA_GROUPS
    first, again, after_reset = result["passes"]
    # The hybrid prefix cache hits at multiples of 512 tokens: 1024 of the 1100 shared.
    assert first["cached"] == [0, 1024, 1024]
    assert again["cached"][0] == 1024
    assert after_reset["cached"] == [0, 1024, 1024]


def test_plain_gemma4_default_block_size(engine: Engine, gemma4: str) -> None:
    result = engine(model=gemma4, engine={"max_model_len": 4096}, prompts=GEMMA_PROMPTS[:1])
    assert result["error"] is None, result["error"]
    assert result["kv_cache_groups"] == [2048, 2048, 2048, 128]
