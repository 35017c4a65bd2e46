"""The connector core: an engine's offloading, in plain terms, with no engine imported.

An engine adapter (:mod:`kvoffload.vllm` today) turns the engine's calls and objects into
token ids, block id lists and counts and drives two sides:

* the **scheduler side**, :class:`~kvoffload.connector.scheduler.OffloadScheduler`: the
  request table and its keys (``requests``), the hit rules of each group kind (``_hits``)
  and the search for hits (``_search``, ``_tails``), load plans and promotions (``loads``,
  ``promotions``), store plans and what window and state groups keep (``stores``,
  ``_retention``, ``_selection``, ``_spans``), the misses (``misses``), and the job book of
  orders out and reports in (``jobs``). It never touches bytes.
* the **worker side**, :class:`~kvoffload.connector.worker.OffloadWorker`: runs each step's
  orders on the :mod:`kvoffload.engine` and reports what finished or failed. It never decides
  what to evict.

They meet in :mod:`kvoffload.messages`. The stand-in (:mod:`kvoffload.standin`) drives both
sides the way vLLM does, so all of this is tested without vLLM.
"""
