"""Tenants and LoRA adapters on a real engine: each is offloaded, and only ever served its own KV.

Every pass but the first resets vLLM's prefix cache, so a cached token is
one the connector loaded, or one vLLM's cache took from the blocks of a load
in the same step (a tenant's own). A pass whose requests must not hit shows 0 cached
tokens and no loaded tokens; a pass whose requests must hit shows the
connector's whole-chunk hit; and every request generates the tokens it
generates without the connector.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from _harness import (
    LLAMA_ENGINE,
    Engine,
    Reference,
    assert_loaded_tokens_match,
    connector_hit,
    delta,
    random_prompts,
)
from _models import build_lora_adapter

CONNECTOR = {"blocks_per_chunk": 1, "cpu_bytes_to_use": "64MiB"}
SYSTEM = random_prompts(1, 256, 512, seed=7)[0]  # 8 chunks of 32 tokens shared by everyone
SUFFIXES = random_prompts(5, 40, 512, seed=8)


def request(suffix: int, salt: str | None = None, lora: list[Any] | None = None) -> dict[str, Any]:
    return {"prompt_token_ids": SYSTEM + SUFFIXES[suffix], "cache_salt": salt, "lora": lora}


def expected_tokens(reference: dict[str, Any], prompts: list[dict[str, Any]]) -> dict[str, Any]:
    """Prompt (as JSON) -> the tokens the run without the connector generated for it."""
    tokens = reference["passes"][0]["tokens"]
    return {json.dumps(p, sort_keys=True): t for p, t in zip(prompts, tokens, strict=True)}


def check_pass(result: dict[str, Any], n: int, expected: dict[str, Any], cached: list[int]) -> None:
    """Pass ``n``: the reference's tokens, these cached tokens, all of them loaded by us."""
    done, prompts = result["passes"][n], result["spec_prompts"][n]
    for prompt, tokens in zip(prompts, done["tokens"], strict=True):
        assert tokens == expected[json.dumps(prompt, sort_keys=True)], f"pass {n}: other tokens"
    assert done["cached"] == cached, (n, done["cached"])
    loaded = delta(result, n, "scheduler", "loaded_tokens")
    assert loaded == delta(result, n, "scheduler", "hit_tokens")
    assert_loaded_tokens_match(result, n)


def run_passes(
    run: Engine, passes: list[list[dict[str, Any]]], /, key_source: str = "auto", **spec: Any
) -> dict[str, Any]:
    steps = [{"prompts": p, **({"reset": True} if i else {})} for i, p in enumerate(passes)]
    connector = {**CONNECTOR, "key_source": key_source}
    result = run(passes=steps, prompts=passes[0], connector=connector, **spec)
    assert result["error"] is None, result["error"]
    result["spec_prompts"] = passes
    scheduler = result["stats"]["scheduler"]
    assert scheduler["failed_loads"] == 0 and scheduler["unkeyable_requests"] == 0
    return result


def test_tenants_hit_their_own_chunks_and_never_another_salts(
    engine: Engine, reference: Reference, llama: str
) -> None:
    alice1, alice2 = request(0, "alice"), request(1, "alice")
    bob1, bob2 = request(2, "bob"), request(3, "bob")
    plain = request(4)
    everything = [alice1, alice2, bob1, bob2, plain]
    expected = expected_tokens(reference(llama, LLAMA_ENGINE, everything), everything)  # type: ignore[arg-type]
    result = run_passes(
        engine,
        [[alice1], [bob1, plain], [alice2, bob2]],
        model=llama,
        engine=LLAMA_ENGINE,
    )
    shared = len(SYSTEM)  # the system prompt: 8 whole chunks of 32 tokens
    check_pass(result, 0, expected, [0])
    # alice's chunks are all the connector holds: bob and the unsalted request miss them.
    check_pass(result, 1, expected, [0, 0])
    # Each tenant's second request hits its own copy of the system prompt.
    check_pass(result, 2, expected, [shared, shared])
    stored = result["passes"][1]["stats"]["scheduler"]["stored_chunks"]
    assert stored >= 3 * len(SYSTEM) // 32  # three separate copies of the system prompt


@pytest.mark.parametrize("key_source", ["auto", "tokens"])
def test_a_lora_adapter_is_offloaded_and_serves_only_its_own_weights(
    engine: Engine, reference: Reference, llama: str, models: Path, key_source: str
) -> None:
    """Keyed by its weights: never another adapter's chunks. On token keys two names for the
    same weights share chunks too; on vLLM's hashes (``auto``), which hold the name, not."""
    adapter_a = build_lora_adapter(Path(llama), models / "lora_a", seed=1)
    adapter_b = build_lora_adapter(Path(llama), models / "lora_b", seed=2)
    same_as_a = models / "lora_a_copy"  # the same weights under another name and path
    shutil.copytree(adapter_a, same_as_a, dirs_exist_ok=True)
    # max_loras covers every adapter of a batch: with fewer slots than adapters, vLLM 0.32's
    # CPU build gave the base request another adapter's tokens (even without the connector).
    engine_args = {**LLAMA_ENGINE, "enable_lora": True, "max_lora_rank": 8, "max_loras": 4}
    with_a, with_b = (
        request(0, lora=["a", 1, str(adapter_a)]),
        request(0, lora=["b", 2, str(adapter_b)]),
    )
    with_copy, base = request(0, lora=["a-copy", 3, str(same_as_a)]), request(0)
    everything = [with_a, with_b, with_copy, base]
    ref = reference(llama, engine_args, everything)  # type: ignore[arg-type]
    expected = expected_tokens(ref, everything)
    tokens = ref["passes"][0]["tokens"]
    assert tokens[0] != tokens[3] and tokens[0] != tokens[1]  # the adapters change the output
    assert tokens[0] == tokens[2]
    result = run_passes(
        engine, [[with_a], [with_b, base], [with_a], [with_copy]], key_source, model=llama,
        engine=engine_args,
    )  # fmt: skip
    hit = connector_hit(with_a["prompt_token_ids"], 32)
    check_pass(result, 0, expected, [0])
    check_pass(result, 1, expected, [0, 0])  # another adapter, or none: no hit
    check_pass(result, 2, expected, [hit])  # adapter a's chunks come back
    # The same weights under another name and path: vLLM's hashes tell them apart.
    check_pass(result, 3, expected, [hit if key_source == "tokens" else 0])


def test_prompt_embeddings_are_offloaded_and_hit_only_the_same_embeddings(
    engine: Engine, reference: Reference, llama: str
) -> None:
    """A prompt of embeddings (the model's own, of token ids) hits its own chunks only."""
    tokens = SYSTEM + SUFFIXES[0]
    as_embeds = {"embeds_of": tokens}
    scaled = {"embeds_of": tokens, "scale": 1.5}  # other embeddings, the same (zero) token ids
    engine_args = {**LLAMA_ENGINE, "enable_prompt_embeds": True}
    everything = [tokens, as_embeds, scaled]
    expected = expected_tokens(reference(llama, engine_args, everything), everything)  # type: ignore[arg-type]
    assert expected[json.dumps(tokens)] == expected[json.dumps(as_embeds, sort_keys=True)]
    result = run_passes(
        engine, [[tokens], [as_embeds], [as_embeds], [scaled, tokens]], model=llama,
        engine=engine_args,
    )  # fmt: skip
    hit = connector_hit(tokens, 32)
    check_pass(result, 0, expected, [0])
    check_pass(result, 1, expected, [0])  # the token ids' chunks are not the embeddings'
    check_pass(result, 2, expected, [hit])
    check_pass(result, 3, expected, [0, hit])  # other embeddings miss; the token ids hit
