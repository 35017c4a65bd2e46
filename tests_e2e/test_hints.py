"""A client's retention hint reaches the connector and changes what the CPU tier keeps.

What no other test proves: vLLM hands a request's ``kv_transfer_params`` (the OpenAI
API's field) to kvoffload. The first pass sends prompt A with a hint that drops all its
tokens (priority 0) and prompt B with none; after vLLM's own cache is reset, the
connector serves B from the CPU tier and has nothing of A, which vLLM computes again.
Each prompt's output is vLLM's alone (A computed, B from vLLM's own cache). (Kept ranges,
their time running out, malformed hints: the unit suite, ``tests/test_hints.py``.)
"""

from __future__ import annotations

from typing import Any

from _harness import (
    LLAMA_ENGINE,
    LOGPROB_TOL,
    Engine,
    alone_oracle,
    connector_hit,
    own_cache_alone_oracle,
    random_prompts,
)

A, B = random_prompts(2, 320, 512, seed=23)
DROP = {"kv_retention": {"token_ranges": [{"token_start": 0, "priority": 0}]}}
ONE_AT_A_TIME: dict[str, Any] = {"one_by_one": True, "reset_each": True}


def test_a_drop_hint_leaves_its_prompt_out_of_the_cpu_tier(engine: Engine, llama: str) -> None:
    connector = {"blocks_per_chunk": 2, "cpu_bytes_to_use": "64MiB"}
    passes = [{**ONE_AT_A_TIME, "prompts": [A], "kv_transfer_params": DROP},
              {**ONE_AT_A_TIME, "prompts": [B]},
              {**ONE_AT_A_TIME, "prompts": [A, B]}]  # fmt: skip
    run = engine(model=llama, engine=LLAMA_ENGINE, prompts=[A, B], connector=connector,
                 passes=passes)  # fmt: skip
    assert run["error"] is None, run["error"]
    assert run["passes"][2]["cached"] == [0, connector_hit(B, 64)]
    scheduler = run["stats"]["scheduler"]
    assert scheduler["retention_hints"] == 1 and scheduler["retention_hints_ignored"] == 0
    assert scheduler["retention_dropped_chunks"] == connector_hit(A, 64) // 64 + 1  # all 5

    cold = alone_oracle(engine, llama, LLAMA_ENGINE, [A, B])["passes"][0]
    cached = own_cache_alone_oracle(engine, llama, LLAMA_ENGINE, [A, B])["passes"][0]
    done = run["passes"][2]
    for n, oracle in enumerate([cold, cached]):  # A computed again, B from a cache
        assert done["tokens"][n] == oracle["tokens"][n], f"prompt {n} generated other tokens"
        pairs = zip(done["logprobs"][n], oracle["logprobs"][n], strict=True)
        assert all(abs(mine - theirs) <= LOGPROB_TOL for mine, theirs in pairs), n
