"""Speculative decoding on a recurrent hybrid: a tiny Qwen3-Next with an MTP layer.

vLLM 0.32 groups the model's KV cache in align mode (prefix caching on) as two
gated-DeltaNet state groups with one speculative state block each
(``num_speculative_blocks``: the state after each draft position lives in one
of the request's trailing blocks) and one full-attention group that holds the
target's attention layer and the MTP layer's (``mtp.layers.0``) alike.

vLLM's CPU build copies those states with a Triton kernel
(``precopy_mamba_align_fused_kernel``) and has no Triton: the engine fails in
its first step. Under Triton's interpreter (``_triton_interp.py``) it runs,
and generates the tokens of the same engine without prefix caching. The
connector is then held to vLLM's own prefix cache with the same speculative
settings and ``disable_eagle_block_drop`` (see ``test_eagle.py``): tokens,
logprobs, hits and accepted draft tokens. The drafter is random, so few drafts
are accepted: these runs prove the states at prefill boundaries and at a
boundary crossed while decoding, not a state moved by an accepted draft.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _harness import Engine, assert_loaded_tokens_match, differences, shared_prefix_prompts
from _models_mtp import build_mtp
from _triton_interp import interpreter_env

MTP = {"method": "mtp", "num_speculative_tokens": 1}
#: As test_recurrent.py's engine, with the MTP drafter.
ALIGN_MTP: dict[str, Any] = {
    "enable_prefix_caching": True,
    "mamba_cache_mode": "align",
    "max_model_len": 4096,
    "speculative_config": MTP,
    "disable_log_stats": False,
}
#: vLLM's own cache as the oracle: hits end where the connector's do.
ORACLE = {**ALIGN_MTP, "speculative_config": {**MTP, "disable_eagle_block_drop": True}}
PROMPTS = shared_prefix_prompts(3, prefix_len=1100, suffix_len=20, vocab=512)
DRAFTED = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


@pytest.fixture(scope="module")
def qwen3_next_mtp(models: Path) -> str:
    return str(build_mtp(models / "qwen3_next_mtp"))


@pytest.fixture(scope="module")
def interpret(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return interpreter_env(tmp_path_factory.mktemp("triton_cpu"))


def test_vllm_cpu_runs_it_under_tritons_interpreter_only(
    engine: Engine, qwen3_next_mtp: str, interpret: dict[str, str]
) -> None:
    plain = {**ALIGN_MTP, "enable_prefix_caching": False}
    del plain["mamba_cache_mode"]
    cold = engine(model=qwen3_next_mtp, engine=plain, prompts=PROMPTS, max_tokens=16)
    assert cold["error"] is None, cold["error"]
    assert cold["metrics"][DRAFTED] > 0
    # Align mode starts (no step yet): two state groups, and one attention group whose two
    # layers are the target's and the MTP layer's (without MTP: three state groups of one).
    started = engine(model=qwen3_next_mtp, engine=ALIGN_MTP, prompts=PROMPTS, passes=[])
    assert started["error"] is None, started["error"]
    assert len(set(started["kv_cache_groups"])) == 1 and len(started["kv_cache_groups"]) == 3
    state = started["kv_cache_state_bytes"]
    assert state[0] == state[1] > 0 and state[2] == 0, state
    with pytest.raises(AssertionError, match="precopy_mamba_align_fused_kernel") as failed:
        engine(model=qwen3_next_mtp, engine=ALIGN_MTP, prompts=PROMPTS, passes=[{}])
    assert "TypeError: 'function' object is not subscriptable" in str(failed.value)
    ran = engine(model=qwen3_next_mtp, engine=ALIGN_MTP, prompts=PROMPTS, max_tokens=16,
                 passes=[{}, {}, {"reset": True}], env=interpret)  # fmt: skip
    assert ran["error"] is None, ran["error"]
    _, again, after_reset = ran["passes"]
    assert again["cached"][0] > 0 and after_reset["cached"][0] == 0
    for n, done in enumerate(ran["passes"]):
        assert done["tokens"] == cold["passes"][0]["tokens"], f"pass {n}"


def assert_like_the_oracle(result: dict[str, Any], oracle: dict[str, Any]) -> None:
    """Pass by pass the oracle's tokens, logprobs and hits; its accepted drafts."""
    assert result["error"] is None, result["error"]
    for n, (done, want) in enumerate(zip(result["passes"], oracle["passes"], strict=True)):
        found = differences(done, want)
        assert not found, f"pass {n}: " + "; ".join(found)
        assert done["cached"] == want["cached"], f"pass {n}"
    assert_loaded_tokens_match(result, 1)
    assert result["stats"]["scheduler"]["failed_loads"] == 0
    assert result["metrics"][DRAFTED] == oracle["metrics"][DRAFTED] > 0
    assert result["metrics"].get(ACCEPTED, 0) == oracle["metrics"].get(ACCEPTED, 0)


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_the_connector_serves_it_as_vllms_own_cache(
    engine: Engine, qwen3_next_mtp: str, interpret: dict[str, str], blocks_per_chunk: int
) -> None:
    """After a reset the connector serves the shared prefix's chunks, the states at their
    ends among them, as vLLM's own cache serves its blocks in the oracle's second pass."""
    run = {"model": qwen3_next_mtp, "engine": ORACLE, "prompts": PROMPTS, "max_tokens": 16,
           "env": interpret}  # fmt: skip
    oracle = engine(**run, passes=[{}, {}])
    assert oracle["error"] is None, oracle["error"]
    assert min(oracle["passes"][1]["cached"]) > 0
    connector = {"blocks_per_chunk": blocks_per_chunk, "cpu_bytes_to_use": "64MiB"}
    result = engine(**run, passes=[{}, {"reset": True}], connector=connector)
    assert_like_the_oracle(result, oracle)
    assert result["stats"]["scheduler"]["hit_tokens"] == sum(result["passes"][1]["cached"])


def test_the_next_turn_hits_a_state_taken_while_drafting(
    engine: Engine, qwen3_next_mtp: str, interpret: dict[str, str]
) -> None:
    """A second turn (prompt, 200 generated tokens, 40 more) resumes at the output's last
    block boundary, whose state vLLM wrote in a step that verified a draft."""
    prompts = PROMPTS[:2]
    args = {**ORACLE, "prefix_cache_retention_interval": None}
    run = {"model": qwen3_next_mtp, "engine": args, "prompts": prompts, "max_tokens": 200,
           "env": interpret}  # fmt: skip
    oracle = engine(**run, passes=[{}, {"follow_up": 40}])
    assert oracle["error"] is None, oracle["error"]
    block = oracle["kv_cache_groups"][0]
    ends = [(len(p) + 200 - 1) // block * block for p in prompts]
    assert oracle["passes"][1]["cached"] == ends and min(ends) > len(prompts[1]), ends
    connector = {"blocks_per_chunk": 1, "cpu_bytes_to_use": "256MiB"}
    result = engine(**run, passes=[{}, {"reset": True, "follow_up": 40}], connector=connector)
    assert_like_the_oracle(result, oracle)


def test_two_speculative_tokens_are_refused_at_start_saying_why(
    engine: Engine, qwen3_next_mtp: str
) -> None:
    """Two speculative state blocks are not proven: refused, naming the fix."""
    args = {**ALIGN_MTP, "speculative_config": {**MTP, "num_speculative_tokens": 2}}
    connector = {"blocks_per_chunk": 1, "cpu_bytes_to_use": "64MiB"}
    result = engine(model=qwen3_next_mtp, engine=args, prompts=PROMPTS[:1], connector=connector)
    error = result["error"]
    assert error is not None, "the engine started"
    assert "ConfigError" in error and "KVOffloadConnector cannot offload KV cache group" in error
    assert "a recurrent group with 2 speculative state blocks is not offloaded" in error
    assert "Use num_speculative_tokens 1" in error
