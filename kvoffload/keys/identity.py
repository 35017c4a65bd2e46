"""How an engine names its chunks, in a form another engine can compare: its key identity.

A prefill engine and a decode engine share chunks only if they name them alike: the
same namespace (model, dtype, the KV layout of each tensor-parallel rank), the same
tokens per chunk, and the same key source (token ids, or the engine's block hashes
under the same algorithm, block size and seed). Any difference makes every lookup of
one miss what the other stored, silently: the chunks are there under other names.
Each split-role engine therefore leaves its identity in the shared tier
(:mod:`kvoffload.tiers.cards`) and compares it with those of the other role, naming
the setting that differs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from dataclasses import dataclass

__all__ = ["KeyIdentity"]


@dataclass(frozen=True, slots=True)
class KeyIdentity:
    """What names an engine's chunks, and what it takes to match it; JSON both ways."""

    #: vLLM's ``kv_role`` of the engine.
    role: str
    model: str
    dtype: str
    #: Tensor-parallel ranks, and whether each holds a shard of every chunk of its own
    #: (KV heads split) rather than one copy for all (an MLA model's latents).
    world_size: int
    sharded: bool
    #: One line per KV cache group: kind, tokens per block, bytes per page.
    groups: tuple[str, ...]
    tokens_per_chunk: tuple[int, ...]
    #: ``tokens``, or the engine's hashes: algorithm, tokens per hash, seed.
    key_source: str
    #: The namespaces (hex fingerprints) the ranks store under.
    namespaces: tuple[str, ...]
    #: Where and when it was written: ``host pid``, seconds since the epoch.
    where: str = ""
    written_at: float = 0.0

    def stamped(self, now: float) -> KeyIdentity:
        """This identity as written now, by this process on this host."""
        where = f"{socket.gethostname()} pid {os.getpid()}"
        return dataclasses.replace(self, where=where, written_at=now)

    def same_keys(self, other: KeyIdentity) -> bool:
        """Whether the two name every chunk alike."""
        return (self.namespaces, self.tokens_per_chunk, self.key_source) == (
            other.namespaces,
            other.tokens_per_chunk,
            other.key_source,
        )

    def differences(self, other: KeyIdentity) -> list[str]:
        """What makes ``other`` name chunks otherwise, each with the setting to change."""
        out = []
        if self.model != other.model:
            out.append(
                f"model {other.model!r} where this engine has {self.model!r} (the model's path "
                "or name is in every key: start both from the same one)"
            )
        if self.dtype != other.dtype:
            out.append(f"dtype {other.dtype} where this engine has {self.dtype}")
        if self.world_size != other.world_size and (self.sharded or other.sharded):
            out.append(
                f"tensor_parallel_size {other.world_size} where this engine has "
                f"{self.world_size}: this model's KV is split across ranks, each rank's shard "
                "a chunk of its own, so prefill and decode must run the same size (an MLA "
                "model, whose KV every rank holds whole, can mix sizes)"
            )
        elif self.groups != other.groups:
            out.append(
                f"KV cache groups {list(other.groups)} where this engine has "
                f"{list(self.groups)} (block_size or kv_cache_dtype)"
            )
        if self.tokens_per_chunk != other.tokens_per_chunk:
            out.append(
                f"{list(other.tokens_per_chunk)} tokens per chunk where this engine has "
                f"{list(self.tokens_per_chunk)} (kvoffload's blocks_per_chunk or block_size)"
            )
        if self.key_source != other.key_source:
            out.append(
                f"keys from {other.key_source} where this engine's are from {self.key_source} "
                "(key_source, vLLM's prefix_caching_hash_algo, or PYTHONHASHSEED)"
            )
        if not out and self.namespaces != other.namespaces:
            out.append("another KV layout (the layers' names or page format differ)")
        return out

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> KeyIdentity | None:
        """The identity in ``text``; ``None`` for anything else (another version's card)."""
        try:
            fields = json.loads(text)
            for name in ("groups", "tokens_per_chunk", "namespaces"):
                fields[name] = tuple(fields[name])
            return cls(**fields)
        except (ValueError, TypeError, KeyError):
            return None
