"""``kvoffload proxy`` in front of two `vllm serve` processes: prefill on one, decode on the other.

What no other test proves: the whole flow of vLLM's disaggregated-prefill
examples on real servers. The proxy's prefill stage reaches a ``kv_producer``
server (it generates the one token the proxy asks for and stores the prompt's
KV on a disk tier both servers share); its decode stage reaches a
``kv_consumer`` server, which loads the prompt from that disk tier, and the
client gets the consumer's answer, streamed through the proxy. The answer is
the one vLLM's own prefix cache gives: the same request sent straight to the
producer afterwards, which serves the prompt from its own cache, returns the
same tokens and logprobs (float32, one core per server).

``test_roles`` proves the roles on offline engines and the unit suite
(``tests/test_proxy.py``) the proxy's HTTP on stand-ins; this test costs two
server starts (side by side), one request through the proxy and one straight to the
producer: 37-46 s here.
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _harness import LLAMA_PROMPTS, LOGPROB_TOL, connector_hit
from _models import with_word_tokenizer

from kvoffload.cli._proxy_http import ProxyServer
from kvoffload.cli._proxy_upstream import parse_upstream

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _serve import Server, ServerSpec, running  # noqa: E402

START_TIMEOUT_S = float(os.environ.get("KVOFFLOAD_E2E_TIMEOUT", "600"))
BLOCK = 32
PROMPT = LLAMA_PROMPTS[0]  # 320 tokens: the consumer loads 288 (9 chunks of one block)


def scrape_until(
    server: Server, key: tuple[str, str], value: float
) -> dict[tuple[str, str], float]:
    """Scrape until ``key`` reaches ``value`` (figures reach the frontend with the engine's
    steps), or a minute has passed; the last scrape."""
    deadline = time.monotonic() + 60
    while (samples := server.samples()).get(key, 0) < value and time.monotonic() < deadline:
        time.sleep(0.5)
    return samples


def completion(port: int, stream: bool) -> dict[str, Any]:
    """One greedy completion of :data:`PROMPT`: its token ids, their logprobs, cached tokens."""
    body = {"model": "model", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 1, "return_token_ids": True,
            "stream": stream}  # fmt: skip
    if stream:
        body["stream_options"] = {"include_usage": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        kind = resp.getheader("Content-Type", "")
        lines = resp.read().splitlines() if stream else []
        events = list(_events(lines)) if stream else [json.loads(resp.read())]
    finally:
        conn.close()
    tokens: list[int] = []
    logprobs: list[float] = []
    for event in events:
        for choice in event.get("choices", []):
            tokens += choice.get("token_ids") or []
            logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
    usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    done = b"data: [DONE]" in lines
    return {"tokens": tokens, "logprobs": logprobs, "cached": cached, "events": len(events),
            "content_type": kind, "done": done}  # fmt: skip


def _events(lines: list[bytes]) -> Iterator[dict[str, Any]]:
    for line in lines:
        data = line.removeprefix(b"data:").strip()
        if not line.startswith(b"data:") or data == b"[DONE]":
            continue
        event: dict[str, Any] = json.loads(data)
        assert "error" not in event, event
        yield event


@pytest.fixture
def servers(llama: str, tmp_path: Path) -> Iterator[tuple[Server, Server, Path]]:
    """A producer and a consumer of the tiny Llama (with a tokenizer, for logprobs) sharing
    one disk tier, each on a core of its own; and the tier's directory."""
    model = with_word_tokenizer(Path(llama), tmp_path / "llama")
    disk = tmp_path / "kv"
    connector = {"blocks_per_chunk": 1, "cpu_bytes_to_use": "64MiB", "disk_path": str(disk),
                 "disk_bytes_to_use": "64MiB"}  # fmt: skip
    cpus = [str(cpu) for cpu in sorted(os.sched_getaffinity(0))]
    specs = [
        ServerSpec(name=role, model=model, dtype="float32", engine_blocks=64, block_size=BLOCK,
                   max_model_len=1024, connector=connector, reserved_cpus=1, kvcache_gib=1,
                   cores=cpus[i % len(cpus)], kv_role=f"kv_{role}", tokenizer=True)
        for i, role in enumerate(("producer", "consumer"))
    ]  # fmt: skip
    with running(specs, tmp_path, START_TIMEOUT_S) as (producer, consumer):
        yield producer, consumer, disk


def test_the_proxy_splits_a_request_and_the_consumer_answers_as_vllms_own_cache(
    servers: tuple[Server, Server, Path],
) -> None:
    producer, consumer, _ = servers
    log: list[str] = []
    # No wait between the stages: the consumer's lookup waits for the producer's stores
    # still on their way (the hand-off), so it loads the whole prompt all the same.
    proxy = ProxyServer(
        ("127.0.0.1", 0),
        [parse_upstream("prefill", f"http://127.0.0.1:{producer.port}")],
        [parse_upstream("decode", f"http://127.0.0.1:{consumer.port}")], log=log.append,
    )  # fmt: skip
    thread = threading.Thread(target=proxy.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        served = completion(int(proxy.server_address[1]), stream=True)
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join()
    hit = connector_hit(PROMPT, BLOCK)
    assert len(served["tokens"]) == len(served["logprobs"]) == 8
    # Streamed and relayed as events: the token deltas, then the usage, then [DONE]. Not one
    # event per token: vLLM merges the deltas its HTTP side has not sent yet
    # (RequestOutputCollector), so on a busy machine all 8 may come in one.
    assert served["content_type"].startswith("text/event-stream") and served["done"]
    assert served["events"] >= 2
    assert served["cached"] == hit  # every full block but the last token's, from the tier
    made = scrape_until(producer, ("vllm:generation_tokens_total", ""), 1)
    took = scrape_until(consumer, ("vllm:kvoffload_loaded_tokens_total", "disk"), hit)
    # The prefill stage generated the one token the proxy asked for; the producer stored the
    # prompt on the shared disk and loaded nothing.
    assert made[("vllm:generation_tokens_total", "")] == 1
    assert made[("vllm:kvoffload_stored_bytes_total", "disk")] > 0
    assert made.get(("vllm:kvoffload_loaded_tokens_total", "disk"), 0) == 0
    # The consumer loaded the prompt from that disk and stored nothing.
    assert took[("vllm:kvoffload_hit_tokens_total", "disk")] == hit
    assert took[("vllm:kvoffload_loaded_tokens_total", "disk")] == hit
    assert took[("vllm:kvoffload_loaded_bytes_total", "disk")] > 0
    assert sum(v for (name, _), v in took.items() if name.endswith("stored_bytes_total")) == 0
    assert took[("vllm:generation_tokens_total", "")] == 8

    # The oracle: the producer serving the same request from vLLM's own prefix cache.
    own = completion(producer.port, stream=False)
    assert own["cached"] == hit
    assert own["tokens"] == served["tokens"]
    for mine, theirs in zip(served["logprobs"], own["logprobs"], strict=True):
        assert abs(mine - theirs) <= LOGPROB_TOL, (served["logprobs"], own["logprobs"])
    assert producer.samples().get(("vllm:kvoffload_hit_tokens_total", "disk"), 0) == 0
    [line] = log
    assert f"prefill http://127.0.0.1:{producer.port}" in line
    assert f"decode http://127.0.0.1:{consumer.port} first byte" in line
