"""Speculative decoding on a recurrent hybrid: a tiny Qwen3-Next with an MTP layer.

vLLM 0.32 groups the model's KV cache in align mode (prefix caching on) as two
gated-DeltaNet state groups with one speculative state block each
(``num_speculative_blocks``: the state after each draft position lives in one
of the request's trailing blocks) and one full-attention group that holds the
target's attention layer and the MTP layer's (``mtp.layers.0``) alike.

vLLM's CPU build cannot run this: with speculative decoding on a hybrid model
in align mode it copies states with Triton kernels
(``precopy_mamba_align_fused_kernel``), which fail on CPU in the first step.
Without prefix caching (no boundary states) the same engine runs and drafts,
so it is the align-mode state copy that fails, not MTP. With no engine to
compare against, the connector refuses the layout at start and says why;
these tests hold both facts, so a vLLM that runs it shows here first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _harness import Engine, shared_prefix_prompts
from _models_mtp import build_mtp

MTP = {"method": "mtp", "num_speculative_tokens": 1}
#: As test_recurrent.py's engine, with the MTP drafter.
ALIGN_MTP: dict[str, Any] = {
    "enable_prefix_caching": True,
    "mamba_cache_mode": "align",
    "max_model_len": 4096,
    "speculative_config": MTP,
}
PROMPTS = shared_prefix_prompts(3, prefix_len=1100, suffix_len=20, vocab=512)
DRAFTED = "vllm:spec_decode_num_draft_tokens"


@pytest.fixture(scope="module")
def qwen3_next_mtp(models: Path) -> str:
    return str(build_mtp(models / "qwen3_next_mtp"))


def test_vllm_cpu_runs_mtp_on_qwen3_next_only_without_boundary_states(
    engine: Engine, qwen3_next_mtp: str
) -> None:
    plain = {"enable_prefix_caching": False, "max_model_len": 4096, "speculative_config": MTP,
             "disable_log_stats": False}  # fmt: skip
    ran = engine(model=qwen3_next_mtp, engine=plain, prompts=PROMPTS, max_tokens=16)
    assert ran["error"] is None, ran["error"]
    assert ran["metrics"][DRAFTED] > 0
    # Align mode starts (no step yet): two state groups, and one attention group whose two
    # layers are the target's and the MTP layer's (without MTP: three state groups of one).
    started = engine(model=qwen3_next_mtp, engine=ALIGN_MTP, prompts=PROMPTS, passes=[])
    assert started["error"] is None, started["error"]
    assert len(set(started["kv_cache_groups"])) == 1 and len(started["kv_cache_groups"]) == 3
    state = started["kv_cache_state_bytes"]
    assert state[0] == state[1] > 0 and state[2] == 0, state
    # If this engine ever generates, lift the refusal (kvoffload/vllm/_layout.py
    # SPECULATIVE_STATE) and prove the connector against vLLM's own prefix cache here.
    with pytest.raises(AssertionError, match="precopy_mamba_align_fused_kernel") as failed:
        engine(model=qwen3_next_mtp, engine=ALIGN_MTP, prompts=PROMPTS, passes=[{}, {}])
    assert "TypeError: 'function' object is not subscriptable" in str(failed.value)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_the_connector_refuses_it_at_start_saying_why(
    engine: Engine, qwen3_next_mtp: str, blocks_per_chunk: int
) -> None:
    connector = {"blocks_per_chunk": blocks_per_chunk, "cpu_bytes_to_use": "64MiB"}
    result = engine(model=qwen3_next_mtp, engine=ALIGN_MTP, prompts=PROMPTS[:1],
                    connector=connector)  # fmt: skip
    error = result["error"]
    assert error is not None, "the engine started"
    assert "ConfigError" in error and "KVOffloadConnector cannot offload KV cache group" in error
    assert "speculative decoding (1 speculative state blocks)" in error
    assert "precopy_mamba_align_fused_kernel" in error
    assert "Run without speculative decoding" in error
