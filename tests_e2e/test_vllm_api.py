"""The connector against the vLLM it runs in: imports, subclassing, signatures, the factory.

Runs against the installed vLLM 0.32 (``make e2e``) and against vLLM 0.33's
and 0.34's modules (``make vllm-api-check``: each wheel unpacked, without
compiled extensions, in front of the 0.32 environment on ``PYTHONPATH``).
Their connector APIs only added methods; those kvoffload implements are
checked to override the base's with the same parameters, and 0.34's hooks
for what they answer.
"""

from __future__ import annotations

import importlib
import inspect
import typing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import vllm
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from kvoffload.errors import ConfigError, ProtocolError
from kvoffload.vllm._scheduler_side import SchedulerSide
from kvoffload.vllm._startup import drafter_lookahead, refuse_draft_kv
from kvoffload.vllm._worker_side import WorkerSide
from kvoffload.vllm.connector import KVOffloadConnector, KVOffloadMetadata

#: vLLM versions this suite is run against (DEVELOPERS.md says how).
TESTED = ("0.32.0", "0.33.0", "0.34.0")
#: Methods vLLM 0.33 added to the connector API, all implemented here.
ADDED_IN_033 = ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches")
#: Methods vLLM 0.34 added that kvoffload implements; ``kv_cache_access`` keeps vLLM's default.
ADDED_IN_034 = ("may_load_async", "supports_lookahead_block_hashes")
CONFIG = KVTransferConfig(
    kv_connector="KVOffloadConnector", kv_connector_module_path="kvoffload.vllm", kv_role="kv_both"
)
#: Tokens per block of the scheduler-side connector below.
BLOCK = 16


def test_this_vllm_is_one_we_test() -> None:
    assert vllm.__version__ in TESTED, vllm.__file__


@pytest.mark.parametrize(
    "module",
    ["kvoffload.vllm", "kvoffload.vllm.connector", "kvoffload.vllm._layout",
     "kvoffload.connector.scheduler", "kvoffload.connector.worker"],
)  # fmt: skip
def test_the_adapter_imports(module: str) -> None:
    importlib.import_module(module)


def test_the_connector_is_a_complete_hybrid_connector() -> None:
    assert issubclass(KVOffloadConnector, KVConnectorBase_V1)
    assert issubclass(KVOffloadConnector, SupportsHMA)
    assert not KVOffloadConnector.__abstractmethods__


def test_overridden_methods_take_the_bases_parameters() -> None:
    differ = []
    for name, member in inspect.getmembers(KVOffloadConnector, inspect.isroutine):
        found = KVConnectorBase_V1.__dict__.get(name) or SupportsHMA.__dict__.get(name)
        if found is None or name.startswith("__"):
            continue
        base = getattr(found, "__func__", found)  # classmethods: compare the functions
        ours = getattr(member, "__func__", member)
        mine = list(inspect.signature(ours).parameters)
        theirs = list(inspect.signature(base).parameters)
        if mine != theirs:
            differ.append((name, theirs, mine))
    assert differ == []


def test_the_methods_033_added_are_ours_where_vllm_has_them() -> None:
    present = [name for name in ADDED_IN_033 if name in KVConnectorBase_V1.__dict__]
    assert present == (list(ADDED_IN_033) if vllm.__version__ >= "0.33" else [])
    assert all(name in KVOffloadConnector.__dict__ for name in ADDED_IN_033)


def test_the_methods_034_added_are_ours_where_vllm_has_them() -> None:
    present = [name for name in ADDED_IN_034 if name in KVConnectorBase_V1.__dict__]
    assert present == (list(ADDED_IN_034) if vllm.__version__ >= "0.34" else [])
    assert all(name in KVOffloadConnector.__dict__ for name in ADDED_IN_034)


def test_vllms_factory_finds_the_connector_and_its_hybrid_support() -> None:
    assert KVConnectorFactory.get_connector_class(CONFIG) is KVOffloadConnector
    assert KVConnectorFactory.supports_hma_config(CONFIG)
    assert KVOffloadConnector.supports_sleep_mode(CONFIG)


def test_multiconnector_rebuilds_the_connectors_stats_by_its_class_name() -> None:
    """Inside ``MultiConnector`` the frontend gets each child's stats as a plain dict keyed
    by the child's class name, and rebuilds them through vLLM's registry by that name:
    importing the connector registers it (unregistered, vLLM's first logged step raised)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from kvoffload.vllm._prom import KVOffloadStats

    assert KVConnectorFactory.get_connector_class_by_name("KVOffloadConnector") is (
        KVOffloadConnector
    )
    counters = {"counters": {"loaded_tokens|cpu": 64}, "gauges": {}, "histograms": {}}
    sent = KVOffloadStats(data=counters).to_dict()
    rebuilt = MultiConnector.build_kv_connector_stats(data={"KVOffloadConnector": sent})
    assert rebuilt is not None
    assert isinstance(rebuilt["KVOffloadConnector"], KVOffloadStats)
    assert rebuilt["KVOffloadConnector"].data == counters


# -- vLLM 0.34's hooks ---------------------------------------------------------------------
def test_the_workers_reach_the_kv_cache_in_process_as_vllm_034_assumes() -> None:
    """``kv_cache_access``: the workers copy with torch in their process, vLLM's default."""
    if vllm.__version__ < "0.34":
        pytest.skip("kv_cache_access is vLLM 0.34's")
    from vllm.config.kv_transfer import KVCacheAccess

    access = KVOffloadConnector.kv_cache_access(CONFIG)
    assert access == KVCacheAccess.IN_PROCESS and not access.needs_single_chunk()


def test_lookahead_block_hashes_are_taken() -> None:
    """EAGLE-like drafters' chunk keys name the tokens after each chunk, as vLLM 0.34's
    lookahead hashes do; the connector makes them from token ids, whatever vLLM hashes."""
    assert KVOffloadConnector.supports_lookahead_block_hashes(CONFIG) is True


def one_group_connector(
    tmp_path: Path, *, inflight: int | None, disk: bool, role: str = "SCHEDULER"
) -> KVOffloadConnector:
    """A connector of ``role`` on one full-attention group, built as vLLM builds it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    extra: dict[str, Any] = {"cpu_bytes_to_use": "1MiB", "key_source": "tokens"}
    if disk:
        extra |= {"disk_path": str(tmp_path / "kv"), "disk_bytes_to_use": "16MiB"}
    transfer = KVTransferConfig(kv_connector="KVOffloadConnector", kv_role="kv_both",
                                kv_connector_module_path="kvoffload.vllm",
                                kv_connector_extra_config=extra)  # fmt: skip
    # The parts of VllmConfig the connector reads (a whole one needs a model).
    engine = SimpleNamespace(
        kv_transfer_config=transfer,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
        model_config=SimpleNamespace(model="tiny", dtype=torch.bfloat16),
        cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256"),
        scheduler_config=SimpleNamespace(max_num_inflight_kv_loads=inflight),
        speculative_config=None,
        kv_events_config=None,
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)])  # fmt: skip
    return KVOffloadConnector(engine, KVConnectorRole[role], kv)  # type: ignore[arg-type]


def request(req_id: str, tokens: list[int]) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=req_id, prompt_token_ids=tokens, pooling_params=None,
                   sampling_params=SamplingParams(max_tokens=1))  # fmt: skip


def test_may_load_async_is_true_for_a_hit_from_the_disk_tier(tmp_path: Path) -> None:
    """With ``max_num_inflight_kv_loads`` the connector looks up on arrival; only a hit whose
    chunks wait on disk may load asynchronously, one in host memory or none may not."""
    from kvoffload.tiers.disk import DiskTier

    connector = one_group_connector(tmp_path, inflight=4, disk=True)
    stored, other = list(range(1, 6 * BLOCK + 2)), list(range(500, 500 + 6 * BLOCK + 1))
    disk = DiskTier(tmp_path / "kv", 16 << 20, connector.setup.namespace(0))
    chunk = np.zeros(connector.setup.config.chunk_bytes[0], dtype=np.uint8)
    assert isinstance(connector.side, SchedulerSide)
    for key in connector.side.scheduler.keys_for(stored)[0][:4]:
        disk.put(key, chunk)
    disk.close()
    hit, miss = request("hit", stored), request("miss", other)
    for req in (hit, miss):
        connector.on_new_request(req)
    assert connector.may_load_async(hit) and not connector.may_load_async(miss)
    assert connector.get_num_new_matched_tokens(hit, 0) == (4 * BLOCK, True)
    connector.request_finished(hit, [])
    assert not connector.may_load_async(hit)  # a finished request is forgotten
    unlimited = one_group_connector(tmp_path, inflight=None, disk=True)
    unlimited.on_new_request(hit)  # vLLM never asks without the limit: no lookup on arrival
    assert not unlimited.may_load_async(hit)
    cpu_only = one_group_connector(tmp_path, inflight=4, disk=False)
    cpu_only.on_new_request(hit)
    assert not cpu_only.may_load_async(hit)
    for side in (connector, unlimited, cpu_only):
        side.shutdown()


def test_a_method_of_the_other_role_is_refused_naming_both_roles(tmp_path: Path) -> None:
    """vLLM builds the connector once per role, each with its own side: a worker's method on
    the scheduler's connector (or the reverse) is vLLM's mistake, named, not a silent no-op."""
    scheduler = one_group_connector(tmp_path, inflight=None, disk=False)
    worker = one_group_connector(tmp_path, inflight=None, disk=False, role="WORKER")
    assert isinstance(scheduler.side, SchedulerSide) and isinstance(worker.side, WorkerSide)
    on_scheduler = "is a worker-side method, called on the scheduler-side connector"
    with pytest.raises(ProtocolError, match=f"register_kv_caches {on_scheduler}"):
        scheduler.register_kv_caches({})
    with pytest.raises(ProtocolError, match=f"wait_for_save {on_scheduler}"):
        scheduler.wait_for_save()
    on_worker = "is a scheduler-side method, called on the worker-side connector"
    with pytest.raises(ProtocolError, match=f"get_num_new_matched_tokens {on_worker}"):
        worker.get_num_new_matched_tokens(request("r", [1, 2, 3]), 0)
    with pytest.raises(ProtocolError, match=f"take_events {on_worker}"):
        worker.take_events()
    worker.bind_connector_metadata(KVOffloadMetadata())  # before a KV tensor: nothing to do
    with pytest.raises(ProtocolError, match=r"wait_for_save .*before register_kv_caches"):
        worker.wait_for_save()  # the worker's own method, before vLLM registered its KV
    assert scheduler.stats()["unkeyable_requests"] == 0 and worker.stats() == {}
    assert worker.get_kv_connector_stats() is None and worker.build_connector_worker_meta() is None
    for connector in (scheduler, worker):
        connector.shutdown()


def _literal_values(kind: Any) -> list[str]:
    args = typing.get_args(kind)
    return [v for a in args for v in (_literal_values(a) if typing.get_args(a) else [a])]


def test_every_speculative_method_is_served_or_refused_by_name() -> None:
    """vLLM's own classification of each method: a separate draft model's KV and the EAGLE-like
    drafters' (their KV reads the tokens after a chunk: keys name them) are offloaded; a
    method keeping hidden states for another consumer is refused by name."""
    from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod

    served, refused = set(), set()
    for method in _literal_values(SpeculativeMethod):
        spec = object.__new__(SpeculativeConfig)  # what the refusal reads: the method
        object.__setattr__(spec, "method", method)
        try:
            refuse_draft_kv(SimpleNamespace(speculative_config=spec))
        except ConfigError as exc:
            assert f"method {method!r}" in str(exc) and "eagle3" in str(exc), str(exc)
            assert spec.uses_draft_kv_cache() and not spec.use_eagle()
            refused.add(method)
        else:
            served.add(method)
    assert {"draft_model", "ngram", "suffix", "eagle", "eagle3", "mtp", "dflash"} <= served
    assert refused == {"extract_hidden_states"}


def test_the_drafters_lookahead_is_the_count_vllm_names_for_every_consumer() -> None:
    """``VllmConfig.num_prefill_lookahead_tokens`` (1 for EAGLE, the drafted tokens for a
    multi-module MTP) is what the keys name after each chunk; none without such a drafter."""
    from vllm.config import VllmConfig

    assert isinstance(inspect.getattr_static(VllmConfig, "num_prefill_lookahead_tokens"), property)
    eagle = SimpleNamespace(use_eagle=lambda: True)
    for count in (1, 3):
        config = SimpleNamespace(speculative_config=eagle, num_prefill_lookahead_tokens=count)
        assert drafter_lookahead(config) == count
    draft = SimpleNamespace(use_eagle=lambda: False)
    assert drafter_lookahead(SimpleNamespace(speculative_config=draft)) == 0
    assert drafter_lookahead(SimpleNamespace(speculative_config=None)) == 0
