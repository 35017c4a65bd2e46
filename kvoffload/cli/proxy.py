"""``kvoffload proxy``: one address in front of prefill and decode instances of `vllm serve`.

A client's completion goes first to a prefill instance (``kv_role:
kv_producer``), which computes the prompt and stores its KV in a tier both
share, then to a decode instance (``kv_consumer``), which loads that KV and
generates the answer the client gets (:mod:`kvoffload.cli._proxy_http`,
:mod:`kvoffload.cli._proxy_upstream`). So a
user runs the whole flow of vLLM's disaggregated-prefill examples with two
``vllm serve`` processes and this command, nothing else installed.

Everything a user can get wrong is refused before the proxy listens, in one
line and exit 2: a URL that is not an instance's base URL, a port that is
taken, an instance that does not answer ``GET /health`` (``--wait`` waits for
instances still loading their model).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.cli._flags import HelpFormatter, int_in, warn_line
from kvoffload.cli._proxy_http import ProxyServer
from kvoffload.cli._proxy_upstream import Upstream, parse_upstream, probe
from kvoffload.errors import ConfigError

__all__ = ["register", "run", "wait_for"]

#: Seconds between two rounds of ``GET /health`` while ``--wait`` waits.
_POLL_S = 1.0


def _instance(role: str) -> Callable[[str], Upstream]:
    def parse(text: str) -> Upstream:
        try:
            return parse_upstream(role, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "URL"
    return parse


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "proxy",
        formatter_class=HelpFormatter,
        help="serve completions through a prefill instance, then a decode instance",
        description="Listen for OpenAI-style completions (POST /v1/completions and "
        "/v1/chat/completions). Each goes first to a prefill instance with max_tokens 1, "
        "not streamed (a vllm serve with kv_role kv_producer: it computes the prompt and "
        "stores its KV), then as sent to a decode instance (kv_role kv_consumer: it loads "
        "that KV), whose answer, streamed or not, is relayed. GET /v1/models and /health go "
        "to a decode instance. Several --prefill or --decode instances are taken in turn. "
        "An instance that fails a request is named in the error the client gets.",
    )
    parser.add_argument(
        "--prefill",
        action="append",
        required=True,
        type=_instance("prefill"),
        metavar="URL",
        help="base URL of a prefill instance, e.g. http://127.0.0.1:8100 (repeat for more)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        required=True,
        type=_instance("decode"),
        metavar="URL",
        help="base URL of a decode instance, e.g. http://127.0.0.1:8200 (repeat for more)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--port", type=int_in(0, 65535), default=8000, help="port to listen on; 0 picks a free one"
    )
    parser.add_argument(
        "--timeout",
        type=int_in(1, 86400),
        default=600,
        metavar="SECONDS",
        help="seconds an instance may stay silent (connecting, computing, between streamed "
        "tokens) before the client gets 504",
    )
    parser.add_argument(
        "--wait",
        type=int_in(0, 86400),
        default=0,
        metavar="SECONDS",
        help="seconds to wait at start for every instance to answer GET /health (vLLM loads "
        "its model first); 0 checks once",
    )
    parser.set_defaults(func=run)


def wait_for(instances: Sequence[Upstream], wait_s: float) -> None:
    """Return once every instance answers ``GET /health`` with 200; a ``ConfigError`` naming
    those that did not, and why, once ``wait_s`` is spent."""
    deadline = time.monotonic() + wait_s
    pending = list(instances)
    while True:
        problems = [(u, why) for u in pending if (why := probe(u)) is not None]
        if not problems:
            return
        if time.monotonic() >= deadline:
            named = "; ".join(f"{u.role} instance {u.url} {why}" for u, why in problems)
            if wait_s:
                raise ConfigError(f"{named}, still after {wait_s} s of --wait")
            raise ConfigError(f"{named}: start it first, or give --wait SECONDS to wait for it")
        pending = [u for u, _ in problems]
        time.sleep(_POLL_S)


def run(args: argparse.Namespace) -> int:
    prefill, decode = args.prefill, args.decode
    try:
        server = ProxyServer((args.host, args.port), prefill, decode, timeout_s=float(args.timeout))
    except OSError as exc:
        why = exc.strerror or str(exc)
        raise ConfigError(
            f"cannot listen on {args.host} port {args.port}: {why} (give another --port or --host)"
        ) from exc
    with server:
        wait_for([*dict.fromkeys([*prefill, *decode])], args.wait)
        shared = sorted({u.url for u in prefill} & {u.url for u in decode})
        if shared:
            warn_line("proxy")(
                f"{', '.join(shared)} is both a prefill and a decode instance: it serves both "
                "stages of the requests the turns give it"
            )
        host, port = args.host, server.server_address[1]
        print(
            f"kvoffload proxy: listening on http://{host}:{port}; prefill "
            f"{', '.join(u.url for u in prefill)}; decode {', '.join(u.url for u in decode)}",
            flush=True,
        )
        server.serve_forever()
    return 0  # pragma: no cover (serve_forever returns only on shutdown())
