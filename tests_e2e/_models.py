"""Tiny models with random weights, built at test time (nothing comes from a model hub).

Weights are seeded, so two builds of one model are identical and a run with
the connector can be compared token for token with a run without it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: A 2-layer Llama: one full-attention KV cache group.
LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}

#: A 2-layer Mistral whose every layer attends a 128-token sliding window: one KV cache
#: group, of sliding-window blocks.
SLIDING_MISTRAL: dict[str, Any] = {
    **LLAMA,
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "sliding_window": 128,
}

#: A 4-layer Gemma-4 text model: three sliding-window layers and one full-attention
#: layer, four KV cache groups on vLLM's CPU backend (512, 512, 512, 32 tokens per
#: block with block_size=32). The project's own example config.
#: The per-layer input embeddings (262144 x layers x 256 by default, half a gigabyte) are
#: shrunk to the model's vocabulary.
GEMMA4: dict[str, Any] = {
    **json.loads(
        (Path(__file__).resolve().parents[1] / "kvoffload/examples/tiny_gemma4.json").read_text()
    ),
    "vocab_size_per_layer_input": 1024,
    "hidden_size_per_layer_input": 16,
}

#: A 4-layer Llama-4 text model: three chunked-local-attention layers (chunks of 256
#: tokens) and one NoPE full-attention layer, a mixture of two experts. With
#: VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 vLLM's CPU backend forms four KV
#: cache groups (three chunked local, one full) of the same block size.
LLAMA4: dict[str, Any] = {
    "architectures": ["Llama4ForCausalLM"],
    "model_type": "llama4_text",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "intermediate_size_mlp": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 1,
    "attention_chunk_size": 256,
    "no_rope_layer_interval": 4,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}

#: A 4-layer Qwen3-Next: three gated-DeltaNet layers and one full-attention layer
#: (full_attention_interval 4), a few experts. On vLLM's CPU backend with prefix caching
#: (mamba_cache_mode "align") that is four KV cache groups of 256 tokens per block: three
#: recurrent-state groups and one full-attention group. Head dims are 64: the CPU
#: gated-DeltaNet kernel rejects 32.
QWEN3_NEXT: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "full_attention_interval": 4,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


#: A 2-layer DeepSeek-V2-style MLA model with two attention heads (one per rank at
#: tensor_parallel_size=2): one latent of kv_lora_rank + qk_rope_head_dim per token, the
#: same on every rank. Both layers dense (first_k_dense_replace). vLLM's CPU MLA backend
#: needs bfloat16 and DeepSeek's head sizes (latent 512, rope 64, nope 128).
DEEPSEEK_V2: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "n_routed_experts": 2,
    "n_shared_experts": 1,
    "num_experts_per_tok": 1,
    "first_k_dense_replace": 2,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}

#: LLAMA with four query heads and two KV heads (GQA): at tensor_parallel_size=2 each
#: rank holds one KV head, its own shard of every chunk.
GQA_LLAMA: dict[str, Any] = {
    **LLAMA,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}


def _state_sensitive(model: Any) -> None:
    """Make a random Qwen3-Next's output depend on its recurrent state, and its logits peaked.

    With random ``A_log`` (about 0.8 to 2.3) a gated-DeltaNet state decays to
    nothing within a token, so a wrong or zeroed state gives the same tokens
    and no test could see it (measured on vLLM's CPU build). ``A_log = -6`` and
    ``dt_bias = -2`` make the state last; a scaled-up ``lm_head`` makes greedy
    choices far from ties.
    """
    import torch

    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.A_log"):
                param.fill_(-6.0)
            elif name.endswith("linear_attn.dt_bias"):
                param.fill_(-2.0)


#: What ``build`` does to a model's random weights before saving them, by model type.
ADJUST = {"qwen3_next": _state_sensitive}

#: A 1-layer draft model for LLAMA with one KV head: its layer's pages are half the target's,
#: and vLLM puts it in the target's KV cache group all the same (pages of two sizes).
DRAFT_LLAMA: dict[str, Any] = {**LLAMA, "num_hidden_layers": 1, "num_key_value_heads": 1}


def build_draft(target: dict[str, Any], path: Path, *, same_weights: bool) -> Path:
    """A draft model for ``target`` (``method: draft_model``) under ``path`` (once).

    ``same_weights``: the target's own config and seed, so the drafter agrees
    with the target and nearly every draft is accepted; a drafter whose KV
    were wrong after a hit would then show in vLLM's accepted-token count.
    Otherwise ``DRAFT_LLAMA`` with the target's vocabulary, a smaller random
    model of another seed.
    """
    if same_weights:
        return build(target, path)
    return build({**DRAFT_LLAMA, "vocab_size": target["vocab_size"]}, path, seed=1)


#: A Llama big enough that prefill costs real time on a CPU, for the TTFT benchmark.
BIG_LLAMA: dict[str, Any] = {
    **LLAMA,
    "vocab_size": 4096,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
}

#: BIG_LLAMA with 6 layers: the serving benchmark's model (benchmarks/serve_chat.py), where
#: prefill of a 2,000-token conversation takes seconds on one core.
SERVE_LLAMA: dict[str, Any] = {**BIG_LLAMA, "num_hidden_layers": 6}


def build(
    config: dict[str, Any], path: Path, seed: int = 0, adjust: Callable[[Any], None] | None = None
) -> Path:
    """Save a randomly initialised bfloat16 model of ``config`` under ``path`` (once).

    The weights depend only on ``config``, ``seed`` and ``adjust`` (what to do to
    them before saving; by default :data:`ADJUST`'s for the model type). The model is written
    to a sibling directory and renamed into place, so an interrupted build
    never leaves a half-written ``path`` that a later call would take as done.
    """
    path = Path(path)
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_config = AutoConfig.for_model(**config)
    model = AutoModelForCausalLM.from_config(hf_config).to(torch.bfloat16)
    adjust = adjust or ADJUST.get(config["model_type"])
    if adjust is not None:
        adjust(model)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
    return path


def build_lora_adapter(model: Path, path: Path, seed: int, rank: int = 8) -> Path:
    """A PEFT LoRA adapter of ``rank`` on ``q_proj`` and ``v_proj`` with random weights (once).

    Written the way vLLM reads adapters (``adapter_config.json`` and
    ``adapter_model.safetensors``); the weights are large enough to change
    what the model generates.
    """
    path = Path(path)
    if (path / "adapter_model.safetensors").exists():
        return path
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model) / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim", hidden // config["num_attention_heads"])
    outputs = {"q_proj": config["num_attention_heads"] * head_dim,
               "v_proj": config["num_key_value_heads"] * head_dim}  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, out in outputs.items():
            base = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(rank, hidden, generator=generator) * 0.5
            b = torch.randn(out, rank, generator=generator) * 0.5
            tensors[f"{base}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{base}.lora_B.weight"] = b.to(torch.bfloat16)
    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(partial / "adapter_model.safetensors"))
    adapter = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "bias": "none",
               "target_modules": list(outputs)}  # fmt: skip
    (partial / "adapter_config.json").write_text(json.dumps(adapter))
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
    return path


def with_word_tokenizer(model: Path, path: Path) -> Path:
    """A copy of ``model`` under ``path`` with a tokenizer whose every id is one word, ``t<id>``.

    The models here have none (engines run with ``skip_tokenizer_init``), but `vllm serve`
    returns logprobs only with a tokenizer: this one lets a served answer be compared
    with another logprob for logprob. Prompts stay token ids; ids 1 and 2 are the
    configuration's BOS and EOS.
    """
    path = Path(path)
    if (path / "tokenizer.json").exists():
        return path
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(model, partial)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2"
    )
    fast.save_pretrained(partial)
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
    return path


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """KV bytes one token takes over all layers of a plain-attention model like ``LLAMA``."""
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * dtype_bytes


MODELS = {
    "llama": LLAMA,
    "sliding_mistral": SLIDING_MISTRAL,
    "gemma4": GEMMA4,
    "llama4": LLAMA4,
    "big_llama": BIG_LLAMA,
    "serve_llama": SERVE_LLAMA,
    "qwen3_next": QWEN3_NEXT,
    "draft_llama": DRAFT_LLAMA,
    "deepseek_v2": DEEPSEEK_V2,
    "gqa_llama": GQA_LLAMA,
}

if __name__ == "__main__":
    # python tests_e2e/_models.py NAME DIR: build one model (a key of MODELS).
    print(build(MODELS[sys.argv[1]], Path(sys.argv[2])))
