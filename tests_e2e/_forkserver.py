"""Engine processes forked from a server that has imported torch and vLLM once.

A fresh ``python _runner.py`` spends about 6 s of its ~13 s importing torch and
vLLM before it builds an engine, and the e2e suite starts well over a hundred
of them. A server here imports those once and forks a child per spec: the child
is a process of its own (its pid, memory, engine, connector, exit), it runs
``_runner.main`` on the spec exactly as a fresh process would, with the caller's
environment, and writes its output to the same log.

What a fork cannot change after the import is kept out of it: a server is
keyed by the environment that vLLM, torch and Triton read (``VLLM_*``,
``TRITON_*``, ``OMP_*``, ...) and by the spec's ``preload`` modules, so a spec
that needs another value gets a server started with it. kvoffload itself is
never imported by a server (it reads ``KVOFFLOAD_*`` at import). What stays
shared between the children of one server is the interpreter's hash seed; the
claims that rest on separate interpreters (a disk cache another process wrote)
run at least once in fresh processes (``fresh=True``, see conftest).

Protocol, over a Unix socket: one JSON request a connection; the child answers
``pid N`` when it starts and ``rc N`` when its runner returned, and the
connection ends when the child has exited (its engine shut down).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["ForkServers", "server_key"]

HERE = Path(__file__).resolve().parent
#: Environment a server's imports may read: a spec that differs here needs its own server.
IMPORT_TIME_PREFIXES = ("VLLM_", "TRITON_", "OMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH",
                        "PYTORCH_", "CUDA", "LD_", "PYTHON", "HF_", "TRANSFORMERS")  # fmt: skip


def server_key(env: Mapping[str, str], preload: list[str]) -> str:
    """What a server's imports depend on: the import-time environment and preloaded patches."""
    seen = {k: v for k, v in sorted(env.items()) if k.startswith(IMPORT_TIME_PREFIXES)}
    return json.dumps([seen, preload])


class ForkServers:
    """The session's servers, one per :func:`server_key`, each started on first use."""

    def __init__(self, work: Path, start_timeout: float = 300.0) -> None:
        self._work = work
        self._start_timeout = start_timeout
        self._servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}

    def run(
        self, spec: Mapping[str, Any], paths: tuple[Path, Path, Path], env: Mapping[str, str],
        timeout: float | None,
    ) -> int:  # fmt: skip
        """``_runner.main`` on the spec at ``paths`` (spec, out, log) in a forked child, in
        ``env``; its return code (-1: it died before its runner returned)."""
        spec_path, out_path, log_path = paths
        address = self._server({**env, **spec.get("env", {})}, list(spec.get("preload", [])))
        request = {"argv": [str(HERE / "_runner.py"), str(spec_path), str(out_path)],
                   "log": str(log_path), "env": dict(env), "cwd": os.getcwd()}  # fmt: skip
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(address)
            conn.sendall(json.dumps(request).encode() + b"\n")
            return _await_child(conn, timeout)

    def close(self) -> None:
        for proc, _address in self._servers.values():
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._servers.clear()

    def _server(self, env: Mapping[str, str], preload: list[str]) -> str:
        key = server_key(env, preload)
        if key not in self._servers:
            n = len(self._servers)
            address = str(Path(tempfile.mkdtemp(prefix="kvo-fork-")) / "socket")
            log = (self._work / f"forkserver{n}.log").open("wb")
            proc = subprocess.Popen(
                [sys.executable, __file__, address, json.dumps(preload)],
                env=dict(env), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            _await_socket(proc, address, self._start_timeout, log.name)
            self._servers[key] = (proc, address)
        return self._servers[key][1]


def _await_socket(proc: subprocess.Popen[bytes], address: str, timeout: float, log: str) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(address):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the fork server did not start: see {log}")
        time.sleep(0.05)


def _await_child(conn: socket.socket, timeout: float | None) -> int:
    """Read ``pid`` and ``rc`` lines until the child's exit closes the connection."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pid, rc, buffer = None, -1, b""
    while True:
        conn.settimeout(None if deadline is None else max(deadline - time.monotonic(), 0.01))
        try:
            data = conn.recv(4096)
        except TimeoutError:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)  # the child and what it started
            raise subprocess.TimeoutExpired("forked engine process", timeout or 0) from None
        if not data:
            return rc
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            name, value = line.decode().split()
            pid, rc = (int(value), rc) if name == "pid" else (pid, int(value))


# --- the server side ------------------------------------------------------------------


def _serve(address: str, preload: list[str]) -> None:
    """Import what every engine needs, then fork a child per request until terminated."""
    for module in preload:  # a patch of vLLM under test, before vLLM (as the runner does)
        importlib.import_module(module)
    import _runner  # noqa: F401  (stdlib only at import)
    import torch  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401  (what LLM() imports first, ~0.4 s)
    from vllm import LLM, SamplingParams  # noqa: F401

    # Only idle native pools (OpenBLAS's, which hand themselves over at fork) may run here.
    print(f"fork server ready: {len(os.listdir('/proc/self/task'))} threads", flush=True)
    # What the imports made is never garbage: out of the collector's sight, vLLM's
    # gc.collect() calls at engine start scan only the child's own objects (1.1 s of a
    # 2.5 s start otherwise), and touch none of the shared pages.
    gc.freeze()

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".tmp")
    listener.listen(16)
    os.rename(address + ".tmp", address)  # the client waits for this name
    listener.settimeout(1.0)
    while True:
        _reap()
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        request = json.loads(conn.makefile("rb").readline())
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            listener.close()
            _child(conn, request)  # never returns
        conn.close()


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _child(conn: socket.socket, request: dict[str, Any]) -> NoReturn:
    os.setsid()  # a group of its own: a timeout kills the engine and its workers together
    conn.sendall(f"pid {os.getpid()}\n".encode())
    os.dup(conn.fileno())  # never closed: the kernel closes it when this process is gone
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = list(request["argv"])
    import _runner

    try:
        rc = _runner.main(sys.argv)
    except BaseException:  # a fresh process would print it and exit 1
        import traceback

        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    conn.sendall(f"rc {rc}\n".encode())
    _runner.exit_after_shutdown(rc)  # the connection closes when this process is gone


if __name__ == "__main__":
    _serve(sys.argv[1], json.loads(sys.argv[2]))
