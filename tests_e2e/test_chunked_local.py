"""Chunked local attention (Llama-4) through KVOffloadConnector on a real vLLM engine.

vLLM keeps Llama-4's chunked layers as full attention unless
``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1``; with it, the tiny
model of ``_models.LLAMA4`` has three chunked-local groups (chunks of 256
tokens) and one full group. A hit at ``H`` then loads, of a chunked group,
only the blocks since ``H``'s attention chunk began (vLLM holds null blocks
before them), and of the full group everything: the tokens must be those of
vLLM without the connector, after its own prefix cache was reset.
"""

from __future__ import annotations

import pytest
from _harness import (
    TWO_PASSES,
    Engine,
    Reference,
    assert_same_output,
    connector_hit,
    negative_control,
    shared_prefix_prompts,
)
from test_connector import assert_served_by_connector

ENGINE = {"block_size": 32, "max_model_len": 4096}
#: Four and a half attention chunks: a hit lands in the fifth, past three freed chunks.
PROMPTS = shared_prefix_prompts(2, prefix_len=1100, suffix_len=20, vocab=512)


@pytest.mark.parametrize(
    ("blocks_per_chunk", "fault"), [(1, "load.corrupt_block"), (2, "load.wrong_block")]
)
def test_llama4_chunked_local_round_trip(  # noqa: PLR0917 - pytest passes fixtures, parameters
    engine: Engine,
    reference: Reference,
    llama4: str,
    blocks_per_chunk: int,
    fault: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Served exactly; with one loaded block of each group damaged (negative control), not."""
    monkeypatch.setenv("VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE", "1")
    expected = reference(llama4, ENGINE, PROMPTS)
    connector = {"blocks_per_chunk": blocks_per_chunk, "cpu_bytes_to_use": "256MiB"}
    spec = {"model": llama4, "engine": ENGINE, "prompts": PROMPTS, "passes": TWO_PASSES,
            "connector": connector}  # fmt: skip
    result = engine(**spec)
    assert result["kv_cache_groups"] == [32, 32, 32, 32]  # three chunked local, one full
    assert_served_by_connector(result, expected)
    hit = connector_hit(PROMPTS[0], 32 * blocks_per_chunk)
    assert hit > 4 * 256  # past four attention chunks
    assert result["passes"][1]["cached"][0] == hit
    negative_control(engine, lambda r: assert_same_output(r, expected), fault, **spec)
