"""GPU end-to-end proof: kvoffload on vLLM 0.33 with DeepSeek-V4 (and its MTP drafter), Gemma-4.

One command checks, on a real engine and GPU, what ``tests_e2e/`` checks on
vLLM's CPU build (which runs DeepSeek-V4 only with AVX-512/AMX)::

    python benchmarks/gpu_e2e.py [--models dsv4,gemma4,dsv4-mtp] [--blocks-per-chunk 1,2]
                                 [--work DIR] [--json-out FILE]

For each model and ``blocks_per_chunk`` one engine runs in its own process
(tiny models from ``kvoffload/examples``, ``load_format="dummy"``: no weights
needed; the dummy weights are then redrawn seeded, norms set to one and
``lm_head`` scaled up, so logits are peaked and a wrong KV shows in the
tokens). The engine generates the same prompts four times, greedily:

1. **store**: nothing cached; kvoffload stores every chunk it completes;
2. **oracle**: vLLM's own prefix cache serves the prompts: these tokens come
   from the same KV the first pass computed;
3. **connector**: after ``reset_prefix_cache()`` only kvoffload can serve the
   history; its tokens must be the oracle's, every prompt must report the
   cached tokens kvoffload's hit rule gives, all of them loaded;
4. **control**: after another reset, kvoffload's CPU tier is scrambled
   before it loads: the tokens must now differ from the oracle's somewhere,
   or the check above could not have failed.

Prints a table and writes the results as JSON; exits 1 if a check failed.
Without CUDA, or with a vLLM older than 0.33, it refuses at once with a
one-line reason (exit 2).

It has not run on a GPU yet: the machines it was written on have none, and
the one GPU machine lent so far (an H200) had no vLLM and could not install
one (no package registry; ``benchmarks/gpu_run.sh`` skips it there). Its
engine process (``child``) and checks did run on vLLM 0.32's CPU build with
the Gemma-4 model (``"engine": {"block_size": 32}`` in the spec): the
connector's tokens were the oracle's, 1024/1024/512 tokens cached, and the
scrambled control gave other tokens. DeepSeek-V4 on vLLM 0.33 with a GPU,
and these tiny DeepSeek-V4 settings with its kernels, are unproven.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

#: Prompt lengths: hits land on each model's chunk alignment below them (256 or 512 tokens).
PROMPT_TOKENS = (1300, 1100, 700)
MAX_TOKENS = 16


def models() -> dict[str, dict[str, Any]]:
    """The engines' model configs (no weights: ``load_format="dummy"``)."""
    examples = ROOT / "kvoffload" / "examples"
    dsv4 = json.loads((examples / "tiny_deepseek_v4.json").read_text())
    gemma4 = {
        **json.loads((examples / "tiny_gemma4.json").read_text()),
        # Per-layer input embeddings shrunk to the vocabulary (as tests_e2e/_models.py).
        "vocab_size_per_layer_input": 1024,
        "hidden_size_per_layer_input": 16,
    }
    return {"dsv4": dsv4, "gemma4": gemma4, "dsv4-mtp": dsv4}


#: Engine arguments beyond the model's, by model name: DeepSeek-V4's own MTP layer drafting
#: (its KV at a position reads the next token: the connector's keys name it). vLLM's block
#: drop is off, so its own cache reuses the same KV up to the same boundaries.
ENGINES: dict[str, dict[str, Any]] = {
    "dsv4-mtp": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1,
                                        "disable_eagle_block_drop": True}},
}  # fmt: skip


# -- the engine process -----------------------------------------------------------------------
def _peak(model: Any) -> int:
    """Redraw float weights seeded, norms to one, ``lm_head`` x20: peaked logits."""
    import torch

    gen = torch.Generator().manual_seed(0)
    changed = 0
    for name, param in model.named_parameters():
        if not param.dtype.is_floating_point or param.element_size() < 2:
            continue  # fp8 / integer tensors keep the dummy loader's values
        if not bool(torch.isfinite(param).all()):
            continue  # e.g. attention sinks of padded heads: -inf on purpose
        owner = name.rsplit(".", 2)[-2] if "." in name else name
        if "norm" in owner:
            param.data.fill_(1.0)
        else:
            draw = torch.randn(param.shape, generator=gen) * 0.05
            param.data.copy_(draw.to(param.dtype))
        if "lm_head" in name:
            param.data.mul_(20.0)
        changed += 1
    return changed


def _scramble_cpu_tier() -> int:
    """Overwrite kvoffload's CPU tier with noise (the control pass); bytes scrambled."""
    import torch

    from kvoffload.vllm import active_connectors

    scrambled = 0
    for connector in active_connectors():
        worker = getattr(connector.side, "worker", None)  # the worker side's, once registered
        if worker is None:
            continue
        worker.engine.wait()
        slab = worker.engine.cascade.cpu.slab
        slab.copy_(torch.randint(0, 256, slab.shape, dtype=torch.uint8))
        scrambled += slab.numel()
    return scrambled


def _layout(llm: Any) -> list[dict[str, Any]]:
    """The groups kvoffload's scheduler side built from vLLM's KV cache config."""
    from kvoffload.vllm import active_connectors

    for connector in active_connectors():
        if getattr(connector.side, "scheduler", None) is not None:
            return [
                {"kind": g.kind, "tokens_per_block": g.tokens_per_block, "layers": g.num_layers,
                 "pages": sorted(set(g.layer_pages)), "window": g.sliding_window}
                for g in connector.setup.layout.groups
            ]  # fmt: skip
    return []


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: the four passes of the module docstring."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connectors live in this process
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model
    from vllm import LLM, SamplingParams

    from kvoffload.vllm import active_connectors

    engine: dict[str, Any] = {
        "load_format": "dummy", "skip_tokenizer_init": True, "enforce_eager": True,
        "gpu_memory_utilization": 0.5, "max_model_len": 4096, "seed": 0,
        "enable_prefix_caching": True,
        "kv_transfer_config": {
            "kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kvoffload.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": "2GiB",
                                          "blocks_per_chunk": spec["blocks_per_chunk"]},
        },
    }  # fmt: skip
    engine.update(spec.get("engine", {}))  # more LLM(...) arguments, for a trial elsewhere
    llm = LLM(model=spec["model"], **engine)
    out: dict[str, Any] = {"peaked_params": sum(llm.apply_model(_peak)), "layout": _layout(llm)}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    passes = []
    for name in ("store", "oracle", "connector", "control"):
        if name in ("connector", "control") and not llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache")
        if name == "control":
            out["scrambled_bytes"] = _scramble_cpu_tier()
        results = llm.generate(prompts, params, use_tqdm=False)
        figures = {str(c.role): c.stats() for c in active_connectors()}
        passes.append({
            "name": name,
            "tokens": [list(r.outputs[0].token_ids) for r in results],
            "cached": [r.num_cached_tokens or 0 for r in results],
            "stats": json.loads(json.dumps(figures, default=str)),
        })  # fmt: skip
    out["passes"] = passes
    return out


# -- the checks -------------------------------------------------------------------------------
def _hit(prompt: int, alignment: int) -> int:
    """What kvoffload offers for a prompt: the aligned prefix, one token left to compute."""
    return (prompt - 1) // alignment * alignment


def check(result: dict[str, Any], spec: dict[str, Any]) -> list[str]:
    """Failed checks of one engine run, in words (empty: the run proves what it should)."""
    if result.get("error"):
        return [f"engine failed: {result['error'].strip().splitlines()[-1]}"]
    store, oracle, connector, control = result["passes"]
    failures = []
    if oracle["tokens"] != store["tokens"]:
        failures.append("vLLM's own prefix cache changed the tokens (the oracle is unsound)")
    if not all(oracle["cached"]):
        failures.append(f"vLLM's prefix cache served nothing: {oracle['cached']}")
    if connector["tokens"] != oracle["tokens"]:
        failures.append("tokens served by kvoffload differ from vLLM's prefix cache's")
    spans = [g["tokens_per_block"] * spec["blocks_per_chunk"] for g in result["layout"]]
    alignment = math.lcm(*spans) if spans else 0
    expected = [_hit(len(p), alignment) for p in spec["prompts"]] if alignment else []
    if connector["cached"] != expected:
        failures.append(f"cached tokens {connector['cached']}, expected {expected}")
    if control["tokens"] == oracle["tokens"]:
        failures.append("a scrambled CPU tier gave the oracle's tokens: the check cannot fail")
    return failures


def _prompts(vocab: int) -> list[list[int]]:
    """Random prompts sharing nothing, seeded: the same in every run."""
    import random

    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in PROMPT_TOKENS]


def refusal() -> str | None:
    """Why this machine cannot run the proof, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device: this proof needs a GPU (vLLM's CPU build cannot run DeepSeek-V4)"
    try:
        import vllm
    except ImportError:
        return "vLLM is not installed: pip install vllm==0.33.0"
    major, minor = (int(x) for x in vllm.__version__.split(".")[:2])
    if (major, minor) < (0, 33):
        return f"needs vLLM 0.33 or newer, found {vllm.__version__}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--models", default="dsv4,gemma4,dsv4-mtp")
    parser.add_argument("--blocks-per-chunk", default="1,2")
    parser.add_argument("--work", default="/tmp/kvoffload-gpu-e2e")
    parser.add_argument("--json-out", default=None)
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(Path(args.child[0]).read_text())
        Path(args.child[1]).write_text(json.dumps(child(spec)))
        return 0
    why = refusal()
    if why:
        print(f"gpu_e2e refused: {why}", file=sys.stderr)
        return 2
    rows = run_all(args)
    ok = all(not row["failures"] for row in rows)
    for row in rows:
        verdict = "ok" if not row["failures"] else "; ".join(row["failures"])
        print(f"{row['model']:<7} blocks_per_chunk={row['blocks_per_chunk']}  "
              f"{row['seconds']:6.1f}s  {verdict}")  # fmt: skip
    text = json.dumps(rows, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text)
    print(text)
    return 0 if ok else 1


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One engine process per model and ``blocks_per_chunk``."""
    work = Path(args.work)
    rows = []
    configs = models()
    for name in args.models.split(","):
        model_dir = work / name
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(configs[name], indent=2))
        for bpc in (int(b) for b in args.blocks_per_chunk.split(",")):
            spec = {"model": str(model_dir), "blocks_per_chunk": bpc,
                    "engine": ENGINES.get(name, {}),
                    "prompts": _prompts(int(configs[name]["vocab_size"]))}  # fmt: skip
            spec_path, out_path = work / f"{name}-{bpc}.spec.json", work / f"{name}-{bpc}.json"
            spec_path.write_text(json.dumps(spec))
            started = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, __file__, "--child", str(spec_path), str(out_path)],
                capture_output=True, text=True, timeout=1800, check=False,
            )  # fmt: skip
            (work / f"{name}-{bpc}.log").write_text(proc.stdout + proc.stderr)
            result = (
                json.loads(out_path.read_text())
                if proc.returncode == 0 and out_path.exists()
                else {"error": proc.stderr[-4000:] or f"exit {proc.returncode}"}
            )
            rows.append({"model": name, "blocks_per_chunk": bpc,
                         "seconds": time.perf_counter() - started,
                         "failures": check(result, spec), "result": result})  # fmt: skip
    return rows


if __name__ == "__main__":
    sys.exit(main())
