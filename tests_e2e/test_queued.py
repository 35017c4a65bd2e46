"""A request that waits in vLLM's queue has its disk-tier chunks fetched into the CPU tier
meanwhile, and loads them in the step that schedules it.

What no other test proves: ``on_new_request`` reaches the connector, and a waiting
request's lower-tier chunks are read while another request runs. The engine runs one
request at a time (``max_num_seqs`` 1) and starts with only the disk holding the second
prompt's chunks (stored by another process): the second request waits while the first
decodes, its chunks come in from disk, and when it is scheduled its hit is a CPU-tier hit
loaded in its step, with the tokens and logprobs of vLLM's own cache. (Holds against
eviction, the share they take and what a store may take back: the unit suite,
``tests/test_queued.py``.)
"""

from __future__ import annotations

from pathlib import Path

from _harness import (
    LLAMA_ENGINE,
    LLAMA_PROMPTS,
    LOGPROB_TOL,
    Engine,
    Reference,
    alone_oracle,
    connector_hit,
    llama_stored_on_disk,
    own_cache_alone_oracle,
    random_prompts,
)

#: Nothing of it is stored: it runs first, and keeps the engine's one running slot.
AHEAD = random_prompts(1, 200, 512, seed=5)[0]


def test_a_waiting_requests_disk_chunks_are_fetched_and_load_in_its_step(
    engine: Engine, reference: Reference, llama: str, tmp_path: Path
) -> None:
    spec, _ = llama_stored_on_disk(engine, reference, llama, tmp_path / "kv", 2)
    waiting = LLAMA_PROMPTS[0]
    one_at_a_time = {**LLAMA_ENGINE, "max_num_seqs": 1}
    connector = {**spec["connector"], "fetch_while_queued": True}
    subject = engine(**{**spec, "engine": one_at_a_time, "prompts": [AHEAD, waiting],
                        "connector": connector})  # fmt: skip
    assert subject["error"] is None, subject["error"]
    hit = connector_hit(waiting, 64)
    assert subject["passes"][0]["cached"] == [0, hit]
    scheduler = subject["stats"]["scheduler"]
    assert scheduler["queued_fetches"] == 1
    assert scheduler["queued_fetched_chunks"] == hit // 64
    assert scheduler["in_step_hit_tokens"] == scheduler["loaded_tokens"] == hit
    assert scheduler["failed_loads"] == 0 and scheduler["index_held"] == 0

    # Each prompt's output is vLLM's alone: the first computed, the second from its own cache.
    first = alone_oracle(engine, llama, LLAMA_ENGINE, [AHEAD])["passes"][0]
    second = own_cache_alone_oracle(engine, llama, LLAMA_ENGINE, LLAMA_PROMPTS)["passes"][0]
    done = subject["passes"][0]
    for n, oracle in enumerate([first, second]):  # each oracle's prompt 0 is this one's n
        assert done["tokens"][n] == oracle["tokens"][0], f"prompt {n} generated other tokens"
        pairs = zip(done["logprobs"][n], oracle["logprobs"][0], strict=True)
        assert all(abs(mine - theirs) <= LOGPROB_TOL for mine, theirs in pairs), n
