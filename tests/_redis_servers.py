"""Real Redis servers on loopback for the remote-tier tests, started and stopped by fixtures.

Each server gets a free port and a directory of its own, persistence off.
Without ``redis-server`` (or the ``redis`` client package, a dev extra) the
tests are skipped on a developer's machine with the command that installs it,
and fail under CI (``CI`` set), which must have both (``.ci/run`` installs them).
"""

from __future__ import annotations

import importlib.util
import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

INSTALL = "apt-get update && apt-get install -y redis-server"


def _missing(message: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def need_redis_py() -> None:
    """Skip (fail under CI) without redis-py, which the remote tier talks through."""
    if importlib.util.find_spec("redis") is None:
        _missing("the redis package is not installed; install it with: pip install 'redis>=5'")


def need_redis_server() -> str:
    need_redis_py()
    path = shutil.which("redis-server")
    if path is None:
        _missing(f"redis-server is not installed; install it with: {INSTALL}")
    assert path is not None  # _missing raised
    return path


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A free loopback port whose cluster bus port (port + 10000) is free and valid too."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 50000)
        if _is_free(port) and _is_free(port + 10000):
            return port


@dataclass
class RedisServer:
    """One ``redis-server`` process on 127.0.0.1."""

    directory: Path
    port: int = field(default_factory=free_port)
    password: str | None = None
    cluster: bool = False
    process: subprocess.Popen[bytes] | None = None
    _client: object = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [need_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.directory)]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_until_ready()
        return self

    def client(self):  # type: ignore[no-untyped-def]
        """One client per server, closed when the server stops, so no socket outlives a test."""
        import redis

        if self._client is None:
            self._client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password)
        return self._client

    def _close_client(self) -> None:
        if self._client is not None:
            self._client.close()  # type: ignore[attr-defined]
            self._client = None

    def wait_until_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process is not None and self.process.poll() is not None:
                code, self.process = self.process.returncode, None
                raise RuntimeError(f"redis-server on port {self.port} exited with {code}")
            try:
                if self.client().ping():
                    return
            except Exception:
                if time.monotonic() > deadline:
                    self.kill()
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, the way a crashed server goes."""
        self._close_client()
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def stop(self) -> None:
        self._close_client()
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def _cluster_ok(node: RedisServer) -> bool:
    """Whether ``node`` reports cluster_state:ok and knows all 16384 slots."""
    info = node.client().execute_command("CLUSTER INFO")
    return bool(info.get("cluster_state") == "ok" and int(info.get("cluster_slots_ok", 0)) == 16384)


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[list[RedisServer]]:
    """Three masters, no replicas, every slot assigned."""
    nodes = [RedisServer(tmp_path / f"node{i}", cluster=True).start() for i in range(3)]
    try:
        cli = shutil.which("redis-cli")
        assert cli is not None, f"redis-cli is missing; install it with: {INSTALL}"
        subprocess.run(
            [cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        # Every node must agree: one node says ok while another still reports CLUSTERDOWN.
        while not all(_cluster_ok(node) for node in nodes):
            assert time.monotonic() < deadline, "the cluster did not reach cluster_state:ok"
            time.sleep(0.1)
        yield nodes
    finally:
        for node in nodes:
            node.stop()
