"""The instance side of ``kvoffload proxy``: the vLLM instances it sends to, and how.

Each stage opens its own connection (nothing pooled: on a loopback or a LAN a
connection costs far less than a prefill). Socket and ``http.client`` errors
become an :class:`UpstreamError` in one place (:func:`failure`), naming the
instance and its stage, with the status the client gets: 502 for an instance
that cannot be reached or breaks off, 504 for one silent past the timeout, and
the instance's own status for one that answers an error. The proxy's server
side is :mod:`kvoffload.cli._proxy_http`.
"""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
import uuid
from dataclasses import dataclass
from email.message import Message
from typing import Any

__all__ = [
    "FORWARDED_HEADERS",
    "Upstream",
    "UpstreamError",
    "answered",
    "error_document",
    "failure",
    "parse_upstream",
    "prefill_body",
    "probe",
    "request_headers",
    "send",
    "send_prefill",
]

#: The client's headers both instances get: its API key, and the request id that ties the
#: two instances' log lines together (one is made when the client sent none).
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
#: At most this many bytes of an instance's error answer are quoted back.
_QUOTED = 2000


@dataclass(frozen=True, slots=True)
class Upstream:
    """One vLLM instance the proxy sends to: its role (``prefill`` or ``decode``) and base URL."""

    role: str
    url: str
    host: str
    port: int
    https: bool

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=timeout_s)


def parse_upstream(role: str, text: str) -> Upstream:
    """``http://HOST:PORT`` -> an :class:`Upstream`; anything else a ``ValueError`` with the fix.

    A path is refused rather than joined: the proxy adds ``/v1/...`` itself, and a base URL
    that already ends in ``/v1`` would send every request to ``/v1/v1/...``.
    """
    example = "give http://HOST:PORT, e.g. http://127.0.0.1:8100"
    parts = urllib.parse.urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{text!r} is not an instance's base URL: {example}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{text!r} has no valid port: {example}") from None
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(
            f"{text!r} has a path: give the instance's base URL alone (the proxy adds /v1/...)"
        )
    https = parts.scheme == "https"
    url = f"{parts.scheme}://{parts.netloc}"
    return Upstream(role, url, parts.hostname, port or (443 if https else 80), https)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's request: the client's, generating one token, not streamed.

    ``stream_options`` goes with the stream (vLLM refuses it without ``stream``), and
    ``min_tokens`` with the token limit (vLLM refuses a minimum above the maximum); the
    decode instance still gets both.
    """
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for name in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(name, None)
    return out


def error_document(message: str, status: int, upstream: Upstream | None = None) -> bytes:
    """An error as vLLM's own API shapes one (``{"error": {"message", "type", "code"}}``), and,
    where an instance failed, which one and in which stage (``instance``, ``stage``)."""
    error: dict[str, Any] = {"message": message, "type": "proxy_error", "code": status}
    if upstream is not None:
        error.update(type="upstream_error", instance=upstream.url, stage=upstream.role)
    return json.dumps({"error": error}).encode()


class UpstreamError(Exception):
    """An instance could not be reached, stayed silent past the timeout, or answered an error.

    ``status`` is what the client gets: 502, 504, or the instance's own error status.
    """

    def __init__(self, upstream: Upstream, status: int, why: str) -> None:
        super().__init__(f"{upstream.role} instance {upstream.url} {why}")
        self.upstream, self.status, self.why = upstream, status, why


def failure(upstream: Upstream, exc: Exception) -> UpstreamError:
    """The one place where a socket's or http.client's error becomes the client's answer."""
    if isinstance(exc, TimeoutError | socket.timeout):
        return UpstreamError(upstream, 504, "did not answer in time")
    if isinstance(exc, ConnectionRefusedError):
        return UpstreamError(upstream, 502, "refused the connection (is it running?)")
    what = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
    return UpstreamError(upstream, 502, f"failed: {what}")


def answered(upstream: Upstream, resp: http.client.HTTPResponse) -> UpstreamError:
    """An error answer, its own message quoted (vLLM's ``error.message`` where it has one)."""
    text = resp.read(_QUOTED + 1).decode(errors="replace")
    try:
        document = json.loads(text)
        error = document.get("error", document)
        text = str(error.get("message", error) if isinstance(error, dict) else error)
    except (ValueError, AttributeError):
        text = text[:_QUOTED]
    return UpstreamError(upstream, resp.status, f"answered {resp.status}: {text.strip()}")


def send(
    conn: http.client.HTTPConnection,
    upstream: Upstream,
    request: tuple[str, str, bytes | None],
    headers: dict[str, str],
) -> http.client.HTTPResponse:
    method, path, body = request
    try:
        conn.request(method, path, body, headers)
        return conn.getresponse()
    except (OSError, http.client.HTTPException) as exc:
        raise failure(upstream, exc) from exc


def probe(upstream: Upstream, timeout_s: float = 5.0) -> str | None:
    """``None`` when the instance answers ``GET /health`` with 200; otherwise why not."""
    conn = upstream.connection(timeout_s)
    try:
        resp = send(conn, upstream, ("GET", "/health", None), {})
        resp.read()
        return None if resp.status == 200 else f"answered GET /health with {resp.status}"
    except UpstreamError as exc:
        return exc.why
    finally:
        conn.close()


def send_prefill(
    upstream: Upstream, path: str, body: dict[str, Any], headers: dict[str, str], timeout_s: float
) -> None:
    """Send :func:`prefill_body` of a request and read the answer whole; raise
    :class:`UpstreamError` on any failure (the proxy then sends no decode stage)."""
    conn = upstream.connection(timeout_s)
    try:
        data = json.dumps(prefill_body(body)).encode()
        resp = send(conn, upstream, ("POST", path, data), headers)
        if resp.status != 200:
            raise answered(upstream, resp)
        try:
            resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise failure(upstream, exc) from exc
    finally:
        conn.close()


def request_headers(given: Message) -> dict[str, str]:
    """The headers both instances get: JSON, and :data:`FORWARDED_HEADERS` from the client."""
    headers = {"Content-Type": "application/json"}
    for name in FORWARDED_HEADERS:
        if value := given.get(name):
            headers[name] = value
    headers.setdefault("X-Request-Id", f"kvoffload-proxy-{uuid.uuid4().hex}")
    return headers
