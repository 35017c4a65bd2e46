"""A tiny Qwen3-Next with one MTP layer (``speculative_config={"method": "mtp"}``).

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

from _models import QWEN3_NEXT, build

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


def build_mtp(path: Path, seed: int = 0) -> Path:
    """Save QWEN3_NEXT_MTP under ``path`` (once): ``build``'s model plus the ``mtp.*`` weights."""
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
    save_file(tensors, str(weights), metadata={"format": "pt"})
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
    return path


if __name__ == "__main__":
    # python tests_e2e/_models_mtp.py DIR: build the model there.
    print(build_mtp(Path(sys.argv[1])))
