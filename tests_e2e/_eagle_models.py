"""EAGLE and EAGLE-3 drafter heads for a tiny Llama, built at test time (nothing downloaded).

An EAGLE head reads, at position ``p``, the target's hidden state there and
the embedding of the token at ``p + 1`` (``fc`` of their concatenation), runs
one decoder layer over its own KV cache and predicts the token after next. So
its KV at a chunk's last position depends on the token after the chunk: the
case the connector's lookahead keys exist for.

:func:`build_agreeing_eagle` makes a head that agrees with its target, so
nearly every draft is accepted and a wrong drafter KV after a hit would show
in vLLM's accepted-token count. The target is one Llama layer whose
embeddings have unit RMS (its input norm, with weight one, is then the
identity) and whose ``lm_head`` is scaled up (peaked logits). The head's
``fc`` keeps the next token's embedding and drops the hidden state, and its
one layer is the target's, without the input norm vLLM's EAGLE layer 0 skips
anyway: at ``p`` it computes what the target computes at ``p + 1``, over
KV one position behind (RoPE sees the same distances), minus the first
token. Its output skips the final norm, a positive scale that leaves the
greedy choice alone.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from _models import LLAMA, build

#: The EAGLE test's target: LLAMA with one layer (the head copies it).
EAGLE_TARGET: dict[str, Any] = {**LLAMA, "num_hidden_layers": 1}
#: The EAGLE-3 test's target: three layers, so that vLLM's default taps (the inputs of
#: layers 2, L // 2 and L - 3) are three different hidden states.
EAGLE3_TARGET: dict[str, Any] = {**LLAMA, "num_hidden_layers": 3}


def _unit_rms_and_peaked(model: Any) -> None:
    import torch

    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed.div_(embed.float().pow(2).mean(-1, keepdim=True).sqrt().to(embed.dtype))
        model.lm_head.weight.mul_(30.0)


def _save(tensors: dict[str, Any], config: dict[str, Any], path: Path) -> Path:
    """Write a checkpoint directory atomically (a half-written one is never taken as done)."""
    from safetensors.torch import save_file

    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    (partial / "config.json").write_text(json.dumps(config))
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
    return path


def build_agreeing_eagle(models: Path) -> tuple[str, str]:
    """``(target, head)`` directories under ``models``: a target and an EAGLE head that agrees."""
    import torch
    from safetensors.torch import load_file

    target = build(EAGLE_TARGET, models / "eagle_target", adjust=_unit_rms_and_peaked)
    head = models / "eagle_head"
    if not (head / "config.json").exists():
        weights = load_file(str(target / "model.safetensors"))
        hidden = EAGLE_TARGET["hidden_size"]
        tensors = {
            "embed_tokens.weight": weights["model.embed_tokens.weight"],
            "fc.weight": torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1).to(
                torch.bfloat16
            ),
        }
        for name, tensor in weights.items():
            if name.startswith("model.layers.0.") and "input_layernorm" not in name:
                tensors[name.removeprefix("model.")] = tensor
        _save(tensors, json.loads((target / "config.json").read_text()), head)
    return str(target), str(head)


def build_random_eagle3(target: dict[str, Any], path: Path, seed: int = 3) -> str:
    """An EAGLE-3 head of random weights for ``target`` (vLLM's ``Eagle3LlamaForCausalLM``):
    ``fc`` over three of the target's hidden states, one layer reading the token embedding
    and that, its own norm and ``lm_head``."""
    import torch

    if (path / "config.json").exists():
        return str(path)
    generator = torch.Generator().manual_seed(seed)
    h, inter, vocab = target["hidden_size"], target["intermediate_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target["num_key_value_heads"]
    head_dim = h // heads

    def rand(*shape: int) -> Any:
        return (torch.randn(*shape, generator=generator) * 0.05).to(torch.bfloat16)

    ones = torch.ones(h, dtype=torch.bfloat16)
    tensors = {
        "embed_tokens.weight": rand(vocab, h),
        "fc.weight": rand(h, 3 * h),
        "midlayer.input_layernorm.weight": ones,
        "midlayer.hidden_norm.weight": ones.clone(),
        "midlayer.post_attention_layernorm.weight": ones.clone(),
        "midlayer.self_attn.q_proj.weight": rand(heads * head_dim, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": ones.clone(),
        "lm_head.weight": rand(vocab, h) * 20,
    }
    config = {**target, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"]}
    return str(_save(tensors, config, path))
