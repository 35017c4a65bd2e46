"""Gather engine KV blocks into chunk buffers and scatter them back, per group.

Chunk byte layout (the one definition; every tier stores these bytes as is)::

    chunk of group g = layer 0 | layer 1 | ... | layer L-1      (layer order of the group)
    layer l          = block 0 | block 1 | ... | block bpc-1    (position inside the chunk)
    block            = page_bytes of that layer's block, as the engine holds it
                       (its padding included); for a [2, num_blocks, ...]
                       tensor: K half then V half

so one block's page is contiguous in the chunk whatever the backend, and a
chunk written from a block-first tensor reads back bit-exact into a K/V-first
one with the same inner page layout. Layer-major order makes the bytes of one
layer inside one chunk a single dense run, so the hot path is **one copy per
layer per chunk** when the chunk's engine blocks are consecutive (a narrow
``copy_``) and one ``index_select(out=)`` / ``index_copy_`` per layer per chunk
otherwise: never a Python loop per block, never a staging copy on the CPU.

A :class:`BlockSpan` names the engine blocks of one group and where the first
of them sits inside its chunk (``first_offset``), so a load may begin inside a
chunk; positions ``first_offset + i`` map block ``i`` to chunk
``pos // bpc``, slot ``pos % bpc``.

CUDA engine tensors move through a staging buffer in device memory that
holds the chunks in their byte order (:mod:`._staged`): one kernel per layer
and one dense DMA per chunk, whatever the backend's tensor layout. Each
calling thread issues its copies on a stream of its own (so a store and a
load overlap on the GPU's copy engines) and waits for that stream alone: the
engine's streams are never synchronised. A store passes the event recorded on
the engine's stream when it was submitted (``after``), so the copy starts
only once the forward pass has written the KV.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvoffload._checks import checked_int
from kvoffload.config.layout import KVLayout
from kvoffload.errors import TransferError
from kvoffload.messages import BlockSpan
from kvoffload.transfer._calibrate import PathChoice, calibrate
from kvoffload.transfer._kernel import KernelCopier, KernelUse, kernel_use
from kvoffload.transfer._moves import move_span
from kvoffload.transfer._staged import DEFAULT_MAX_STAGING_BYTES, staged_copy
from kvoffload.transfer.views import KVSplit, LayerPages, register_layers

__all__ = ["KVTransfer"]

logger = logging.getLogger("kvoffload")


class KVTransfer:
    """Moves whole pages between registered engine tensors and chunk buffers.

    ``kv_caches`` is what vLLM's ``register_kv_caches`` receives (layer name
    -> tensor); see :mod:`kvoffload.transfer.views` for the layouts detected.
    Chunk buffers are 1-D ``uint8`` CPU tensors of at least
    ``chunk_bytes(group)`` bytes (a CPU tier slot, a staging buffer); only the
    first ``chunk_bytes(group)`` are used. Methods are thread-safe for
    disjoint chunk buffers and block ids: they only read shared state.

    ``staged`` picks the copy path: ``None`` (the default) stages through
    device memory on CUDA and copies directly on host tensors, where that is
    fastest; ``True`` runs the staged path on host tensors too, which is how
    the tests check the CUDA path's bookkeeping on machines without a GPU.
    ``max_staging_bytes`` bounds the device memory one call stages at a time.
    ``kernel`` (:class:`~kvoffload.transfer.KernelUse`, or its name) turns on
    the Triton kernel path (:mod:`._kernel`): ``"off"`` (the default: it has
    not run on a GPU yet), ``"always"``, or ``"auto"`` (on CUDA, kernel or
    staged DMA as a calibration at start measured faster; :mod:`._calibrate`).
    """

    def __init__(
        self,
        layout: KVLayout,
        kv_caches: Mapping[str, torch.Tensor],
        blocks_per_chunk: int,
        split: KVSplit | None = None,
        *,
        staged: bool | None = None,
        max_staging_bytes: int = DEFAULT_MAX_STAGING_BYTES,
        kernel: KernelUse | str = KernelUse.OFF,
    ) -> None:
        self.layout = layout
        self.blocks_per_chunk = checked_int(
            "blocks_per_chunk", blocks_per_chunk, error=TransferError
        )
        self.groups: tuple[tuple[LayerPages, ...], ...] = register_layers(layout, kv_caches, split)
        devices = {str(views[0].device) for views in self.groups}
        if len(devices) != 1:
            raise TransferError(f"KV caches span several devices {sorted(devices)}; use one")
        self.device = self.groups[0][0].device
        self._cuda = self.device.type == "cuda"
        self.staged = self._cuda if staged is None else staged
        self.max_staging_bytes = checked_int(
            "max_staging_bytes", max_staging_bytes, error=TransferError
        )
        self._streams = threading.local()  # one CUDA stream per calling thread
        self.kernel = kernel_use(kernel)
        self._kernel, self._choice = self._kernel_path()

    def _kernel_path(self) -> tuple[KernelCopier | None, PathChoice | None]:
        """The kernel copier ``kernel`` asks for, and on ``auto`` the calibrated choice."""
        use = self.kernel
        if use is KernelUse.OFF or (use is KernelUse.AUTO and not self._cuda):
            return None, None
        blocks = [self.chunk_blocks(g) for g in range(len(self.groups))]
        copier = KernelCopier(self.groups, blocks)
        if use is KernelUse.ALWAYS:
            return copier, None
        sizes = [self.chunk_bytes(g) for g in range(len(self.groups))]
        choice = calibrate(self.groups, blocks, sizes)
        logger.info(
            "kvoffload transfer on %s, kernel or DMA per call: %s",
            torch.cuda.get_device_name(self.device),
            choice.summary(),
        )
        return copier, choice

    @property
    def is_cuda(self) -> bool:
        return self._cuda

    def chunk_bytes(self, group: int) -> int:
        return self.layout.groups[group].chunk_bytes(self.blocks_per_chunk)

    def chunk_blocks(self, group: int) -> int:
        """Engine blocks one chunk of ``group`` holds (one for a state group)."""
        return self.layout.groups[group].chunk_blocks(self.blocks_per_chunk)

    def num_blocks(self, group: int) -> int:
        return self.groups[group][0].num_blocks

    def gather(
        self,
        group: int,
        span: BlockSpan,
        chunks: Sequence[torch.Tensor],
        after: torch.cuda.Event | None = None,
    ) -> None:
        """Copy the span's engine blocks into ``chunks`` (one buffer per chunk touched)."""
        self._run(group, span, chunks, to_chunks=True, after=after)

    def scatter(
        self,
        group: int,
        span: BlockSpan,
        chunks: Sequence[torch.Tensor],
        after: torch.cuda.Event | None = None,
        layer: int | None = None,
    ) -> None:
        """Copy ``chunks`` back into the span's engine blocks (after ``after``, on CUDA).

        ``layer`` (an index into the group's layers) copies that layer's pages
        only: a load in the step copies layer by layer, so the forward pass can
        start on the first layers while later ones are still copying.
        """
        self._run(group, span, chunks, to_chunks=False, after=after, layer=layer)

    def layer_index(self) -> dict[str, tuple[int, int]]:
        """Each registered layer's ``(group, index in the group)``, by layer name."""
        return {p.name: (g, i) for g, views in enumerate(self.groups) for i, p in enumerate(views)}

    # -- implementation ----------------------------------------------------------
    def _check(
        self, group: int, span: BlockSpan, chunks: Sequence[torch.Tensor]
    ) -> npt.NDArray[np.int64]:
        if not 0 <= group < len(self.groups):
            raise TransferError(f"group {group} is not in the layout (0..{len(self.groups) - 1})")
        bpc = self.chunk_blocks(group)
        if span.first_offset >= bpc:
            raise TransferError(
                f"first_offset {span.first_offset} must be < {bpc}, the group's blocks per chunk"
            )
        if not span.block_ids:  # a promotion's spans (NO_BLOCKS) never reach the engine
            raise TransferError(f"group {group}: a transfer needs at least one block id")
        ids = np.asarray(span.block_ids, dtype=np.int64)
        nb = self.num_blocks(group)
        if int(ids.max()) >= nb:
            raise TransferError(f"group {group}: block id {int(ids.max())} >= num_blocks {nb}")
        need, size = span.num_chunks(bpc), self.chunk_bytes(group)
        if len(chunks) != need:
            raise TransferError(f"group {group}: span touches {need} chunks, got {len(chunks)}")
        for buf in chunks:
            if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.device.type != "cpu":
                raise TransferError(
                    f"chunk buffers must be 1-D uint8 CPU tensors, got {buf.dtype} "
                    f"{tuple(buf.shape)} on {buf.device}"
                )
            if buf.numel() < size or buf.stride(0) != 1:
                raise TransferError(
                    f"group {group}: chunk buffer of {buf.numel()} bytes (stride "
                    f"{buf.stride(0)}) cannot hold a {size}-byte chunk"
                )
        return ids

    def _run(
        self,
        group: int,
        span: BlockSpan,
        chunks: Sequence[torch.Tensor],
        *,
        to_chunks: bool,
        after: torch.cuda.Event | None,
        layer: int | None = None,
    ) -> None:
        ids = self._check(group, span, chunks)
        pages = _Pages.of(self, group, chunks, layer)
        if not self._cuda:
            self._copy(pages, span, ids, to_chunks=to_chunks, after=None)
            return
        stream = self._stream()
        with torch.cuda.stream(stream):
            self._copy(pages, span, ids, to_chunks=to_chunks, after=after)
        # This thread's stream only: never the engine's. Device temporaries (staging,
        # indices) were allocated on this stream, so their memory is reused only after it.
        stream.synchronize()

    def _stream(self) -> torch.cuda.Stream:
        stream: torch.cuda.Stream | None = getattr(self._streams, "stream", None)
        if stream is None:
            stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            self._streams.stream = stream
        return stream

    def _copy(
        self,
        pages: _Pages,
        span: BlockSpan,
        ids: npt.NDArray[np.int64],
        *,
        to_chunks: bool,
        after: torch.cuda.Event | None,
    ) -> None:
        """The kernel, staged or direct path, on the current stream (waiting for ``after``)."""
        kernel, chunks, group = self._kernel, pages.chunks, pages.group
        if (
            kernel is not None
            and pages.whole  # the kernel moves every layer of a group in one launch
            and kernel.accepts(chunks)
            and (self._choice is None or self._choice.use_kernel(group, to_chunks, len(chunks)))
        ):
            if after is not None:
                torch.cuda.current_stream(self.device).wait_event(after)
            kernel.copy(group, span, ids, chunks, to_chunks=to_chunks)
            return
        if self.staged:
            staged_copy(
                pages.layers,
                span,
                ids,
                chunks,
                pages.bpc,
                pages.size,
                to_chunks=to_chunks,
                max_staging_bytes=self.max_staging_bytes,
                after=after,
            )
            return
        if after is not None:
            torch.cuda.current_stream(self.device).wait_event(after)
        bpc, size = pages.bpc, pages.size
        move_span(pages.layers, span, ids, chunks, bpc=bpc, size=size, to_chunks=to_chunks)


@dataclass(frozen=True, slots=True)
class _Pages:
    """What one copy moves: some of a group's layers, and where their bytes lie in each chunk.

    Every layer of the group (``whole``), or one layer: its bytes are one dense
    run of each chunk (chunks are layer-major), so the chunk buffers are
    narrowed to that run and the copy proceeds as for a group of one layer.
    """

    group: int
    layers: tuple[LayerPages, ...]
    chunks: Sequence[torch.Tensor]
    bpc: int
    size: int
    whole: bool

    @classmethod
    def of(
        cls, transfer: KVTransfer, group: int, chunks: Sequence[torch.Tensor], layer: int | None
    ) -> _Pages:
        layers, bpc = transfer.groups[group], transfer.chunk_blocks(group)
        if layer is None:
            return cls(group, layers, chunks, bpc, transfer.chunk_bytes(group), whole=True)
        if not 0 <= layer < len(layers):
            raise TransferError(f"group {group} has layers 0..{len(layers) - 1}, not {layer}")
        start = bpc * sum(p.page_bytes for p in layers[:layer])
        size = bpc * layers[layer].page_bytes
        narrowed = [buf.narrow(0, start, size) for buf in chunks]
        return cls(group, (layers[layer],), narrowed, bpc, size, whole=False)
