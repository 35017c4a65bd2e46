"""DeepSeek-V4's KV cache groups from its ``config.json``, formed as vLLM 0.32/0.33 forms them.

Every decoder layer ``i`` has a compress ratio ``r``: 1 for a
``sliding_attention`` layer, 4 for ``compressed_sparse_attention`` (CSA), 128
for ``heavily_compressed_attention`` (HCA); ``layer_types`` and
``compress_rates`` name them, or the older ``compress_ratios`` list (0, 4,
128, MTP entries past ``num_hidden_layers`` ignored: MTP layers hold KV only
when vLLM runs them for speculative decoding). The layer's KV cache layers,
in the order they register in vLLM (``models/deepseek_v4/attention.py``):

=================================  =====  ===========  ========================  ======
layer                              when   block (tok)  entry                     window
=================================  =====  ===========  ========================  ======
``attn.indexer.k_cache``           r=4    256, 64/blk  132 B (fp8 keys + scales)  -
``attn.indexer.compressor.state``  r=4    4            fp32 x 4 x index_head_dim  8
``attn.swa_cache``                 all    64           one token                 sliding_window
``attn``                           r>1    256, 256/r   one entry per r tokens    -
``attn.compressor.state_cache``    r>1    4 (r=4), 8   fp32 x 2 x coff x head    coff x r
=================================  =====  ===========  ========================  ======

(``coff`` is 2 for r=4, else 1.) A token or entry of the MLA caches is 584
bytes in FlashMLA's ``fp8_ds_mla`` layout (448 fp8 NoPE bytes, 64 bf16 RoPE
dims, 8 scale bytes) or ``head_dim`` elements of the cache dtype; pages are
padded to 576 bytes (``fp8_ds_mla``) or 512. vLLM packs these layers into
blocks of the block-outermost layout its indexer requires
(``_get_packed_kv_cache_groups``): layers of one *type* (block size and
window; the MLA caches and the indexer keys are one type) form a bucket; a
bucket holding as many layers of each page size is a repeating pattern, and
all such buckets are cut into groups of the same number of repeats (the one
that pads least, at least the largest mixed bucket's count). A group's
layers keep their own page sizes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

from kvoffload.config._hf_fields import int_field, layer_count
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.errors import ConfigError

__all__ = ["deepseek_v4_layout"]

#: vLLM's dtypes for the DeepSeek-V4 cache (``--kv-cache-dtype``) and their element bytes.
CACHE_DTYPES = {"fp8_ds_mla": 1, "bfloat16": 2, "bf16": 2, "auto": 2, "fp8": 1, "fp8_e4m3": 1}
_RATIO_OF_TYPE = {
    "sliding_attention": 0,
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}


class _Layer(NamedTuple):
    name: str
    kind: str
    block: int
    window: int | None
    page: int


def _ratios(config: Mapping[str, Any], num_layers: int) -> list[int]:
    """Each decoder layer's compress ratio, 1 for a sliding-window-only layer."""
    types = config.get("layer_types")
    if types is not None:
        rates = {
            "compressed_sparse_attention": 4,
            "heavily_compressed_attention": 128,
            **(config.get("compress_rates") or {}),
        }
        if not isinstance(types, list) or len(types) != num_layers:
            raise ConfigError(
                f"model config 'layer_types' must list one type per layer ({num_layers}), "
                f"got {types!r}"
            )
        unknown = sorted({t for t in types if t not in _RATIO_OF_TYPE})
        if unknown:
            raise ConfigError(
                f"DeepSeek-V4 layer types {unknown} are unknown; expected {sorted(_RATIO_OF_TYPE)}"
            )
        ratios = [int(rates.get(t, 0)) for t in types]
    elif config.get("compress_ratios") is not None:
        ratios = list(config["compress_ratios"])[:num_layers]
    else:  # transformers' default: two HCA layers, then CSA and HCA in turn
        ratios = [128] * min(num_layers, 2) + [4 if i % 2 else 128 for i in range(num_layers - 2)]
    bad = [r for r in ratios if r not in (0, 1, 4, 128)]
    if len(ratios) != num_layers or bad:
        raise ConfigError(
            f"DeepSeek-V4 compress ratios must be 0, 4 or 128, one per layer ({num_layers}); "
            f"got {ratios!r}"
        )
    return [max(1, r) for r in ratios]


def _entry_bytes(config: Mapping[str, Any], dtype: str, head_dim: int) -> int:
    """Bytes of one token (or compressed entry) of the MLA and SWA caches."""
    if dtype != "fp8_ds_mla":
        return head_dim * CACHE_DTYPES[dtype]
    rope = config.get("qk_rope_head_dim")
    if rope is None:
        rope = int(head_dim * float(config.get("partial_rotary_factor") or 64 / 512))
    if (head_dim, rope) != (512, 64):
        raise ConfigError(
            f"fp8_ds_mla stores 584 bytes per token for head_dim 512 with qk_rope_head_dim "
            f"64 (vLLM fixes it), got head_dim {head_dim}, qk_rope_head_dim {rope}; "
            "use --dtype bfloat16"
        )
    return 584


def _layers(config: Mapping[str, Any], dtype: str) -> list[_Layer]:
    num_layers = layer_count(config)
    head = int_field(config, "head_dim", 512)
    window = int_field(config, "sliding_window", 128)
    index_head = int_field(config, "index_head_dim", 128)
    align = 576 if dtype == "fp8_ds_mla" else 512
    entry = _entry_bytes(config, dtype, head)

    def page(states: int, state_bytes: int) -> int:
        return -(-states * state_bytes // align) * align

    layers = []
    for i, r in enumerate(_ratios(config, num_layers)):
        p = f"model.layers.{i}.attn"
        if r == 4:
            keys = index_head + index_head // 128 * 4  # fp8 keys and their scales
            indexer = f"{p}.indexer"
            state = page(4, 4 * 4 * index_head)
            layers.append(_Layer(f"{indexer}.k_cache", "compressed_mla", 256, None, page(64, keys)))
            layers.append(_Layer(f"{indexer}.compressor.state_cache", "sliding_mla", 4, 8, state))
        layers.append(_Layer(f"{p}.swa_cache", "sliding_mla", 64, window, page(64, entry)))
        if r > 1:
            coff = 2 if r == 4 else 1
            layers.append(_Layer(p, "compressed_mla", 256, None, page(256 // r, entry)))
            block = 4 if r == 4 else 8
            compressor = f"{p}.compressor.state_cache"
            state = page(block, 4 * 2 * coff * head)
            layers.append(_Layer(compressor, "sliding_mla", block, coff * r, state))
    return layers


def _least_padding(values: list[int], lower: int) -> int:
    """vLLM's ``_approximate_gcd``: the repeat count that pads least, the larger on ties."""
    best, best_pad = lower, None
    for d in range(lower, max(*values, lower) + 1):
        pad = sum((d - x % d) % d for x in values)
        if best_pad is None or pad <= best_pad:
            best, best_pad = d, pad
    return best


def deepseek_v4_layout(config: Mapping[str, Any], dtype: str) -> KVLayout:
    """The groups vLLM packs a DeepSeek-V4 model's KV cache into (module docstring)."""
    if dtype not in CACHE_DTYPES:
        raise ConfigError(
            f"DeepSeek-V4 KV cache dtype {dtype!r} is not one vLLM offers for it; choose one "
            f"of {', '.join(CACHE_DTYPES)}"
        )
    buckets: dict[tuple[str, int, int | None], list[_Layer]] = {}
    for layer in _layers(config, dtype):  # in registration order, as vLLM's dict of specs
        family = "window" if layer.window is not None else "full"
        buckets.setdefault((family, layer.block, layer.window), []).append(layer)
    patterns = []
    for layers in buckets.values():
        by_page: dict[int, list[_Layer]] = {}
        for layer in layers:
            by_page.setdefault(layer.page, []).append(layer)
        balanced = len({len(v) for v in by_page.values()}) == 1
        patterns.append((layers, by_page, balanced))
    mixed = [len(next(iter(p.values()))) for _, p, balanced in patterns if balanced and len(p) > 1]
    repeats = None
    if mixed:
        counts = [max(len(v) for v in p.values()) for _, p, balanced in patterns if balanced]
        repeats = _least_padding(counts, max(mixed))
    groups = []
    for layers, by_page, balanced in patterns:
        most = max(len(v) for v in by_page.values())
        n = math.ceil(most / repeats) if balanced and repeats else 1
        if n == 1:
            groups.append(_group(layers))
            continue
        rows = list(zip(*by_page.values(), strict=True))
        groups.extend(_group([layer for row in rows[i::n] for layer in row]) for i in range(n))
    return KVLayout(tuple(groups))


def _group(layers: list[_Layer]) -> CacheGroup:
    first = layers[0]
    pages = tuple(layer.page for layer in layers)
    return CacheGroup(
        kind=first.kind,
        tokens_per_block=first.block,
        layer_names=tuple(layer.name for layer in layers),
        page_bytes=max(pages),
        sliding_window=first.window,
        layer_page_bytes=pages,
        replicated=True,  # every cache of an MLA model is the same on each rank
    )
