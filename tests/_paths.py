"""The transfer paths every round-trip test runs on: host direct, host staged, and CUDA.

``cpu-staged`` runs the CUDA path's staging code (:mod:`kvoffload.transfer._staged`)
on host tensors, so its bookkeeping is checked on machines without a GPU; the
``cuda`` paths run only where torch sees one (marker ``cuda``) and skip cleanly
elsewhere. ``cuda-direct`` is the unstaged reference ``benchmarks/gpu_check.py``
measures the staged path against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pytest
import torch

from kvoffload.config.layout import KVLayout
from kvoffload.transfer import KVTransfer

HAS_CUDA = torch.cuda.is_available()
needs_cuda = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]


@dataclass(frozen=True)
class TransferPath:
    device: str
    staged: bool
    #: ``KVTransfer``'s ``kernel``: "off" (torch copies) or "always" (the Triton kernel).
    kernel: str = "off"

    def transfer(
        self,
        layout: KVLayout,
        kv: Mapping[str, torch.Tensor],
        bpc: int,
        **kwargs: int,
    ) -> KVTransfer:
        return KVTransfer(layout, kv, bpc, staged=self.staged, kernel=self.kernel, **kwargs)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A zeroed chunk buffer, pinned where the engine tensors live on a GPU."""
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=self.device == "cuda")


PATHS = [
    pytest.param(TransferPath("cpu", False), id="cpu"),
    pytest.param(TransferPath("cpu", True), id="cpu-staged"),
    pytest.param(TransferPath("cuda", True), id="cuda", marks=needs_cuda),
    pytest.param(TransferPath("cuda", False), id="cuda-direct", marks=needs_cuda),
]


# The Triton kernel path (``kernel="always"``). On host tensors it would run in Triton's
# interpreter, slowly, so there it runs only in the kernel's own tests
# (``tests/test_transfer_kernel*.py``, against the torch paths); on a GPU every test of
# ``PATHS`` runs it.
PATHS.append(
    pytest.param(TransferPath("cuda", True, kernel="always"), id="cuda-kernel", marks=needs_cuda)
)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, to compare KV bit for bit whatever its dtype."""
    return t.contiguous().view(torch.uint8)
