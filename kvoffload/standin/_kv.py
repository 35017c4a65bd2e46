"""The stand-in engine's KV: what a block must hold, written by its "forward", checked after loads.

A block's KV is a function of its group, layer and block hash (the hash of
every token up to the block's end), so a block that a load filled is right
exactly when it equals that function: no copy of what was stored is kept.
Any swapped, shifted, stale or torn page differs from it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import torch

from kvoffload.config.layout import KVLayout
from kvoffload.errors import ConfigError

__all__ = ["KVPages", "expected_page"]

_TILE_WORDS = 512


def expected_page(block_hash: bytes, layer: int, nbytes: int) -> torch.Tensor:
    """The bytes of one layer's page of the block ``block_hash``: a keyed tile plus positions.

    A vectorised add per word instead of a random generator per byte keeps
    the demo's verification cheap.
    """
    digest = hashlib.blake2b(block_hash + layer.to_bytes(4, "little"), digest_size=8).digest()
    generator = np.random.Generator(np.random.PCG64(int.from_bytes(digest, "little")))
    tile = np.frombuffer(generator.bytes(8 * _TILE_WORDS), "<u8")
    words = -(-nbytes // 8)
    data = np.resize(tile, words) + np.arange(words, dtype=np.uint64)
    return torch.from_numpy(data.view(np.uint8)[:nbytes].copy())


class KVPages:
    """Byte views of the engine's KV tensors, per group and layer: ``[num_blocks, page_bytes]``."""

    def __init__(self, layout: KVLayout, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.layout = layout
        self.pages = [
            [self._bytes(kv_caches[name]) for name in group.layer_names] for group in layout.groups
        ]

    @staticmethod
    def _bytes(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 4 and tensor.shape[1:3] == (1, 1) and tensor.stride(-1) == 1:
            # A recurrent state as vLLM hands it over: its bytes only, the padding untouched.
            return tensor.view(torch.uint8)[:, 0, 0]
        if not tensor.is_contiguous():
            raise ConfigError(
                "the stand-in writes pages of block-first (contiguous) KV tensors only"
            )
        return tensor.view(torch.uint8).reshape(tensor.shape[0], -1)

    def write(self, group: int, block: int, block_hash: bytes) -> None:
        """The forward pass: the KV of ``block_hash`` into ``block`` of every layer of ``group``."""
        for layer, pages in enumerate(self.pages[group]):
            pages[block].copy_(expected_page(block_hash, layer, pages.shape[1]))

    def copy(self, group: int, source: int, target: int) -> None:
        """``source`` 's pages into ``target`` in every layer of ``group`` (an engine-side copy)."""
        for pages in self.pages[group]:
            pages[target].copy_(pages[source])

    def holds(self, group: int, block: int, block_hash: bytes) -> bool:
        """Whether ``block`` holds exactly the KV of ``block_hash`` in every layer of ``group``."""
        return all(
            torch.equal(
                pages[block], expected_page(block_hash, layer, pages.shape[1]).to(pages.device)
            )
            for layer, pages in enumerate(self.pages[group])
        )
