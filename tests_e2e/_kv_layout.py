"""Start one vLLM engine (no request) and write its KV cache layout, as JSON.

Usage: ``python tests_e2e/_kv_layout.py SPEC.json OUT.json``; the spec holds
``model``, ``engine`` and ``env`` as ``_runner.py``'s. The result is what
``kvoffload plan`` must predict, read from the engine itself::

    {"error": null | "traceback at engine start",
     "groups": [{"spec": "MLAAttentionSpec", "block_size": 16,
                 "layers": {"model.layers.0.self_attn.attn": PAGE_BYTES, ...},
                 "state_bytes": 0,         # a MambaSpec's state content, else 0
                 "state_shapes": []}],     # a MambaSpec's shapes (conv, SSM), else []
     "num_prefill_lookahead_tokens": 1,    # vLLM's count of tokens a drafter reads ahead
     "num_speculative_tokens": 1,
     "connector_layout": {...} | null}     # kvoffload's reading (group_map), when it has one

``connector_layout`` is the layout the connector would serve
(``kvoffload.vllm._layout.group_map`` with ``drafter_lookahead``), as
``dataclasses.asdict``; null with the reason in ``connector_error`` where the
connector refuses the layout.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback
from pathlib import Path
from typing import Any

from _runner import _environment


def _groups(kv_cache_config: Any) -> list[dict[str, Any]]:
    from vllm.v1.kv_cache_interface import MambaSpec, UniformTypeKVCacheSpecs

    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_layer = (
            spec.kv_cache_specs
            if isinstance(spec, UniformTypeKVCacheSpecs)
            else dict.fromkeys(group.layer_names, spec)
        )
        groups.append({
            "spec": type(spec).__name__,
            "block_size": int(spec.block_size),
            "layers": {name: int(per_layer[name].page_size_bytes) for name in group.layer_names},
            "state_bytes": (int(spec.state_content_size_bytes)
                            if isinstance(spec, MambaSpec) else 0),
            "state_shapes": ([list(s) for s in spec.shapes]
                             if isinstance(spec, MambaSpec) else []),
        })  # fmt: skip
    return groups


def layout(spec: dict[str, Any]) -> dict[str, Any]:
    _environment(spec)
    from vllm import LLM

    engine = {"skip_tokenizer_init": True, "enforce_eager": True, "gpu_memory_utilization": 0.3,
              "seed": 0, **spec.get("engine", {})}  # fmt: skip
    try:
        llm = LLM(model=spec["model"], **engine)
    except Exception as exc:  # the test reads the message
        return {"error": "".join(traceback.format_exception(exc))}
    from kvoffload.vllm._layout import group_map
    from kvoffload.vllm._startup import drafter_lookahead

    vllm_config = llm.llm_engine.vllm_config
    kv_cache_config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    result: dict[str, Any] = {
        "error": None,
        "groups": _groups(kv_cache_config),
        "num_prefill_lookahead_tokens": int(vllm_config.num_prefill_lookahead_tokens),
        "num_speculative_tokens": int(vllm_config.num_speculative_tokens or 0),
        "connector_layout": None,
    }
    try:
        served = group_map(kv_cache_config, drafter_lookahead(vllm_config)).layout
        result["connector_layout"] = dataclasses.asdict(served)
    except Exception as exc:  # a refusal: the test reads it
        result["connector_error"] = str(exc)
    return result


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(layout(json.loads(Path(sys.argv[1]).read_text()))))
