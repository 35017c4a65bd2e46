"""The worker's loads in the step: this step's, from before its forward pass to its poll.

A load in the step (a CPU-tier hit served in the step that asked for it,
invariant 8) starts before the forward pass and copies while it runs,
layer by layer (:mod:`kvoffload.engine._layered`). It ends before the step's
stores start, so that they know whether it failed: the step computed on top
of its blocks, so what the step wrote is not stored, and is recomputed once
vLLM learns of the failure. Its results then wait for the step's poll with
the pool jobs'.
"""

from __future__ import annotations

from enum import Enum

from kvoffload.engine import CopyMode, LayeredLoad, OffloadEngine
from kvoffload.messages import JobReport, JobResult, TransferOrder

__all__ = ["ForwardPass", "StepLoads"]


class ForwardPass(Enum):
    """How the forward pass that reads this step's loads in the step runs."""

    #: Each attention layer waits for its own KV first (``OffloadWorker.wait_layer``), so the
    #: loads copy in the copy mode measured for the device, later layers while earlier compute.
    LAYER_BY_LAYER = "layer_by_layer"
    #: A CUDA graph replays the whole pass and no layer waits: every copy ends before it.
    FULL_GRAPH = "full_graph"

    def copies(self, measured: CopyMode) -> CopyMode:
        """How this pass's loads copy, where ``measured`` is the device's copy mode."""
        return CopyMode.BEFORE if self is ForwardPass.FULL_GRAPH else measured


class StepLoads:
    """This step's loads in the step on ``engine``: copying, then their results until taken."""

    def __init__(self, engine: OffloadEngine) -> None:
        self._engine = engine
        #: A load in the step of this step failed, or never ran: the step's stores are void.
        self.failed = False
        self._copying: tuple[list[TransferOrder], LayeredLoad] | None = None
        self._results: list[tuple[TransferOrder, JobResult]] = []

    @property
    def copying(self) -> bool:
        return self._copying is not None

    def new_step(self) -> None:
        """End what a step that raised before its poll left copying, and forget its failure."""
        self.end()
        self.failed = False

    def start(self, orders: list[TransferOrder], copies: CopyMode) -> None:
        """Verify the orders' chunks and start copying them; raises if the engine refuses them."""
        spans, running = [o.spans for o in orders], [o.running_states for o in orders]
        self._copying = (orders, self._engine.load_by_layer(spans, copies, running))

    def never_ran(self, order: TransferOrder) -> None:
        """``order`` fails without running: if it is a load in the step, the step failed."""
        self.failed |= order.in_step

    def wait_layer(self, name: str) -> None:
        if self._copying is not None:
            self._copying[1].wait_layer(name)

    def end(self) -> None:
        """Wait for the copies to finish, and keep the results."""
        if self._copying is None:
            return
        orders, load = self._copying
        self._copying = None
        for order, result in zip(orders, load.join(), strict=True):
            self._results.append((order, result))
            self.failed |= not JobReport.of(order, result).ok

    def take_results(self) -> list[tuple[TransferOrder, JobResult]]:
        results, self._results = self._results, []
        return results
