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
recompute's tokens and logprobs, with as many drafts accepted, at one speculative
token and one block per chunk, and at two and two. (With the rule turned off,
measured once: it resumed the first prompt at the boundary its drafts crossed,
as vLLM's cache does, and 157 of its 200 tokens differed from the recompute's.)

Under the interpreter every step costs: a turn generates just enough tokens to
cross the block boundary it tests (:func:`generated`).
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
    started = engine(
        model=qwen3_next_mtp, engine=ALIGN_MTP, prompts=PROMPTS, passes=[], memo=True
    )  # the block fixture's run
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


#: The two conversations of the turn tests.
TURN_PROMPTS = PROMPTS[:2]


def generated(block: int) -> int:
    """Tokens a turn generates: its output crosses the block boundary after the longer prompt,
    24 tokens past it (55 at 384-token blocks, 183 at 256). The interpreter's cost is per
    step: a run generates what the boundary it tests needs, no more."""
    longest = max(map(len, TURN_PROMPTS))
    return (longest // block + 1) * block - longest + 24


def new_tokens(block: int, *, decode_crosses: bool) -> int:
    """A second turn's new tokens after the first turn's output: 40, or, where the second
    turn's decode must cross a boundary too (a drafted state the connector then does not
    store), enough that its prompt ends 20 tokens before one."""
    if not decode_crosses:
        return 40
    end = max(map(len, TURN_PROMPTS)) + generated(block)
    boundary = -(-(end + 60) // block) * block
    return boundary - 20 - end


@pytest.fixture(scope="module")
def block(engine: Engine, qwen3_next_mtp: str) -> int:
    """vLLM's tokens per block (one for every group here): 256 or 384 by processor."""
    started = engine(model=qwen3_next_mtp, engine=ALIGN_MTP, prompts=PROMPTS, passes=[],
                     memo=True)  # fmt: skip
    assert started["error"] is None, started["error"]
    return int(started["kv_cache_groups"][0])


Turn = Callable[..., dict[str, Any]]


@pytest.fixture(scope="module")
def turns(agreeing_mtp: str, interpret: dict[str, str], block: int) -> Turn:
    """The runner arguments of the two conversations with that many speculative tokens; a
    second turn is a pass with ``follow_up``: each prompt, its output and new tokens."""

    def run(tokens: int) -> dict[str, Any]:
        speculative = {**ORACLE["speculative_config"], "num_speculative_tokens": tokens}
        args = {**ORACLE, "prefix_cache_retention_interval": None,
                "speculative_config": speculative}  # fmt: skip
        return {"model": agreeing_mtp, "engine": args, "prompts": TURN_PROMPTS,
                "max_tokens": generated(block), "env": interpret}  # fmt: skip

    return run


@pytest.fixture(scope="module")
def recomputed(engine: Engine, turns: Turn) -> Turn:
    """The second turn recomputed (vLLM's cache reset, no connector), once per module for
    each speculative token count and second turn."""

    def get(tokens: int, follow_up: int) -> dict[str, Any]:
        passes = [{}, {"reset": True, "follow_up": follow_up}]
        result = engine(**turns(tokens), passes=passes, memo=True)
        assert result["error"] is None, result["error"]
        assert result["passes"][1]["cached"] == [0, 0]
        return result

    return get


def test_vllms_own_cache_keeps_a_state_a_recompute_does_not_give_once_drafts_are_accepted(
    engine: Engine, turns: Turn, recomputed: Turn, block: int
) -> None:
    """A second turn (prompt, its output, 40 more), from vLLM's own cache (it resumes at the
    output's last block boundary) and recomputed after a reset."""
    run = turns(1)
    cached = engine(**run, passes=[{}, {"follow_up": 40}])
    assert cached["error"] is None, cached["error"]
    assert cached["metrics"][ACCEPTED] > 0.5 * cached["metrics"][DRAFTED]  # drafts accepted
    ends = [(len(p) + run["max_tokens"] - 1) // block * block for p in TURN_PROMPTS]
    assert cached["passes"][1]["cached"] == ends and min(ends) > len(TURN_PROMPTS[1]), ends
    recompute = recomputed(1, 40)
    assert not differences(recompute["passes"][0], cached["passes"][0])  # the first turn
    found = differences(cached["passes"][1], recompute["passes"][1])
    assert found, (
        "vLLM's kept state now equals a recompute's: kvoffload.connector._drafts may store "
        "the states accepted drafts reached"
    )
    print(f"\nvLLM's own cache against a recompute, second turn: {'; '.join(found)}")


@pytest.mark.parametrize(("tokens", "blocks_per_chunk"), [(1, 1), (2, 2)])
def test_the_connector_serves_the_next_turn_as_a_recompute(  # noqa: PLR0917 - fixtures
    engine: Engine, turns: Turn, recomputed: Turn, block: int, tokens: int, blocks_per_chunk: int
) -> None:
    """The second turn served by the connector after the reset: it resumes at the first
    turn's last prefill boundary (its output's boundaries were crossed by accepted drafts:
    no state stored there), and generates the recompute's tokens and logprobs with as many
    drafts accepted. The second turn's decode crosses a boundary too, whose drafted state
    the connector must not store (``drafted_states``)."""
    run = turns(tokens)
    follow_up = new_tokens(block, decode_crosses=True)
    connector = {"blocks_per_chunk": blocks_per_chunk, "cpu_bytes_to_use": "256MiB"}
    served = engine(**run, passes=[{}, {"reset": True, "follow_up": follow_up}],
                    connector=connector)  # fmt: skip
    assert served["error"] is None, served["error"]
    want = recomputed(tokens, follow_up)
    assert served["passes"][1]["cached"] == [(len(p) - 1) // block * block for p in TURN_PROMPTS]
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
