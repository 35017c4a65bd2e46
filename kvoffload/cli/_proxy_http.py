"""The HTTP side of ``kvoffload proxy``: one client request, a prefill request, a decode request.

What vLLM's disaggregated-prefill example proxies do (``toy_proxy_server.py``,
``disagg_prefill_proxy_server.py``), with the standard library only, so the
command needs nothing kvoffload does not already install:

1. The **prefill** instance (an engine started with ``kv_role: kv_producer``)
   gets the request with ``max_tokens`` 1 (and ``max_completion_tokens`` 1
   where the client set it), not streamed
   (:func:`~kvoffload.cli._proxy_upstream.prefill_body`). It computes the
   prompt, and kvoffload stores the prompt's KV in the tier both engines
   share. Its one-token answer is read whole and dropped.
2. The **decode** instance (``kv_consumer``) gets the client's request byte for
   byte. kvoffload loads the prompt's KV from the shared tier, so the instance
   computes only what is not there. Its answer is relayed to the client as it
   arrives: a streamed answer (no ``Content-Length``) chunk by chunk, in order.

Instances of each role are taken round-robin. A failure is never swallowed:
an instance that cannot be reached answers the client 502, one that stays
silent past the timeout 504, and one that answers an error passes its own
status on; the error object names the instance and the stage
(:mod:`kvoffload.cli._proxy_upstream`). A stream that breaks after it started
ends with an error event. Every request is one line on stderr.
"""

from __future__ import annotations

import http.client
import itertools
import json
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvoffload.cli._proxy_upstream import (
    Upstream,
    UpstreamError,
    answered,
    error_document,
    failure,
    request_headers,
    send,
    send_prefill,
)

__all__ = ["MAX_BODY_BYTES", "PASSTHROUGH", "ROUTES", "ProxyServer"]

#: The requests split into a prefill and a decode (vLLM's OpenAI-compatible generation APIs).
ROUTES = ("/v1/completions", "/v1/chat/completions")
#: Requests passed to a decode instance as they are: what a client asks before generating.
PASSTHROUGH = ("/v1/models", "/health")
#: The longest request body read (a prompt of token ids or text; images as base64 included).
MAX_BODY_BYTES = 256 << 20
_READ = 64 << 10


class ProxyServer(ThreadingHTTPServer):
    """The proxy: a thread per client connection, instances of each role taken round-robin.

    :meth:`prefill` is the first stage; a subclass may wrap it (the end-to-end test
    waits there for the producer's files, until the hand-off waits by itself).
    """

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        prefill: Sequence[Upstream],
        decode: Sequence[Upstream],
        *,
        timeout_s: float = 600.0,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs a prefill instance and a decode instance")
        self.instances = {"prefill": tuple(prefill), "decode": tuple(decode)}
        self.timeout_s = timeout_s
        self.log = log or (lambda line: print(f"kvoffload proxy: {line}", file=sys.stderr))
        self._turns: dict[str, Iterator[Upstream]] = {
            role: itertools.cycle(found) for role, found in self.instances.items()
        }
        self._lock = threading.Lock()
        super().__init__(address, _Handler)

    def next(self, role: str) -> Upstream:
        """The instance of ``role`` whose turn it is."""
        with self._lock:
            return next(self._turns[role])

    def prefill(
        self, upstream: Upstream, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> None:
        """The first stage: :func:`send_prefill` with this proxy's timeout."""
        send_prefill(upstream, path, body, headers, self.timeout_s)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-request is one line; anything else is a bug, and
        keeps the traceback the standard library prints."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            self.log(f"a client went away: {sys.exc_info()[1]!r}")
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    """One client connection. Answers are HTTP/1.1: a relayed stream is sent chunked."""

    protocol_version = "HTTP/1.1"
    server: ProxyServer

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the proxy logs one line of its own per request (:meth:`ProxyServer.log`)."""

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path not in ROUTES:
            self._error(404, f"POST {path}: the proxy serves POST {' and '.join(ROUTES)}")
            return
        request = self._json_body()
        if request is None:
            return
        headers = request_headers(self.headers)
        prefill, decode = self.server.next("prefill"), self.server.next("decode")
        line = f"POST {path} {headers['X-Request-Id']}: "
        try:
            line += self._split(request, headers, prefill, decode)
        except OSError as exc:  # the client went away: the answer has nowhere to go
            self.close_connection = True
            line += f"the client went away ({type(exc).__name__})"
        self.server.log(line)

    def _split(
        self,
        request: tuple[dict[str, Any], bytes],
        headers: dict[str, str],
        prefill: Upstream,
        decode: Upstream,
    ) -> str:
        """The two stages of one request; the log line's account of them."""
        body, raw = request
        started = time.perf_counter()
        try:
            self.server.prefill(prefill, self.path, body, headers)
            done = f"prefill {prefill.url} {time.perf_counter() - started:.2f} s; "
            return done + self._relay(decode, raw, headers, time.perf_counter())
        except UpstreamError as exc:
            self._error(exc.status, str(exc), exc.upstream)
            return f"{exc} -> {exc.status}"

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        if path not in PASSTHROUGH:
            self._error(404, f"GET {path}: the proxy passes on GET {' and '.join(PASSTHROUGH)}")
            return
        upstream = self.server.next("decode")
        conn = upstream.connection(self.server.timeout_s)
        try:
            resp = send(conn, upstream, ("GET", self.path, None), request_headers(self.headers))
            data = resp.read()
        except (UpstreamError, http.client.HTTPException, OSError) as exc:
            failed = exc if isinstance(exc, UpstreamError) else failure(upstream, exc)
            self._error(failed.status, str(failed), upstream)
            self.server.log(f"GET {path}: {failed} -> {failed.status}")
            return
        finally:
            conn.close()
        self._answer(resp.status, data, resp.getheader("Content-Type", "application/json"))

    def _json_body(self) -> tuple[dict[str, Any], bytes] | None:
        """The request's JSON object and its bytes (what the decode instance gets), or
        ``None`` once an error is answered."""
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or length is None:
            self._error(411, "send the request body with a Content-Length")
            return None
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            self._error(413, f"a request body of at most {MAX_BODY_BYTES} bytes, please")
            return None
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw)
        except ValueError as exc:
            self._error(400, f"the request body is not JSON: {exc}")
            return None
        if not isinstance(body, dict):
            self._error(400, "the request body must be a JSON object")
            return None
        return body, raw

    def _relay(
        self, upstream: Upstream, raw: bytes, headers: dict[str, str], started: float
    ) -> str:
        """Send the client's request to the decode instance and pass its answer on; the log's
        part of it."""
        conn = upstream.connection(self.server.timeout_s)
        try:
            resp = send(conn, upstream, ("POST", self.path, raw), headers)
            if resp.status != 200:
                raise answered(upstream, resp)
            kind = resp.getheader("Content-Type", "application/json")
            if resp.getheader("Content-Length") is not None:
                try:
                    data = resp.read()
                except (OSError, http.client.HTTPException) as exc:
                    raise failure(upstream, exc) from exc
                self._answer(200, data, kind)
                return f"decode {upstream.url} {time.perf_counter() - started:.2f} s"
            first = self._stream(upstream, resp, kind, started)
            done = time.perf_counter() - started
            return f"decode {upstream.url} first byte {first}, all {done:.2f} s"
        finally:
            conn.close()

    def _stream(
        self, upstream: Upstream, resp: http.client.HTTPResponse, kind: str, started: float
    ) -> str:
        """Relay a body of unknown length chunk by chunk as it arrives; the first byte's time.

        A stream that breaks after the answer started can no longer change its status: an
        event stream ends with an error event, anything else is cut off (no final chunk).
        """
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        first = "never"
        while True:
            try:
                piece = resp.read1(_READ)
            except (OSError, http.client.HTTPException) as exc:
                failed = failure(upstream, exc)
                self.server.log(f"{failed} in the middle of a stream")
                self.close_connection = True
                if kind.startswith("text/event-stream"):
                    error = error_document(str(failed), failed.status, upstream)
                    self._chunk(b"data: " + error + b"\n\n")
                    self._chunk(b"")
                return f"{first}, broken: {failed}"
            if first == "never":
                first = f"{time.perf_counter() - started:.2f} s"
            self._chunk(piece)
            if not piece:
                return first

    def _chunk(self, data: bytes) -> None:
        """One chunk of a chunked answer (an empty one ends it), sent at once."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _answer(self, status: int, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, upstream: Upstream | None = None) -> None:
        """Answer an error; the connection closes (an unread request body may follow)."""
        self.close_connection = True
        self._answer(status, error_document(message, status, upstream), "application/json")
