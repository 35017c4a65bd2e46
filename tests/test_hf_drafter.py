"""A draft model's layers in ``kvoffload plan``'s layout, where vLLM 0.32 puts them.

The expected groups are those vLLM 0.32's CPU build formed for the same
models (the engines of ``tests_e2e/test_speculative.py``; the one-group case
is also held to vLLM's grouping code in ``tests_e2e/test_spec_kinds.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload import ConfigError
from kvoffload.cli import main
from kvoffload.cli.plan import example_path
from kvoffload.config.hf_drafter import DRAFT_PREFIX, with_draft_model
from kvoffload.config.hf_layout import layout_from_hf_config

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
