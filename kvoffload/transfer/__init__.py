"""Gather and scatter between engine KV tensors and chunk buffers; see :mod:`.copy`."""

from kvoffload.transfer._kernel import KernelUse
from kvoffload.transfer.copy import KVTransfer
from kvoffload.transfer.synthetic import allocate_kv_caches, fill_blocks
from kvoffload.transfer.views import KVSplit, LayerPages, layer_pages, register_layers

__all__ = [
    "KVSplit",
    "KVTransfer",
    "KernelUse",
    "LayerPages",
    "allocate_kv_caches",
    "fill_blocks",
    "layer_pages",
    "register_layers",
]
