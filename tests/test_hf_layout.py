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
        (llama(num_hidden_layers=0), {}, r"'num_hidden_layers' must be an int in \[1, 65536\]"),
        (llama(num_hidden_layers=10**9), {}, r"must be an int in \[1, 65536\], got 1000000000"),
        ({"model_type": "deepseek_v4", "num_hidden_layers": 10**9}, {}, "got 1000000000"),
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


# -- DeepSeek-V4 ------------------------------------------------------------------------------
DSV4 = example_path("tiny_deepseek_v4")


@pytest.mark.parametrize(
    ("dtype", "pages"),
    [
        # SWA, [indexer keys, MLA C4, MLA C128], C4 states [indexer, attention], C128 states
        ("fp8_ds_mla", (37440, (8640, 37440, 1728), (8640, 32832), 32832)),
        ("bfloat16", (65536, (8704, 65536, 2048), (8192, 32768), 32768)),
    ],
)
def test_deepseek_v4_groups_as_vllm_packs_them(
    dtype: str, pages: tuple[int, tuple[int, ...], tuple[int, ...], int]
) -> None:
    """The notes' worked example: compress ratios [0, 0, 4, 128, 4, 128] (+1 MTP entry)."""
    layout = layout_from_hf_config(DSV4, dtype=dtype)
    got = [(g.kind, g.tokens_per_block, g.sliding_window) for g in layout.groups]
    assert got == [("sliding_mla", 64, 128)] * 3 + [
        ("compressed_mla", 256, None),
        ("sliding_mla", 4, 8),
        ("sliding_mla", 8, 128),
    ]
    swa, mla, c4, c128 = pages
    assert [g.layer_names for g in layout.groups[:3]] == [
        (f"model.layers.{i}.attn.swa_cache", f"model.layers.{i + 3}.attn.swa_cache")
        for i in range(3)
    ]
    assert all(g.layer_pages == (swa, swa) for g in layout.groups[:3])
    assert layout.groups[3].layer_names == tuple(
        f"model.layers.{name}"
        for name in ("2.attn.indexer.k_cache", "2.attn", "3.attn",
                     "4.attn.indexer.k_cache", "4.attn", "5.attn")
    )  # fmt: skip
    assert layout.groups[3].layer_pages == (*mla[:2], mla[2], *mla[:2], mla[2])
    assert layout.groups[4].layer_pages == c4 * 2
    assert layout.groups[5].layer_pages == (c128, c128)


def test_deepseek_v4_default_pattern_packs_into_five_groups() -> None:
    """transformers' default 43 layers (HCA, HCA, then HCA and CSA in turn), as vLLM forms them."""
    config = {"model_type": "deepseek_v4", "num_hidden_layers": 43}
    layout = layout_from_hf_config(config, dtype="fp8_ds_mla")
    got = [(g.kind, g.tokens_per_block, g.num_layers) for g in layout.groups]
    assert got == [
        ("sliding_mla", 64, 22),
        ("sliding_mla", 64, 21),
        ("compressed_mla", 256, 43 + 20),  # every MLA cache and the 20 CSA layers' keys
        ("sliding_mla", 8, 23),  # HCA compressor states
        ("sliding_mla", 4, 40),  # CSA compressor states, attention's and the indexer's
    ]


def test_deepseek_v4_layer_types_mean_the_same_as_compress_ratios() -> None:
    types = {0: "sliding_attention", 4: "compressed_sparse_attention",
             128: "heavily_compressed_attention"}  # fmt: skip
    ratios = [0, 4, 4, 128, 0, 128, 4, 4]
    by_ratios = {"model_type": "deepseek_v4", "num_hidden_layers": 8, "compress_ratios": ratios}
    by_types = {**by_ratios, "layer_types": [types[r] for r in ratios]}
    del by_types["compress_ratios"]
    assert layout_from_hf_config(by_ratios) == layout_from_hf_config(by_types)


@pytest.mark.parametrize(
    ("overrides", "dtype", "fragment"),
    [
        ({"compress_ratios": [0, 2]}, "bfloat16", "must be 0, 4 or 128"),
        ({"compress_ratios": [0]}, "bfloat16", "one per layer"),
        ({"layer_types": ["sliding_attention", "dense"]}, "bfloat16", "unknown"),
        ({"head_dim": 256}, "fp8_ds_mla", "584 bytes per token for head_dim 512"),
        ({}, "float16", "DeepSeek-V4 KV cache dtype 'float16'"),
        ({"sliding_window": 0}, "bfloat16", "'sliding_window' must be a positive int"),
    ],
)
def test_bad_deepseek_v4_configs(overrides: dict[str, Any], dtype: str, fragment: str) -> None:
    config = {"model_type": "deepseek_v4", "num_hidden_layers": 2, **overrides}
    with pytest.raises(ConfigError, match=fragment):
        layout_from_hf_config(config, dtype=dtype)


# -- Qwen3-Next / Qwen3.5 and Llama-4 ---------------------------------------------------------
def test_qwen3_next_state_groups_as_measured_on_vllms_cpu_backend() -> None:
    """Measured (notes): 3 GDN groups and 1 full, block 256, state 35840 B in a 65536 B page."""
    layout = layout_from_hf_config(example_path("tiny_qwen3_next"), block_size=128)
    assert [(g.kind, g.tokens_per_block, g.page_bytes) for g in layout.groups] == [
        ("mamba", 256, 35840), ("mamba", 256, 35840), ("mamba", 256, 35840), ("full", 256, 65536),
    ]  # fmt: skip
    assert layout.groups[0].layer_names == ("model.layers.0.linear_attn",)


@pytest.mark.parametrize(("block_size", "block"), [(16, 544), (128, 640)])
def test_qwen3_next_80b_raises_the_attention_block_until_a_page_holds_a_state(
    block_size: int, block: int
) -> None:
    """Qwen3-Next-80B: a 1097728-byte state, 2048 attention bytes per token (notes, §2.2)."""
    config = {
        "model_type": "qwen3_next", "num_hidden_layers": 48, "full_attention_interval": 4,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    }  # fmt: skip
    layout = layout_from_hf_config(config, block_size=block_size)
    assert [(g.kind, g.num_layers) for g in layout.groups] == [("mamba", 12)] * 3 + [("full", 12)]
    assert layout.tokens_per_block == (block,) * 4
    assert layout.groups[0].page_bytes == 3 * 8192 * 2 + 32 * 128 * 128 * 2
    assert layout.groups[3].page_bytes == block * 2048


def test_llama4_is_one_full_group_unless_the_hybrid_allocator_is_on() -> None:
    source = example_path("tiny_llama4")
    (only,) = layout_from_hf_config(source, block_size=128).groups  # vLLM's default
    assert (only.kind, only.num_layers) == ("full", 8)
    layout = layout_from_hf_config(source, block_size=128, hybrid=True)
    assert [(g.kind, g.attention_chunk_size) for g in layout.groups] == [
        ("chunked_local", 1024)] * 3 + [("full", None)]  # fmt: skip
    # NoPE layers (every 4th) attend fully, the others in chunks: [0,4], [1,5], [2,6], [3,7].
    assert [g.layer_names[1][13] for g in layout.groups] == ["4", "5", "6", "7"]
    types = ["chunked_attention"] * 3 + ["full_attention"]
    explicit = {"model_type": "llama4_text", "num_hidden_layers": 4, "num_attention_heads": 4,
                "hidden_size": 256, "attention_chunk_size": 64, "layer_types": types}  # fmt: skip
    kinds = [g.kind for g in layout_from_hf_config(explicit, hybrid=True).groups]
    assert kinds == ["chunked_local"] * 3 + ["full"]
    no_chunks = {**explicit, "attention_chunk_size": None}
    assert [g.kind for g in layout_from_hf_config(no_chunks, hybrid=True).groups] == ["full"]


def test_without_the_hybrid_allocator_pages_must_agree() -> None:
    with pytest.raises(ConfigError, match="one page size for all layers"):
        layout_from_hf_config(GEMMA4, hybrid=False)
    with pytest.raises(ConfigError, match="hybrid KV cache allocator for recurrent"):
        layout_from_hf_config(example_path("tiny_qwen3_next"), hybrid=False)
