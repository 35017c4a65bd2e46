"""Every KV cache spec kind of vLLM, decided on vLLM's own objects (no engine, no forward pass).

The DeepSeek-V4 cases build the ``KVCacheConfig`` vLLM builds for a small
DeepSeek-V4-style model (its layers' ``get_kv_cache_spec`` and vLLM's
grouping, see ``_vllm_specs.py``), on the worker side and the scheduler
side, hand both to the connector's layout code and check each group's kind,
tokens per block, pages and hit rule (against vLLM's own managers), the
chunk settings, and a transfer through the very tensors vLLM would register.
They run against the installed vLLM 0.32 and, with ``make vllm033-check``,
against vLLM 0.33's modules.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import vllm.v1.kv_cache_interface as interface
from _vllm_specs import Built, build, dsv4_specs, llama4_specs
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    HiSparseHotSpec,
    HiSparseResidentSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from kvoffload import ConfigError, build_offloading_config
from kvoffload.config.layout import Reuse
from kvoffload.connector._hits import needed_tokens
from kvoffload.messages import BlockSpan
from kvoffload.transfer import KVTransfer
from kvoffload.vllm._layout import SPEC_TABLE, Action, group_map
from kvoffload.vllm._startup import kv_identity

BF16 = torch.bfloat16
ATTN: dict[str, Any] = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": BF16}
#: The DeepSeek-V4-style model of the notes: two sliding-only layers, C4, C128, C4, C128.
RATIOS = [0, 0, 4, 128, 4, 128]


# -- the table covers vLLM --------------------------------------------------------------------
def test_every_spec_class_of_vllm_has_exactly_one_decision() -> None:
    classes = {
        name
        for name, cls in inspect.getmembers(interface, inspect.isclass)
        if issubclass(cls, KVCacheSpec) and cls.__module__ == interface.__name__
    }
    # Abstract bases never reach a group; the wrapper is decided layer by layer.
    unrowed = {"KVCacheSpec", "AttentionSpec", "UniformTypeKVCacheSpecs"}
    rowed = {name.split("/")[0] for name in SPEC_TABLE}
    assert classes - unrowed == rowed
    assert all(row.reason and (row.kind is None) == (row.action is not Action.SERVE)
               for row in SPEC_TABLE.values())  # fmt: skip


def with_full(spec: KVCacheSpec, **group: Any) -> KVCacheConfig:
    """A config of a full-attention group and one group of ``spec`` (vLLM allocates none)."""
    return KVCacheConfig(
        num_blocks=8,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["full"], FullAttentionSpec(**ATTN)),
            KVCacheGroupSpec(["other"], spec, **group),
        ],
    )


class _Custom(FullAttentionSpec):
    """A spec class kvoffload has no row for (as a later vLLM may add)."""


MLA_C4 = MLAAttentionSpec(
    block_size=256, num_kv_heads=1, head_size=512, dtype=BF16, tokens_per_state=4
)
SWA_MLA = SlidingWindowMLASpec(
    block_size=64, num_kv_heads=1, head_size=512, dtype=BF16, sliding_window=128
)
CHUNKED = ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=64)
SERVED = [
    (FullAttentionSpec(**ATTN), "full", {}),
    (FullAttentionSpec(**ATTN, sliding_window=64), "full", {}),  # hybrid allocator off
    (FullAttentionSpec(**ATTN, attention_chunk_size=64), "full", {}),
    (SinkFullAttentionSpec(**ATTN, sink_len=16), "full", {}),
    (MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=BF16), "mla", {}),
    (MLA_C4, "compressed_mla", {}),
    (HiddenStateCacheSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=BF16), "mla", {}),
    (SlidingWindowSpec(**ATTN, sliding_window=64), "sliding", {"sliding_window": 64}),
    (SWA_MLA, "sliding_mla", {"sliding_window": 128}),
    (CHUNKED, "chunked_local", {"attention_chunk_size": 64}),
]


@pytest.mark.parametrize(("spec", "kind", "window"), SERVED, ids=lambda v: str(v)[:40])
def test_served_kinds(spec: KVCacheSpec, kind: str, window: dict[str, int]) -> None:
    served = group_map(with_full(spec))
    group = served.layout.groups[1]
    assert (group.kind, group.tokens_per_block, group.page_bytes) == (
        kind, spec.block_size, spec.page_size_bytes,
    )  # fmt: skip
    for name in ("sliding_window", "attention_chunk_size"):
        assert getattr(group, name) == window.get(name)
    assert served.group_ids == (0, 1) and served.skipped == ()


SKIPPED = [
    (SlidingWindowMLASpec(block_size=64, num_kv_heads=1, head_size=512, dtype=BF16,
                          sliding_window=128, bounded_replay=True), {}, "DeepSeek-V4.1"),
    (CircularBufferSpec(**ATTN), {}, "per-request ring"),
    (HiSparseHotSpec(block_size=64, page_size=4096, blocks_per_request=4), {}, "staging"),
    (HiSparseResidentSpec(block_size=64, page_size=4096), {}, "reclaimable"),
    (EncoderOnlyAttentionSpec(**ATTN), {}, "no KV between steps"),
    (FullAttentionSpec(**ATTN), {"enable_kv_transfer": False}, "enable_kv_transfer=False"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "group", "reason"), SKIPPED, ids=lambda v: str(v)[:40])
def test_skipped_kinds_are_neither_stored_nor_loaded(
    spec: KVCacheSpec, group: dict[str, Any], reason: str
) -> None:
    served = group_map(with_full(spec, **group))
    assert [g.kind for g in served.layout.groups] == ["full"]
    assert served.group_ids == (0,)
    assert served.skipped[0][0] == 1 and reason in served.skipped[0][1]
    # vLLM's block ids come per vLLM group; the skipped group's never reach the scheduler.
    assert served.served_block_ids([[4, 5], [9]]) == ([4, 5],)
    with pytest.raises(ConfigError, match="for 1 KV cache groups, the layout was built for 2"):
        served.served_block_ids([[4, 5]])


MAMBA = MambaSpec(block_size=256, shapes=((3, 512), (4, 64, 64)), dtypes=(BF16, BF16))
REFUSED = [
    (MAMBA, {}, r'MambaSpec.*enable_prefix_caching=True and mamba_cache_mode="align"'),
    (CrossAttentionSpec(**ATTN), {}, "CrossAttentionSpec.*encoder's input"),
    (RSWASpec(**ATTN, rswa_window=64), {}, "RSWASpec.*decode"),
    (FullAttentionSpec(**ATTN, non_causal=True), {}, "FullAttentionSpec.*prefix LM"),
    (SinkFullAttentionSpec(**ATTN, sink_len=16, non_causal=True), {}, "prefix LM"),
    (_Custom(**ATTN), {}, "unknown KV cache spec class .*_Custom"),
    (FullAttentionSpec(**ATTN), {"host_resident": True}, "host pool"),
]


def test_a_state_group_with_speculative_blocks_is_served() -> None:
    """MTP beside gated DeltaNet: the states accepted drafts move are not stored
    (``kvoffload.connector._drafts``), so the group is served, with or without them."""
    for blocks in (0, 1, 2):
        spec = replace(MAMBA, mamba_cache_mode="align", num_speculative_blocks=blocks)
        assert [g.kind for g in group_map(with_full(spec)).layout.groups] == ["full", "mamba"]


@pytest.mark.parametrize(("spec", "group", "reason"), REFUSED, ids=lambda v: str(v)[:40])
def test_refused_kinds_name_the_group_and_the_reason(
    spec: KVCacheSpec, group: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ConfigError, match=f"cannot offload KV cache group 1 .*{reason}"):
        group_map(with_full(spec, **group))


def test_a_model_with_nothing_reusable_is_refused() -> None:
    config = KVCacheConfig(8, [], [KVCacheGroupSpec(["ring"], CircularBufferSpec(**ATTN))])
    with pytest.raises(ConfigError, match="no KV cache group a prefix hit can reuse"):
        group_map(config)


# -- DeepSeek-V4 ------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["fp8_ds_mla", "bf16"])
def dsv4(request: pytest.FixtureRequest) -> Built:
    """vLLM's KV cache of the model, in the block-outermost layout its indexer requires."""
    return build(dsv4_specs(RATIOS, fp8=request.param == "fp8_ds_mla"), KVCacheLayout.BLHNC)


def test_dsv4_scheduler_and_workers_build_the_same_layout(dsv4: Built) -> None:
    # The scheduler sees each group's first layer only (generate_scheduler_kv_cache_config).
    worker, scheduler = group_map(dsv4.worker), group_map(dsv4.scheduler)
    assert [type(g.kv_cache_spec).__name__ for g in dsv4.worker.kv_cache_groups] == [
        "UniformTypeKVCacheSpecs"
    ] * 6
    assert worker == scheduler
    for group, vllm_group in zip(worker.layout.groups, dsv4.worker.kv_cache_groups, strict=True):
        inner = vllm_group.kv_cache_spec.kv_cache_specs  # type: ignore[attr-defined]
        assert group.layer_pages == tuple(inner[n].page_size_bytes for n in group.layer_names)
        assert group.block_bytes == vllm_group.kv_cache_spec.page_size_bytes


def test_dsv4_groups_have_their_kinds_blocks_and_windows(dsv4: Built) -> None:
    layout = group_map(dsv4.scheduler).layout
    got = [(g.kind, g.tokens_per_block, g.sliding_window, g.num_layers) for g in layout.groups]
    assert got == [
        ("sliding_mla", 64, 128, 2),  # every layer's SWA cache, three groups of two
        ("sliding_mla", 64, 128, 2),
        ("sliding_mla", 64, 128, 2),
        ("compressed_mla", 256, None, 6),  # C4 and C128 caches and the indexer's keys
        ("sliding_mla", 4, 8, 4),  # the C4 compressors' states (attention and indexer)
        ("sliding_mla", 8, 128, 2),  # the C128 compressors' states
    ]
    assert len(set(layout.groups[3].layer_pages)) == 3  # 64 or 2 entries per 256 tokens


@pytest.mark.parametrize("hit", [256, 512, 1024, 1280])
def test_dsv4_hit_rules_match_vllms_managers(dsv4: Built, hit: int) -> None:
    """What a hit needs from each group starts where vLLM's manager stops skipping tokens."""
    served = group_map(dsv4.scheduler)
    for g, group in zip(served.group_ids, served.layout.groups, strict=True):
        spec = dsv4.scheduler.kv_cache_groups[g].kv_cache_spec
        manager = KVCacheSpecRegistry.get_manager_class(spec)
        assert manager is not None
        state = SimpleNamespace(
            sliding_window=getattr(spec, "sliding_window", None),
            extra_retained_tokens=getattr(spec, "extra_retained_tokens", 0),
            attention_chunk_size=getattr(spec, "attention_chunk_size", None),
        )
        skipped = manager.get_num_skipped_tokens(state, hit)  # type: ignore[arg-type]
        assert needed_tokens(group, 0, hit) == (skipped, hit), (g, manager.__name__)
        assert (group.reuse is Reuse.PREFIX) == (skipped == 0)


@pytest.mark.parametrize("bpc", [1, 2])
def test_dsv4_takes_blocks_per_chunk(dsv4: Built, bpc: int) -> None:
    layout = group_map(dsv4.scheduler).layout
    config = build_offloading_config({"blocks_per_chunk": bpc, "cpu_bytes_to_use": "64MiB"}, layout)
    assert config.tokens_per_chunk == tuple(bpc * t for t in (64, 64, 64, 256, 4, 8))
    assert config.chunk_bytes == tuple(bpc * g.block_bytes for g in layout.groups)
    assert config.num_cpu_chunks == (64 << 20) // max(config.chunk_bytes)


def test_dsv4_refuses_block_size_and_points_to_blocks_per_chunk(dsv4: Built) -> None:
    layout = group_map(dsv4.scheduler).layout
    with pytest.raises(ConfigError, match=r"\[64, 64, 64, 256, 4, 8\]; use 'blocks_per_chunk'"):
        build_offloading_config({"block_size": 256, "cpu_bytes_to_use": "64MiB"}, layout)


@pytest.mark.parametrize("bpc", [1, 2])
def test_dsv4_transfer_through_the_tensors_vllm_registers(dsv4: Built, bpc: int) -> None:
    """vLLM's own allocator makes the tensors (packed blocks, padded pages, fp8 and fp32)."""
    from vllm.v1.worker.utils import allocate_kv_cache

    served = group_map(dsv4.worker)
    src = allocate_kv_cache(dsv4.worker, torch.device("cpu"), dsv4.layout)
    dst = allocate_kv_cache(dsv4.worker, torch.device("cpu"), dsv4.layout)
    src_raw = _storage(src)
    src_raw.copy_(torch.randint(0, 256, src_raw.shape, dtype=torch.uint8))
    out, back = KVTransfer(served.layout, src, bpc), KVTransfer(served.layout, dst, bpc)
    ids = (7, 3, 4, 5)[: 2 * bpc]
    for g in range(len(served.layout.groups)):
        chunks = [torch.zeros(out.chunk_bytes(g), dtype=torch.uint8) for _ in range(2)]
        out.gather(g, BlockSpan(ids), chunks[: BlockSpan(ids).num_chunks(bpc)])
        back.scatter(g, BlockSpan(ids), chunks[: BlockSpan(ids).num_chunks(bpc)])
    # Every group aliases the same buffer: after all groups, the blocks moved are equal
    # byte for byte in every layer's page, and no other block was written.
    stride = dsv4.worker.kv_cache_tensors[0].block_stride
    moved = torch.zeros(_storage(dst).numel(), dtype=torch.bool)
    for b in ids:
        moved[b * stride : (b + 1) * stride] = True
    assert torch.equal(_storage(dst)[moved], src_raw[moved])
    assert int(_storage(dst)[~moved].count_nonzero()) == 0


def _storage(kv_caches: dict[str, torch.Tensor]) -> torch.Tensor:
    """The one backing allocation vLLM views every layer of."""
    tensor = next(iter(kv_caches.values()))
    flat = torch.empty(0, dtype=torch.uint8)
    flat.set_(tensor.untyped_storage())
    return flat


# -- Llama-4 and Qwen3-Next -------------------------------------------------------------------
def test_llama4_chunked_local_groups_with_the_hybrid_allocator_on() -> None:
    served = group_map(build(llama4_specs(), KVCacheLayout.LBNHC).scheduler)
    got = [(g.kind, g.attention_chunk_size, g.num_layers) for g in served.layout.groups]
    assert got == [("chunked_local", 8192, 2)] * 3 + [("full", None, 2)]
    group = served.layout.groups[0]
    assert needed_tokens(group, 0, 8192 + 384) == (8192, 8192 + 384)


def test_llama4_is_one_full_group_with_the_hybrid_allocator_off() -> None:
    """vLLM's default for Llama-4: chunked layers promoted to full attention keep every block."""
    served = group_map(build(llama4_specs(), KVCacheLayout.LBNHC, hybrid=False).scheduler)
    assert [(g.kind, g.num_layers) for g in served.layout.groups] == [("full", 8)]


def test_qwen3_next_is_three_state_groups_and_one_full_group() -> None:
    """Three gated-DeltaNet layers and one full layer, as vLLM's CPU backend groups them."""
    page = 256 * 2 * 64 * 2  # the attention page the state page is padded up to
    gdn = MambaSpec(block_size=256, shapes=((3, 512), (4, 64, 64)), dtypes=(BF16, BF16),
                    page_size_padded=page, mamba_cache_mode="align")  # fmt: skip
    full = FullAttentionSpec(block_size=256, num_kv_heads=1, head_size=64, dtype=BF16)
    specs: dict[str, KVCacheSpec] = {f"model.layers.{i}.linear_attn": gdn for i in range(3)}
    specs["model.layers.3.self_attn.attn"] = full
    built = build(specs, KVCacheLayout.LBHNC)
    assert [type(g.kv_cache_spec).__name__ for g in built.scheduler.kv_cache_groups] == [
        "MambaSpec", "MambaSpec", "MambaSpec", "FullAttentionSpec",
    ]  # fmt: skip
    layout = group_map(built.scheduler).layout
    state = (3 * 512 + 4 * 64 * 64) * 2  # vLLM pads it to ``page``; only the state is moved
    assert [(g.kind, g.tokens_per_block, g.page_bytes) for g in layout.groups] == [
        ("mamba", 256, state), ("mamba", 256, state), ("mamba", 256, state), ("full", 256, page),
    ]  # fmt: skip
    assert group_map(built.worker).layout == layout
    group = layout.groups[0]
    assert needed_tokens(group, 0, 1024) == (1023, 1024)  # the block ending at 1024
    assert group.chunk_bytes(blocks_per_chunk=2) == state  # one state per chunk


# -- kvoffload plan forms the groups vLLM forms -----------------------------------------------
DEFAULT_43 = [128, 128] + [4 if i % 2 else 128 for i in range(41)]


@pytest.mark.parametrize("ratios", [RATIOS, [0, 4, 4, 128, 0, 128, 4, 4], DEFAULT_43])
@pytest.mark.parametrize("dtype", ["fp8_ds_mla", "bfloat16"])
def test_plan_of_a_deepseek_v4_config_is_vllms_layout(ratios: list[int], dtype: str) -> None:
    from kvoffload.config.hf_layout import layout_from_hf_config

    config = {"model_type": "deepseek_v4", "num_hidden_layers": len(ratios),
              "compress_ratios": ratios}  # fmt: skip
    specs = dsv4_specs(ratios, fp8=dtype == "fp8_ds_mla")
    vllm_layout = group_map(build(specs, KVCacheLayout.BLHNC).scheduler).layout
    assert layout_from_hf_config(config, dtype=dtype) == vllm_layout


@pytest.mark.parametrize("hybrid", [True, False])
def test_plan_of_a_llama4_config_is_vllms_layout(hybrid: bool) -> None:
    from kvoffload.config.hf_layout import layout_from_hf_config

    config = {"model_type": "llama4_text", "num_hidden_layers": 8, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 2048,
              "attention_chunk_size": 8192}  # fmt: skip
    built = build(llama4_specs(), KVCacheLayout.LBNHC, hybrid=hybrid)
    assert layout_from_hf_config(config, block_size=128, hybrid=hybrid) == (
        group_map(built.scheduler).layout
    )


def test_plan_of_a_qwen3_next_config_has_vllms_state_bytes() -> None:
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    from kvoffload.cli.plan import example_path
    from kvoffload.config.hf_layout import layout_from_hf_config, load_hf_config

    config = load_hf_config(example_path("tiny_qwen3_next"))
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        1, config["linear_num_key_heads"], config["linear_num_value_heads"],
        config["linear_key_head_dim"], config["linear_value_head_dim"],
        config["linear_conv_kernel_dim"],
    )  # fmt: skip
    state = sum(2 * math.prod(shape) for shape in shapes)  # bfloat16
    layout = layout_from_hf_config(config, block_size=128)
    assert [g.page_bytes for g in layout.groups if g.kind == "mamba"] == [state] * 3 == [35840] * 3


# -- vLLM 0.34's page fields ------------------------------------------------------------------
@pytest.mark.skipif(
    "kv_head_major_slots" not in {f.name for f in dataclasses.fields(FullAttentionSpec)},
    reason="vLLM 0.34's spec fields",
)
def test_page_fields_are_served_and_name_the_namespace() -> None:
    """Fields that reorder a page's bytes change no group, and enter the key namespace."""
    plain = group_map(with_full(SlidingWindowSpec(**ATTN, sliding_window=64)))
    major = group_map(with_full(SlidingWindowSpec(**ATTN, sliding_window=64,
                                                  kv_head_major_slots=True)))  # fmt: skip
    assert major.layout == plain.layout
    assert (plain.page_format, major.page_format) == ((), (("kv_head_major_slots", True),))
    # A 5-byte and a 6-byte state: 16-byte alignment pads the first to 16 within the page.
    state = MambaSpec(block_size=16, shapes=((5,), (3,)), dtypes=(torch.uint8, BF16),
                      mamba_cache_mode="align", state_alignment=16)  # fmt: skip
    aligned = group_map(with_full(state))
    assert aligned.page_format == (("state_alignment", 16),)
    assert aligned.layout.groups[1].page_bytes == 16 + 16  # every state, at its offset
    assert group_map(with_full(replace(state, state_alignment=1))).layout.groups[1].page_bytes == 11
    engine = SimpleNamespace(model_config=SimpleNamespace(model="m"), speculative_config=None)
    names = {kv_identity(engine, g) for g in (plain, major, aligned)}
    assert len(names) == 3 and kv_identity(engine, plain) == "m"  # 0.32's namespace kept


# -- a draft model's layers (method: draft_model) ------------------------------------------
@pytest.mark.parametrize("draft_heads", [2, 1])
def test_plan_of_a_draft_model_is_vllms_grouping(draft_heads: int) -> None:
    """The target's and the drafter's layers as vLLM's grouping code forms them."""
    from kvoffload.config.hf_drafter import with_draft_model
    from kvoffload.config.hf_layout import layout_from_hf_config

    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "hidden_size": 64}  # fmt: skip
    draft = {**config, "num_hidden_layers": 1, "num_key_value_heads": draft_heads}
    spec = {"block_size": 32, "head_size": 32, "dtype": BF16}
    specs: dict[str, KVCacheSpec] = {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(num_kv_heads=2, **spec)
        for i in range(2)
    }
    specs["draft_model.model.layers.0.self_attn.attn"] = FullAttentionSpec(
        num_kv_heads=draft_heads, **spec
    )
    vllm_layout = group_map(build(specs, KVCacheLayout.LBHNC).scheduler).layout
    target = layout_from_hf_config(config, block_size=32)
    assert with_draft_model(target, draft, block_size=32) == vllm_layout
    assert len(vllm_layout.groups) == 1  # the drafter's layer in the target's group
