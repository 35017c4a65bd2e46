"""vLLM's own KV cache objects for a model, built the way vLLM builds them, with no engine.

The per-layer specs come from the model layers' own ``get_kv_cache_spec``
methods (DeepSeek-V4) or the spec constructors its layers call (Qwen3-Next,
Llama-4), each called with the attributes the layer's constructor sets; the
groups, the ``KVCacheConfig`` of a worker and the scheduler's flattened copy
come from vLLM's grouping code itself. Nothing runs a forward pass, so this
works on any CPU, against vLLM 0.32 (installed) and 0.33 (its wheel's
modules on ``PYTHONPATH``: ``make vllm033-check``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

try:  # 0.33 moved the grouping into kv_cache_planning
    from vllm.v1.core.kv_cache_planning import (  # type: ignore[import-not-found]
        get_kv_cache_config_from_groups,
        get_kv_cache_groups,
    )
except ImportError:
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

#: DeepSeek-V4's backends take only 256-token blocks (sparse_mla.py); its SWA cache uses 64.
DSV4_BLOCK = 256


def _engine_config(layout: KVCacheLayout, *, hybrid: bool = True, cache_dtype: str = "auto") -> Any:
    """The parts of ``VllmConfig`` vLLM's grouping reads."""
    return SimpleNamespace(
        scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=not hybrid),
        attention_config=SimpleNamespace(hisparse_config=None),
        speculative_config=None,
        cache_config=SimpleNamespace(
            get_resolved_kv_cache_layout=lambda: layout,
            kv_cache_layout=layout.name,
            prefix_cache_retention_interval=0,
            num_gpu_blocks_override=None,
            block_size=DSV4_BLOCK,
            cache_dtype=cache_dtype,
        ),
    )


@dataclass
class Built:
    """One model's KV cache as vLLM forms it."""

    specs: dict[str, KVCacheSpec]
    worker: KVCacheConfig
    scheduler: KVCacheConfig
    layout: KVCacheLayout


def build(
    specs: dict[str, KVCacheSpec],
    layout: KVCacheLayout,
    memory: int = 64 << 20,
    *,
    hybrid: bool = True,
) -> Built:
    """Group ``specs`` with vLLM's code: a worker's config and the scheduler's."""
    config = _engine_config(layout, hybrid=hybrid)
    groups = get_kv_cache_groups(config, dict(specs))
    worker = get_kv_cache_config_from_groups(config, groups, memory)
    worker.kv_cache_layout = layout.name
    return Built(specs, worker, generate_scheduler_kv_cache_config([worker]), layout)


def dsv4_specs(
    compress_ratios: list[int],
    *,
    fp8: bool = True,
    window: int = 128,
    head_dim: int = 512,
    index_head_dim: int = 128,
) -> dict[str, KVCacheSpec]:
    """Every KV cache layer of a DeepSeek-V4 decoder, from the layers' own methods.

    Layer ``i`` of compress ratio ``r`` (``max(1, ratio)``, attention.py) has
    an SWA cache; ``r > 1`` adds the compressed MLA cache and its
    compressor's state; ``r == 4`` adds the sparse indexer's key cache and its
    compressor's state. ``fp8`` is FlashMLA's ``fp8_ds_mla`` cache (the
    default on SM90/SM100), otherwise a bf16 cache.
    """
    from vllm.models.deepseek_v4.attention import DeepseekV4Attention, DeepseekV4IndexerCache
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    cache_dtype = "fp8_ds_mla" if fp8 else "auto"
    kv_dtype = torch.uint8 if fp8 else torch.bfloat16
    cache_config = SimpleNamespace(cache_dtype=cache_dtype, block_size=DSV4_BLOCK)
    engine = SimpleNamespace(cache_config=cache_config)
    specs: dict[str, KVCacheSpec] = {}
    for i, ratio in enumerate(compress_ratios):
        # In the order the layers register (attention.py): the indexer's caches, then the
        # SWA cache, the attention itself and its compressor.
        r, prefix = max(1, ratio), f"model.layers.{i}.attn"
        if r == 4:
            keys = SimpleNamespace(
                cache_config=cache_config, head_dim=index_head_dim + index_head_dim // 128 * 4,
                dtype=torch.uint8, compress_ratio=4,
            )  # fmt: skip
            specs[f"{prefix}.indexer.k_cache"] = _spec(DeepseekV4IndexerCache, keys, engine)
            index_state = SimpleNamespace(
                block_size=4, state_dim=2 * 2 * index_head_dim, dtype=torch.float32,
                sliding_window=8,
            )  # fmt: skip
            specs[f"{prefix}.indexer.compressor.state_cache"] = _spec(
                CompressorStateCache, index_state, engine
            )
        swa = SimpleNamespace(
            bounded_replay=False, block_size=64, head_dim=head_dim, dtype=kv_dtype,
            window_size=window, cache_config=cache_config, packed_bytes_per_token=584,
            packed_page_alignment=576, packed_block_stride_alignment=None,
        )  # fmt: skip
        specs[f"{prefix}.swa_cache"] = _spec(DeepseekV4SWACache, swa, engine)
        if r == 1:
            continue
        attn = SimpleNamespace(
            compress_ratio=r, kv_cache_dtype=cache_dtype, head_dim=head_dim,
            kv_cache_torch_dtype=torch.bfloat16,
        )  # fmt: skip
        specs[prefix] = _spec(DeepseekV4Attention, attn, engine)
        coff = 1 + (r == 4)
        state = SimpleNamespace(
            block_size=4 if r == 4 else 8, state_dim=2 * coff * head_dim, dtype=torch.float32,
            sliding_window=coff * r,
        )  # fmt: skip
        specs[f"{prefix}.compressor.state_cache"] = _spec(CompressorStateCache, state, engine)
    return specs


def _spec(layer_class: Any, layer: SimpleNamespace, engine: SimpleNamespace) -> KVCacheSpec:
    """The layer class's own ``get_kv_cache_spec``, on the attributes its constructor sets."""
    spec: KVCacheSpec = layer_class.get_kv_cache_spec(layer, engine)
    return spec


def llama4_specs(
    num_layers: int = 8, chunk: int = 8192, block: int = 128
) -> dict[str, KVCacheSpec]:
    """Llama-4's layers (vllm llama4.py): chunked local attention, every 4th layer NoPE full."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec

    specs: dict[str, KVCacheSpec] = {}
    for i in range(num_layers):
        kw: dict[str, Any] = {"block_size": block, "num_kv_heads": 8, "head_size": 128,
                              "dtype": torch.bfloat16}  # fmt: skip
        nope = (i + 1) % 4 == 0
        specs[f"model.layers.{i}.self_attn.attn"] = (
            FullAttentionSpec(**kw)
            if nope
            else ChunkedLocalAttentionSpec(attention_chunk_size=chunk, **kw)
        )
    return specs
