"""A draft model's layers in ``kvoffload plan``'s layout, where vLLM 0.32 puts them, and served.

The expected groups are those vLLM 0.32's CPU build formed for the same
models (the engines of ``tests_e2e/test_speculative.py``; the one-group case
is also held to vLLM's grouping code in ``tests_e2e/test_spec_kinds.py``).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvoffload import ConfigError, build_offloading_config
from kvoffload.cli import main
from kvoffload.cli.plan import example_path
from kvoffload.config.hf_drafter import DRAFT_PREFIX, with_draft_model
from kvoffload.config.hf_layout import layout_from_hf_config
from kvoffload.keys import namespace_of
from kvoffload.standin import KVOffloadSide, KVPages, StandIn
from kvoffload.transfer import allocate_kv_caches

LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 2, "hidden_size": 64}  # fmt: skip
SMALL = {**LLAMA, "num_hidden_layers": 1, "num_key_value_heads": 1}


def test_a_drafter_joins_a_uniform_targets_group_with_its_own_pages() -> None:
    target = layout_from_hf_config(LLAMA, block_size=32)
    (same,) = with_draft_model(target, LLAMA, block_size=32).groups
    assert same.layer_names[2:] == tuple(DRAFT_PREFIX + n for n in target.layer_names)
    assert same.layer_pages == (8192,) * 4
    (small,) = with_draft_model(target, SMALL, block_size=32).groups
    assert small.layer_pages == (8192, 8192, 4096)  # vLLM 0.32: one group, two page sizes
    assert small.tokens_per_block == 32


def test_a_one_layer_drafter_beside_a_hybrid_target_is_a_group_of_its_own() -> None:
    gemma = json.loads(example_path("tiny_gemma4").read_text())
    target = layout_from_hf_config(gemma, block_size=32)
    layout = with_draft_model(target, SMALL, block_size=32)
    assert [g.tokens_per_block for g in layout.groups] == [512, 512, 512, 32, 1024]
    assert layout.groups[:4] == target.groups
    assert layout.groups[4].page_bytes == target.groups[3].page_bytes


def test_drafters_vllm_refuses_are_refused() -> None:
    gemma = json.loads(example_path("tiny_gemma4").read_text())
    target = layout_from_hf_config(gemma, block_size=32)
    with pytest.raises(ConfigError, match="draft model of 2 layers beside a hybrid target"):
        with_draft_model(target, LLAMA, block_size=32)
    with pytest.raises(ConfigError, match="blocks hold"):
        with_draft_model(layout_from_hf_config(LLAMA, block_size=32), SMALL, block_size=16)


def test_plan_shows_the_drafters_group_and_refuses_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, config in (("small", SMALL), ("llama", LLAMA)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    args = ["plan", "tiny_gemma4", "--block-size", "32", "--json", "--draft-model"]
    assert main([*args, str(tmp_path / "small")]) == 0
    groups = json.loads(capsys.readouterr().out)["groups"]
    assert [g["tokens_per_block"] for g in groups] == [512, 512, 512, 32, 1024]
    assert main([*args, str(tmp_path / "llama")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "draft model of 2 layers" in err


@pytest.mark.parametrize("target", ["llama", "gemma4"])
def test_the_stand_in_serves_a_drafters_layers_bit_exact(target: str) -> None:
    """Prompts evicted from the stand-in's GPU cache come back with the drafter's KV too."""
    base = LLAMA if target == "llama" else json.loads(example_path("tiny_gemma4").read_text())
    layout = with_draft_model(layout_from_hf_config(base, block_size=4), SMALL, block_size=4)
    assert any(name.startswith(DRAFT_PREFIX) for name in layout.layer_names)
    slot = max(g.chunk_bytes(1) for g in layout.groups)
    config = build_offloading_config({"cpu_bytes_to_use": 400 * slot}, layout)
    kv = allocate_kv_caches(layout, 120)
    side = KVOffloadSide(config, namespace_of("drafter", "bfloat16", layout), kv)
    try:
        engine = StandIn(layout, side, gpu_blocks=120, step_tokens=256, kv=KVPages(layout, kv))
        rng = random.Random(3)
        prompts = [[rng.randrange(1, 500) for _ in range(260)] for _ in range(4)]
        stats = engine.run([(f"{r}{i}", p) for r in "ab" for i, p in enumerate(prompts)])
    finally:
        side.close()
    assert stats.loaded_tokens > 0 and stats.verified_blocks > 0
    assert stats.mismatched_blocks == 0
