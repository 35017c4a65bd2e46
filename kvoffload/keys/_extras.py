"""What a request's KV depends on besides its token ids, as :mod:`kvoffload.keys` hashes it.

Re-exported by :mod:`kvoffload.keys`, which explains where each part goes in
the chain. Every field is content (a salt string, a digest of weights, a
hash of media, the embeddings' bytes), never a per-process id, so keys built
from it are equal in every process and on every machine.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

from kvoffload._checks import checked_int
from kvoffload.errors import ConfigError

__all__ = ["KEY_BYTES", "KeyExtras", "MMItem", "PromptEmbeds", "canonical"]

#: Length of every chunk key and namespace, in bytes (128 bits).
KEY_BYTES = 16

_REQUEST_TAG = b"kvoffload/request-extras/v1\x00"
_CHUNK_TAG = b"kvoffload/chunk-extras/v1\x00"


def canonical(document: object) -> bytes:
    """One byte string per value: sorted keys, no spaces, ASCII (what both tags hash)."""
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class MMItem:
    """One multimodal input: its content hash and the token positions it occupies.

    ``identifier`` must name the item's content (vLLM's ``mm_feature.identifier``
    is a hash of the media and its processor settings), never a per-process id.
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str) or not self.identifier:
            raise ConfigError(f"MMItem.identifier must be a non-empty str, got {self.identifier!r}")
        checked_int("MMItem.offset", self.offset, minimum=0)
        checked_int("MMItem.length", self.length)


@dataclass(frozen=True, slots=True)
class PromptEmbeds:
    """A prompt's embeddings as raw bytes: ``rows`` positions of equal size, from position 0.

    ``is_token`` (one byte per row, 1 or 0) marks rows that are token ids in a
    mixed prompt, or is ``None`` when every row is an embedding.
    """

    data: bytes
    rows: int
    dtype: str
    is_token: bytes | None = None

    def __post_init__(self) -> None:
        checked_int("PromptEmbeds.rows", self.rows)
        if not isinstance(self.data, bytes) or len(self.data) % self.rows:
            raise ConfigError(
                f"PromptEmbeds.data must be bytes holding {self.rows} rows of equal size, "
                f"got {type(self.data).__name__} of length {len(self.data)}"
            )
        if self.is_token is not None and len(self.is_token) != self.rows:
            raise ConfigError(
                f"PromptEmbeds.is_token must have one byte per row ({self.rows}), "
                f"got {len(self.is_token)}"
            )

    def digest(self, start: int, stop: int) -> str:
        """A digest of rows ``[start, stop)`` (clipped to the rows there are), with the dtype."""
        row = len(self.data) // self.rows
        stop = min(stop, self.rows)
        hasher = hashlib.blake2b(self.dtype.encode() + struct.pack("<QQ", row, stop - start))
        hasher.update(memoryview(self.data)[start * row : stop * row])
        if self.is_token is not None:
            hasher.update(self.is_token[start:stop])
        return hasher.hexdigest()[: 2 * KEY_BYTES]


@dataclass(frozen=True, slots=True)
class KeyExtras:
    """What a request's KV depends on besides its token ids (see the module docstring).

    ``salt`` is the tenant's cache salt (``""`` means none, as in vLLM);
    ``adapter`` a digest that identifies a LoRA adapter's weights; ``mm`` the
    multimodal items, in any order; ``embeds`` the prompt embeddings.
    """

    salt: str | None = None
    adapter: bytes | None = None
    mm: tuple[MMItem, ...] = ()
    embeds: PromptEmbeds | None = None

    def __post_init__(self) -> None:
        if self.salt is not None and not isinstance(self.salt, str):
            raise ConfigError(f"KeyExtras.salt must be a str or None, got {self.salt!r}")
        if self.salt == "":
            object.__setattr__(self, "salt", None)
        if self.adapter is not None and (not isinstance(self.adapter, bytes) or not self.adapter):
            raise ConfigError(f"KeyExtras.adapter must be non-empty bytes, got {self.adapter!r}")
        items = tuple(self.mm)
        if not all(isinstance(item, MMItem) for item in items):
            raise ConfigError(f"KeyExtras.mm must hold MMItem records, got {items!r}")
        object.__setattr__(self, "mm", tuple(sorted(items, key=lambda i: i.offset)))
        if self.embeds is not None and not isinstance(self.embeds, PromptEmbeds):
            raise ConfigError(f"KeyExtras.embeds must be PromptEmbeds, got {self.embeds!r}")

    @property
    def tenant(self) -> str | None:
        """Whose share of the CPU tier the request's chunks count against: its salt."""
        return self.salt

    def request_tag(self) -> bytes | None:
        """What every chunk of the request depends on (salt, adapter), or None."""
        if self.salt is None and self.adapter is None:
            return None
        adapter = None if self.adapter is None else self.adapter.hex()
        return _REQUEST_TAG + canonical({"adapter": adapter, "salt": self.salt})

    @property
    def per_chunk(self) -> bool:
        """Whether some chunks carry inputs of their own (multimodal items, embeddings)."""
        return bool(self.mm) or self.embeds is not None

    def chunk_tag(self, start: int, stop: int) -> bytes:
        """What tokens ``[start, stop)`` depend on besides their ids; empty if nothing.

        A multimodal item counts in every chunk it overlaps, with its offset
        relative to the chunk's start (negative in the chunks after the one
        where it begins), as vLLM's block hashes count it.
        """
        mm = [
            [item.identifier, item.offset - start, item.length]
            for item in self.mm
            if item.offset < stop and start < item.offset + item.length
        ]
        embeds = self.embeds
        digest = embeds.digest(start, stop) if embeds is not None and start < embeds.rows else None
        if not mm and digest is None:
            return b""
        return _CHUNK_TAG + canonical({"embeds": digest, "mm": mm})
