"""`vllm serve` with the connector: `/metrics` has the `vllm:kvoffload_*` series, and they move.

One server on a loopback port (CPU and disk tiers), one request, a scrape;
vLLM's prefix cache reset (``VLLM_SERVER_DEV_MODE``), the same request again
(served by the connector), a second scrape. The series carry vLLM's labels
(``model_name``, ``engine``) and ``tier`` where one applies; counters grow,
gauges hold the tiers' usage, histograms count the jobs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _harness import LLAMA_PROMPTS, connector_hit

START_TIMEOUT_S = float(os.environ.get("KVOFFLOAD_E2E_TIMEOUT", "600"))
SAMPLE = re.compile(r"^(vllm:kvoffload_\w+)\{([^}]*)\} (\S+)$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http(url: str, body: dict[str, Any] | None = None, method: str = "GET") -> str:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method if body is None else "POST",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as response:
        text: str = response.read().decode()
        return text


def scrape(base: str) -> dict[tuple[str, str], float]:
    """``vllm:kvoffload_*`` samples of ``/metrics``: (name, tier or reason label, or "") ->
    value."""
    out: dict[tuple[str, str], float] = {}
    for line in http(f"{base}/metrics").splitlines():
        match = SAMPLE.match(line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            assert labels["engine"] == "0" and labels["model_name"], line
            label = labels.get("tier", labels.get("reason", ""))
            out[(match.group(1), label)] = float(match.group(3))
    return out


@pytest.fixture
def server(llama: str, tmp_path: Path) -> Iterator[str]:
    """A ``vllm serve`` of the tiny Llama with kvoffload (CPU and disk tiers); its base URL."""
    port = free_port()
    extra = {"blocks_per_chunk": 1, "cpu_bytes_to_use": "64MiB",
             "disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": "64MiB"}  # fmt: skip
    transfer = {"kv_connector": "KVOffloadConnector", "kv_connector_module_path": "kvoffload.vllm",
                "kv_role": "kv_both", "kv_connector_extra_config": extra}  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", llama,
         "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager",
         "--block-size", "32", "--max-model-len", "1024", "--gpu-memory-utilization", "0.3",
         "--kv-transfer-config", json.dumps(transfer)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited: {(tmp_path / 'serve.log').read_text()[-4000:]}")
            try:
                http(f"{base}/health")
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("vllm serve did not become healthy")
                time.sleep(2)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine process it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def complete(base: str, llama: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": llama, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    answer: dict[str, Any] = json.loads(http(f"{base}/v1/completions", body))
    return answer


def scrape_until(base: str, ready: Any, timeout_s: float = 60.0) -> dict[tuple[str, str], float]:
    """Scrape until ``ready(samples)``: figures reach the frontend with the engine's steps."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(base)
        if ready(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(1)


def test_metrics_have_the_connector_series_and_they_move(server: str, llama: str) -> None:
    prompt = LLAMA_PROMPTS[0]
    first = complete(server, llama, prompt)
    stored = scrape_until(server, lambda s: s.get(("vllm:kvoffload_usage_chunks", "disk"), 0) > 0)
    chunks = connector_hit(prompt, 32) // 32
    assert stored[("vllm:kvoffload_usage_chunks", "cpu")] >= chunks
    assert stored[("vllm:kvoffload_usage_chunks", "disk")] >= chunks
    assert stored[("vllm:kvoffload_usage_bytes", "cpu")] > 0
    assert stored[("vllm:kvoffload_stored_bytes_total", "cpu")] > 0
    assert stored[("vllm:kvoffload_stored_bytes_total", "disk")] > 0
    assert stored[("vllm:kvoffload_store_seconds_count", "")] >= 1
    for name in ("failed_loads", "failed_stores"):  # present, and nothing failed
        assert stored[(f"vllm:kvoffload_{name}_total", "cpu")] == 0
        assert stored[(f"vllm:kvoffload_{name}_total", "disk")] == 0
    assert stored[("vllm:kvoffload_evictions_total", "cpu")] == 0
    assert stored.get(("vllm:kvoffload_hit_tokens_total", "cpu"), 0) == 0
    # The first sight of a prompt is a miss with a reason an operator can read.
    never = ("vllm:kvoffload_lookup_misses_total", "never_stored")
    missed = scrape_until(server, lambda s: s.get(never, 0) > 0)
    assert missed[never] >= 1
    tokens_missed = missed[("vllm:kvoffload_lookup_miss_tokens_total", "never_stored")]
    assert tokens_missed == connector_hit(prompt, 32) * missed[never]

    http(f"{server}/reset_prefix_cache", {})  # vLLM's own cache only: the connector keeps its own
    again = complete(server, llama, prompt)
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    hit = connector_hit(prompt, 32)
    moved = scrape_until(server, lambda s: s.get(("vllm:kvoffload_loaded_tokens_total", "cpu")))
    assert moved[("vllm:kvoffload_hit_tokens_total", "cpu")] == hit
    assert moved[("vllm:kvoffload_loaded_tokens_total", "cpu")] == hit
    assert moved[("vllm:kvoffload_loaded_bytes_total", "cpu")] > 0
    assert moved[("vllm:kvoffload_load_seconds_count", "")] >= 1
    assert moved[never] == missed[never]  # the full hit missed nothing
    assert (
        moved[("vllm:kvoffload_stored_bytes_total", "cpu")]
        >= stored[("vllm:kvoffload_stored_bytes_total", "cpu")]
    )
