"""Runs one vLLM engine in its own process and prints what it generated, as JSON.

Usage: ``python tests_e2e/_runner.py SPEC.json OUT.json``. The spec names the
model, the engine arguments, the connector configuration (or none), the
prompts (token ids) and the passes; each pass may first reset vLLM's prefix
cache. The result holds, per pass and prompt, the generated token ids and
``num_cached_tokens``, the connectors' own figures, and the text of an error
raised at engine start (so a test can check a configuration message).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
connectors' figures can be read with ``kvoffload.vllm.active_connectors()``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def _plain(value: Any) -> Any:
    """Figures as JSON: nested dicts of numbers, everything else as text."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return str(value)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    engine = dict(spec.get("engine", {}))
    if spec.get("connector") is not None:
        engine["kv_transfer_config"] = {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec["connector"],
            "kv_load_failure_policy": spec.get("failure_policy", "recompute"),
        }
    try:
        llm = LLM(
            model=spec["model"],
            skip_tokenizer_init=True,
            enforce_eager=True,
            gpu_memory_utilization=0.3,
            seed=0,
            **engine,
        )
    except Exception as exc:  # the test reads the message
        return {"error": "".join(traceback.format_exception(exc)), "passes": []}
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    passes = []
    for step in spec.get("passes", [{}]):
        if step.get("reset") and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache")
        outputs = llm.generate(prompts, params, use_tqdm=False)
        passes.append(
            {
                "tokens": [list(out.outputs[0].token_ids) for out in outputs],
                "cached": [out.num_cached_tokens or 0 for out in outputs],
            }
        )
    figures = {}
    if spec.get("connector") is not None:
        from kvoffload.vllm import active_connectors

        for connector in active_connectors():
            figures[connector.role.name.lower()] = _plain(connector.figures())
    return {"error": None, "passes": passes, "figures": figures}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = run(json.load(f))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
