"""layout_from_hf_config forms groups the way vLLM 0.32's hybrid allocator does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvoffload import ConfigError, layout_from_hf_config
from kvoffload.cli.plan import example_path

GEMMA4 = example_path("tiny_gemma4")


def llama(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
    }
    config.update(overrides)
    return config


@pytest.mark.parametrize(
    ("block_size", "tokens_per_block", "page_bytes"),
    [(128, (2048, 2048, 2048, 128), 524288), (32, (512, 512, 512, 32), 131072)],
)
def test_gemma4_gets_four_groups_as_on_vllms_cpu_backend(
    block_size: int, tokens_per_block: tuple[int, ...], page_bytes: int
) -> None:
    layout = layout_from_hf_config(GEMMA4, dtype="bfloat16", block_size=block_size)
    assert layout.tokens_per_block == tokens_per_block
    assert [g.kind for g in layout.groups] == ["sliding", "sliding", "sliding", "full"]
    assert all(g.num_layers == 1 for g in layout.groups)
    assert {g.page_bytes for g in layout.groups} == {page_bytes}
    assert layout.groups[0].sliding_window == 64
    assert layout.groups[3].layer_names == ("model.layers.3.self_attn.attn",)


def test_gemma4_per_layer_config_and_text_config_nesting(tmp_path: Path) -> None:
    text = json.loads(GEMMA4.read_text())
    del text["global_head_dim"]
    text["per_layer_config"] = {"3": {"head_dim": 512}}
    (tmp_path / "config.json").write_text(json.dumps({"text_config": text}))
    layout = layout_from_hf_config(tmp_path, block_size=128)
    assert layout.tokens_per_block == (2048, 2048, 2048, 128)


def test_llama_has_one_full_group_with_the_block_size() -> None:
    layout = layout_from_hf_config(llama(), dtype="float16", block_size=16)
    (group,) = layout.groups
    assert (group.kind, group.tokens_per_block, group.num_layers) == ("full", 16, 2)
    assert group.page_bytes == 2 * 16 * 2 * (256 // 8) * 2  # K+V, tokens, heads, head_dim, fp16


def test_five_to_one_pattern_groups_like_gemma3() -> None:
    config = llama(num_hidden_layers=12, sliding_window=512, sliding_window_pattern=6, head_dim=64)
    layout = layout_from_hf_config(config, block_size=16)
    # 10 sliding + 2 full layers -> group size 2 -> five sliding groups and one full group.
    assert [g.kind for g in layout.groups] == ["sliding"] * 5 + ["full"]
    assert layout.groups[0].layer_names == (
        "model.layers.0.self_attn.attn",
        "model.layers.6.self_attn.attn",
    )
    assert layout.tokens_per_block == (16,) * 6  # same page shape: no rescaling


def test_near_equal_counts_use_the_larger_group_size() -> None:
    types = ["sliding_attention"] * 12 + ["full_attention"] * 13
    layout = layout_from_hf_config(
        llama(num_hidden_layers=25, layer_types=types, sliding_window=128), block_size=16
    )
    assert [g.num_layers for g in layout.groups] == [12, 13]


def test_mla_layers_store_one_latent_per_token() -> None:
    config = llama(kv_lora_rank=512, qk_rope_head_dim=64)
    (group,) = layout_from_hf_config(config, dtype="bfloat16", block_size=64).groups
    assert group.kind == "mla"
    assert group.page_bytes == 64 * (512 + 64) * 2


def test_kv_shared_layers_have_no_cache_of_their_own() -> None:
    layout = layout_from_hf_config(llama(num_hidden_layers=4, num_kv_shared_layers=2))
    assert layout.layer_names == ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


@pytest.mark.parametrize(
    ("source", "kwargs", "fragment"),
    [
        ("/nonexistent/model", {}, "no model config at"),
        (llama(), {"dtype": "float64"}, "unknown KV cache dtype"),
        (llama(), {"block_size": 0}, "block_size must be a positive int"),
        (llama(num_hidden_layers=0), {}, "'num_hidden_layers' must be a positive int"),
        (llama(layer_types=["full_attention"]), {}, "one type per layer"),
        (llama(layer_types=["mamba", "full_attention"]), {}, "cannot map"),
        (llama(num_hidden_layers=2, num_kv_shared_layers=2), {}, "no layer with its own KV"),
    ],
)
def test_unmappable_configs_are_config_errors(
    source: Any, kwargs: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ConfigError, match=fragment):
        layout_from_hf_config(source, **kwargs)


def test_unreadable_json_is_a_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read model config"):
        layout_from_hf_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object"):
        layout_from_hf_config(bad)
