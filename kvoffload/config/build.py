"""``build_offloading_config``: the one boundary where raw settings are checked.

It reads the declarative key table (:mod:`kvoffload.config.keys`) and applies
its rules in a fixed order, so the first error a user sees is the most basic
one (an unknown key before a bad value, a bad value before a rule between
keys). Only ``ConfigError`` ever escapes.
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from kvoffload.config.disk_path import check_disk_path, disk_path_notes
from kvoffload.config.keys import EXCLUSIVE, KEYS, KEYS_BY_NAME, REQUIRES, Key, KeyType
from kvoffload.config.layout import KVLayout
from kvoffload.config.offload_config import OffloadConfig, disk_footprint
from kvoffload.config.roles import KVRole
from kvoffload.config.values import Bounds, format_bytes, safe_repr, to_int
from kvoffload.errors import ConfigError
from kvoffload.registry import POLICIES

__all__ = ["IgnoredKeysWarning", "Warn", "build_offloading_config"]


#: Workers sharing the CPU budget (tensor-parallel ranks): 2^16 is past any deployment.
_WORKERS = Bounds(1, 2**16, "2^16")


class IgnoredKeysWarning(UserWarning):
    """Keys of vLLM's own connector were given that kvoffload does not use."""


#: Shows one plain line to whoever started the engine (a log's ``warning``, the CLI's stderr).
Warn = Callable[[str], None]


def build_offloading_config(
    extra_config: Mapping[str, Any] | None,
    layout: KVLayout,
    world_size: int = 1,
    *,
    kv_role: object = None,
    warn: Warn | None = None,
) -> OffloadConfig:
    """Validate vLLM's ``kv_connector_extra_config`` mapping against ``layout``.

    ``world_size`` is the number of workers that share ``cpu_bytes_to_use``;
    ``kv_role`` is vLLM's (``kv_both`` when ``None``, see :mod:`.roles`).
    Raises ``ConfigError`` (a ``ValueError``) naming the key, the value and
    the fix; no other exception escapes.

    What is accepted but worth a word is handed to ``warn`` as one line each:
    keys of vLLM's own connector that kvoffload ignores, a ``disk_path`` that
    will be created, a disk budget past the free space. The engine passes its
    logger's ``warning`` and the CLI its stderr; without ``warn``, a library
    caller gets the ignored keys as an ``IgnoredKeysWarning`` (to filter or
    catch) and no notes about the machine it runs on.
    """
    if not isinstance(layout, KVLayout):
        raise ConfigError(f"layout must be a KVLayout, got {safe_repr(layout)}")
    workers = to_int("world_size", world_size, _WORKERS)
    given = _known_items(extra_config, warn)
    parsed = {name: _coerce(KEYS_BY_NAME[name], raw) for name, raw in given.items()}
    _check_rules(parsed)
    fields = {name: value for name, value in parsed.items() if KEYS_BY_NAME[name].sets_field}
    if "block_size" in parsed:
        fields["blocks_per_chunk"] = _blocks_of_block_size(parsed["block_size"], layout)
    role = KVRole.parse(kv_role)
    config = OffloadConfig(layout=layout, world_size=workers, kv_role=role, **fields)
    _check_role(config, {"consumer_write_back", "handoff_wait_ms"} & parsed.keys())
    _check_budgets(config)
    _check_password_env(config)
    if config.disk_path is not None:
        check_disk_path(config.disk_path)
        if warn is not None:
            for note in disk_path_notes(config.disk_path, config.disk_bytes_to_use):
                warn(note)
    return config


def _check_role(config: OffloadConfig, given: set[str]) -> None:
    """A split role needs a tier the other engines reach; ``consumer_write_back`` a consumer,
    ``handoff_wait_ms`` a split role."""
    role = config.kv_role
    if "consumer_write_back" in given and role is not KVRole.CONSUMER:
        raise ConfigError(
            f"'consumer_write_back' applies to kv_role 'kv_consumer' only, and this engine is "
            f"{role.value!r}: remove the key, or start the engine as kv_consumer"
        )
    if "handoff_wait_ms" in given and not role.disaggregated:
        raise ConfigError(
            "'handoff_wait_ms' applies to kv_role 'kv_producer' and 'kv_consumer' only, and "
            "this engine is 'kv_both': remove the key, or start the engine in a split role"
        )
    if role.disaggregated and config.disk_path is None and config.remote_url is None:
        does = "stores for other engines" if role is KVRole.PRODUCER else "loads what others stored"
        raise ConfigError(
            f"kv_role {role.value!r} {does}, but no tier they share is configured (the CPU "
            f"tier is this engine's own): set 'disk_path' (engines on one host) or "
            f"'remote_url' (a fleet), or use kv_role 'kv_both'"
        )


def _check_password_env(config: OffloadConfig) -> None:
    """The password variable must be set where the engine starts (its value is never shown)."""
    name = config.remote_password_env
    if name is not None and not os.environ.get(name):
        raise ConfigError(
            f"'remote_password_env' names ${name}, which is not set (or empty) in this "
            f"environment; export {name} with the remote server's password before starting"
        )


def _known_items(extra_config: Mapping[str, Any] | None, warn: Warn | None) -> dict[str, object]:
    """The given keys kvoffload uses; unknown keys raise, vLLM-only keys warn once."""
    if extra_config is None:
        extra_config = {}
    if not isinstance(extra_config, Mapping):
        raise ConfigError(
            f"the offloading configuration must be a mapping of keys to values, "
            f"got {safe_repr(extra_config)}"
        )
    try:
        items = list(extra_config.items())
    except Exception as exc:  # a broken Mapping subclass is still a bad input
        raise ConfigError(f"cannot read the offloading configuration: {exc!r}") from exc
    for name, _ in items:
        if not isinstance(name, str) or name not in KEYS_BY_NAME:
            raise ConfigError(_unknown_key_message(name))
    ignored = sorted(name for name, _ in items if KEYS_BY_NAME[name].ignored)
    if ignored:
        message = (
            f"kvoffload ignores these keys of vLLM's OffloadingConnector: {', '.join(ignored)}"
        )
        if warn is not None:
            warn(message)
        else:
            warnings.warn(message, IgnoredKeysWarning, stacklevel=3)
    return {name: value for name, value in items if not KEYS_BY_NAME[name].ignored}


def _unknown_key_message(name: object) -> str:
    known = [key.name for key in KEYS]
    hint = ""
    if isinstance(name, str):
        close = difflib.get_close_matches(name, known, n=1)
        if close:
            hint = f" (did you mean {close[0]!r}?)"
    return f"unknown key {safe_repr(name)}{hint}. Known keys: {', '.join(known)}"


def _coerce(key: Key, raw: object) -> Any:
    assert key.type.coerce is not None  # ignored keys were dropped by _known_items
    if key.bounds is not None:
        return key.type.coerce(key.name, raw, key.bounds)
    value = key.type.coerce(key.name, raw)
    if key.type is KeyType.POLICY:
        try:
            return POLICIES.check(value)
        except ConfigError as exc:
            raise ConfigError(f"{key.name!r}: {exc}") from None
    return value


def _check_rules(parsed: dict[str, Any]) -> None:
    for group in EXCLUSIVE:
        present = [name for name in group if name in parsed]
        if len(present) > 1:
            names = " or ".join(repr(name) for name in group)
            raise ConfigError(f"Specify only one of {names}, not both (got {present})")
    for name, needed in REQUIRES.items():
        for other in needed:
            if name in parsed and other not in parsed:
                raise ConfigError(f"{name!r} needs {other!r} too; set both or neither")
    for key in KEYS:
        if key.required and key.name not in parsed:
            raise ConfigError(f"{key.name!r} is required: {key.meaning}")


def _blocks_of_block_size(block_size: int, layout: KVLayout) -> int:
    """``blocks_per_chunk`` from the older key, tokens per chunk, where it has a meaning."""
    sizes = layout.tokens_per_block
    if not layout.is_uniform:
        raise ConfigError(
            f"'block_size' (tokens per chunk) needs every KV cache group to have the same "
            f"tokens_per_block, but the groups have {list(sizes)}; "
            f"use 'blocks_per_chunk' instead"
        )
    if block_size % sizes[0]:
        raise ConfigError(
            f"'block_size'={block_size} is not a multiple of the groups' tokens_per_block "
            f"{sizes[0]}; use a multiple of {sizes[0]}, or 'blocks_per_chunk' instead"
        )
    return block_size // sizes[0]


def _ies(config: OffloadConfig) -> str:
    """'y' or 'ies': one copy of a replicated layout's chunks, one per rank of a sharded one."""
    return "y" if config.copies == 1 else "ies"


def _check_budgets(config: OffloadConfig) -> None:
    largest = config.max_chunk_bytes
    group = config.chunk_bytes.index(largest)
    chunk = (
        f"one chunk of the largest group (group {group}) is {largest} bytes "
        f"({format_bytes(largest)})"
    )
    if config.num_cpu_chunks < 1:
        minimum = largest * config.copies
        raise ConfigError(
            f"'cpu_bytes_to_use'={config.cpu_bytes_to_use} holds no chunk: {chunk}, so "
            f"{config.world_size} worker(s) holding {config.copies} cop{_ies(config)} of a chunk "
            f"need at least {minimum} bytes "
            f"({format_bytes(minimum)}); "
            f"raise 'cpu_bytes_to_use' or lower 'blocks_per_chunk'"
        )
    if config.remote_url is not None and config.remote_queue_bytes < largest:
        raise ConfigError(
            f"'remote_queue_bytes'={config.remote_queue_bytes} holds no chunk: {chunk}; "
            f"set 'remote_queue_bytes' to at least {largest}"
        )
    if config.disk_path is not None and config.num_disk_chunks < 1:
        footprint = disk_footprint(largest) * config.copies
        raise ConfigError(
            f"'disk_bytes_to_use'={config.disk_bytes_to_use} holds no chunk: {chunk}, "
            f"{footprint} bytes on disk with its header for {config.world_size} rank(s) "
            f"({config.copies} cop{_ies(config)}) "
            f"(the budget is shared by every rank); "
            f"set 'disk_bytes_to_use' to at least {footprint}"
        )
