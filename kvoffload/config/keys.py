"""The declarative table of configuration keys.

One row per key: the parser, the error messages, the README's key table and
``kvoffload plan --help`` all read this table, so a new setting is one row
here plus the ``OffloadConfig`` field of the same name, which holds its
default. Rules between keys (``block_size`` excludes ``blocks_per_chunk``;
disk keys need each other) are declared here too, not written as ad-hoc
``if``s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from kvoffload.config import values
from kvoffload.config.offload_config import OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.registry import POLICIES

__all__ = [
    "EXCLUSIVE",
    "IGNORED_KEYS",
    "KEYS",
    "KEYS_BY_NAME",
    "REQUIRES",
    "Key",
    "KeyType",
    "render_key_table",
]


class KeyType(Enum):
    """How a raw value is read; ``label`` is what documentation shows."""

    INT = ("int", values.to_int)
    FRACTION = ("fraction", values.to_fraction)
    SHARE = ("fraction or 0", values.to_share)
    SIZE = ("bytes", values.to_size)
    BOOL = ("bool", values.to_bool)
    POLICY = ("policy name", values.to_str)
    KEY_SOURCE = ("auto, tokens or engine", values.to_key_source)
    TRANSFER_KERNEL = ("off, auto or always", values.to_transfer_kernel)
    LOAD_IN_STEP = ("auto, always or never", values.to_load_in_step)
    PATH = ("path", values.to_path)
    URL = ("URL", values.to_remote_url)
    ENV = ("variable name", values.to_env_name)
    IGNORED = ("any", None)

    def __init__(self, label: str, coerce: Callable[..., object] | None) -> None:
        self.label = label
        #: ``coerce(name, raw)``, and for INT and SIZE ``coerce(name, raw, bounds)``.
        self.coerce = coerce

    @property
    def numeric(self) -> bool:
        return self in (KeyType.INT, KeyType.SIZE)


#: OffloadConfig's field defaults by name; ``MISSING`` marks a required field.
_FIELD_DEFAULTS: dict[str, object] = {
    field.name: field.default for field in dataclasses.fields(OffloadConfig)
}


@dataclass(frozen=True, slots=True)
class Key:
    """One configuration key.

    A key sets the ``OffloadConfig`` field of its name and takes its default
    from there; a field without a default makes the key required. A key with
    ``sets_field=False`` is read by ``build_offloading_config`` itself
    (``block_size`` becomes ``blocks_per_chunk``) and has no default. INT and
    SIZE keys, and only they, have ``bounds``: every number a user gives is
    checked against a documented range. ``ignored`` keys are accepted for
    compatibility with vLLM's own ``OffloadingConnector`` and do nothing here.
    """

    name: str
    type: KeyType
    meaning: str
    bounds: values.Bounds | None = None
    sets_field: bool = True

    def __post_init__(self) -> None:
        if self.type.numeric != (self.bounds is not None):
            raise ConfigError(f"key {self.name!r}: INT and SIZE keys, and only they, take bounds")

    @property
    def ignored(self) -> bool:
        return self.type is KeyType.IGNORED

    @property
    def required(self) -> bool:
        return self.sets_field and _FIELD_DEFAULTS[self.name] is dataclasses.MISSING

    @property
    def default(self) -> object:
        """The value a configuration without this key gets, or None for none.

        A field default below the key's minimum is a sentinel, not a
        setting (``disk_bytes_to_use`` is 0 when there is no disk tier), so
        the key shows none.
        """
        if self.ignored or not self.sets_field or self.required:
            return None
        default = _FIELD_DEFAULTS[self.name]
        bounds = self.bounds
        below = bounds is not None and isinstance(default, int) and default < bounds.minimum
        return None if below else default

    def range_text(self) -> str:
        """The accepted range of a numeric key, as the key table shows it ('' for others)."""
        if self.type is KeyType.FRACTION:
            return "above 0, up to 1"
        if self.type is KeyType.SHARE:
            return "0 (off) to 1"
        return self.bounds.text(self.type is KeyType.SIZE) if self.bounds else ""

    def default_text(self) -> str:
        if self.required:
            return "required"
        default = self.default
        if self.type is KeyType.SIZE and isinstance(default, int):
            return f"`{values.format_bytes(default).replace(' ', '')}`"
        return "unset" if default is None else f"`{default}`"


_VLLM_ONLY = "accepted for vLLM compatibility; unused by kvoffload (one warning names it)"

# Upper bounds: far above any real setting, far below where a number stops fitting what
# consumes it (a float, a 64-bit size, a C timeout). Say why beside each new one.
#: Bytes: 1 EiB is more memory or disk than any host has, and sums stay in 64 bits.
_BYTES = values.Bounds(1, 2**60)
#: Blocks per chunk: 2^20 blocks of 16 tokens are 16M tokens, past any context window.
_BLOCKS = values.Bounds(1, 2**20, "2^20")
#: Tokens per chunk: 2^24 (16M) tokens, past any context window.
_TOKENS = values.Bounds(1, 2**24, "2^24")
#: Tokens between retained hit points: 0 for none; 2^24 (16M) tokens, past any context window.
_INTERVAL = values.Bounds(0, 2**24, "2^24")
#: Sightings before a store: a higher threshold would store almost nothing.
_SIGHTINGS = values.Bounds(1, 1000)
#: Waits in milliseconds: a server slower than a day is down, and a day fits every timer.
_MILLISECONDS = values.Bounds(1, 86_400_000, "one day")
_WAIT_MILLISECONDS = values.Bounds(0, 600_000, "ten minutes")

KEYS: tuple[Key, ...] = (
    Key(
        "cpu_bytes_to_use",
        KeyType.SIZE,
        "Host-memory budget for offloaded KV, the total across all workers (as in vLLM). "
        "An integer or a size: '512MiB', '8GiB', '500MB'. "
        "Must hold one chunk of the largest group. With tensor parallelism it is one "
        "shared-memory region in /dev/shm that every rank maps (replicated MLA KV: one "
        "copy), which must have the room.",
        bounds=_BYTES,
    ),
    Key(
        "blocks_per_chunk",
        KeyType.INT,
        "Engine blocks per offloaded chunk, in every group. Works for any layout, hybrid "
        "ones included. Excludes `block_size`.",
        bounds=_BLOCKS,
    ),
    Key(
        "block_size",
        KeyType.INT,
        "Tokens per chunk (the older vLLM key). Only for layouts whose groups all share one "
        "`tokens_per_block`, and must be a multiple of it. Excludes `blocks_per_chunk`.",
        bounds=_TOKENS,
        sets_field=False,
    ),
    Key(
        "eviction_policy",
        KeyType.POLICY,
        f"Eviction policy of the offload index: one of {', '.join(POLICIES.names())}. "
        "Its admission filter (adaptive's) decides what the CPU tier keeps; with a disk or "
        "remote tier every chunk still reaches them.",
    ),
    Key(
        "store_threshold",
        KeyType.INT,
        "Keep a chunk in the CPU tier once it has been seen this many times (1: on first "
        "sight; 2 and more filter out one-off prefixes). A disk or remote tier gets every "
        "chunk regardless.",
        bounds=_SIGHTINGS,
    ),
    Key(
        "offload_prompt_only",
        KeyType.BOOL,
        "Offload only chunks that lie wholly inside the prompt, not generated tokens.",
    ),
    Key(
        "key_source",
        KeyType.KEY_SOURCE,
        "What chunk keys are hashed from. `tokens`: the token ids (with salt, adapter and "
        "multimodal inputs), the same in every process and every vLLM version. `engine`: "
        "vLLM's own block hashes of the request, which it computes anyway, so the connector "
        "hashes almost nothing; the same in every process only where vLLM's are (its "
        "`prefix_caching_hash_algo` sha256 or sha256_cbor, or `PYTHONHASHSEED` set), and a "
        "vLLM version that hashes differently misses what another stored. `auto`: `engine` "
        "where vLLM's hashes are the same in every process or no disk or remote tier "
        "outlives the process, `tokens` otherwise.",
    ),
    Key(
        "transfer_kernel",
        KeyType.TRANSFER_KERNEL,
        "How the worker moves pages between GPU KV and host memory. `off`: torch copies "
        "through a staging buffer (measured on an H200). `auto`: per group, direction and "
        "call size, the faster of those and one Triton kernel launch per call, timed at "
        "start on scratch memory and logged. `always`: the kernel. Opt-in until it has run "
        "on a GPU (docs/data-plane.md); host KV always uses torch copies.",
    ),
    Key(
        "load_in_step",
        KeyType.LOAD_IN_STEP,
        "When a hit whose chunks are all in the CPU tier is loaded. `auto`: in the step that "
        "asks for it (vLLM schedules the rest of the prompt at once, as for a hit in its own "
        "cache) where vLLM can recompute a failed load from the failed block on: one KV cache "
        "group that keeps the whole prefix (full attention, MLA). Other layouts (sliding "
        "windows, several groups, recurrent states) load one step later, where a failed load "
        "fails its request and vLLM starts it over (docs/vllm.md). `always`: in the step on "
        "every layout, a recurrent state also into the block vLLM runs it in (host slots "
        "are pinned, so only a bug can fail such a load; where vLLM cannot recompute it, it "
        "is logged as an error). `never`: one step later. Hits that need "
        "the disk or remote tier load over later steps (with `KVOFFLOAD_LOWER_TIER_HITS="
        "promote` they are read into the CPU tier first and then load in their step: "
        "measured no faster here, docs/vllm.md).",
    ),
    Key(
        "tenant_cpu_share",
        KeyType.FRACTION,
        "Most of the CPU tier one tenant (one `cache_salt`; requests without one are a "
        "tenant too) may hold, as a fraction of its chunks: a tenant at its share evicts "
        "its own chunks, never the others'. Unset: no limit.",
    ),
    Key(
        "queued_cpu_share",
        KeyType.SHARE,
        "Most of the CPU tier held for requests in vLLM's waiting queue: once a step leaves "
        "a request waiting (before that step's stores evict), the chunks it will hit in the "
        "CPU tier are not evicted until it is scheduled (or aborted, or has waited a "
        "minute), up to this fraction of the tier, first come first held. 0: nothing held.",
    ),
    Key(
        "retention_cpu_share",
        KeyType.SHARE,
        "Most of the CPU tier held for the token ranges clients' retention hints keep "
        "(`kv_transfer_params`, docs/vllm.md), beside `queued_cpu_share`: a kept range is not "
        "evicted for its duration, up to this fraction of the tier; when it is full, the "
        "range whose time runs out last makes room for one whose time runs out sooner. 0: "
        "nothing kept (drops still apply).",
    ),
    Key(
        "fetch_while_queued",
        KeyType.BOOL,
        "Read the disk or remote chunks of a request that a step left waiting into the "
        "CPU tier meanwhile, within `queued_cpu_share`, so that its hit loads from host "
        "memory in the step that schedules it (a lower-tier hit otherwise loads over later "
        "steps). Off by default: on the demo's trace it moved 2,048 tokens from the GPU "
        "prefix cache's hits to kvoffload's and cost 512 more computed (docs/vllm.md).",
    ),
    Key(
        "retention_interval",
        KeyType.INT,
        "Sliding-window chunks and recurrent states are stored only where a later hit can "
        "land: the aligned ends of each request's prompt and output, where its prefix left "
        "what was stored, and one hit point every this many tokens (rounded up to a chunk "
        "boundary of every group). 0: no periodic points; 1: every chunk boundary (stores "
        "every chunk). Full-attention chunks are always all stored. The default kept 98% of "
        "the hits of storing every chunk for 29% of its bytes (docs/benchmarks.md).",
        bounds=_INTERVAL,
    ),
    Key(
        "disk_path",
        KeyType.PATH,
        "Directory of the disk tier (created 0700), on a local file system. Processes may "
        "share it (data-parallel replicas, several servers, tensor-parallel ranks): each "
        "loads what the others stored. Unset: no disk tier. Needs `disk_bytes_to_use`.",
    ),
    Key(
        "disk_bytes_to_use",
        KeyType.SIZE,
        "Byte budget of everything under `disk_path`: per directory (so per host), not per "
        "rank or process. All processes and tensor-parallel ranks on the path stay within it "
        "together, evicting in one LRU order; give them all the same value. Needs `disk_path`.",
        bounds=_BYTES,
    ),
    Key(
        "remote_url",
        KeyType.URL,
        "The shared remote tier, behind CPU and disk: `redis://host:6379/0` (Redis or "
        "Valkey), `rediss://` for TLS, `redis+cluster://host:7000` for a Redis Cluster. "
        "Unset: no remote tier. The server evicts on its own (`maxmemory` with an LRU or "
        "LFU policy).",
    ),
    Key(
        "remote_password_env",
        KeyType.ENV,
        "Name of the environment variable that holds the remote server's password "
        "(never the password itself). Needs `remote_url`.",
    ),
    Key(
        "remote_timeout_ms",
        KeyType.INT,
        "Timeout of every call to the remote tier, in milliseconds; a slower server is "
        "treated as down. Needs `remote_url`.",
        bounds=_MILLISECONDS,
    ),
    Key(
        "remote_retry_ms",
        KeyType.INT,
        "Longest wait between reconnection attempts while the remote tier is down, in "
        "milliseconds (the wait doubles from 100 ms up to this). Needs `remote_url`.",
        bounds=_MILLISECONDS,
    ),
    Key(
        "remote_queue_bytes",
        KeyType.SIZE,
        "Bytes of stores waiting for the remote tier: stores are written behind the store "
        "job from a queue this big; when it is full a store skips the remote tier (counted, "
        "named in the job's errors) and stays in CPU and disk. Needs `remote_url`.",
        bounds=_BYTES,
    ),
    Key(
        "consumer_write_back",
        KeyType.BOOL,
        "With vLLM's `kv_role` `kv_consumer` (a decode instance): also store what this engine "
        "computes, so a later turn it serves finds its output. Off: a consumer only loads what "
        "producers (`kv_producer`, which only store) put in the disk or remote tier. Only with "
        "`kv_consumer`.",
    ),
    Key(
        "handoff_wait_ms",
        KeyType.INT,
        "Prefill and decode on different engines: a `kv_producer` marks each chunk it is "
        "storing in the shared tier for this long, and a `kv_consumer` whose lookup finds "
        "marked chunks past its hit asks vLLM to try again, for at most this long, rather "
        "than recompute what is milliseconds from landing. 0: no marks, no waiting. Only "
        "with `kv_producer` or `kv_consumer`.",
        bounds=_WAIT_MILLISECONDS,
    ),
    *(
        Key(name, KeyType.IGNORED, _VLLM_ONLY, sets_field=False)
        for name in (
            "spec_name",
            "spec_module_path",
            "cache_policy_module_path",
            "max_tracker_size",
            "self_describing_kv_events",
            "canonical_layout",
            "secondary_tiers",
            "backpressure",
        )
    ),
)

KEYS_BY_NAME: dict[str, Key] = {key.name: key for key in KEYS}
IGNORED_KEYS: frozenset[str] = frozenset(key.name for key in KEYS if key.ignored)

#: Groups of keys of which at most one may be given.
EXCLUSIVE: tuple[tuple[str, ...], ...] = (("block_size", "blocks_per_chunk"),)

#: key -> keys that must be given with it.
REQUIRES: dict[str, tuple[str, ...]] = {
    "disk_path": ("disk_bytes_to_use",),
    "disk_bytes_to_use": ("disk_path",),
    "remote_password_env": ("remote_url",),
    "remote_timeout_ms": ("remote_url",),
    "remote_retry_ms": ("remote_url",),
    "remote_queue_bytes": ("remote_url",),
}


def render_key_table() -> str:
    """The Markdown table of all keys, as README.md shows it."""
    lines = ["| key | type | default | range | meaning |", "|---|---|---|---|---|"]
    for key in KEYS:
        if not key.ignored:
            lines.append(
                f"| `{key.name}` | {key.type.label} | {key.default_text()} "
                f"| {key.range_text()} | {key.meaning} |"
            )
    ignored = ", ".join(f"`{name}`" for name in sorted(IGNORED_KEYS))
    lines.append(f"| {ignored} | any | unset | | {_VLLM_ONLY[0].upper()}{_VLLM_ONLY[1:]}. |")
    return "\n".join(lines)
