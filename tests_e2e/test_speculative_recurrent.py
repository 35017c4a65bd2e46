"""Speculative decoding on a recurrent hybrid: a tiny Qwen3-Next with an MTP layer.

vLLM 0.32 groups the model's KV cache in align mode (prefix caching on) as two
gated-DeltaNet state groups with one speculative state block each
(``num_speculative_blocks``: the state after each draft position lives in one
of the request's trailing blocks) and one full-attention group that holds the
target's attention layer and the MTP layer's (``mtp.layers.0``) alike.

vLLM's CPU build copies those states with a Triton kernel
(``precopy_mamba_align_fused_kernel``) and has no Triton: the engine fails in
its first step. Under Triton's interpreter (``_triton_interp.py``) it runs,
and generates the tokens of the same engine without prefix caching.

With an MTP layer that agrees with its target (most drafts accepted), a second
turn that vLLM's own prefix cache resumes at a block boundary its accepted
drafts crossed generates other tokens than a recompute of the same turn: the
state vLLM keeps there is not the one a recompute gives. A test below
holds vLLM's side of that (the day vLLM's kept state matches a recompute, it
fails). The connector stores no state accepted drafts moved
(``kvoffload.connector._drafts``): the same second turn, served by it after a
reset, resumes at the first turn's last prefill boundary and generates the
recompute's tokens and logprobs, with as many drafts accepted, at one and two
speculative tokens and one and two blocks per chunk. (With the rule turned off,
measured once: it resumed the first prompt at the boundary its drafts crossed,
as vLLM's cache does, and 157 of its 200 tokens differed from the recompute's.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _harness import Engine, differences, shared_prefix_prompts
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


@pytest.fixture(scope="module")
def agreeing_mtp(models: Path) -> str:
    return str(build_mtp(models / "qwen3_next_mtp_agreeing", agreeing=True))


Runs = Callable[[int], dict[str, Any]]


@pytest.fixture(scope="module")
def turns(agreeing_mtp: str, interpret: dict[str, str]) -> Runs:
    """The runner arguments of two prompts sharing a prefix, 200 tokens each, with that many
    speculative tokens; a second turn is a pass with ``follow_up``: each prompt, its output
    and 40 more tokens."""

    def run(tokens: int) -> dict[str, Any]:
        speculative = {**ORACLE["speculative_config"], "num_speculative_tokens": tokens}
        args = {**ORACLE, "prefix_cache_retention_interval": None,
                "speculative_config": speculative}  # fmt: skip
        return {"model": agreeing_mtp, "engine": args, "prompts": PROMPTS[:2],
                "max_tokens": 200, "env": interpret}  # fmt: skip

    return run


@pytest.fixture(scope="module")
def recomputed(engine: Engine, turns: Runs) -> Runs:
    """Per speculative token count, the second turn recomputed (vLLM's cache reset, no
    connector), once per module."""
    done: dict[int, dict[str, Any]] = {}

    def get(tokens: int) -> dict[str, Any]:
        if tokens not in done:
            result = engine(**turns(tokens),
                            passes=[{}, {"reset": True, "follow_up": 40}])  # fmt: skip
            assert result["error"] is None, result["error"]
            assert result["passes"][1]["cached"] == [0, 0]
            done[tokens] = result
        return done[tokens]

    return get


def test_vllms_own_cache_keeps_a_state_a_recompute_does_not_give_once_drafts_are_accepted(
    engine: Engine, turns: Runs, recomputed: Runs
) -> None:
    """A second turn (prompt, 200 generated tokens, 40 more), from vLLM's own cache (it
    resumes at the output's last block boundary) and recomputed after a reset."""
    run = turns(1)
    prompts = run["prompts"]
    cached = engine(**run, passes=[{}, {"follow_up": 40}])
    assert cached["error"] is None, cached["error"]
    assert cached["metrics"][ACCEPTED] > 0.5 * cached["metrics"][DRAFTED]  # drafts accepted
    block = cached["kv_cache_groups"][0]
    ends = [(len(p) + 200 - 1) // block * block for p in prompts]
    assert cached["passes"][1]["cached"] == ends and min(ends) > len(prompts[1]), ends
    recompute = recomputed(1)
    assert not differences(recompute["passes"][0], cached["passes"][0])  # the first turn
    found = differences(cached["passes"][1], recompute["passes"][1])
    assert found, (
        "vLLM's kept state now equals a recompute's: kvoffload.connector._drafts may store "
        "the states accepted drafts reached"
    )
    print(f"\nvLLM's own cache against a recompute, second turn: {'; '.join(found)}")


@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
@pytest.mark.parametrize("tokens", [1, 2])
def test_the_connector_serves_the_next_turn_as_a_recompute(
    engine: Engine, turns: Runs, recomputed: Runs, tokens: int, blocks_per_chunk: int
) -> None:
    """The same second turn served by the connector after the reset: it resumes at the
    first turn's last prefill boundary (its output's boundaries were crossed by accepted
    drafts: no state stored there), and generates the recompute's tokens and logprobs with
    as many drafts accepted."""
    run = turns(tokens)
    connector = {"blocks_per_chunk": blocks_per_chunk, "cpu_bytes_to_use": "256MiB"}
    served = engine(**run, passes=[{}, {"reset": True, "follow_up": 40}], connector=connector)
    assert served["error"] is None, served["error"]
    want = recomputed(tokens)
    block = served["kv_cache_groups"][0]
    prompts = run["prompts"]
    assert served["passes"][1]["cached"] == [(len(p) - 1) // block * block for p in prompts]
    for n in (0, 1):
        found = differences(served["passes"][n], want["passes"][n])
        assert not found, f"turn {n + 1}: " + "; ".join(found)
    scheduler = served["stats"]["scheduler"]
    assert scheduler["drafted_states"] > 0 and scheduler["failed_loads"] == 0
    assert scheduler["hit_tokens"] == sum(served["passes"][1]["cached"])
    assert served["metrics"][DRAFTED] == want["metrics"][DRAFTED] > 0
    assert served["metrics"][ACCEPTED] == want["metrics"][ACCEPTED] > 0.5 * want["metrics"][DRAFTED]
    print(
        f"\n{tokens} speculative, {blocks_per_chunk} blocks per chunk: cached "
        f"{served['passes'][1]['cached']}, drafted {served['metrics'][DRAFTED]}, accepted "
        f"{served['metrics'][ACCEPTED]}, states not stored {scheduler['drafted_states']}"
    )
