"""KV cache groups of a Hugging Face model, formed the way vLLM forms them.

vLLM's hybrid allocator (0.32, 0.33) works in three steps that we reproduce:

1. Each layer gets a spec: attention kind, head size, KV heads, window (or
   attention chunk); a recurrent layer its state. Layers sharing another
   layer's KV (Gemma's ``num_kv_shared_layers``) get none.
2. Layers with equal specs are split into groups of equal layer count: the
   count is the smallest number of layers any spec has, or the largest when
   all are within 1.5x of each other; spec ``s`` with ``n`` layers becomes
   ``ceil(n / count)`` groups, taking every ``k``-th layer.
3. Pages are unified: every group's page (one block of one layer) must have
   the same bytes, so the spec with the most bytes per token keeps
   ``block_size`` and the others get proportionally more tokens per block.
   With recurrent layers the attention block is first raised until its page
   holds a state (``Platform._align_hybrid_block_size``): every group then
   has that block size and a state's page is padded up to the attention page.

Supported: Llama/Qwen/Mistral-style configs, Gemma-2/3/4 (``layer_types``,
``sliding_window``, ``sliding_window_pattern``, Gemma-4's ``global_head_dim``
and ``per_layer_config``), Llama-4 (chunked local attention:
``attention_chunk_size``, ``no_rope_layers``), Qwen3-Next and Qwen3.5
(``linear_attention`` layers: gated DeltaNet state), multimodal configs with a
``text_config``, DeepSeek-style MLA (``kv_lora_rank``) and DeepSeek-V4
(:mod:`kvoffload.config._hf_deepseek_v4`).

vLLM turns its hybrid allocator off for models with chunked local attention
(Llama-4) unless ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1``:
every layer is then kept as full attention in one group. ``hybrid`` says
which to show (``None``: vLLM's default).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from kvoffload._checks import checked_int
from kvoffload.config._hf_deepseek_v4 import deepseek_v4_layout
from kvoffload.config._hf_fields import int_field, layer_count
from kvoffload.config.architectures import check_architecture
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.errors import ConfigError

__all__ = ["DTYPE_BYTES", "layout_from_hf_config", "load_hf_config"]

#: Bytes per element of the KV cache dtypes vLLM offers.
# One row per width, laid out by hand (fmt: skip): formatting would put each on a line.
DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1,
}  # fmt: skip

_LAYER_KINDS = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked_local",
    "linear_attention": "mamba",
}


class _LayerSpec(NamedTuple):
    """What makes two layers' KV pages interchangeable."""

    kind: str
    #: Attention: KV bytes of one token. Recurrent: 0 (see ``state_bytes``).
    bytes_per_token: int
    #: The sliding window, or the attention chunk of a chunked-local layer.
    window: int | None
    #: A recurrent layer's state (conv and SSM), the bytes a hit restores.
    state_bytes: int = 0


def load_hf_config(path_or_dict: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """The text model's config: a mapping, a ``config.json`` or a model directory."""
    if isinstance(path_or_dict, Mapping):
        config = dict(path_or_dict)
    else:
        path = Path(path_or_dict)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(
                f"no model config at {str(path)!r}: pass a model directory or its config.json"
            ) from None
        except (OSError, ValueError, RecursionError) as exc:  # ValueError: bad JSON, huge ints
            raise ConfigError(f"cannot read model config {str(path)!r}: {exc}") from exc
        if not isinstance(config, dict):
            raise ConfigError(f"model config {str(path)!r} must hold a JSON object")
    text = config.get("text_config")
    text_config = dict(text) if isinstance(text, Mapping) else config
    check_architecture(config, text_config)
    return text_config


def _layer_types(config: Mapping[str, Any], num_layers: int) -> list[str]:
    types = config.get("layer_types")
    if types is None:
        return _implied_layer_types(config, num_layers)
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigError(
            f"model config 'layer_types' must list one type per layer ({num_layers}), got {types!r}"
        )
    unknown = sorted({t for t in types if t not in _LAYER_KINDS})
    if unknown:
        raise ConfigError(
            f"model config has layer types {unknown} that from_hf_config cannot map; "
            f"supported: {sorted(_LAYER_KINDS)}. Build the KVLayout from CacheGroups instead"
        )
    return list(types)


def _implied_layer_types(config: Mapping[str, Any], num_layers: int) -> list[str]:
    """Layer types of configs without ``layer_types``, as their transformers classes infer them."""
    if config.get("attention_chunk_size") and config.get("model_type", "").startswith("llama4"):
        # Llama-4: RoPE layers attend in chunks, NoPE layers (no_rope_layers[i] == 0) fully.
        interval = int(config.get("no_rope_layer_interval") or 4)
        rope = config.get("no_rope_layers") or [
            int((i + 1) % interval != 0) for i in range(num_layers)
        ]
        return ["chunked_attention" if r else "full_attention" for r in rope]
    if "full_attention_interval" in config:  # Qwen3-Next: every n-th layer is full attention
        interval = int_field(config, "full_attention_interval")
        return [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(num_layers)
        ]
    pattern = config.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 0 and config.get("sliding_window"):
        return [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    uses_window = config.get("use_sliding_window", config.get("model_type") == "mistral")
    sliding = bool(config.get("sliding_window")) and bool(uses_window)
    return ["sliding_attention" if sliding else "full_attention"] * num_layers


def _state_bytes(config: Mapping[str, Any], dtype_bytes: int, tp: int = 1, spec: int = 0) -> int:
    """A gated DeltaNet layer's state (vLLM's ``gated_delta_net_state_shape``): conv and SSM,
    of one of ``tp`` tensor-parallel ranks (each holds its share of the heads); the conv
    state keeps a row more for each of ``spec`` speculative tokens."""
    k_heads, v_heads = (
        max(1, int_field(config, "linear_num_key_heads") // tp),
        max(1, int_field(config, "linear_num_value_heads") // tp),
    )
    k_dim, v_dim = (
        int_field(config, "linear_key_head_dim"),
        int_field(config, "linear_value_head_dim"),
    )
    conv_dim = 2 * k_dim * k_heads + v_dim * v_heads
    conv = (int_field(config, "linear_conv_kernel_dim") - 1 + spec) * conv_dim
    ssm = v_heads * v_dim * k_dim
    return (conv + ssm) * dtype_bytes


def _layer_spec(
    config: Mapping[str, Any],
    layer: int,
    layer_type: str,
    dtype_bytes: int,
    tp: int = 1,
    *,
    spec: int = 0,
) -> _LayerSpec:
    """One layer's KV on one of ``tp`` tensor-parallel ranks: an MLA latent whole (every rank
    holds it), KV heads and recurrent states split (vLLM gives each rank at least one head);
    ``spec``: speculative tokens, whose conv rows a recurrent state keeps."""
    if layer_type == "linear_attention":
        return _LayerSpec("mamba", 0, None, _state_bytes(config, dtype_bytes, tp, spec))
    if "kv_lora_rank" in config:  # MLA: one latent vector per token, no K/V split
        latent = int_field(config, "kv_lora_rank") + int_field(config, "qk_rope_head_dim")
        return _LayerSpec("mla", latent * dtype_bytes, None)
    overrides = config.get("per_layer_config") or {}
    override = (
        overrides.get(str(layer), overrides.get(layer, {}))
        if isinstance(overrides, Mapping)
        else {}
    )
    heads = int_field(config, "num_attention_heads")
    head_dim = config.get("head_dim") or int_field(config, "hidden_size") // heads
    kv_heads = config.get("num_key_value_heads") or heads
    if layer_type == "full_attention" and not override:
        head_dim = config.get("global_head_dim") or head_dim
        kv_heads = config.get("num_global_key_value_heads") or kv_heads
    head_dim = int_field({"head_dim": override.get("head_dim", head_dim)}, "head_dim")
    kv_heads = int_field(
        {"num_key_value_heads": override.get("num_key_value_heads", kv_heads)},
        "num_key_value_heads",
    )
    kind = _LAYER_KINDS[layer_type]
    window = None
    if kind == "sliding":
        window = int_field(config, "sliding_window")
    elif kind == "chunked_local" and config.get("attention_chunk_size") is None:
        kind = "full"  # Llama-4 without attention_chunk_size attends fully everywhere
    elif kind == "chunked_local":
        window = int_field(config, "attention_chunk_size")
    return _LayerSpec(kind, 2 * max(1, kv_heads // tp) * head_dim * dtype_bytes, window)


def _group_layers(specs: dict[str, _LayerSpec]) -> list[tuple[_LayerSpec, list[str]]]:
    by_spec: dict[_LayerSpec, list[str]] = {}
    for name, spec in specs.items():
        by_spec.setdefault(spec, []).append(name)
    counts = [len(names) for names in by_spec.values()]
    group_size = min(counts)
    if max(counts) < group_size * 1.5:
        group_size = max(counts)
    groups: list[tuple[_LayerSpec, list[str]]] = []
    for spec, names in by_spec.items():
        num_groups = math.ceil(len(names) / group_size)
        groups.extend((spec, names[i::num_groups]) for i in range(num_groups))
    return groups


def _layer_name(layer: int, spec: _LayerSpec) -> str:
    return f"model.layers.{layer}.{'linear_attn' if spec.kind == 'mamba' else 'self_attn.attn'}"


def _promote(specs: dict[str, _LayerSpec]) -> dict[str, _LayerSpec]:
    """The hybrid allocator off: every attention layer is kept as full attention."""
    if any(spec.kind == "mamba" for spec in specs.values()):
        raise ConfigError(
            "vLLM needs its hybrid KV cache allocator for recurrent (linear_attention) layers"
        )
    promoted = {name: _LayerSpec("full", s.bytes_per_token, None) for name, s in specs.items()}
    if len(set(promoted.values())) > 1:
        raise ConfigError(
            "without its hybrid allocator vLLM keeps every layer as full attention, which "
            "needs one page size for all layers; these layers differ"
        )
    return promoted


def _attention_block(specs: dict[str, _LayerSpec], block_size: int) -> int:
    """``block_size``, raised until one attention page holds a recurrent state."""
    states = [s.state_bytes for s in specs.values() if s.kind == "mamba"]
    if not states:
        return block_size
    per_token = max((s.bytes_per_token for s in specs.values() if s.kind != "mamba"), default=0)
    if not per_token:
        raise ConfigError("a model of recurrent layers only has no attention page to size by")
    return max(block_size, block_size * -(-max(states) // (block_size * per_token)))


def _dtype_bytes(config: Mapping[str, Any], dtype: str) -> int:
    if dtype == "fp8_ds_mla":
        raise ConfigError(
            f"KV cache dtype 'fp8_ds_mla' is FlashMLA's packed format, which only DeepSeek-V4 "
            f"uses; model type {config.get('model_type')!r} takes one of {', '.join(DTYPE_BYTES)}"
        )
    if dtype not in DTYPE_BYTES:
        raise ConfigError(
            f"unknown KV cache dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}"
        )
    return DTYPE_BYTES[dtype]


def _layer_specs(
    config: Mapping[str, Any], dtype_bytes: int, tp: int, more_layers: Mapping[str, str], spec: int
) -> dict[str, _LayerSpec]:
    """Every layer with its own KV, by vLLM's name: the config's, then ``more_layers``."""
    num_layers, shared = layer_count(config), config.get("num_kv_shared_layers") or 0
    specs = {}
    for i, layer_type in enumerate(_layer_types(config, num_layers)[: num_layers - shared]):
        layer = _layer_spec(config, i, layer_type, dtype_bytes, tp, spec=spec)
        specs[_layer_name(i, layer)] = layer
    for i, (name, layer_type) in enumerate(more_layers.items(), num_layers):
        specs[name] = _layer_spec(config, i, layer_type, dtype_bytes, tp)
    if not specs:
        raise ConfigError("model config has no layer with its own KV cache")
    return specs


def layout_from_hf_config(
    path_or_dict: str | Path | Mapping[str, Any],
    dtype: str = "bfloat16",
    block_size: int = 16,
    hybrid: bool | None = None,
    tensor_parallel_size: int = 1,
    *,
    more_layers: Mapping[str, str] | None = None,
    speculative_tokens: int = 0,
) -> KVLayout:
    """See the module docstring; raises ``ConfigError`` on anything it cannot map. One rank's
    layout at ``tensor_parallel_size`` > 1: heads and states split, MLA latents whole.
    ``more_layers``: layers of the target's shape after its own (name -> layer type), grouped
    with them (a target's MTP layers, :mod:`kvoffload.config._hf_mtp`); ``speculative_tokens``:
    vLLM's ``num_speculative_tokens``, which lengthens a gated-DeltaNet conv state."""
    checked_int("block_size", block_size)
    tp = checked_int("tensor_parallel_size", tensor_parallel_size)
    config = load_hf_config(path_or_dict)
    if config.get("model_type") == "deepseek_v4":
        return deepseek_v4_layout(config, dtype)
    specs = _layer_specs(
        config, _dtype_bytes(config, dtype), tp, more_layers or {}, speculative_tokens
    )
    chunked = any(spec.kind == "chunked_local" for spec in specs.values())
    if hybrid is False or (hybrid is None and chunked):
        specs = _promote(specs)
    block = _attention_block(specs, block_size)
    largest = max(spec.bytes_per_token for spec in specs.values())
    page_bytes = largest * block
    groups: list[CacheGroup] = []
    for spec, names in _group_layers(specs):
        if spec.kind == "mamba":  # one state per block; vLLM pads its page to page_bytes
            groups.append(CacheGroup("mamba", block, tuple(names), spec.state_bytes))
            continue
        if page_bytes % spec.bytes_per_token:
            raise ConfigError(
                f"cannot unify page sizes: {spec.bytes_per_token} bytes per token does not "
                f"divide the largest page of {page_bytes} bytes"
            )
        chunked = spec.kind == "chunked_local"
        groups.append(
            CacheGroup(
                kind=spec.kind,
                tokens_per_block=page_bytes // spec.bytes_per_token,
                layer_names=tuple(names),
                page_bytes=page_bytes,
                sliding_window=None if chunked else spec.window,
                attention_chunk_size=spec.window if chunked else None,
                replicated=spec.kind == "mla",  # a latent: the same on every rank
            )
        )
    return KVLayout(groups=tuple(groups))
