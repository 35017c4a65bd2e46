"""``kvoffload proxy`` against two real HTTP servers standing for the vLLM instances.

The stand-ins (standard library servers on loopback ports) record every request
they receive and answer as `vllm serve` does: a JSON completion, or a stream of
server-sent events sent chunk by chunk. The proxy runs in this process on a free
port; one test runs the real command in a child process. Nothing here is timed:
where an order matters (a streamed event relayed before the next is produced), the
stand-in waits for the test to say it has read the first.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvoffload import cli
from kvoffload.cli._proxy_http import ProxyServer
from kvoffload.cli._proxy_upstream import Upstream, parse_upstream, prefill_body

#: Longest a stand-in waits for the test before it gives up (a hang guard, not a measure).
_HANG_S = 60.0


@dataclass
class Instance:
    """A stand-in for a `vllm serve` instance: what it received, and how it answers."""

    role: str
    received: list[dict[str, Any]] = field(default_factory=list)
    #: "ok", "error" (400, vLLM's error shape), "break" (a stream cut after one event),
    #: "silent" (never answers, until released), "long" (a stream of 1000 events).
    mode: str = "ok"
    #: Set by the test once it read the first streamed event; the stand-in sends the rest then.
    release: threading.Event = field(default_factory=threading.Event)
    released_in_time: bool | None = None
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"


def _handler(instance: Instance) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._json(200, {"path": self.path, "role": instance.role})

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers["Content-Length"]))
            headers = dict(self.headers)
            instance.received.append(
                {"path": self.path, "raw": raw, "body": json.loads(raw), "headers": headers}
            )
            body = json.loads(raw)
            if instance.mode == "silent":
                instance.release.wait(_HANG_S)
                self.close_connection = True
            elif instance.mode == "error":
                self._json(400, {"error": {"message": "too long a prompt", "code": 400}})
            elif body.get("stream"):
                self._stream()
            else:
                self._json(200, {"role": instance.role, "max_tokens": body.get("max_tokens")})

        def _stream(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._chunk(b'data: {"n": 0}\n\n')
            if instance.mode == "break":  # the process dies: no more chunks, no final one
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            instance.released_in_time = instance.release.wait(_HANG_S)
            try:
                for n in range(1, 2 if instance.mode == "ok" else 1000):
                    self._chunk(b'data: {"n": %d}\n\n' % n)
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")
            except OSError:  # "long": the proxy closed the connection (its client went away)
                self.close_connection = True

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def _json(self, status: int, document: dict[str, Any]) -> None:
            data = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


@contextmanager
def serving(server: ThreadingHTTPServer) -> Iterator[ThreadingHTTPServer]:
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@dataclass
class Rig:
    prefill: list[Instance]
    decode: list[Instance]
    proxy: ProxyServer
    log: list[str]

    @property
    def port(self) -> int:
        return int(self.proxy.server_address[1])

    def lines(self, n: int) -> list[str]:
        """The proxy's log once it has ``n`` lines: it writes a request's line after the
        client has the answer."""
        deadline = time.monotonic() + _HANG_S
        while len(self.log) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.log


@contextmanager
def rig(decodes: int = 1, timeout_s: float = _HANG_S) -> Iterator[Rig]:
    """A prefill stand-in, ``decodes`` decode stand-ins, and the proxy in front of them."""
    instances = [Instance("prefill")] + [Instance("decode") for _ in range(decodes)]
    log: list[str] = []
    with ExitStack() as stack:
        for instance in instances:
            instance.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(instance))
            stack.enter_context(serving(instance.server))
        upstreams = [parse_upstream(i.role, i.url) for i in instances]
        proxy = ProxyServer(("127.0.0.1", 0), upstreams[:1], upstreams[1:],
                            timeout_s=timeout_s, log=log.append)  # fmt: skip
        stack.enter_context(serving(proxy))
        try:
            yield Rig(instances[:1], instances[1:], proxy, log)
        finally:
            for instance in instances:  # a stand-in still waiting for the test stops waiting
                instance.release.set()


def post(
    port: int, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=_HANG_S)) as conn:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())


def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=_HANG_S)) as conn:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())


def free_port() -> int:
    """A port nobody listens on (bound, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


COMPLETION = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "temperature": 0,
              "min_tokens": 4, "logprobs": 1}  # fmt: skip


def test_the_prefill_instance_computes_one_token_and_the_decode_instance_gets_the_request() -> None:
    with rig() as r:
        raw = json.dumps(COMPLETION, indent=1).encode()  # bytes a re-encoding would change
        status, answer = post(r.port, "/v1/completions", raw, {"Authorization": "Bearer k"})
        assert status == 200 and answer == {"role": "decode", "max_tokens": 8}
        [prefill], [decode] = r.prefill[0].received, r.decode[0].received
    assert prefill["path"] == decode["path"] == "/v1/completions"
    # min_tokens goes: vLLM refuses a minimum above the maximum.
    expected = {k: v for k, v in COMPLETION.items() if k != "min_tokens"}
    assert prefill["body"] == {**expected, "max_tokens": 1, "stream": False}
    assert decode["raw"] == raw  # the client's request, byte for byte
    for name in ("Authorization", "X-Request-Id"):  # one id ties both instances' logs
        assert prefill["headers"][name] == decode["headers"][name], name
    assert prefill["headers"]["X-Request-Id"].startswith("kvoffload-proxy-")
    [line] = r.lines(1)
    assert "prefill " + r.prefill[0].url in line and "decode " + r.decode[0].url in line


def test_a_chat_request_keeps_its_own_token_limit_field_and_request_id() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    body = prefill_body(chat)
    assert body["max_completion_tokens"] == body["max_tokens"] == 1
    assert body["stream"] is False and "stream_options" not in body
    assert chat["max_completion_tokens"] == 50  # the client's request is not changed
    with rig() as r:
        r.decode[0].release.set()
        with closing(http.client.HTTPConnection("127.0.0.1", r.port, timeout=_HANG_S)) as conn:
            conn.request("POST", "/v1/chat/completions", json.dumps(chat), {"X-Request-Id": "r1"})
            assert conn.getresponse().read().endswith(b"data: [DONE]\n\n")
    [prefill], [decode] = r.prefill[0].received, r.decode[0].received
    assert prefill["path"] == "/v1/chat/completions" and prefill["body"] == body
    assert decode["body"] == chat
    assert prefill["headers"]["X-Request-Id"] == decode["headers"]["X-Request-Id"] == "r1"


def test_a_stream_is_relayed_event_by_event_in_order() -> None:
    """The stand-in sends its second event only once the test has read the first through the
    proxy: a proxy that held the stream back would leave it waiting (``released_in_time``)."""
    with rig() as r:
        conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=_HANG_S)
        with closing(conn):
            conn.request("POST", "/v1/completions", json.dumps({**COMPLETION, "stream": True}))
            resp = conn.getresponse()
            assert resp.status == 200
            assert resp.getheader("Content-Type") == "text/event-stream"
            assert resp.readline() == b'data: {"n": 0}\n'
            r.decode[0].release.set()
            rest = resp.read()
        assert rest == b'\ndata: {"n": 1}\n\ndata: [DONE]\n\n'
        assert r.decode[0].released_in_time is True
        assert r.prefill[0].received[0]["body"]["stream"] is False


def test_instances_of_a_role_are_taken_in_turn() -> None:
    with rig(decodes=2) as r:
        for _ in range(4):
            assert post(r.port, "/v1/completions", COMPLETION)[0] == 200
    assert [len(d.received) for d in r.decode] == [2, 2]
    assert len(r.prefill[0].received) == 4


def test_models_and_health_are_passed_to_a_decode_instance() -> None:
    with rig() as r:
        assert get(r.port, "/v1/models") == (200, {"path": "/v1/models", "role": "decode"})
        assert get(r.port, "/health") == (200, {"path": "/health", "role": "decode"})
        status, answer = get(r.port, "/metrics")
        assert status == 404 and "GET /v1/models and /health" in answer["error"]["message"]


def error_of(answer: dict[str, Any]) -> dict[str, Any]:
    error: dict[str, Any] = answer["error"]
    return error


def test_a_prefill_instance_that_fails_is_named_and_no_decode_is_sent() -> None:
    with rig() as r:
        r.prefill[0].mode = "error"
        status, answer = post(r.port, "/v1/completions", COMPLETION)
        assert r.decode[0].received == []
        assert status == 400  # the instance's own status: the request was refused
        assert error_of(answer) == {
            "message": f"prefill instance {r.prefill[0].url} answered 400: too long a prompt",
            "type": "upstream_error", "code": 400, "instance": r.prefill[0].url,
            "stage": "prefill",
        }  # fmt: skip
        assert r.lines(1)[0].endswith("too long a prompt -> 400")


def test_an_instance_that_is_not_there_is_a_bad_gateway() -> None:
    gone = parse_upstream("decode", f"http://127.0.0.1:{free_port()}")
    with rig() as r:
        r.proxy.instances["decode"] = (gone,)
        r.proxy._turns["decode"] = iter([gone])
        status, answer = post(r.port, "/v1/completions", COMPLETION)
    assert status == 502 and len(r.prefill[0].received) == 1
    error = error_of(answer)
    assert error["instance"] == gone.url and error["stage"] == "decode"
    assert "refused the connection" in error["message"]


def test_a_silent_instance_times_out() -> None:
    with rig(timeout_s=0.5) as r:
        r.decode[0].mode = "silent"
        status, answer = post(r.port, "/v1/completions", COMPLETION)
    assert status == 504
    assert (
        error_of(answer)["message"] == f"decode instance {r.decode[0].url} did not answer in time"
    )


def test_a_stream_that_breaks_ends_with_an_error_event_naming_the_instance() -> None:
    with rig() as r:
        r.decode[0].mode = "break"
        with closing(http.client.HTTPConnection("127.0.0.1", r.port, timeout=_HANG_S)) as conn:
            conn.request("POST", "/v1/completions", json.dumps({**COMPLETION, "stream": True}))
            resp = conn.getresponse()
            assert resp.status == 200  # sent before the break: it cannot change
            events = resp.read().decode().split("\n\n")
    assert events[0] == 'data: {"n": 0}'
    error = error_of(json.loads(events[1].removeprefix("data: ")))
    assert error["stage"] == "decode" and error["instance"] == r.decode[0].url
    assert events[2:] == [""]
    assert "in the middle of a stream" in r.lines(2)[0]


def test_a_client_that_goes_away_mid_stream_is_one_log_line() -> None:
    with rig() as r:
        r.decode[0].mode = "long"
        conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=_HANG_S)
        with closing(conn):
            conn.request("POST", "/v1/completions", json.dumps({**COMPLETION, "stream": True}))
            resp = conn.getresponse()
            assert resp.readline() == b'data: {"n": 0}\n'
            resp.close()
        r.decode[0].release.set()
        [line] = r.lines(1)
    assert "the client went away" in line


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/completions", b"{not json", 400, "not JSON"),
        ("/v1/completions", b"[1, 2]", 400, "a JSON object"),
        ("/v1/embeddings", b"{}", 404, "POST /v1/completions and /v1/chat/completions"),
    ],
)
def test_a_request_the_proxy_cannot_split_is_refused_before_any_instance(
    path: str, body: bytes, status: int, fragment: str
) -> None:
    with rig() as r:
        got, answer = post(r.port, path, body)
    assert got == status and fragment in error_of(answer)["message"]
    assert error_of(answer)["type"] == "proxy_error"
    assert r.prefill[0].received == r.decode[0].received == []


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("127.0.0.1:8100", "is not an instance's base URL"),
        ("ftp://host:1", "is not an instance's base URL"),
        ("http://host:99999", "has no valid port"),
        ("http://host:8100/v1", "has a path"),
    ],
)
def test_a_bad_url_is_one_line_and_exit_2(
    text: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["proxy", "--prefill", text, "--decode", "http://h:1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvoffload proxy: error: argument --prefill")
    assert fragment in err


def test_base_urls_parse_with_their_default_ports() -> None:
    assert parse_upstream("decode", "https://h/") == Upstream("decode", "https://h", "h", 443, True)
    assert parse_upstream("prefill", " http://[::1]:8100 ").port == 8100


def test_start_up_errors_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    cases = [
        (["--prefill", "http://127.0.0.1:1"], "the following arguments are required: --decode"),
        (["--prefill", nobody, "--decode", nobody, "--port", "0"],
         f"prefill instance {nobody} refused the connection"),
        (["--prefill", nobody, "--decode", nobody, "--port", "70000"], "argument --port"),
        (["--prefill", nobody, "--decode", nobody, "--port", "0", "--wait", "1"],
         "still after 1 s of --wait"),
        (["--prefill", nobody, "--decode", nobody, "--host", "no.such.host.invalid",
          "--port", "0"], "cannot listen on no.such.host.invalid"),
    ]  # fmt: skip
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cases.append((["--prefill", nobody, "--decode", nobody, "--port", port],
                      f"cannot listen on 127.0.0.1 port {port}"))  # fmt: skip
        for argv, fragment in cases:
            assert cli.main(["proxy", *argv]) == 2, argv
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "kvoffload proxy: error: " in err, err
            assert fragment in err, err


def test_the_command_serves_a_request() -> None:
    """The real ``kvoffload proxy`` in a child process: it says where it listens, then serves,
    one line on stderr per request."""
    with rig() as r:
        child = subprocess.Popen(
            [sys.executable, "-m", "kvoffload", "proxy", "--port", "0", "--prefill",
             r.prefill[0].url, "--decode", r.decode[0].url, "--decode", r.prefill[0].url],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert child.stdout is not None and child.stderr is not None
        try:
            line = child.stdout.readline()
            assert line.startswith("kvoffload proxy: listening on http://127.0.0.1:"), line
            port = int(line.split(";")[0].rsplit(":", 1)[1])
            assert post(port, "/v1/completions", COMPLETION)[0] == 200
            # An instance in both roles works (it serves both stages in its turns): a warning.
            warning, request = child.stderr.readline(), child.stderr.readline()
        finally:
            child.terminate()
            child.communicate(timeout=_HANG_S)
    assert warning.startswith("kvoffload proxy: warning: ")
    assert f"{r.prefill[0].url} is both a prefill and a decode instance" in warning
    assert request.startswith("kvoffload proxy: POST /v1/completions kvoffload-proxy-")
    assert len(r.prefill[0].received) == len(r.decode[0].received) == 1
