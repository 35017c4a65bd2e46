"""CPU-tier hits loaded in the step that asks for them (``load_in_step``), on a real engine.

With one KV cache group that keeps the whole prefix (a full-attention Llama)
the connector answers a lookup whose chunks are all in the CPU tier
synchronously: vLLM schedules the rest of the prompt in the same step and the
worker copies the chunks in before the forward pass. The tokens must be those
of the run without the connector, every hit counted once and as loaded in the
step. A load that fails there (fault point ``load.fail_last_chunk``: the last
chunk is withheld and reported failed) goes back through vLLM's
``get_block_ids_with_load_errors``: vLLM logs the tokens it rescheduled,
recomputes them, and the tokens are still right.

A sliding window (a Mistral whose every layer attends 128 tokens: one group
too) loads one step later: vLLM would resume at the failed block, attending
blocks outside the hit's window that were never loaded (this test saw wrong
tokens that way), so a failure fails the request and vLLM starts it over. A
recurrent hybrid (several KV cache groups, where vLLM takes no block ids at
all) does the same. Both give the right tokens after a failed load.

With ``load_in_step: always`` every group kind loads in the step that asks:
sliding windows, Gemma-4's four groups, Llama-4's chunked local attention,
and Qwen3-Next's recurrent states, each state also into the block vLLM runs
the request's state in (vLLM fills that block from the hit's state block
before the connector's ``start_load_kv``). The tokens must be vLLM's own
prefix cache's.
"""

from __future__ import annotations

from typing import Any

import pytest
from _harness import (
    GEMMA_ENGINE,
    GEMMA_PROMPTS,
    LLAMA_ENGINE,
    LLAMA_PROMPTS,
    TWO_PASSES,
    Engine,
    Reference,
    assert_passes_match,
    assert_same_output,
    differences,
    failpoint_fired,
    negative_control,
)
from test_chunked_local import ENGINE as LLAMA4_ENGINE
from test_chunked_local import PROMPTS as LLAMA4_PROMPTS
from test_connector import vllm_recovered_tokens
from test_recurrent import QWEN_ENGINE, QWEN_PROMPTS

#: How a load in the step copies (``kvoffload.engine._layered``): each mode is served.
COPIES = "KVOFFLOAD_IN_STEP_COPIES"
#: The first load's last chunk fails; vLLM's retry of a failed request loads it again.
FAIL = {"KVOFFLOAD_FAILPOINTS": "load.fail_last_chunk=1"}


def one_group(model: str) -> dict[str, Any]:
    """The Llama's is test_connector's round trip at one block per chunk: one run serves both."""
    connector = {"blocks_per_chunk": 1, "cpu_bytes_to_use": "64MiB"}
    return {"model": model, "engine": LLAMA_ENGINE, "prompts": LLAMA_PROMPTS,
            "passes": TWO_PASSES, "connector": connector}  # fmt: skip


def copy_mode(copies: str) -> dict[str, str]:
    """The environment that picks a copy mode; none for ``before``, the CPU's default."""
    return {} if copies == "before" else {COPIES: copies}


@pytest.mark.parametrize(
    ("model_name", "in_step", "copies"),
    [("llama", True, "before"), ("llama", True, "layer"), ("llama", True, "thread"),
     ("sliding_mistral", False, "before")],
)  # fmt: skip
def test_whole_prefix_hits_load_in_the_step_that_asks(
    engine: Engine,
    reference: Reference,
    request: pytest.FixtureRequest,
    *,
    model_name: str,
    in_step: bool,
    copies: str,
) -> None:
    """``layer`` copies each layer only in vLLM's ``wait_for_layer_load`` for it: right tokens
    there prove vLLM waits for each layer before its attention reads the KV."""
    spec = one_group(request.getfixturevalue(model_name))
    expected = reference(spec["model"], LLAMA_ENGINE, LLAMA_PROMPTS)
    result = engine(**spec, env=copy_mode(copies), memo=True)
    assert len(result["kv_cache_groups"]) == 1
    assert_same_output(result, expected)
    assert result["passes"][1]["cached"][0] > 0
    scheduler, worker = result["stats"]["scheduler"], result["stats"]["worker"]
    assert scheduler["loaded_tokens"] == scheduler["hit_tokens"] > 0  # counted once
    assert scheduler["in_step_hit_tokens"] == (scheduler["hit_tokens"] if in_step else 0)
    assert worker["in_step_load_jobs"] == (worker["load_jobs"] if in_step else 0)
    assert (worker["in_step_layer_waits"] > 0) == in_step
    if model_name == "sliding_mistral":  # the Llama's round trip has its own controls
        negative_control(
            engine, lambda r: assert_same_output(r, expected), "load.corrupt_block", **spec
        )


@pytest.mark.parametrize(
    ("model_name", "by_block", "copies"),
    [("llama", True, "before"), ("llama", True, "thread"), ("sliding_mistral", False, "before")],
)
def test_a_failed_load_is_recomputed_by_vllm(
    engine: Engine,
    reference: Reference,
    request: pytest.FixtureRequest,
    *,
    model_name: str,
    by_block: bool,
    copies: str,
) -> None:
    spec = one_group(request.getfixturevalue(model_name))
    expected = reference(spec["model"], LLAMA_ENGINE, LLAMA_PROMPTS)
    result = engine(**spec, env={**FAIL, **copy_mode(copies)}, failure_policy="recompute")
    assert failpoint_fired(result, "load.fail_last_chunk") > 0
    assert_same_output(result, expected)  # the worker lives on, and nothing wrong was used
    scheduler, worker = result["stats"]["scheduler"], result["stats"]["worker"]
    assert scheduler["failed_loads"] > 0 and worker["failed_load_blocks"] > 0
    assert (worker["in_step_load_jobs"] > 0) == by_block
    # By block vLLM logs what it rescheduled; a failed request it just starts over.
    assert (vllm_recovered_tokens(result) > 0) == by_block


def test_a_failed_load_on_a_recurrent_layout_is_recomputed(
    engine: Engine, reference: Reference, qwen3_next: str
) -> None:
    """Several KV cache groups: the load waits a step, and a failure fails the request's load,
    which vLLM computes again from its own cache (none after the reset).

    The second pass sends the first prompt alone: on CPUs with AMX a Qwen3-Next prompt's
    logprobs follow what is batched with it, so its recompute is compared with vLLM
    computing it alone.
    """
    first = QWEN_PROMPTS[:1]
    connector = {"cpu_bytes_to_use": "256MiB"}
    result = engine(model=qwen3_next, engine=QWEN_ENGINE, prompts=QWEN_PROMPTS,
                    passes=[{}, {"reset": True, "prompts": first}], connector=connector,
                    env=FAIL, failure_policy="recompute")  # fmt: skip
    assert failpoint_fired(result, "load.fail_last_chunk") > 0
    assert result["error"] is None, result["error"]
    expected = [reference(qwen3_next, QWEN_ENGINE, prompts) for prompts in (QWEN_PROMPTS, first)]
    for n, (done, want) in enumerate(zip(result["passes"], expected, strict=True)):
        found = differences(done, want["passes"][0])
        assert not found, f"pass {n}: " + "; ".join(found)
    scheduler, worker = result["stats"]["scheduler"], result["stats"]["worker"]
    assert scheduler["failed_loads"] > 0 and scheduler["in_step_hit_tokens"] == 0
    assert worker.get("in_step_load_jobs", 0) == 0


#: Each layout's engine and prompts, and the environment its groups need.
EVERY_KIND: dict[str, tuple[dict[str, Any], list[list[int]], dict[str, str]]] = {
    "sliding_mistral": (LLAMA_ENGINE, LLAMA_PROMPTS, {}),
    "gemma4": (GEMMA_ENGINE, GEMMA_PROMPTS, {}),
    "llama4": (LLAMA4_ENGINE, LLAMA4_PROMPTS,
               {"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"}),
    "qwen3_next": (QWEN_ENGINE, QWEN_PROMPTS, {}),
}  # fmt: skip


@pytest.mark.parametrize("model_name", list(EVERY_KIND))
def test_always_loads_every_group_kind_in_the_step_that_asks(
    engine: Engine,
    reference: Reference,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    model_name: str,
) -> None:
    """vLLM's own prefix cache's tokens, logprobs and hits, every hit loaded in its step."""
    model = request.getfixturevalue(model_name)
    engine_args, prompts, env = EVERY_KIND[model_name]
    for name, value in env.items():  # the reference's engine needs it too
        monkeypatch.setenv(name, value)
    expected = reference(model, engine_args, prompts)
    oracle = {"passes": expected["passes"][:2]}  # the second: vLLM's own prefix cache
    connector = {"cpu_bytes_to_use": "256MiB", "load_in_step": "always"}
    result = engine(model=model, engine=engine_args, prompts=prompts, passes=TWO_PASSES,
                    connector=connector)  # fmt: skip
    assert_passes_match(result, oracle)
    assert result["passes"][1]["cached"] == oracle["passes"][1]["cached"]
    scheduler, worker = result["stats"]["scheduler"], result["stats"]["worker"]
    assert scheduler["in_step_hit_tokens"] == scheduler["hit_tokens"] == scheduler["loaded_tokens"]
    assert scheduler["hit_tokens"] > 0 and scheduler["failed_loads"] == 0
    assert worker["in_step_load_jobs"] == worker["load_jobs"] > 0
