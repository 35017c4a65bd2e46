"""A draft model beside a hybrid target (Gemma-4): its KV is offloaded with the target's, exactly.

The target is the tiny Gemma-4 (three sliding-window groups of 512 tokens per
block and one full-attention group of 32); the drafter is a one-layer Llama of
the same vocabulary (``method: draft_model``). vLLM gives the drafter's layer
a group of its own, full attention with 1024 tokens per block (the common
page), which the connector serves like any full-attention group.

**vLLM 0.32 misroutes that drafter's KV.** Its model runner hands a
``DraftModelProposer`` the attention metadata of the *first* KV cache group
(a sliding group), not of its own (EAGLE, DFlash, Gemma-4's MTP and the
hidden-state export are handed their own): the drafter writes and reads its
KV through another group's block table and slot mapping, into pages that
other groups' blocks hold. Measured on ``GEMMA_PROMPTS`` (1120 tokens): cold
runs gave the target's own output (tokens and logprobs bit for bit those of
the target without a drafter), but prompts served 1024 tokens from vLLM's
prefix cache generated other tokens from the first on (logprobs 0.34 apart in
bfloat16, 0.46 in float32: not near-ties), and others again in the next pass;
served by the connector, other tokens too (0.34 apart), the same in every
pass. Where the misrouted writes land depends on the blocks allocated: on
``PROMPTS`` below vLLM's own cache came out right, and on a machine with AMX on
``GEMMA_PROMPTS`` too. ``test_vllm_032_hands...`` keeps vLLM's side as a
tripwire, read from its model runner.

So these tests fix it in the engine's process (``_vllm_draft_group_fix``:
the drafter gets its own group's metadata, one name added to vLLM's list).
With the fix vLLM's own prefix cache gives the cold run's tokens and logprobs
bit for bit, in bfloat16, in every pass: it is the oracle again, as in
``test_speculative.py``. After ``reset_prefix_cache()`` the connector must
serve the history (2048 of each prompt's 2120 tokens: a hit ends on a chunk
boundary of every group, the drafter's 1024-token blocks included, so at
``blocks_per_chunk`` 2 the prompts are longer than one 2048-token chunk), with
the oracle's tokens and logprobs and accepted draft tokens. The drafter is a
random one-layer Llama: it drafts, but none of its drafts was accepted, so the
accepted count is compared without proving much; the tokens and logprobs,
which a corrupt loaded block changes (the negative control), prove the loads.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path
from typing import Any

import pytest
from _harness import (
    GEMMA_ENGINE,
    GEMMA_GROUPS,
    Engine,
    assert_loaded_tokens_match,
    assert_passes_match,
    differences,
    negative_control,
    shared_prefix_prompts,
)
from _models import GEMMA4, build_draft

ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFTED = "vllm:spec_decode_num_draft_tokens"
#: vLLM's engine patch (see the module docstring), imported by the runner before the engine.
FIX = ["_vllm_draft_group_fix"]
#: Three prompts (2120 to 2122 tokens) sharing 2100: a hit of 2048 at blocks_per_chunk 1 and 2.
PROMPTS = shared_prefix_prompts(3, prefix_len=2100, suffix_len=20, vocab=1024, seed=3)
HIT = 2048


@pytest.fixture(scope="module")
def draft(models: Path) -> str:
    """A one-layer random Llama with Gemma-4's vocabulary."""
    return str(build_draft(GEMMA4, models / "draft_gemma4", same_weights=False))


def draft_engine(draft: str) -> dict[str, Any]:
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2}
    return {**GEMMA_ENGINE, "speculative_config": spec, "disable_log_stats": False}


def run(engine: Engine, gemma4: str, draft: str, **spec: Any) -> dict[str, Any]:
    spec = {"prompts": PROMPTS, **spec}
    result = engine(model=gemma4, engine=draft_engine(draft), max_tokens=32, **spec)
    assert result["error"] is None, result["error"]
    assert result["kv_cache_groups"] == [*GEMMA_GROUPS, 1024], "the drafter's group of its own"
    return result


@pytest.fixture(scope="module")
def expected(engine: Engine, gemma4: str, draft: str) -> dict[str, Any]:
    """vLLM alone, fixed: its own prefix cache serves the second pass the cold run's output."""
    result = run(engine, gemma4, draft, passes=[{}, {}], preload=FIX)
    first, again = result["passes"]
    assert again["cached"] == [HIT] * 3, again["cached"]
    assert not differences(again, first), differences(again, first)  # consistent: an oracle
    return result


def test_vllm_032_hands_a_draft_model_the_first_groups_metadata() -> None:
    """Tripwire, read from vLLM's model runner: the drafters handed their own group's attention
    metadata, which ``DraftModelProposer`` is not one of.

    What that changes depends on the blocks allocated: on ``GEMMA_PROMPTS`` (1120 tokens,
    hits of 1024) every prompt vLLM's own cache served generated other tokens on a 2-core
    AVX-512 machine, and the same tokens on one with AMX. So vLLM's code is checked, not an
    output. When this fails, vLLM may hand the draft model its own group's metadata: check,
    and drop the fix.
    """
    from vllm.v1.worker import gpu_model_runner

    source = textwrap.dedent(
        inspect.getsource(gpu_model_runner.GPUModelRunner._build_attention_metadata)
    )
    handed_their_own = [
        {element.id for element in call.args[1].elts if isinstance(element, ast.Name)}
        for call in ast.walk(ast.parse(source))
        if isinstance(call, ast.Call)
        and getattr(call.func, "id", None) == "isinstance"
        and ast.unparse(call.args[0]) == "self.drafter"
        and isinstance(call.args[1], ast.Tuple)
    ]
    assert any("EagleProposer" in names for names in handed_their_own), handed_their_own
    assert not any("DraftModelProposer" in names for names in handed_their_own), "fixed in vLLM?"


@pytest.mark.parametrize("bpc", [1, 2], ids=["bpc1", "bpc2"])
def test_draft_model_beside_a_hybrid_target(
    engine: Engine, gemma4: str, draft: str, expected: dict[str, Any], bpc: int
) -> None:
    connector = {"blocks_per_chunk": bpc, "cpu_bytes_to_use": "256MiB"}
    spec = {"passes": [{}, {"reset": True}], "connector": connector, "preload": FIX}
    result = run(engine, gemma4, draft, **spec)
    assert_passes_match(result, expected)
    assert result["passes"][1]["cached"] == [HIT] * 3, result["passes"][1]["cached"]
    assert_loaded_tokens_match(result, 1)
    assert result["stats"]["scheduler"]["failed_loads"] == 0
    # The connector tells users of unpatched vLLM 0.32/0.33 (kvoffload.vllm._startup).
    assert (
        "runs a draft model beside a target of several KV cache groups"
        in Path(result["log"]).read_text()
    )
    assert result["metrics"].get(DRAFTED, 0) > 0
    assert result["metrics"].get(ACCEPTED, 0) == expected["metrics"].get(ACCEPTED, 0)
    if bpc == 1:  # the check sees a damaged loaded block (the last of each group)
        negative_control(
            lambda **s: run(engine, gemma4, draft, **s),
            lambda r: assert_passes_match(r, expected),
            "load.corrupt_block",
            **spec,
        )
