"""``OffloadConfig``: the validated, frozen result of parsing a configuration.

Everything after ``build_offloading_config`` trusts this object: geometry is
derived from the layout and ``blocks_per_chunk`` as properties, never stored
twice, so it cannot disagree with itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvoffload.config.layout import KVLayout, Reuse
from kvoffload.config.roles import KVRole
from kvoffload.config.values import format_bytes
from kvoffload.registry import DEFAULT_POLICY

__all__ = ["ALIGN", "OffloadConfig", "disk_footprint"]

#: The one alignment of the data plane: what O_DIRECT needs of a buffer, a length and
#: a file offset (4096 satisfies the 512- and 4096-byte blocks of every device in use).
#: The disk tier writes a chunk as one header block plus its payload, both padded to
#: it, and budgets are checked against that footprint; the CPU tier starts its slots
#: on it, so the disk tier moves a slot with O_DIRECT and no staging copy.
ALIGN = 4096


def disk_footprint(payload_bytes: int) -> int:
    """Bytes one chunk of ``payload_bytes`` occupies in the disk tier, header included."""
    return ALIGN + -(-payload_bytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class OffloadConfig:
    """Validated offloading settings for one layout.

    A field's default is the default of the configuration key of its name
    (:mod:`kvoffload.config.keys` reads it from here); a field without one is
    a required key. ``layout``, ``world_size`` and ``kv_role`` are not keys:
    the engine hands them to ``build_offloading_config``.
    """

    #: The KV cache groups this configuration was validated against.
    layout: KVLayout
    #: Host-memory budget across all workers, in bytes.
    cpu_bytes_to_use: int
    #: Engine blocks per chunk, the same count in every group.
    blocks_per_chunk: int = 1
    #: Registry name of the index's eviction policy.
    eviction_policy: str = DEFAULT_POLICY
    #: Sightings of a chunk before it is offloaded (1: first sight).
    store_threshold: int = 1
    #: Offload only chunks wholly inside the prompt.
    offload_prompt_only: bool = False
    #: What chunk keys are hashed from: "auto", "tokens" or "engine" (vLLM's block hashes).
    key_source: str = "auto"
    #: How the worker moves pages on CUDA: "off", "auto" or "always" (the Triton kernel).
    transfer_kernel: str = "off"
    #: When CPU-tier hits load: "auto", "always" or "never" (one step later).
    load_in_step: str = "auto"
    #: Most of the CPU tier's chunks one tenant (cache salt) may hold; None: no limit.
    tenant_cpu_share: float | None = None
    #: Most of the CPU tier held for the chunks of queued requests (0: none held).
    queued_cpu_share: float = 0.25
    #: Read a waiting request's lower-tier chunks into the CPU tier while it waits.
    fetch_while_queued: bool = False
    #: Most of the CPU tier held for the ranges clients' retention hints keep (0: none).
    retention_cpu_share: float = 0.5
    #: Tokens between the hit points kept besides each request's ends (0: none; 1: all).
    retention_interval: int = 16384
    #: Directory of the disk tier, or None for no disk tier.
    disk_path: str | None = None
    #: Byte budget of everything under ``disk_path``, shared by every process and rank on it
    #: (0, outside the key's range, when there is no disk tier).
    disk_bytes_to_use: int = 0
    #: Workers sharing ``cpu_bytes_to_use`` and ``disk_bytes_to_use`` (tensor-parallel ranks).
    world_size: int = 1
    #: The remote tier's canonical URL (no secret in it), or None for none.
    remote_url: str | None = None
    #: Name of the environment variable holding the remote server's password.
    remote_password_env: str | None = None
    #: Timeout of each remote call, and the longest wait between reconnection attempts.
    remote_timeout_ms: int = 100
    remote_retry_ms: int = 10000
    #: Bytes of stores the remote tier's write-behind queue holds before it drops stores.
    remote_queue_bytes: int = 256 << 20
    #: vLLM's ``kv_role`` (not a key: the engine hands it over).
    kv_role: KVRole = KVRole.BOTH
    #: With ``kv_role`` ``kv_consumer``: store too, not only load.
    consumer_write_back: bool = False
    #: With a split ``kv_role``: how long a producer's hand-off marks last, and how long a
    #: consumer waits for marked chunks (:mod:`kvoffload.tiers.handoff`); 0: neither.
    handoff_wait_ms: int = 10_000

    @property
    def loads(self) -> bool:
        """Whether lookups may hit (a ``kv_producer`` only stores)."""
        return self.kv_role.loads

    @property
    def stores(self) -> bool:
        """Whether what the engine computes is stored (a ``kv_consumer`` only with
        ``consumer_write_back``)."""
        return self.kv_role is not KVRole.CONSUMER or self.consumer_write_back

    @property
    def announces_stores(self) -> bool:
        """Whether this engine marks the chunks it is storing, for consumers (a producer)."""
        return self.kv_role is KVRole.PRODUCER and self.handoff_wait_ms > 0

    @property
    def awaits_handoffs(self) -> bool:
        """Whether a lookup waits for chunks producers marked (a consumer)."""
        return self.kv_role is KVRole.CONSUMER and self.handoff_wait_ms > 0

    @property
    def tokens_per_block(self) -> tuple[int, ...]:
        return self.layout.tokens_per_block

    @property
    def tokens_per_chunk(self) -> tuple[int, ...]:
        """Token span of one chunk, per group: it differs between groups."""
        return tuple(t * self.blocks_per_chunk for t in self.tokens_per_block)

    @property
    def chunk_bytes(self) -> tuple[int, ...]:
        """Bytes of one chunk per group: page_bytes * layers * blocks_per_chunk."""
        return tuple(g.chunk_bytes(self.blocks_per_chunk) for g in self.layout.groups)

    @property
    def max_chunk_bytes(self) -> int:
        """Slot size of the CPU tier: every slot can hold a chunk of any group."""
        return max(self.chunk_bytes)

    @property
    def hit_alignment(self) -> int:
        """Hits land on multiples of this many tokens: a chunk boundary of every group."""
        return math.lcm(*self.tokens_per_chunk)

    @property
    def retention_step(self) -> int:
        """Tokens between periodic hit points: ``retention_interval`` rounded up to a hit
        boundary, 0 for none."""
        interval, align = self.retention_interval, self.hit_alignment
        return -(-interval // align) * align

    @property
    def copies(self) -> int:
        """Copies of a chunk the tiers hold: one for a layout every tensor-parallel rank
        holds alike (``KVLayout.replicated``: an MLA model), else one shard per rank."""
        return 1 if self.layout.replicated else self.world_size

    @property
    def cpu_bytes_per_worker(self) -> int:
        """Bytes of the CPU tier each rank's chunks take: the whole budget for a replicated
        layout (every rank reads the one copy), else the rank's share of it."""
        return self.cpu_bytes_to_use // self.copies

    @property
    def num_cpu_chunks(self) -> int:
        """Slots of the CPU tier: chunks it holds, whatever the number of ranks."""
        return self.cpu_bytes_per_worker // self.max_chunk_bytes

    @property
    def num_disk_chunks(self) -> int:
        """Chunks of the largest group the disk budget holds, each as one file per copy (a
        lower bound on what fits: the budget is the directory's, which all ranks share)."""
        return self.disk_bytes_to_use // (disk_footprint(self.max_chunk_bytes) * self.copies)

    def __str__(self) -> str:
        rows = [("group", "kind", "layers", "tokens/block", "tokens/chunk", "bytes/chunk")]
        for i, (group, span, size) in enumerate(
            zip(self.layout.groups, self.tokens_per_chunk, self.chunk_bytes, strict=True)
        ):
            rows.append(
                (
                    str(i),
                    group.kind,
                    str(group.num_layers),
                    str(group.tokens_per_block),
                    str(span),
                    format_bytes(size),
                )
            )
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        table = [
            "  ".join(
                cell.rjust(w) if c else cell.ljust(w)
                for c, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
            for row in rows
        ]
        table.insert(1, "  ".join("-" * w for w in widths))
        disk = (
            f"{self.disk_path} ({format_bytes(self.disk_bytes_to_use)} shared by every "
            f"process and rank on it: {self.num_disk_chunks} chunks)"
            if self.disk_path
            else "off"
        )
        settings = [
            ("blocks_per_chunk", str(self.blocks_per_chunk)),
            ("cpu_bytes_to_use", self._cpu_text()),
            ("eviction_policy", self.eviction_policy),
            ("store_threshold", str(self.store_threshold)),
            ("offload_prompt_only", str(self.offload_prompt_only).lower()),
            ("key_source", self.key_source),
            ("transfer_kernel", self.transfer_kernel),
            ("load_in_step", self.load_in_step),
            (
                "tenant_cpu_share",
                "off"
                if self.tenant_cpu_share is None
                else f"{self.tenant_cpu_share:g} of the CPU tier per tenant",
            ),
            ("retention_interval", self._retention_text()),
            ("disk tier", disk),
            ("remote tier", self._remote_text()),
        ]
        summary = [f"{name:<20} {value}" for name, value in settings]
        return "\n".join([*table, "", *summary])

    def _cpu_text(self) -> str:
        text = (
            f"{format_bytes(self.cpu_bytes_to_use)} across {self.world_size} worker(s): "
            f"{self.num_cpu_chunks} chunks per worker"
        )
        if self.world_size == 1:
            return text
        if self.copies == 1:
            return f"{text} (replicated groups: one copy, stored once, loaded by every rank)"
        return f"{text} (sharded groups: each rank holds its shard of every chunk)"

    def _retention_text(self) -> str:
        if not any(g.reuse is not Reuse.PREFIX for g in self.layout.groups):
            return f"{self.retention_interval} (no window or state group: every chunk is kept)"
        if self.retention_step == 0:
            return "0: window chunks and states at each request's ends only"
        return (
            f"{self.retention_interval}: window chunks and states at each request's ends "
            f"and every {self.retention_step} tokens (hits land on multiples of "
            f"{self.hit_alignment})"
        )

    def _remote_text(self) -> str:
        if self.remote_url is None:
            return "off"
        password = (
            f", password from ${self.remote_password_env}" if self.remote_password_env else ""
        )
        return (
            f"{self.remote_url} (timeout {self.remote_timeout_ms} ms, write-behind queue "
            f"{format_bytes(self.remote_queue_bytes)}{password})"
        )
