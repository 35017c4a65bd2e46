"""The connector against the vLLM it runs in: imports, subclassing, signatures, the factory.

Runs against the installed vLLM 0.32 (``make e2e``) and against vLLM 0.33's
modules (``make vllm033-check``: its wheel unpacked, without compiled
extensions, in front of the 0.32 environment on ``PYTHONPATH``). 0.33's
connector API only added methods; those kvoffload implements are checked to
override the base's with the same parameters.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import vllm
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA

from kvoffload.vllm.connector import KVOffloadConnector

#: vLLM versions this suite is run against (DEVELOPERS.md says how).
TESTED = ("0.32.0", "0.33.0", "0.34.0")
#: Methods vLLM 0.33 added to the connector API, all implemented here.
ADDED_IN_033 = ("supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches")


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


def test_vllms_factory_finds_the_connector_and_its_hybrid_support() -> None:
    config = KVTransferConfig(
        kv_connector="KVOffloadConnector",
        kv_connector_module_path="kvoffload.vllm",
        kv_role="kv_both",
    )
    assert KVConnectorFactory.get_connector_class(config) is KVOffloadConnector
    assert KVConnectorFactory.supports_hma_config(config)
    assert KVOffloadConnector.supports_sleep_mode(config)
