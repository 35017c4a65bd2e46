"""Runs one vLLM engine in its own process and writes what it generated, as JSON.

Usage: ``python tests_e2e/_runner.py SPEC.json [OUT.json]`` (without OUT the
result goes to stdout, after a line ``=== kvoffload-e2e result ===``, since
vLLM writes its logs there too). One process per engine keeps the tests
isolated and lets a test start a second engine on the same disk directory.

The spec (every key but ``model`` and ``prompts`` optional)::

    {
      "model": "/tmp/llama",                     # a model directory (see _models.py)
      "engine": {"block_size": 32, ...},         # more keyword arguments of vllm.LLM
      "connector": {"blocks_per_chunk": 2, ...}, # kv_connector_extra_config of
                                                 #   KVOffloadConnector; null: no connector
      "failure_policy": "recompute",             # kv_load_failure_policy (vLLM's default
                                                 #   when absent: "fail")
      "kv_role": "kv_producer",                  # vLLM's kv_role (absent: "kv_both")
      "kv_transfer_config": {...},               # or the whole kv_transfer_config instead
      "prompts": [[1, 2, 3], ...],               # token ids, or {"prompt_token_ids": [...],
                                                 #   "cache_salt": "t1", "lora": [name, id, path]}
      "max_tokens": 8,
      "passes": [{}, {"reset": true}],           # one generate() of all prompts each
      "kv_events": true,                         # vLLM's KV events on, published over ZMQ
                                                 #   to this process (each pass's "events")
      "env": {"KVOFFLOAD_FAILPOINTS": "..."},    # set in this process before vLLM starts
                                                 #   (fault points: docs/failpoints.md;
                                                 #   PYTHONPATH goes on sys.path too)
      "preload": ["module"]                      # imported after env, before the engine
    }                                            #   (a patch of vLLM under test)

Each pass may first act: ``reset`` (``llm.reset_prefix_cache()``, vLLM's own
cache only), ``reset_connector`` (the same with ``reset_connector=True``),
``corrupt`` (a directory: overwrite bytes in the middle of every ``*.kv``
file under it), ``truncate`` (a directory: cut every ``*.kv`` file under it
to its header), ``delete`` (a directory: remove every ``*.kv`` file under
it). ``prompts`` in a pass replaces the spec's for that pass; ``follow_up``
(a number ``n``) makes each prompt the next turn of a conversation: the
previous pass's prompt, what it generated, and ``n`` new token ids. With
``"one_by_one": true`` the pass sends its prompts one ``generate()`` at a
time, and with ``"reset_each": true`` resets vLLM's prefix cache before each
(the benchmark's way to time one prompt's prefill alone).

Two engines running at once meet through files: a pass with ``"signal_start": path``
creates ``path`` before it does anything else, one with ``"wait_for": path`` waits (up
to two minutes) until ``path`` exists before it sends its prompts, and one with
``"signal_end": path`` creates ``path`` once its ``generate()`` returned (its outputs
are out; the connector's stores may still be on their way). ``"kv_transfer_params"``
in a pass goes to vLLM with each of its prompts (``SamplingParams.extra_args``), as
the OpenAI API's field of that name does.

The result::

    {
      "error": null | "traceback text of an exception raised at engine start",
      "start_seconds": 3.2,
      "kv_cache_groups": [2048, ...],   # vLLM's tokens per block, per KV cache group
      "kv_cache_state_bytes": [0, ...], # per group, the bytes of one recurrent state
                                        #   (a MambaSpec's content; 0 for attention)
      "torch_threads": 2, "cpu_affinity": [0, 1],  # what the engine computes with
      "passes": [{"tokens": [[...], ...], "logprobs": [[-0.01, ...], ...],
                  "cached": [288, ...], "finish": ["length", ...],
                  "seconds": 0.4, "prompt_seconds": [...], "ttft": [...] | null,
                  "settle_steps": 2,       # engine steps after generate() until vLLM
                                           #   held no finished request (_settle)
                  "stats": {"scheduler": {...}, "worker": {...}},
                  "acted": {"corrupted_files": 12, ...}}],
      "stats": {"scheduler": {...}, "worker": {...}},  # after the last pass
      "shared_cpu_tier": [{"pid": 12, "name": "kvoffload-cpu-...", "size": ...,
                           "rss": ..., "pss": ...}],  # tensor-parallel workers' mappings
      "metrics": {"vllm:prompt_tokens_total": 123.0, ...} # when stats are logged, else {}
    }

With ``kv_events`` each pass records the KV events vLLM published during it
(``"events"``: msgpack maps as routers receive them, GPU and connector
alike), received on a loopback ZMQ socket this process binds.

``logprobs`` holds, per prompt, the log-probability of each token generated
(vLLM's ``logprobs=0``: the sampled token's only), which a damaged block moves
even where it leaves the greedy choice alone. ``cached`` is
``RequestOutput.num_cached_tokens`` (vLLM's prefix cache and the connector
together); ``stats`` are ``KVOffloadConnector.stats()`` of
the live connectors of this process, keyed by role (the engine runs in this
process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). ``ttft`` is vLLM's
``first_token_latency`` per prompt when the engine logs stats
(``"disable_log_stats": false`` in ``engine``), else null; ``metrics`` are
then vLLM's Prometheus figures after the last pass (``llm.get_metrics()``):
counters and gauges summed over their labels, histograms as ``NAME_count``
and ``NAME_sum``.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

RESULT_MARK = "=== kvoffload-e2e result ==="


def _plain(value: Any) -> Any:
    """Figures as JSON: nested dicts and lists of numbers, anything else as text."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return str(value)


def corrupt_chunk_files(directory: str | Path, nbytes: int = 64) -> int:
    """Overwrite ``nbytes`` in the middle of every ``*.kv`` file under ``directory``.

    A chunk file is a 4 KiB header and the payload, so for payloads of 4 KiB
    or more the middle of the file is KV bytes. Returns how many files were
    damaged.
    """
    files = sorted(Path(directory).rglob("*.kv"))
    for path in files:
        with path.open("r+b") as f:
            f.seek(path.stat().st_size // 2)
            old = f.read(nbytes)
            f.seek(-len(old), 1)
            f.write(bytes(b ^ 0xA5 for b in old))  # every byte changes
    return len(files)


def truncate_chunk_files(directory: str | Path) -> int:
    """Cut every ``*.kv`` file under ``directory`` to its 4 KiB header: the disk tier finds
    it short when it loads it (a deleted file is only a miss: the lookup sees it gone)."""
    files = sorted(Path(directory).rglob("*.kv"))
    for path in files:
        os.truncate(path, 4096)
    return len(files)


def delete_chunk_files(directory: str | Path) -> int:
    files = sorted(Path(directory).rglob("*.kv"))
    for path in files:
        path.unlink()
    return len(files)


def stat_delta(passes: list[dict[str, Any]], n: int, side: str, name: str) -> int:
    """How much connector stat ``name`` of ``side`` grew during pass ``n`` (absent: 0)."""

    def get(p: dict[str, Any]) -> int:
        return int(p.get("stats", {}).get(side, {}).get(name, 0))

    return get(passes[n]) - (get(passes[n - 1]) if n else 0)


def _connector_stats() -> dict[str, Any]:
    """``stats()`` of this process's live connectors, keyed by role (scheduler, worker)."""
    try:
        from kvoffload.vllm import active_connectors
    except ImportError:
        return {}
    out: dict[str, Any] = {}
    for connector in active_connectors():
        role = getattr(connector.role, "name", str(connector.role)).lower()
        out[role] = _plain(connector.stats())
    return out


def _kv_cache_facts(llm: Any) -> dict[str, list[int] | None]:
    """Per KV cache group, vLLM's tokens per block and state bytes (in-process engine only)."""
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        specs = [g.kv_cache_spec for g in scheduler.kv_cache_config.kv_cache_groups]
    except AttributeError:
        return {"kv_cache_groups": None, "kv_cache_state_bytes": None}
    return {
        "kv_cache_groups": [int(spec.block_size) for spec in specs],
        "kv_cache_state_bytes": [_state_bytes(spec) for spec in specs],
    }


def _state_bytes(spec: Any) -> int:
    """One recurrent state's bytes as vLLM keeps it (its dtypes differ between CPUs), or 0."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return int(spec.state_content_size_bytes) if isinstance(spec, MambaSpec) else 0


def _metrics(llm: Any) -> dict[str, float]:
    """vLLM's Prometheus figures of this engine, summed over labels (needs logged stats)."""
    from vllm.v1.metrics.reader import Counter, Gauge, Histogram

    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter | Gauge):
            out[metric.name] = out.get(metric.name, 0.0) + float(metric.value)
        elif isinstance(metric, Histogram):
            for suffix, value in (("_count", metric.count), ("_sum", metric.sum)):
                out[metric.name + suffix] = out.get(metric.name + suffix, 0.0) + float(value)
    return out


class _EventSink:
    """vLLM's KV events, read back through the ZMQ publisher's replay socket.

    The live PUB stream drops what is sent before a subscription reaches it
    (vLLM 0.32 lost the first batch here even after the connection's
    handshake), so events are fetched from the publisher's replay buffer by
    sequence number instead: every batch, in order, exactly once.
    """

    def __init__(self) -> None:
        import zmq

        context = zmq.Context.instance()
        self._live = context.socket(zmq.SUB)  # where the publisher connects; not read
        live = self._live.bind_to_random_port("tcp://127.0.0.1")
        probe = context.socket(zmq.REP)
        replay = probe.bind_to_random_port("tcp://127.0.0.1")
        probe.close(linger=0)  # a free port for the publisher to bind its replay socket
        self._replay = context.socket(zmq.DEALER)  # one request, many replies
        self._replay.connect(f"tcp://127.0.0.1:{replay}")
        self._next = 0
        self.config = {"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"tcp://127.0.0.1:{live}",
                       "replay_endpoint": f"tcp://127.0.0.1:{replay}"}  # fmt: skip

    def _fetch(self) -> list[dict[str, Any]]:
        """Every batch from the next sequence number on, as the replay socket sends them."""
        import msgspec

        self._replay.send_multipart((b"", self._next.to_bytes(8, "big")))
        events: list[dict[str, Any]] = []
        while True:
            if not self._replay.poll(60_000):
                raise RuntimeError("vLLM's KV event replay socket did not answer")
            _empty, _topic, seq, payload = self._replay.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number < 0:  # the end-of-sequence marker
                return events
            _ts, batch, *_ = msgspec.msgpack.decode(payload)
            events += [_plain(event) for event in batch]
            self._next = number + 1

    def take(self, quiet_s: float = 1.0) -> list[dict[str, Any]]:
        """Events published since the last call, once none came for ``quiet_s``."""
        events = self._fetch()
        while True:
            time.sleep(quiet_s)  # the publisher thread may still be sending
            more = self._fetch()
            if not more:
                return events
            events += more


def _settle(llm: Any, timeout_s: float = 120.0) -> int:
    """Step the engine until it holds no finished request; how many steps that took.

    ``LLM.generate`` returns once every output is done, but vLLM keeps a finished
    request's blocks while the connector stores them, and hears that the stores landed
    only at a later step. Without these steps a pass's statistics would miss the stores
    its last steps made (they would count in the next pass, or nowhere), depending on
    how fast the machine ran. In-process engine only (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
    """
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + timeout_s
    steps = 0
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine still held finished requests after {timeout_s} s")
        llm.llm_engine.step()
        steps += 1
        time.sleep(0.002)  # the worker's store jobs run in their own threads
    return steps


def _with_params(params: Any, step: dict[str, Any]) -> Any:
    """The pass's sampling parameters: with its ``kv_transfer_params`` for every prompt."""
    if step.get("kv_transfer_params") is None:
        return params
    params = params.clone()
    params.extra_args = {"kv_transfer_params": step["kv_transfer_params"]}
    return params


def _wait_for(path: Path, timeout_s: float = 120.0) -> None:
    """Wait until another engine's pass creates ``path`` (``signal_start``, ``signal_end``)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.01)


def _generate(
    llm: Any, step: dict[str, Any], prompts: Any, loras: Any, params: Any
) -> tuple[list[Any], list[float] | None]:
    """The pass's outputs, and with ``one_by_one`` each prompt's seconds."""
    if not step.get("one_by_one"):
        lora_list = list(loras) if any(loras) else None
        return llm.generate(list(prompts), params, use_tqdm=False, lora_request=lora_list), None
    outputs, seconds = [], []
    for prompt, lora in zip(prompts, loras, strict=True):
        if step.get("reset_each"):
            _act(llm, {"reset": True})
        started = time.perf_counter()
        outputs += llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
        seconds.append(time.perf_counter() - started)
    return outputs, seconds


def _act(llm: Any, step: dict[str, Any]) -> dict[str, Any]:
    acted: dict[str, Any] = {}
    if step.get("corrupt"):
        acted["corrupted_files"] = corrupt_chunk_files(step["corrupt"])
    if step.get("truncate"):
        acted["truncated_files"] = truncate_chunk_files(step["truncate"])
    if step.get("delete"):
        acted["deleted_files"] = delete_chunk_files(step["delete"])
    if step.get("reset") or step.get("reset_connector"):
        ok = llm.reset_prefix_cache(reset_connector=bool(step.get("reset_connector")))
        if not ok:
            raise RuntimeError("vLLM could not reset its prefix cache")
        acted["reset"] = True
    return acted


def _embeddings(model: str, token_ids: list[int], scale: float) -> Any:
    """The model's input embeddings of ``token_ids`` (times ``scale``), as a prompt's embeds."""
    from safetensors import safe_open

    with safe_open(str(Path(model) / "model.safetensors"), framework="pt") as f:
        table = f.get_tensor("model.embed_tokens.weight")
    return table[token_ids] * scale


def _prompt(entry: Any, model: str = "") -> tuple[dict[str, Any], Any]:
    """vLLM's prompt and LoRA request of one spec prompt (token ids, or a dict with more).

    ``{"embeds_of": [token ids], "scale": 1.0}`` is a prompt of embeddings: the
    model's own embeddings of those tokens, scaled.
    """
    if not isinstance(entry, dict):
        return {"prompt_token_ids": entry}, None
    if "embeds_of" in entry:
        embeds = _embeddings(model, entry["embeds_of"], entry.get("scale", 1.0))
        return {"prompt_embeds": embeds}, None
    prompt = {"prompt_token_ids": entry["prompt_token_ids"]}
    if entry.get("cache_salt") is not None:
        prompt["cache_salt"] = entry["cache_salt"]
    lora = None
    if entry.get("lora") is not None:
        from vllm.lora.request import LoRARequest

        name, lora_id, path = entry["lora"]
        lora = LoRARequest(name, lora_id, path)
    return prompt, lora


def follow_up(prompts: list[list[int]], outputs: list[list[int]], n: int) -> list[list[int]]:
    """The next turn of each conversation: prompt, its output, ``n`` new token ids (seeded)."""
    turns = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        rng = random.Random(f"follow-up {i} {len(prompt)}")
        turns.append(prompt + output + [rng.randrange(1, 500) for _ in range(n)])
    return turns


def _sampled_logprobs(completion: Any) -> list[float]:
    """The log-probability of each token ``completion`` generated."""
    return [float(step[token].logprob) for token, step in
            zip(completion.token_ids, completion.logprobs or [], strict=True)]  # fmt: skip


def _record(outputs: list[Any]) -> dict[str, Any]:
    ttft = [getattr(out.metrics, "first_token_latency", None) for out in outputs]
    return {
        "tokens": [list(out.outputs[0].token_ids) for out in outputs],
        "logprobs": [_sampled_logprobs(out.outputs[0]) for out in outputs],
        "cached": [out.num_cached_tokens or 0 for out in outputs],
        "finish": [out.outputs[0].finish_reason for out in outputs],
        "ttft": None if None in ttft else ttft,
    }


def _children() -> list[int]:
    """This process's child processes (vLLM's tensor-parallel workers)."""
    me, pids = str(os.getpid()), []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == me
            ):
                pids.append(int(entry.name))
        except OSError:
            continue
    return sorted(pids)


def shared_cpu_tier() -> list[dict[str, Any]]:
    """Each worker's mappings of kvoffload's shared CPU tier: name, bytes, resident, shared.

    Read from ``/proc/PID/smaps`` of this process's children: ``size`` is the
    mapping's length, ``pss`` its proportional share (the region's pages split
    between the processes that map them), so the sum of ``pss`` over the
    workers is the host memory the region holds.
    """
    found = []
    for pid in _children():
        try:
            lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
        except OSError:
            continue
        current: dict[str, Any] | None = None
        for line in lines:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                path = head[5] if len(head) > 5 else ""
                current = None
                if "/kvoffload-cpu-" in path:
                    current = {"pid": pid, "name": Path(path).name}
                    found.append(current)
            elif current is not None and head[0] in ("Size:", "Rss:", "Pss:"):
                current[head[0][:-1].lower()] = int(head[1]) * 1024
    return found


def _environment(spec: dict[str, Any]) -> None:
    """Before vLLM is imported: CPU KV cache of 1 GiB, the engine in this process, the spec's
    (its ``PYTHONPATH`` on ``sys.path`` too: found by imports and entry points alike)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env = spec.get("env", {})
    os.environ.update(env)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    for module in spec.get("preload", []):  # a patch of vLLM under test (this directory's)
        importlib.import_module(module)


def run(spec: dict[str, Any]) -> dict[str, Any]:
    _environment(spec)
    from vllm import LLM, SamplingParams

    engine = {
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "gpu_memory_utilization": 0.3,
        "seed": 0,
        **spec.get("engine", {}),
    }
    sink = _EventSink() if spec.get("kv_events") else None
    if sink is not None:
        engine["kv_events_config"] = sink.config
    if spec.get("kv_transfer_config") is not None:
        engine["kv_transfer_config"] = spec["kv_transfer_config"]
    elif spec.get("connector") is not None:
        config = {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.vllm",
            "kv_role": spec.get("kv_role", "kv_both"),
            "kv_connector_extra_config": spec["connector"],
        }
        if spec.get("failure_policy"):
            config["kv_load_failure_policy"] = spec["failure_policy"]
        engine["kv_transfer_config"] = config
    started = time.perf_counter()
    try:
        llm = LLM(model=spec["model"], **engine)
    except Exception as exc:  # the test reads the message
        return {"error": "".join(traceback.format_exception(exc)), "passes": [], "stats": {}}
    import torch

    result: dict[str, Any] = {
        "error": None,
        "start_seconds": time.perf_counter() - started,
        **_kv_cache_facts(llm),
        # What the engine (in this process) computes with: its torch threads, its cores.
        "torch_threads": torch.get_num_threads(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "passes": [],
    }
    params = SamplingParams(
        temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True, logprobs=0
    )
    last: tuple[list[list[int]], list[list[int]]] | None = None
    for step in spec.get("passes", [{}]):
        if step.get("signal_start"):
            Path(step["signal_start"]).touch()
        if step.get("wait_for"):
            _wait_for(Path(step["wait_for"]))
        acted = _act(llm, step)
        entries = step.get("prompts", spec["prompts"])
        if step.get("follow_up"):
            if last is None:
                raise ValueError("'follow_up' needs a pass before it")
            entries = follow_up(*last, step["follow_up"])
        prompts, loras = zip(*[_prompt(p, spec["model"]) for p in entries], strict=True)
        started = time.perf_counter()
        outputs, seconds = _generate(llm, step, prompts, loras, _with_params(params, step))
        if step.get("signal_end"):
            Path(step["signal_end"]).touch()
        settled = _settle(llm)
        record = _record(outputs)
        record["settle_steps"] = settled
        last = (entries, record["tokens"])
        record.update(seconds=time.perf_counter() - started, prompt_seconds=seconds, acted=acted)
        record["stats"] = _connector_stats() if "kv_transfer_config" in engine else {}
        if sink is not None:
            record["events"] = sink.take()
        result["passes"].append(record)
    result["stats"] = _connector_stats() if "kv_transfer_config" in engine else {}
    result["shared_cpu_tier"] = shared_cpu_tier()
    result["metrics"] = {} if engine.get("disable_log_stats", True) else _metrics(llm)
    return result


def exit_after_shutdown(rc: int) -> NoReturn:
    """Exit once vLLM's engine has shut down, without the interpreter's module teardown.

    vLLM shuts its engine down (and the connector closes its tiers) in exit hooks,
    which run here as at any exit; what is skipped is the teardown of some 5,000
    modules one by one, about 2 s a process that no test reads anything from.
    """
    gc.collect()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    result = run(spec)
    text = json.dumps(result)
    if len(argv) > 2:
        Path(argv[2]).write_text(text)
    else:
        print(RESULT_MARK)
        print(text)
    sys.stdout.flush()
    # vLLM's engine shuts down (and the connector closes its tiers) at exit.
    return 0


if __name__ == "__main__":
    exit_after_shutdown(main(sys.argv))
