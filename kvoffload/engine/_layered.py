"""Loads in the step, copied layer by layer so the forward pass need not wait for all of them.

vLLM calls the connector's ``wait_for_layer_load(layer)`` just before each
attention layer reads its KV. A load in the step (a CPU-tier hit scheduled in
the step that asked for it) therefore need only have *that* layer's blocks in
place by then: the copies run in the model's layer order, and each layer's
wait ends when its own copies are done, so later layers copy while earlier
ones compute. How the copies run (:class:`CopyMode`):

* ``thread``: a copy thread of its own, layer after layer; a wait blocks until
  its layer is copied. On CUDA the thread's copies finish on its own stream
  before the layer is released, so the forward pass never enqueues a kernel
  ahead of the KV it reads.
* ``layer``: each wait copies the layers up to its own in the calling thread
  (no overlap, no thread).
* ``before``: every copy before the forward pass, as a load job does.

All of them first verify every chunk in its CPU slot, in ``start_load_kv``:
what fails there is never copied. A recurrent state is copied there too,
whatever the mode: vLLM's recurrent layers read their state without a wait.
It goes into its own block and into the block vLLM runs the request's state
in (``running_states``), which vLLM filled from the former before the load.
A copy that fails marks its run failed; its blocks are reported after the
forward pass like any failed load's, and vLLM recomputes them. A wait for a
layer the load does not know (a layer that reads another's KV, say) waits
for every layer.
"""

from __future__ import annotations

import functools
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from enum import Enum

import torch

from kvoffload.engine._book import JobBook
from kvoffload.engine._copier import ChunkCopier, Run
from kvoffload.engine._outcome import Outcome
from kvoffload.errors import ConfigError
from kvoffload.messages import ChunkSpan, JobKind, JobResult

__all__ = ["COPY_MODE_ENV", "CopyMode", "LayeredLoader", "LayeredLoad", "model_order"]

#: Environment variable that picks the copy mode (for measurements; the default is measured).
COPY_MODE_ENV = "KVOFFLOAD_IN_STEP_COPIES"


class CopyMode(Enum):
    """How a load in the step runs its copies (see the module docstring)."""

    THREAD = "thread"
    LAYER = "layer"
    BEFORE = "before"

    @classmethod
    def default(cls, cuda: bool) -> CopyMode:
        """The mode measured fastest on the device, unless ``KVOFFLOAD_IN_STEP_COPIES`` names one.

        On the CPU backend every layer's copies before the forward pass: on 2
        cores a copy thread competes with the forward pass's own threads
        (docs/benchmarks.md, "How a load in the step copies"). On CUDA a copy thread: the
        copies run on the copy engines while the GPU computes.
        """
        value = os.environ.get(COPY_MODE_ENV, "").strip().lower()
        if not value:
            return cls.THREAD if cuda else cls.BEFORE
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ConfigError(
                f"{COPY_MODE_ENV}={value!r} is not a copy mode; use one of {choices}, "
                f"or leave it unset for the measured default"
            ) from None


def model_order(names: Sequence[str]) -> list[str]:
    """Layer names in the model's order: vLLM's names carry the layer index (``layers.12.``).

    Names without one keep their place after those with one (a drafter's).
    """

    def index(pair: tuple[int, str]) -> tuple[int, int]:
        found = re.search(r"\.(\d+)\.", f".{pair[1]}.")
        return (int(found.group(1)) if found else 1 << 30, pair[0])

    return [name for _, name in sorted(enumerate(names), key=index)]


class LayeredLoader:
    """Starts the loads in the step, and holds what they all share.

    That is the copier and the job book (a load in the step is a job like any
    other: it takes the locks of its chunks and counts as pending), the model's
    layer order (worked out once, from the layer names), and the copy thread
    of :class:`CopyMode` ``thread`` (started by the first load that uses it).
    """

    def __init__(self, copier: ChunkCopier, book: JobBook) -> None:
        self.copier = copier
        self.book = book
        self._thread: ThreadPoolExecutor | None = None

    @functools.cached_property
    def layers(self) -> list[tuple[str, int, int]]:
        """``(name, group, index in the group)`` of every layer, in the model's order."""
        at = self.copier.transfer.layer_index()
        return [(name, *at[name]) for name in model_order(list(at))]

    def start(
        self,
        jobs: Sequence[tuple[ChunkSpan, ...]],
        after: torch.cuda.Event | None,
        mode: CopyMode,
        running_states: Sequence[Mapping[int, int]],
    ) -> LayeredLoad:
        """Verify ``jobs``' chunks and start copying them (see :class:`LayeredLoad`)."""
        self.book.begin(JobKind.LOAD, queued=False)
        try:
            return LayeredLoad(self, jobs, after, mode, running_states)
        except BaseException:
            self.book.end_unqueued()
            raise

    def copy_thread(self) -> ThreadPoolExecutor:
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvoffload-layers")
        return self._thread

    def close(self) -> None:
        """Let the copy thread finish what it was given."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)


class LayeredLoad:
    """The step's loads (one :class:`JobResult` each), copied layer by layer.

    Made by :meth:`LayeredLoader.start` in the thread that runs the forward
    pass; :meth:`join` there ends it (the job locks are taken and let go in
    that thread).
    """

    def __init__(
        self,
        loader: LayeredLoader,
        jobs: Sequence[tuple[ChunkSpan, ...]],
        after: torch.cuda.Event | None,
        mode: CopyMode,
        running_states: Sequence[Mapping[int, int]],
    ) -> None:
        copier, book = loader.copier, loader.book
        self._copier, self._book = copier, book
        self._after, self._start = after, time.perf_counter()
        self._ids = [book.new_id() for _ in jobs]
        self._outcomes = [Outcome() for _ in jobs]
        self._locks = book.locked([s for spans in jobs for s in spans])
        self._states = copier.transfer.layout.state_groups
        try:
            self._runs = [
                [run for span in spans for run in copier.verified_runs(span, outcome)]
                for spans, outcome in zip(jobs, self._outcomes, strict=True)
            ]
            self._copy_states(running_states or [{}] * len(jobs))
        except BaseException:  # a bug: the caller refuses the orders; the chunks go free
            self._locks.close()
            raise
        groups = {s.group for spans in jobs for s in spans} - self._states
        self._order = [layer for layer in loader.layers if layer[1] in groups]
        self._copied = [threading.Event() for _ in self._order]
        self._position = {name: i for i, (name, _, _) in enumerate(self._order)}
        self._next = 0
        self._lock = threading.Lock()
        self._future: Future[None] | None = None
        if mode is CopyMode.THREAD:
            self._future = loader.copy_thread().submit(self._advance, len(self._order))
        elif mode is CopyMode.BEFORE:
            self._scatter_whole()
            self._next = len(self._order)

    def wait_layer(self, name: str) -> None:
        """Return once ``name``'s blocks are in place (every layer's, for a name not loaded)."""
        upto = self._position.get(name, len(self._order) - 1) + 1
        if self._future is None:
            self._advance(upto)
        elif upto:
            self._copied[upto - 1].wait()

    def join(self) -> list[JobResult]:
        """Finish every copy, let the chunks go, and report each job."""
        if self._future is None:
            self._advance(len(self._order))
        else:
            self._future.result()
        self._locks.close()
        seconds = time.perf_counter() - self._start
        results = []
        for job_id, runs, outcome in zip(self._ids, self._runs, self._outcomes, strict=True):
            self._copier.settle(runs, outcome)
            results.append(outcome.result(job_id, JobKind.LOAD, seconds))
        self._book.end_unqueued()
        return results

    def _advance(self, upto: int) -> None:
        """Copy the layers before position ``upto`` not copied yet, in order."""
        with self._lock:
            try:
                while self._next < upto:
                    _, group, layer = self._order[self._next]
                    self._scatter_layer(group, layer)
                    self._copied[self._next].set()
                    self._next += 1
            except Exception as exc:  # a bug fails the load, never the forward pass's wait
                self._fail_all(exc)

    def _runs_to_copy(self) -> Iterator[tuple[Run, Outcome]]:
        """The verified runs still to copy: every group's but the states' (copied at start)."""
        for runs, outcome in zip(self._runs, self._outcomes, strict=True):
            for run in runs:
                if run.ok and run.span.group not in self._states:
                    yield run, outcome

    def _scatter_whole(self) -> None:
        """Copy every layer of each run in one call, as a load job does."""
        for run, outcome in self._runs_to_copy():
            run.ok = self._copier.scatter(run, self._after, outcome)

    def _scatter_layer(self, group: int, layer: int) -> None:
        """Copy ``group``'s ``layer`` of each of its runs."""
        for run, outcome in self._runs_to_copy():
            if run.span.group == group:
                run.ok = self._copier.scatter(run, self._after, outcome, layer)

    def _copy_states(self, running: Sequence[Mapping[int, int]]) -> None:
        """Copy the verified states, each also into its request's running-state block."""
        copier, after = self._copier, self._after
        for runs, outcome, into in zip(self._runs, self._outcomes, running, strict=True):
            for run in runs:
                span = run.span
                if not run.ok or span.group not in self._states:
                    continue
                run.ok = copier.scatter(run, after, outcome)
                if run.ok and span.group in into and run.stop == len(span.keys):
                    run.ok = copier.scatter_last_into(run, into[span.group], after, outcome)

    def _fail_all(self, exc: Exception) -> None:
        for runs, outcome in zip(self._runs, self._outcomes, strict=True):
            outcome.errors.append(f"{type(exc).__name__}: {exc}")
            for run in runs:
                run.ok = False
        self._next = len(self._order)
        for event in self._copied:
            event.set()
