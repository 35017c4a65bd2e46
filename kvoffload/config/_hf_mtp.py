"""The layers a target's own multi-token-prediction (MTP) modules add, as vLLM 0.32 names them.

``speculative_config={"method": "mtp"}`` takes no drafter model: vLLM loads
the MTP modules from the target's checkpoint with the target's config
(``SpeculativeConfig.hf_config_override`` maps each family's ``model_type`` to
its MTP architecture and sets ``n_predict``). Planned here, each checked
against vLLM's model code (0.32; 0.33 and 0.34 the same):

* DeepSeek-V3 (``deepseek_mtp.py``): ``num_nextn_predict_layers`` decoder
  layers ``model.layers.{N + i}`` after the target's ``N``, each a
  ``DeepseekV2DecoderLayer`` of the target's config: the same MLA latent, so
  they join the target's MLA group;
* Qwen3-Next (``qwen3_next_mtp.py``, ``num_nextn_predict_layers``) and
  Qwen3.5 (``qwen3_5_mtp.py``, ``mtp_num_hidden_layers``): full-attention
  decoder layers ``mtp.layers.{i}`` of the target's attention shape; beside
  the gated-DeltaNet layers they change vLLM's grouping (a group holds as many
  layers as the fewest of one spec), so the target is grouped again with them.

Not planned, with the reason: DeepSeek-V2 (vLLM maps no MTP for it),
DeepSeek-V4 (its MTP layers are compressed decoder layers, of ratio
``compress_ratios[N + i]``, in V4's own groups; vLLM's CPU build has no V4
MTP to check them on), Gemma-4 (its MTP drafter is a separate assistant
checkpoint).

The drafter's KV at a position reads ``num_prefill_lookahead_tokens`` tokens
after it (``vllm/config/vllm.py``): ``num_speculative_tokens`` when several
MTP modules take turns (each reads one token further), else 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from kvoffload.config._hf_fields import layer_count
from kvoffload.config.values import safe_repr
from kvoffload.errors import ConfigError

__all__ = ["MTP_FAMILIES", "MtpLayers", "mtp_layers"]


class _Family(NamedTuple):
    #: The config field vLLM reads the module count from.
    field: str
    #: Whether its layers follow the target's (``model.layers.{N + i}``) or are ``mtp.layers.{i}``.
    after_target: bool


#: ``model_type`` -> how vLLM 0.32 lays out its MTP modules.
MTP_FAMILIES: dict[str, _Family] = {
    "deepseek_v3": _Family("num_nextn_predict_layers", after_target=True),
    "qwen3_next": _Family("num_nextn_predict_layers", after_target=False),
    "qwen3_5": _Family("mtp_num_hidden_layers", after_target=False),
    "qwen3_5_text": _Family("mtp_num_hidden_layers", after_target=False),
    "qwen3_5_moe": _Family("mtp_num_hidden_layers", after_target=False),
    "qwen3_5_moe_text": _Family("mtp_num_hidden_layers", after_target=False),
}

_NOT_PLANNED = {
    "deepseek_v2": "vLLM maps no MTP architecture for DeepSeek-V2 (only V3 and later)",
    "deepseek_v4": "DeepSeek-V4's MTP layers are compressed layers (compress_ratios[N + i]) "
    "in V4's own groups, and vLLM's CPU build has no V4 MTP to check their placement on",
    "gemma4": "Gemma-4's MTP drafter is a separate assistant checkpoint",
    "gemma4_text": "Gemma-4's MTP drafter is a separate assistant checkpoint",
}


class MtpLayers(NamedTuple):
    """What ``method: mtp`` adds to a target: its layers (name -> ``layer_types`` entry),
    its module count, the draft tokens and the lookahead."""

    layers: dict[str, str]
    modules: int
    num_speculative_tokens: int
    lookahead: int


def _modules(config: Mapping[str, Any], family: _Family, model_type: str) -> int:
    value = config.get(family.field)
    if type(value) is not int or value < 1:
        raise ConfigError(
            f"--speculative-method mtp: the {model_type!r} config has no MTP layers "
            f"({family.field}: {safe_repr(value)}); use a checkpoint that ships them, or "
            "another speculative method"
        )
    return value


def mtp_layers(config: Mapping[str, Any], num_speculative_tokens: int | None) -> MtpLayers:
    """The MTP layers of text config ``config`` and the lookahead at ``num_speculative_tokens``
    (``None``: vLLM's default, one per module); ``ConfigError`` where vLLM serves none or
    refuses the count."""
    model_type = config.get("model_type")
    family = MTP_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        why = _NOT_PLANNED.get(model_type) if isinstance(model_type, str) else None
        raise ConfigError(
            f"--speculative-method mtp is not planned for model type {safe_repr(model_type)}"
            f"{': ' + why if why else ''}; it plans the MTP of {', '.join(MTP_FAMILIES)}: "
            "plan one of those, or this model with --draft-model and another method"
        )
    modules = _modules(config, family, str(model_type))
    tokens = modules if num_speculative_tokens is None else num_speculative_tokens
    if tokens > modules and tokens % modules:
        raise ConfigError(
            f"--num-speculative-tokens {tokens} with {modules} MTP modules: vLLM takes the "
            f"modules in turns and needs a multiple of {modules} (or at most {modules})"
        )
    if family.field != "num_nextn_predict_layers" and min(modules, tokens) > 1:
        # vLLM 0.32 counts modules for the lookahead from num_nextn_predict_layers alone
        # (default 1), 0.34 from n_predict (here mtp_num_hidden_layers): they differ.
        raise ConfigError(
            f"--speculative-method mtp: {modules} Qwen3.5 MTP modules at {tokens} speculative "
            "tokens read ahead as far as vLLM 0.32 and 0.34 count differently (1 or "
            f"{tokens} tokens); plan it with --num-speculative-tokens 1"
        )
    start = layer_count(config) if family.after_target else 0
    stem = "model.layers" if family.after_target else "mtp.layers"
    layers = {f"{stem}.{start + i}.self_attn.attn": "full_attention" for i in range(modules)}
    return MtpLayers(layers, modules, tokens, tokens if min(modules, tokens) > 1 else 1)
