"""KV cache groups of a Hugging Face model, formed the way vLLM forms them.

vLLM's hybrid allocator (0.32) works in three steps that we reproduce:

1. Each layer gets a spec: attention kind, head size, KV heads, window.
   Layers sharing another layer's KV (Gemma's ``num_kv_shared_layers``) get
   none.
2. Layers with equal specs are split into groups of equal layer count: the
   count is the smallest number of layers any spec has, or the largest when
   all are within 1.5x of each other; spec ``s`` with ``n`` layers becomes
   ``ceil(n / count)`` groups, taking every ``k``-th layer.
3. Pages are unified: every group's page (one block of one layer) must have
   the same bytes, so the spec with the most bytes per token keeps
   ``block_size`` and the others get proportionally more tokens per block.

Supported: Llama/Qwen/Mistral-style configs, Gemma-2/3/4 (``layer_types``,
``sliding_window``, ``sliding_window_pattern``, Gemma-4's ``global_head_dim``
and ``per_layer_config``), multimodal configs with a ``text_config``, and
DeepSeek-style MLA (``kv_lora_rank``). Mamba layers need a hand-built layout.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from kvoffload._checks import checked_int
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.errors import ConfigError

__all__ = ["DTYPE_BYTES", "layout_from_hf_config", "load_hf_config"]

#: Bytes per element of the KV cache dtypes vLLM offers.
DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1,
}  # fmt: skip

_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}


class _LayerSpec(NamedTuple):
    """What makes two layers' KV pages interchangeable."""

    kind: str
    bytes_per_token: int
    sliding_window: int | None


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
    return dict(text) if isinstance(text, Mapping) else config


def _int_field(config: Mapping[str, Any], name: str, default: int | None = None) -> int:
    return checked_int(f"model config field {name!r}", config.get(name, default))


def _layer_types(config: Mapping[str, Any], num_layers: int) -> list[str]:
    types = config.get("layer_types")
    if types is None:
        pattern = config.get("sliding_window_pattern")
        if isinstance(pattern, int) and pattern > 0 and config.get("sliding_window"):
            return [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(num_layers)
            ]
        uses_window = config.get("use_sliding_window", config.get("model_type") == "mistral")
        sliding = bool(config.get("sliding_window")) and bool(uses_window)
        return ["sliding_attention" if sliding else "full_attention"] * num_layers
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


def _layer_spec(
    config: Mapping[str, Any], layer: int, layer_type: str, dtype_bytes: int
) -> _LayerSpec:
    if "kv_lora_rank" in config:  # MLA: one latent vector per token, no K/V split
        latent = _int_field(config, "kv_lora_rank") + _int_field(config, "qk_rope_head_dim")
        return _LayerSpec("mla", latent * dtype_bytes, None)
    overrides = config.get("per_layer_config") or {}
    override = (
        overrides.get(str(layer), overrides.get(layer, {}))
        if isinstance(overrides, Mapping)
        else {}
    )
    heads = _int_field(config, "num_attention_heads")
    head_dim = config.get("head_dim") or _int_field(config, "hidden_size") // heads
    kv_heads = config.get("num_key_value_heads") or heads
    if layer_type == "full_attention" and not override:
        head_dim = config.get("global_head_dim") or head_dim
        kv_heads = config.get("num_global_key_value_heads") or kv_heads
    head_dim = _int_field({"head_dim": override.get("head_dim", head_dim)}, "head_dim")
    kv_heads = _int_field(
        {"num_key_value_heads": override.get("num_key_value_heads", kv_heads)},
        "num_key_value_heads",
    )
    kind = _LAYER_KINDS[layer_type]
    window = _int_field(config, "sliding_window") if kind == "sliding" else None
    return _LayerSpec(kind, 2 * kv_heads * head_dim * dtype_bytes, window)


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


def layout_from_hf_config(
    path_or_dict: str | Path | Mapping[str, Any], dtype: str = "bfloat16", block_size: int = 16
) -> KVLayout:
    """See the module docstring; raises ``ConfigError`` on anything it cannot map."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(
            f"unknown KV cache dtype {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}"
        )
    checked_int("block_size", block_size)
    config = load_hf_config(path_or_dict)
    num_layers = _int_field(config, "num_hidden_layers")
    shared = config.get("num_kv_shared_layers") or 0
    types = _layer_types(config, num_layers)
    specs = {
        f"model.layers.{i}.self_attn.attn": _layer_spec(config, i, types[i], DTYPE_BYTES[dtype])
        for i in range(num_layers - shared)
    }
    if not specs:
        raise ConfigError("model config has no layer with its own KV cache")
    largest = max(spec.bytes_per_token for spec in specs.values())
    page_bytes = largest * block_size
    groups: list[CacheGroup] = []
    for spec, names in _group_layers(specs):
        if page_bytes % spec.bytes_per_token:
            raise ConfigError(
                f"cannot unify page sizes: {spec.bytes_per_token} bytes per token does not "
                f"divide the largest page of {page_bytes} bytes"
            )
        groups.append(
            CacheGroup(
                kind=spec.kind,
                tokens_per_block=page_bytes // spec.bytes_per_token,
                layer_names=tuple(names),
                page_bytes=page_bytes,
                sliding_window=spec.sliding_window,
            )
        )
    return KVLayout(groups=tuple(groups))
