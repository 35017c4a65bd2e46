"""Tiny targets with one MTP layer (``speculative_config={"method": "mtp"}``).

**Qwen3-Next** (recurrent: vLLM 0.32's CPU build cannot run it with prefix caching).

The target is ``_models.QWEN3_NEXT`` (its state made to last, as there) with
``num_nextn_predict_layers: 1``; vLLM's ``Qwen3NextMTP`` reads the
checkpoint's ``mtp.*`` weights (``vllm/model_executor/models/qwen3_next_mtp.py``):
one full-attention decoder layer (``mtp.layers.0.*``, here a copy of the
target's full-attention layer 3), the projection of the embedding and the
hidden state (``mtp.fc``) with their norms, and a final norm. Embedding and
``lm_head`` are the target's. The weights are seeded like ``build``'s.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from _models import DEEPSEEK_V2, QWEN3_NEXT, build

#: QWEN3_NEXT with one multi-token-prediction layer.
QWEN3_NEXT_MTP: dict[str, Any] = {**QWEN3_NEXT, "num_nextn_predict_layers": 1}

#: The target's full-attention layer (full_attention_interval 4 of 4 layers), copied.
_FULL_LAYER = "model.layers.3."


def mtp_weights(tensors: dict[str, Any], hidden: int, seed: int) -> dict[str, Any]:
    """The ``mtp.*`` tensors: layer 3's copy, a seeded ``fc``, unit norms."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    out = {
        "mtp.layers.0." + name[len(_FULL_LAYER) :]: t.clone()
        for name, t in tensors.items()
        if name.startswith(_FULL_LAYER)
    }
    fc = torch.randn(hidden, 2 * hidden, generator=generator) * (2 * hidden) ** -0.5
    out["mtp.fc.weight"] = fc.to(torch.bfloat16)
    # Qwen3-Next's RMSNorm scales by (1 + weight): zeros are the identity, as HF initialises.
    for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        out[f"mtp.{norm}.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)
    return out


#: Branch outputs (attention, linear attention, experts) of the agreeing model, scaled by this.
BRANCH_SCALE = 0.1


def _agreeing(tensors: dict[str, Any], hidden: int) -> None:
    """Make the MTP layer agree with its target: most drafts are then accepted, so the
    steps that move a state between blocks by the accepted count run, and are checked.

    Every branch's output is scaled down (``BRANCH_SCALE``): the target's next token is
    then nearly a function of the current one (its residual stream is the embedding, plus
    a little that the state and the attention still move, enough for the logprob checks).
    The MTP layer's ``fc`` keeps the embedding of the token after ``p`` and drops the
    hidden state: it predicts, from that token, what the target predicts from it.
    """
    import torch

    for name, tensor in tensors.items():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            tensors[name] = tensor * BRANCH_SCALE
    fc = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], 1)
    tensors["mtp.fc.weight"] = fc.to(torch.bfloat16)


def build_mtp(path: Path, seed: int = 0, *, agreeing: bool = False) -> Path:
    """Save QWEN3_NEXT_MTP under ``path`` (once): ``build``'s model plus the ``mtp.*`` weights;
    ``agreeing``: its MTP layer drafts what the target generates, nearly always."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    from safetensors.torch import load_file, save_file

    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    build(QWEN3_NEXT_MTP, partial, seed=seed)
    weights = partial / "model.safetensors"
    tensors = load_file(str(weights))
    tensors.update(mtp_weights(tensors, QWEN3_NEXT_MTP["hidden_size"], seed))
    if agreeing:
        _agreeing(tensors, QWEN3_NEXT_MTP["hidden_size"])
    save_file(tensors, str(weights), metadata={"format": "pt"})
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
    return path


#: A DeepSeek-V3-style MLA model (DEEPSEEK_V2's sizes) with one MTP layer, a mixture of
#: experts from layer 1 on (the MTP layer is layer 2, a copy of layer 1).
DEEPSEEK_V3_MTP: dict[str, Any] = {
    **DEEPSEEK_V2,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "num_nextn_predict_layers": 1,
}


def _peaked(model: Any) -> None:
    """A scaled-up ``lm_head``: greedy choices far from ties (the MTP head shares it)."""
    import torch

    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)


def build_deepseek_mtp(path: Path, seed: int = 0) -> Path:
    """Save DEEPSEEK_V3_MTP under ``path`` (once), with vLLM's ``DeepSeekMTP`` weights.

    vLLM reads the MTP layer as ``model.layers.N.*`` after the target's N layers: a
    decoder layer (here layer N - 1's copy), ``enorm`` / ``hnorm`` over the embedding and
    the hidden state, ``eh_proj`` of the two, and a ``shared_head`` (norm and the target's
    ``lm_head``); ``deepseek_mtp.py`` in vLLM.
    """
    path = Path(path)
    if (path / "config.json").exists():
        return path
    import torch
    from safetensors.torch import load_file, save_file

    partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    build(DEEPSEEK_V3_MTP, partial, seed=seed, adjust=_peaked)
    weights = partial / "model.safetensors"
    tensors = load_file(str(weights))
    n, hidden = DEEPSEEK_V3_MTP["num_hidden_layers"], DEEPSEEK_V3_MTP["hidden_size"]
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    tensors.update(
        {mtp + k[len(last) :]: t.clone() for k, t in tensors.items() if k.startswith(last)}
    )
    generator = torch.Generator().manual_seed(seed)
    ones = torch.ones(hidden, dtype=torch.bfloat16)
    tensors.update({
        mtp + "enorm.weight": ones, mtp + "hnorm.weight": ones.clone(),
        mtp + "eh_proj.weight": (torch.randn(hidden, 2 * hidden, generator=generator)
                                 * (2 * hidden) ** -0.5).to(torch.bfloat16),
        mtp + "shared_head.norm.weight": ones.clone(),
        mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    })  # fmt: skip
    save_file(tensors, str(weights), metadata={"format": "pt"})
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
    return path


if __name__ == "__main__":
    # python tests_e2e/_models_mtp.py DIR: build the model there.
    print(build_mtp(Path(sys.argv[1])))
