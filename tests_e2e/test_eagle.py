"""EAGLE-like drafters on a real engine: their KV is offloaded with the target's, exactly.

vLLM's EAGLE head sits in the target's KV cache group (one group of 32-token
blocks); its KV at position ``p`` is computed from the target's hidden state
at ``p`` and the token at ``p + 1``. The connector's keys name that token
after every chunk (``KVLayout.lookahead``), so a chunk loads only into a
request that goes on as the stored one did.

The oracle is vLLM's own prefix cache with the same speculative settings and
``disable_eagle_block_drop``: by default vLLM drops the last block of every
hit under EAGLE (it cannot tell which token followed it), so its hits end a
block earlier than the connector's and the two runs would recompute different
spans. With the drop off, vLLM reuses its cached KV up to the same kind of
boundary; for a prompt sent again (the same next token) that is exact. Its
tokens, logprobs and accepted draft tokens are what the connector must give.
(A request whose hit leaves one token to compute loses one round of drafts
in vLLM 0.32 either way, measured with vLLM's own cache: the oracle shares it.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _eagle_models import EAGLE3_TARGET, build_agreeing_eagle, build_random_eagle3
from _harness import (
    CPU_MLA_DRAFTER,
    LLAMA_ENGINE,
    LLAMA_PROMPTS,
    MLA_FLOAT32_ENGINE,
    Engine,
    assert_loaded_tokens_match,
    assert_passes_match,
    connector_hit,
    own_cache_oracle,
    random_prompts,
)
from _models import build
from _models_mtp import build_deepseek_mtp

ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFTED = "vllm:spec_decode_num_draft_tokens"
#: Prefill in steps of 128 tokens: the drafter runs on each step's part of the prompt, its
#: last position reading the first token of the next step's part.
CHUNKED = {"max_num_batched_tokens": 128}


@pytest.fixture(scope="module")
def eagle(models: Path) -> tuple[str, str]:
    return build_agreeing_eagle(models)


def eagle_engine(method: str, head: str, *, drop: bool = False, **more: Any) -> dict[str, Any]:
    spec = {"method": method, "model": head, "num_speculative_tokens": 3}
    if not drop:
        spec["disable_eagle_block_drop"] = True
    return {**LLAMA_ENGINE, "speculative_config": spec, "disable_log_stats": False, **more}


@pytest.mark.parametrize(
    ("bpc", "more"), [(1, {}), (2, {}), (1, CHUNKED)], ids=["bpc1", "bpc2", "chunked-prefill"]
)
def test_eagle_kv_is_offloaded_with_the_targets(
    engine: Engine, eagle: tuple[str, str], bpc: int, more: dict[str, Any]
) -> None:
    target, head = eagle
    args = eagle_engine("eagle", head, **more)
    expected = own_cache_oracle(engine, target, args)
    connector = {"blocks_per_chunk": bpc, "cpu_bytes_to_use": "64MiB"}
    result = engine(model=target, engine=args, prompts=LLAMA_PROMPTS,
                    passes=[{}, {"reset": True}], connector=connector, max_tokens=32)  # fmt: skip
    assert_passes_match(result, expected)
    assert result["kv_cache_groups"] == [32], "the head's layer joined the target's group"
    cached = result["passes"][1]["cached"]
    assert cached[0] == connector_hit(LLAMA_PROMPTS[0], 32 * bpc) > 0, cached
    assert_loaded_tokens_match(result, 1)
    assert result["stats"]["scheduler"]["failed_loads"] == 0
    drafted, accepted = result["metrics"].get(DRAFTED, 0), result["metrics"].get(ACCEPTED, 0)
    assert accepted == expected["metrics"][ACCEPTED] > 0.9 * drafted > 0, (accepted, drafted)


def test_a_chunk_followed_by_another_token_is_not_loaded(
    engine: Engine, eagle: tuple[str, str]
) -> None:
    """Two prompts share 320 tokens (ten chunks) and go on differently: the tenth chunk's
    drafter KV read the first prompt's next token, so the second gets nine chunks, as
    vLLM's own cache (dropping the block it cannot vouch for) serves it nine blocks."""
    target, head = eagle
    shared = random_prompts(1, 320, 512, seed=21)[0]
    first, second = (shared + tail for tail in random_prompts(2, 12, 512, seed=22))
    assert first[320] != second[320]
    args = eagle_engine("eagle", head, drop=True)
    passes: list[dict[str, Any]] = [{"prompts": [first]}, {"prompts": [second]}]
    expected = engine(model=target, engine=args, prompts=[first], passes=passes, max_tokens=16)
    assert expected["error"] is None, expected["error"]
    assert expected["passes"][1]["cached"] == [288]  # vLLM: ten blocks matched, one dropped
    connector = {"blocks_per_chunk": 1, "cpu_bytes_to_use": "64MiB"}
    reset: list[dict[str, Any]] = [{"prompts": [first]}, {"prompts": [second], "reset": True}]
    result = engine(model=target, engine=args, prompts=[first], passes=reset,
                    connector=connector, max_tokens=16)  # fmt: skip
    assert_passes_match(result, expected)
    assert result["passes"][1]["cached"] == [288]  # nine chunks: the tenth named 320's token
    again = [{"prompts": [first]}, {"prompts": [first], "reset": True}]
    same = engine(model=target, engine=args, prompts=[first], passes=again, connector=connector,
                  max_tokens=16)  # fmt: skip
    assert same["error"] is None, same["error"]
    assert same["passes"][1]["cached"] == [320]  # the same next token: all ten
    assert result["metrics"][ACCEPTED] == expected["metrics"][ACCEPTED]


@pytest.mark.parametrize("bpc", [1, 2])
def test_eagle3_kv_is_offloaded_with_the_targets(engine: Engine, models: Path, bpc: int) -> None:
    """EAGLE-3 (a head over three of the target's hidden states), random weights."""
    target = str(build(EAGLE3_TARGET, models / "eagle3_target"))
    head = build_random_eagle3(EAGLE3_TARGET, models / "eagle3_head")
    args = eagle_engine("eagle3", head)
    expected = own_cache_oracle(engine, target, args)
    connector = {"blocks_per_chunk": bpc, "cpu_bytes_to_use": "64MiB"}
    result = engine(model=target, engine=args, prompts=LLAMA_PROMPTS,
                    passes=[{}, {"reset": True}], connector=connector, max_tokens=32)  # fmt: skip
    assert_passes_match(result, expected)
    assert result["kv_cache_groups"] == [32]
    assert result["passes"][1]["cached"][0] == connector_hit(LLAMA_PROMPTS[0], 32 * bpc) > 0
    assert_loaded_tokens_match(result, 1)
    assert result["metrics"].get(DRAFTED, 0) > 0
    assert result["metrics"].get(ACCEPTED, 0) == expected["metrics"].get(ACCEPTED, 0)


@pytest.mark.parametrize("bpc", [1, 2])
def test_mtp_kv_of_an_mla_model_is_offloaded_with_the_targets(
    engine: Engine, models: Path, bpc: int
) -> None:
    """A DeepSeek-V3-style MLA model with one MTP layer (vLLM's ``DeepSeekMTP``): the MTP
    layer joins the target's group. vLLM's CPU build turns its own prefix cache off for
    MLA, so the oracle is the run without the connector, whose second pass recomputes: in
    float32, since a recompute under other chunking flips this tiny model's near-tied
    tokens in bfloat16. Logprobs are not compared: MLA's attention over loaded latents
    (vLLM's path for a prompt with context) rounds otherwise than over a whole prompt,
    0.02 to 0.05 apart here, where one damaged block moves them by more than 1."""
    target = str(build_deepseek_mtp(models / "deepseek_v3_mtp"))
    spec = {"method": "mtp", "num_speculative_tokens": 1, **CPU_MLA_DRAFTER}
    args = {**MLA_FLOAT32_ENGINE, "speculative_config": spec, "disable_log_stats": False}
    expected = engine(model=target, engine=args, prompts=LLAMA_PROMPTS, passes=[{}, {}],
                      max_tokens=32, memo=True)  # fmt: skip
    assert expected["error"] is None, expected["error"]
    assert expected["passes"][1]["cached"] == [0, 0, 0]  # no prefix cache for MLA here
    connector = {"blocks_per_chunk": bpc, "cpu_bytes_to_use": "64MiB"}
    result = engine(model=target, engine=args, prompts=LLAMA_PROMPTS,
                    passes=[{}, {"reset": True}], connector=connector, max_tokens=32)  # fmt: skip
    assert result["error"] is None, result["error"]
    assert result["kv_cache_groups"] == [16]
    for n in (0, 1):
        assert result["passes"][n]["tokens"] == expected["passes"][n]["tokens"], f"pass {n}"
    hits = [connector_hit(p, 16 * bpc) for p in LLAMA_PROMPTS]
    assert result["passes"][1]["cached"] == hits
    assert_loaded_tokens_match(result, 1)
    assert result["metrics"].get(DRAFTED, 0) > 0
    assert result["metrics"].get(ACCEPTED, 0) == expected["metrics"].get(ACCEPTED, 0)
