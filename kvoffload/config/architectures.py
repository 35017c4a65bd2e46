"""Which model families ``layout_from_hf_config`` knows, refuses, or plans with a warning.

A ``config.json`` says what it is in ``model_type`` (and ``architectures``).
Families listed in :data:`KNOWN_MODEL_TYPES` have the fields
:mod:`kvoffload.config.hf_layout` reads, placed as it expects (``tests_e2e``
checks Llama, Gemma-4, Llama-4, Qwen3-Next and DeepSeek-V4 against vLLM's own
grouping code). Encoder-only and
encoder-decoder models are refused by name: vLLM keeps no reusable prefix KV
for them (an encoder has no cache; cross-attention KV is per request). Any
other family is planned from its attention fields as a Llama-style decoder,
with a warning naming it, since an unknown family may place layers the way
no field says (``docs/cli.md`` lists the known ones).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from kvoffload.config.values import safe_repr
from kvoffload.errors import ConfigError

__all__ = [
    "KNOWN_MODEL_TYPES",
    "UnknownModelWarning",
    "check_architecture",
]

#: ``model_type`` values read as vLLM reads them (outer configs and their text configs).
KNOWN_MODEL_TYPES: dict[str, str] = {
    "llama": "Llama 2/3 and Llama-style decoders",
    "mistral": "Mistral (sliding window where the config sets one)",
    "mixtral": "Mixtral",
    "qwen2": "Qwen2 and Qwen2.5",
    "qwen2_moe": "Qwen2-MoE",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
    "qwen3_next": "Qwen3-Next (gated DeltaNet and full attention)",
    "qwen3_5": "Qwen3.5 (gated DeltaNet and full attention)",
    "qwen3_5_text": "Qwen3.5, text config",
    "qwen3_5_moe": "Qwen3.5-MoE",
    "qwen3_5_moe_text": "Qwen3.5-MoE, text config",
    "gemma2": "Gemma-2 (sliding and full attention)",
    "gemma3": "Gemma-3 (multimodal; its text config is read)",
    "gemma3_text": "Gemma-3, text config",
    "gemma4": "Gemma-4 (multimodal; its text config is read)",
    "gemma4_text": "Gemma-4, text config",
    "llama4": "Llama-4 (multimodal; its text config is read)",
    "llama4_text": "Llama-4 (chunked local and full attention)",
    "deepseek_v2": "DeepSeek-V2 (MLA)",
    "deepseek_v3": "DeepSeek-V3 and R1 (MLA)",
    "deepseek_v4": "DeepSeek-V4 (compressed MLA, sliding MLA, indexer)",
}

#: Families vLLM serves without a reusable decoder KV cache, and why.
_REFUSED: dict[str, str] = {
    "t5": "T5 is an encoder-decoder model",
    "mt5": "mT5 is an encoder-decoder model",
    "umt5": "UMT5 is an encoder-decoder model",
    "bart": "BART is an encoder-decoder model",
    "mbart": "mBART is an encoder-decoder model",
    "whisper": "Whisper is an encoder-decoder model",
    "bert": "BERT is an encoder-only model",
    "roberta": "RoBERTa is an encoder-only model",
    "xlm-roberta": "XLM-RoBERTa is an encoder-only model",
    "modernbert": "ModernBERT is an encoder-only model",
}


class UnknownModelWarning(UserWarning):
    """A model family kvoffload does not know is planned as a Llama-style decoder."""


def _name(config: Mapping[str, Any]) -> str:
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures:
        return f"{safe_repr(config.get('model_type'))} ({safe_repr(architectures[0], 60)})"
    return safe_repr(config.get("model_type"))


def check_architecture(config: Mapping[str, Any], text: Mapping[str, Any]) -> None:
    """Refuse encoder models by name, warn on unknown families; configs without a
    ``model_type`` (hand-written mappings) are read as they are."""
    model_type = config.get("model_type")
    why = _REFUSED.get(model_type) if isinstance(model_type, str) else None
    if why is None and config.get("is_encoder_decoder") is True:
        why = f"model type {_name(config)} is an encoder-decoder model"
    if why is not None:
        raise ConfigError(
            f"{why} ({_name(config)}): kvoffload offloads the prefix KV of decoder-only "
            "models, and vLLM keeps none it could reuse for this one; the families kvoffload "
            "knows are listed in docs/cli.md"
        )
    if model_type is None or model_type in KNOWN_MODEL_TYPES:
        return
    if text.get("model_type") in KNOWN_MODEL_TYPES:  # a multimodal wrapper of a known text model
        return
    warnings.warn(
        f"model type {_name(config)} is not one kvoffload knows; it is planned from its "
        "attention fields as a Llama-style decoder, which may not be how vLLM lays it out "
        "(known: " + ", ".join(KNOWN_MODEL_TYPES) + ")",
        UnknownModelWarning,
        stacklevel=4,
    )
