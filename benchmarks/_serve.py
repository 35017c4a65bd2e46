"""`vllm serve` on a free loopback port, and a streaming client of its completions API.

The client does what a user's OpenAI-compatible client does: one HTTP request
per completion, the server-sent events read as they arrive. So the time to the
first token is measured where a user sees it, through the server's queue, its
engine and its HTTP stack. Standard library only: nothing is added to the
vLLM environment for the benchmark.

Every server runs in a session of its own (API server, engine core and worker
processes in one process group) and is stopped with its whole group when the
``running`` block ends, by an error or Ctrl-C too.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SERVED_NAME = "model"
#: The metrics the benchmark reads, summed over label sets (the engine's counters).
METRICS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:num_preemptions_total",
)
#: kvoffload's hit tokens, and (a key of :meth:`Server.metrics`) those whose chunks were on disk.
KVOFFLOAD_HITS = "vllm:kvoffload_hit_tokens_total"
DISK_HITS = KVOFFLOAD_HITS + "{tier=disk}"


class ServerError(RuntimeError):
    """A server that did not start, died, or answered with an error."""


@dataclass(frozen=True)
class ServerSpec:
    """One `vllm serve` process: the engine's arguments and its environment."""

    name: str
    model: Path
    dtype: str
    engine_blocks: int  # --num-gpu-blocks-override: the engine's own KV cache
    block_size: int
    max_model_len: int
    connector: dict[str, Any] | None  # kv_connector_extra_config; None: no connector
    reserved_cpus: int  # VLLM_CPU_NUM_OF_RESERVED_CPU, the same in every timed mode
    kvcache_gib: int  # VLLM_CPU_KVCACHE_SPACE
    cores: str | None = None  # VLLM_CPU_OMP_THREADS_BIND (e.g. "1"); None: vLLM's auto
    extra_env: tuple[tuple[str, str], ...] = ()  # more of the server's environment
    kv_role: str = "kv_both"  # vLLM's kv_role: kv_producer and kv_consumer split the work
    tokenizer: bool = False  # the model directory has one (logprobs need it); else none loaded
    max_num_seqs: int | None = None  # --max-num-seqs: requests the engine runs at once

    def argv(self, port: int) -> list[str]:
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--served-model-name", SERVED_NAME,
            "--host", "127.0.0.1", "--port", str(port),
            "--dtype", self.dtype, "--block-size", str(self.block_size),
            "--num-gpu-blocks-override", str(self.engine_blocks),
            "--max-model-len", str(self.max_model_len),
            "--enforce-eager", "--seed", "0",
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if not self.tokenizer:
            argv.append("--skip-tokenizer-init")
        if self.max_num_seqs is not None:
            argv += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.connector is not None:
            transfer = {
                "kv_connector": "KVOffloadConnector",
                "kv_connector_module_path": "kvoffload.vllm",
                "kv_role": self.kv_role,
                "kv_connector_extra_config": self.connector,
            }
            argv += ["--kv-transfer-config", json.dumps(transfer)]
        return argv

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kvcache_gib)
        # vLLM's CPU backend reserves one core more when a KV connector is configured
        # (vllm/utils/ompmultiprocessing.py); on 2 cores that leaves the engine two
        # cores with the connector and one without. The same value in every mode.
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(self.reserved_cpus)
        if self.cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cores
        # This checkout's kvoffload, not whichever one is installed in the environment.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        env.update(self.extra_env)
        return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Server:
    """One running `vllm serve`; ``stop()`` ends its whole process group."""

    def __init__(self, spec: ServerSpec, log: Path) -> None:
        self.spec, self.log, self.port = spec, log, free_port()
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                spec.argv(self.port),
                env=spec.env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.spec.name}: the server exited:\n{self.log_tail()}")
            try:
                if self._get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1)
        raise ServerError(f"{self.spec.name}: not ready in time:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL to what is left of it after 15 s."""
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.proc.poll()  # reap the API server, the group's leader
                if not group_alive(self.proc.pid):
                    return
                time.sleep(0.2)
        self.proc.poll()

    def metrics(self) -> dict[str, float]:
        status, body = self._get("/metrics")
        if status != 200:
            raise ServerError(f"{self.spec.name}: /metrics answered {status}")
        totals = dict.fromkeys((*METRICS, DISK_HITS), 0.0)
        for line in body.splitlines():
            sample = re.fullmatch(r"([^\s{]+)(?:\{.*\})?\s+(\S+)", line)
            if sample and sample.group(1) in totals:
                totals[sample.group(1)] += float(sample.group(2))
            if sample and sample.group(1) == KVOFFLOAD_HITS and 'tier="disk"' in line:
                totals[DISK_HITS] += float(sample.group(2))
        return totals

    def samples(self) -> dict[tuple[str, str], float]:
        """Every sample of ``/metrics``: (name, its ``tier`` label or "") -> value, summed
        over the other labels."""
        status, body = self._get("/metrics")
        if status != 200:
            raise ServerError(f"{self.spec.name}: /metrics answered {status}")
        out: dict[tuple[str, str], float] = {}
        for line in body.splitlines():
            sample = re.fullmatch(r"([^\s{#]+)(?:\{(.*)\})?\s+(\S+)", line)
            if sample:
                tier = re.search(r'(?:^|,)tier="([^"]*)"', sample.group(2) or "")
                key = (sample.group(1), tier.group(1) if tier else "")
                out[key] = out.get(key, 0.0) + float(sample.group(3))
        return out

    def record(self) -> dict[str, Any]:
        """Where it ran: its process (group) id, port, log, and the cores its engine used."""
        found = re.search(r"local_rank=0, core ids=(\[[^\]]*\])", self.log_tail(10**7))
        return {
            "name": self.spec.name,
            "pgid": self.proc.pid,
            "port": self.port,
            "log": str(self.log),
            "engine_cores": found.group(1) if found else "?",  # as vLLM logged the binding
        }

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def _get(self, path: str) -> tuple[int, str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, resp.read().decode()
        finally:
            conn.close()


def group_alive(pgid: int) -> bool:
    """Whether any process of process group ``pgid`` is still there (not a zombie)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def settled_chunks(disk: Path, at_least: int, timeout_s: float = 60.0) -> int:
    """Wait until the disk tier at ``disk`` records ``at_least`` chunks in its index and no
    more a moment later (or ``timeout_s`` has passed); the count.

    A producer's stores land after its answer, and a consumer's lookup does not wait for
    stores in flight yet (docs/vllm.md): this is how a client makes sure they landed.
    """
    from kvoffload.tiers.disk.inspect import inspect_disk  # the caller's kvoffload

    deadline = time.monotonic() + timeout_s
    seen = -1
    while True:
        now = inspect_disk(disk).chunks
        if (now >= at_least and now == seen) or time.monotonic() > deadline:
            return now
        seen = now
        time.sleep(0.25)


@contextmanager
def running(specs: list[ServerSpec], work: Path, timeout_s: float) -> Iterator[list[Server]]:
    """Start every server at once, wait until all are ready, stop all of them at the end."""
    with ExitStack() as stack:
        servers = []
        for spec in specs:
            server = Server(spec, work / f"{spec.name}.log")
            stack.callback(server.stop)
            servers.append(server)
        deadline = time.monotonic() + timeout_s
        for server in servers:
            server.wait_ready(deadline)
        yield servers


@dataclass(frozen=True)
class Completion:
    tokens: list[int]
    ttft_s: float  # request sent -> first token received
    seconds: float  # request sent -> last event received
    prompt_tokens: int
    cached_tokens: int  # vLLM's prefix cache and the connector together


def complete(port: int, prompt: list[int], max_tokens: int, timeout_s: float) -> Completion:
    """One streaming greedy completion of token ids, exactly ``max_tokens`` long."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        started = time.perf_counter()
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise ServerError(f"completion answered {resp.status}: {resp.read()[:2000]!r}")
        tokens: list[int] = []
        first = None
        usage: dict[str, Any] = {}
        for event in _events(resp):
            for choice in event.get("choices", []):
                tokens += choice.get("token_ids") or []
            if tokens and first is None:
                first = time.perf_counter()
            usage = event.get("usage") or usage
        done = time.perf_counter()
    finally:
        conn.close()
    if first is None or len(tokens) != max_tokens or not usage:
        raise ServerError(f"incomplete answer: {len(tokens)} of {max_tokens} tokens, {usage}")
    details = usage.get("prompt_tokens_details") or {}
    return Completion(
        tokens, first - started, done - started, usage["prompt_tokens"], details["cached_tokens"]
    )


def _events(resp: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a server-sent event stream, up to ``data: [DONE]``."""
    while line := resp.readline():
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        event: dict[str, Any] = json.loads(data)
        if "error" in event:
            raise ServerError(f"error in the stream: {event['error']}")
        yield event
