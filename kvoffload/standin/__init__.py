"""A stand-in for vLLM: drives a connector's scheduler and worker sides the way vLLM 0.32 does.

vLLM itself does not run everywhere (its CPU build needs its own environment,
a GPU engine a GPU); this engine does, so the demo, ``kvoffload replay`` and
the tests run the connector's real code wherever kvoffload installs. It keeps
what a connector can observe of vLLM and nothing else:

* **Requests** are token ids: a prompt, and the output it generates, decoded
  after it (``decode_tokens`` a step; vLLM: one). It finishes when all but its
  last token are computed (vLLM never computes the KV of the last token it
  samples; a prompt alone is computed whole).
* **The GPU prefix cache** (:class:`PrefixCache`): one pool of ``gpu_blocks``
  blocks for every group, per-group block tables, vLLM's null block where a
  group holds nothing (before a sliding window), hits only at multiples of
  every group's block size, the least recently freed blocks evicted first
  and a request's tail before its head. Which blocks a hit needs is the
  connector's own rule (:func:`kvoffload.connector._hits.needed_tokens`), so a
  new group kind is served here as soon as the scheduler knows it.
  ``prefix_caching=False`` turns it off (vLLM's ``enable_prefix_caching``).
* **An EAGLE-like drafter** (``KVLayout.lookahead = k``): a block's KV is a
  function of the tokens up to its end and the ``k`` after it, and final
  only once the drafter's KV of its last position is; until then the
  forward writes other bytes (:mod:`kvoffload.standin._forward`). The GPU
  cache hashes blocks with those tokens (vLLM 0.34's lookahead block hashes)
  and caches final blocks only; every load is checked against the final KV.
* **A recurrent state** (``mamba_cache_mode="align"``, :mod:`._state`): a
  step runs a request's state in the block it ends in, copied there before
  the connector's loads start from the block the state before it is in (a
  hit's, or the last step's); the forward pass checks the state it starts
  from there. A loaded state gets its block at the hit point, and a hit on a
  state another request computes in the same step waits a step, as in vLLM.
* **A step** is vLLM's ``schedule`` / ``execute_model`` / ``update_from_output``:
  running requests continue (prefill or decode) within ``step_tokens``; waiting
  ones get their local hit, then ``get_num_new_matched_tokens`` (``None``
  skips the request this step), block allocation, ``update_state_after_alloc``
  (a request with an external hit waits for its load); then
  ``build_connector_meta``; the worker side's step around the forward pass
  (loads started, KV written, stores saved, finished jobs collected); then
  finished requests (``request_finished``, their blocks freed) and
  ``update_connector_output``. A request whose load finished resumes at the
  next step, its blocks cached; a failed load is recomputed from what is
  left valid, as vLLM's ``recompute`` policy does.

A connector plugs in as a :class:`ConnectorSide`: kvoffload's own
(:class:`KVOffloadSide`) or, in ``benchmarks/replay_vs_vllm.py``, vLLM's
``OffloadingConnector``. Each side measures the seconds of its
scheduler-side calls (:class:`Stopwatch`), which is what a connector costs
vLLM's scheduler per step.
"""

from __future__ import annotations

from kvoffload.standin._engine import MAX_IDLE_STEPS, StandIn
from kvoffload.standin._kv import KVPages, expected_page
from kvoffload.standin._kvoffload import KVOffloadSide
from kvoffload.standin._prefix_cache import NULL_BLOCK, PrefixCache
from kvoffload.standin._state import aligned_stop, state_block_size, state_key
from kvoffload.standin._types import (
    ConnectorSide,
    SimRequest,
    StandInStats,
    Status,
    StepPlan,
    Stopwatch,
    WorkerResult,
)

__all__ = [
    "MAX_IDLE_STEPS",
    "NULL_BLOCK",
    "ConnectorSide",
    "KVOffloadSide",
    "KVPages",
    "PrefixCache",
    "SimRequest",
    "StandIn",
    "StandInStats",
    "Status",
    "StepPlan",
    "Stopwatch",
    "WorkerResult",
    "aligned_stop",
    "expected_page",
    "state_block_size",
    "state_key",
]
