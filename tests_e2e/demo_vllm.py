"""The main job on a real engine: kvoffload's connector in vLLM 0.32 (CPU build), answers checked.

``make demo-vllm`` (and ``make demo``, when ``.venv-vllm`` exists) runs it:

1. builds the tiny Gemma-4 text model (random weights, three sliding-window
   layers and one full-attention layer: four KV cache groups, 512, 512, 512
   and 32 tokens per block) with ``_models.py``;
2. serves the first requests of the bundled demo trace twice in an engine
   with the connector (CPU and disk tiers, ``blocks_per_chunk`` 1): the first
   pass stores, then vLLM's own prefix cache is reset and the second pass
   can only skip its prefill through what the connector loads;
3. serves them twice in an engine without the connector, whose own prefix
   cache serves the second pass: the same KV reused, so the answers must be
   the same token for token (greedy, ``max_tokens`` 8, one prompt at a time).

It prints what vLLM reported cached and what the connector loaded, and exits
1 if any answer differs or the connector loaded nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _models import GEMMA4, build
from _runner import RESULT_MARK, stat_delta

from kvoffload.replay.trace import load_trace

HERE = Path(__file__).resolve().parent
TRACE = HERE.parent / "kvoffload" / "examples" / "demo_trace.jsonl"
ENGINE = {"block_size": 32, "max_model_len": 4096}
#: kvoffload's second pass starts with vLLM's own cache reset; the reference's does not.
PASSES = [{"one_by_one": True}, {"one_by_one": True, "reset": True}]
REFERENCE = [{"one_by_one": True}, {"one_by_one": True}]


def engine(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine process (``_runner.py``) on ``spec``; its result."""
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        file.write(json.dumps(spec))
        file.flush()
        done = subprocess.run(
            [sys.executable, str(HERE / "_runner.py"), file.name],
            capture_output=True, text=True, env=env, check=False,
        )  # fmt: skip
    out = done.stdout.split(RESULT_MARK, 1)
    if done.returncode or len(out) < 2:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"the engine failed (exit {done.returncode})")
    result: dict[str, Any] = json.loads(out[1])
    if result["error"]:
        raise SystemExit(result["error"])
    return result


def main(requests: int = 8) -> int:
    trace = load_trace(TRACE, limit=requests)
    prompts = [trace.tokens(i).tolist() for i in range(requests)]
    with tempfile.TemporaryDirectory(prefix="kvoffload-demo-vllm-") as tmp:
        model = str(build(GEMMA4, Path(tmp) / "gemma4"))
        connector = {"blocks_per_chunk": 1, "cpu_bytes_to_use": "64MiB",
                     "disk_path": str(Path(tmp) / "disk"), "disk_bytes_to_use": "1GiB"}  # fmt: skip
        spec = {"model": model, "engine": ENGINE, "prompts": prompts, "passes": PASSES}
        ours = engine({**spec, "connector": connector, "failure_policy": "recompute"})
        theirs = engine({**spec, "passes": REFERENCE})
    second, reference = ours["passes"][1], theirs["passes"][1]
    same = sum(a == b for a, b in zip(second["tokens"], reference["tokens"], strict=True))
    loaded = stat_delta(ours["passes"], 1, "scheduler", "loaded_tokens")
    print(
        f"kvoffload demo on vLLM (CPU): tiny Gemma-4, KV cache groups of "
        f"{ours['kv_cache_groups']} tokens per block, {requests} requests of the demo trace\n"
        f"  prompt tokens of the second pass                  {sum(map(len, prompts)):>6}\n"
        f"  cached, vLLM's cache reset, kvoffload loading     {sum(second['cached']):>6}  "
        f"(loaded by the connector: {loaded})\n"
        f"  cached, vLLM's own prefix cache (no connector)    {sum(reference['cached']):>6}\n"
        f"  answers identical to vLLM's own cache             {same} of {len(prompts)}"
    )
    ok = same == len(prompts) and loaded > 0
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
