"""vLLM's ``kv_role`` through the connector core: a producer stores for others and never
loads, a consumer loads what producers stored and stores only when asked to.

The engines are the stand-in for vLLM over kvoffload's real scheduler and worker, on
one real ``disk_path`` (the tier a producer and a consumer share on one host), with
every loaded block checked bit-exact.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvoffload import build_offloading_config
from kvoffload.cli import main
from kvoffload.config.layout import CacheGroup, KVLayout
from kvoffload.config.roles import KVRole
from kvoffload.errors import ConfigError
from kvoffload.keys import namespace_of
from kvoffload.standin import KVOffloadSide, KVPages, StandIn
from kvoffload.tiers.disk import DiskProbe
from kvoffload.transfer import allocate_kv_caches

LAYOUT = KVLayout((CacheGroup("full", 16, ("l0", "l1"), 512),))
NAMESPACE = namespace_of("roles-test", "bfloat16", LAYOUT)
#: Prompts of 20 full blocks each, nothing shared between them.
PROMPTS = [(f"p{i}", [random.Random(i).randrange(1, 30000) for _ in range(320)]) for i in range(4)]


def config(tmp_path: Path, kv_role: object, **extra: object) -> Any:
    disk = {"disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": "64MiB"}
    keys = {"cpu_bytes_to_use": "8MiB", **disk, **extra}
    return build_offloading_config(keys, LAYOUT, kv_role=kv_role)


def serve(tmp_path: Path, kv_role: str, **extra: object) -> tuple[dict[str, Any], Any]:
    """One engine of ``kv_role`` on the shared disk serves ``PROMPTS``: (its core's stats, its
    stand-in's)."""
    settings = config(tmp_path, kv_role, **extra)
    kv = allocate_kv_caches(LAYOUT, 128)
    side = KVOffloadSide(settings, NAMESPACE, kv, [DiskProbe(tmp_path / "kv", NAMESPACE)])
    try:
        engine = StandIn(LAYOUT, side, gpu_blocks=128, kv=KVPages(LAYOUT, kv))
        ran = engine.run(PROMPTS)
        return side.scheduler.stats(), ran
    finally:
        side.close()


def disk_files(tmp_path: Path) -> set[str]:
    return {p.name for p in (tmp_path / "kv").rglob("*.kv")}


def test_a_consumer_loads_what_a_producer_stored_and_stores_nothing(tmp_path: Path) -> None:
    produced, ran = serve(tmp_path, "kv_producer")
    assert produced["stored_chunks"] == 4 * 20 and produced["hit_tokens"] == 0
    assert ran.loaded_tokens == 0
    stored = disk_files(tmp_path)
    assert len(stored) == 4 * 20

    consumed, ran = serve(tmp_path, "kv_consumer")
    # Each prompt's whole chunks but the last (the engine computes at least one token).
    assert ran.loaded_tokens == consumed["loaded_tokens"] == 4 * 304
    assert consumed["lower_hit_chunks"] == 4 * 19
    assert ran.mismatched_blocks == 0 and ran.failed_load_tokens == 0
    assert consumed["stored_chunks"] == 0
    assert disk_files(tmp_path) == stored


def test_a_producer_never_loads_what_is_there(tmp_path: Path) -> None:
    serve(tmp_path, "kv_both")
    again, ran = serve(tmp_path, "kv_producer")  # the disk holds every chunk of PROMPTS
    assert ran.loaded_tokens == again["loaded_tokens"] == again["hit_tokens"] == 0
    assert again["lookups"] > 0 and again["lower_hit_chunks"] == 0
    assert again["stored_chunks"] == 4 * 20  # stored again: the disk tier finds them held
    both, ran = serve(tmp_path, "kv_both")
    assert ran.loaded_tokens == 4 * 304 and both["stored_chunks"] > 0


def test_a_consumer_writes_back_when_asked(tmp_path: Path) -> None:
    written, _ = serve(tmp_path, "kv_consumer", consumer_write_back=True)
    assert written["stored_chunks"] == 4 * 20
    assert len(disk_files(tmp_path)) == 4 * 20


@pytest.mark.parametrize(
    ("kv_role", "loads", "stores"),
    [("kv_both", True, True), ("kv_producer", False, True), ("kv_consumer", True, False)],
)
def test_what_each_role_does(tmp_path: Path, kv_role: str, loads: bool, stores: bool) -> None:
    settings = config(tmp_path, kv_role)
    assert (settings.kv_role, settings.loads, settings.stores) == (kv_role, loads, stores)


def test_an_engine_without_a_role_is_kv_both(tmp_path: Path) -> None:
    assert config(tmp_path, None).kv_role is KVRole.BOTH


REFUSALS = [
    ("kv_decoder", {}, "kv_role 'kv_decoder' is not a role kvoffload serves: use kv_both, "),
    ("kv_both", {"consumer_write_back": True}, "applies to kv_role 'kv_consumer' only, and "),
    ("kv_producer", {"consumer_write_back": False}, "this engine is 'kv_producer': remove the"),
]


@pytest.mark.parametrize(("kv_role", "extra", "message"), REFUSALS)
def test_a_role_it_cannot_serve_is_refused_by_name(
    tmp_path: Path, kv_role: str, extra: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        config(tmp_path, kv_role, **extra)
    assert message in str(refused.value)


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer"])
def test_a_split_role_needs_a_tier_the_other_engines_reach(kv_role: str) -> None:
    with pytest.raises(ConfigError) as refused:
        build_offloading_config({"cpu_bytes_to_use": "8MiB"}, LAYOUT, kv_role=kv_role)
    assert str(refused.value).startswith(f"kv_role '{kv_role}' ")
    assert "set 'disk_path' (engines on one host) or 'remote_url' (a fleet)" in str(refused.value)


def test_plan_checks_a_roles_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    extra = '{"cpu_bytes_to_use": "1GiB", "consumer_write_back": true, "remote_url": "redis://h"}'
    plan = ["plan", "tiny_llama", "--extra-config", extra, "--json"]
    assert main([*plan, "--kv-role", "kv_consumer"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["kv_role"], summary["consumer_write_back"]) == ("kv_consumer", True)
    assert main(plan) == 2  # kv_both by default: the key is refused, in one line
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "applies to kv_role 'kv_consumer' only" in err
