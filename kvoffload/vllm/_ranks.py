"""A worker's offload engine under tensor parallelism: one CPU tier per engine, shared by its ranks.

With ``tensor_parallel_size`` > 1 vLLM runs one worker per rank, each in its
own process. Each builds its :class:`~kvoffload.engine.OffloadEngine` here:

* **The CPU tier** is one shared-memory region of ``cpu_bytes_to_use``
  (:mod:`kvoffload.tiers.shared`), vLLM's budget per engine: rank 0 creates
  it (after removing what crashed engines left), tells the others its name
  over vLLM's tensor-parallel group, every rank maps it, and rank 0 unlinks
  the name once all have (nothing is left under ``/dev/shm``, even after a
  crash). Where every group is replicated (``KVLayout.replicated``: an MLA
  model) all ranks view the whole region: the index's slot ``s`` is one slot
  that every rank fills with the same bytes and loads from, so the region
  holds ``cpu_bytes_to_use`` of distinct chunks. Where groups are sharded,
  each rank views its own ``1/world_size`` of it, its shard of every slot.
* **The lower tiers** of a replicated layout are one namespace for all ranks
  (:meth:`~kvoffload.vllm._startup.EngineSetup.namespace`); the ranks write
  its chunks in turns (:class:`~kvoffload.tiers.from_config.TakingTurns`), so
  each chunk is written once, and all read them.

At ``tensor_parallel_size`` 1 the engine is built as before, with a private slab.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tp_group

from kvoffload.config.values import format_bytes
from kvoffload.engine import OffloadEngine
from kvoffload.errors import ConfigError
from kvoffload.tiers.cpu import CPUSlab, slab_bytes
from kvoffload.tiers.from_config import lower_tiers
from kvoffload.tiers.shared import SharedRegion
from kvoffload.transfer import KVTransfer

if TYPE_CHECKING:
    from kvoffload.config import OffloadConfig

__all__ = ["shared_slab", "tp_rank", "worker_engine"]

logger = logging.getLogger("kvoffload")


def tp_rank(world_size: int) -> int:
    """This worker's tensor-parallel rank (0 without tensor parallelism)."""
    return get_tensor_model_parallel_rank() if world_size > 1 else 0


def worker_engine(
    config: OffloadConfig, kv_caches: Mapping[str, torch.Tensor], namespace: bytes, rank: int
) -> OffloadEngine:
    """Rank ``rank``'s engine over ``kv_caches``; see the module docstring."""
    if config.world_size == 1:
        return OffloadEngine.from_config(config, kv_caches, namespace)
    transfer = KVTransfer(
        config.layout, kv_caches, config.blocks_per_chunk, kernel=config.transfer_kernel
    )
    cpu = shared_slab(config, rank, pin=transfer.is_cuda)
    writers = config.world_size if config.copies == 1 else 1  # one namespace: turns
    lower = lower_tiers(config, namespace, rank=rank, ranks=writers)
    return OffloadEngine.create(transfer, cpu, lower)


def shared_slab(config: OffloadConfig, rank: int, *, pin: bool) -> CPUSlab:
    """Rank ``rank``'s view of the engine's shared CPU tier (every rank calls this at once)."""
    slots, slot_bytes = config.num_cpu_chunks, config.max_chunk_bytes
    part = slab_bytes(slots, slot_bytes)
    region = _shared_region(part * config.copies, rank)
    start = 0 if config.copies == 1 else rank * part
    if pin:
        region.pin(start, part)
    logger.info(
        "kvoffload: rank %d maps the CPU tier's shared memory %s of %d bytes (%s) for %d "
        "ranks, %s at offset %d",
        rank,
        region.name,
        region.nbytes,
        format_bytes(region.nbytes),
        config.world_size,
        "all of it (replicated groups: one copy)"
        if config.copies == 1
        else f"its shard of {part} bytes",
        start,
    )
    slab = CPUSlab(slots, slot_bytes, pin_memory=pin, buffer=region.tensor[start : start + part])
    slab.ranks = config.world_size if config.copies == 1 else 1
    return slab


def _shared_region(nbytes: int, rank: int) -> SharedRegion:
    """Create (rank 0) or map (the others) the region, then unlink its name once all mapped.

    Every rank takes part in both collectives, a failing one too, so that no
    rank waits forever for another's failure: rank 0's ``ConfigError``
    reaches every rank as its own.
    """
    group = get_tp_group()
    region, error = None, None
    if rank == 0:
        try:
            region = SharedRegion.create(nbytes)
        except ConfigError as exc:
            error = str(exc)
    path, error = group.broadcast_object(
        (None if region is None else str(region.path), error), src=0
    )
    if region is None and error is None:
        try:
            region = SharedRegion.attach(path, nbytes)
        except ConfigError as exc:
            error = str(exc)
    group.barrier()  # every rank has mapped it (or failed): the name can go
    if region is not None and region.owner:
        region.unlink()
    if error is not None or region is None:
        raise ConfigError(error or "the CPU tier's shared memory was not created")
    return region
