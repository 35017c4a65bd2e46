"""Fixtures of the end-to-end suite: tiny models, one engine process per run, references.

The suite runs in the vLLM virtual environment (``make e2e``); elsewhere it is
skipped as a whole. Every engine runs in a subprocess (``_runner.py``), so
the tests share nothing but the model directories and the reference runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _timing
import pytest
from _forkserver import ForkServers
from _harness import Engine, Reference
from _launch import EngineFailed, run_spec
from _models import GEMMA4, LLAMA, LLAMA4, QWEN3_NEXT, SLIDING_MISTRAL, build

# The remote-tier tests use the unit tests' real Redis servers on loopback (appended,
# so that tests/conftest.py never shadows this one).
sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))
pytest_plugins = ["_redis_servers"]

#: vLLM compiles its logprob gather (``Sampler.gather_logprobs``, ``torch.compile``) at each
#: engine's first step: 3 s of every engine process here, for tensors of a few thousand
#: elements. Every run of the suite, oracle and subject alike, gathers logprobs eagerly.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

#: One engine process may take this long (start-up is ~10 s on two cores).
ENGINE_TIMEOUT_S = float(os.environ.get("KVOFFLOAD_E2E_TIMEOUT", "600"))

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Outside the vLLM environment every test is skipped with the reason (not failed)."""
    if not HAVE_VLLM:
        skip = pytest.mark.skip(reason="vLLM is not installed here: run `make e2e`")
        for item in items:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Where the minutes went: engine processes, their start against their wall time."""
    lines = _timing.summary()
    if lines:
        terminalreporter.section("engine processes")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the session's models live (``KVOFFLOAD_E2E_MODELS`` keeps them between runs)."""
    keep = os.environ.get("KVOFFLOAD_E2E_MODELS")
    return Path(keep) if keep else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def llama(models: Path) -> str:
    return str(build(LLAMA, models / "llama"))


@pytest.fixture(scope="session")
def sliding_mistral(models: Path) -> str:
    return str(build(SLIDING_MISTRAL, models / "sliding_mistral"))


@pytest.fixture(scope="session")
def gemma4(models: Path) -> str:
    return str(build(GEMMA4, models / "gemma4"))


@pytest.fixture(scope="session")
def qwen3_next(models: Path) -> str:
    return str(build(QWEN3_NEXT, models / "qwen3_next"))


@pytest.fixture(scope="session")
def llama4(models: Path) -> str:
    return str(build(LLAMA4, models / "llama4"))


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """Run one engine process on a spec (the keys of ``_runner.py``) and return its result.

    The process is forked from a server that imported vLLM once (``_forkserver.py``),
    or, with ``fresh=True`` (or ``KVOFFLOAD_E2E_FORK=0`` for every run), a fresh
    interpreter: for the claims that rest on separate interpreters. With ``memo=True``
    a run identical to an earlier one (spec and the environment engines read) is not
    run again: for oracles that several tests compare with. A process that dies
    (rather than returning an ``error``) fails the test with the tail of its output.
    """
    work = tmp_path_factory.mktemp("runs")
    forks = ForkServers(work) if os.environ.get("KVOFFLOAD_E2E_FORK", "1") != "0" else None
    count = iter(range(10**6))

    done: dict[str, dict[str, Any]] = {}

    def run(*, fresh: bool = False, memo: bool = False, **spec: Any) -> dict[str, Any]:
        if not spec.get("env", True):
            del spec["env"]  # no environment of its own: the same run as without the key
        environment = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        key = json.dumps([spec, environment], sort_keys=True)
        if memo and key in done:
            return done[key]
        started = time.perf_counter()
        launcher = None if fresh else forks
        try:
            result = run_spec(
                spec, work, f"run{next(count)}", timeout=ENGINE_TIMEOUT_S, forks=launcher
            )
        except EngineFailed as exc:
            raise AssertionError(str(exc)) from None
        _timing.record(result, time.perf_counter() - started, forked=launcher is not None)
        if memo:
            done[key] = result
        return result

    yield run
    if forks is not None:
        forks.close()


@pytest.fixture(scope="session")
def reference(engine: Engine) -> Reference:
    """The run without the connector of (model, engine arguments, prompts), once per session.

    Three passes: the first, the same again (vLLM's prefix cache serves it),
    and once more after ``llm.reset_prefix_cache()`` (nothing left to serve
    the first prompt). The checks that make the comparison meaningful are
    done here, on every reference.
    """
    done: dict[str, dict[str, Any]] = {}

    def get(model: str, engine_args: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
        key = json.dumps([model, engine_args, prompts], sort_keys=True)
        if key not in done:
            result = engine(
                model=model, engine=engine_args, prompts=prompts, passes=[{}, {}, {"reset": True}]
            )
            assert result["error"] is None, result["error"]
            first, again, after_reset = result["passes"]
            assert again["cached"][0] > 0, again["cached"]  # the prefix cache works
            assert after_reset["cached"][0] == 0, after_reset["cached"]  # and the reset too
            assert first["tokens"] == again["tokens"] == after_reset["tokens"]
            assert result["stats"] == {}
            done[key] = result
        return done[key]

    return get
