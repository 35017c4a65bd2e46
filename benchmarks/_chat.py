"""Multi-turn conversations driven against a completion function, and their figures.

A conversation's next turn is its shared system prompt, its whole history
(earlier questions and the server's answers) and a new question. Turns are
served round-robin: a conversation whose turn is answered goes to the back of
the queue, so its history waits behind the other conversations' turns, as it
does for real users who read and type between turns.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from _serve import DISK_HITS, Completion

Ask = Callable[[list[int]], Completion]


@dataclass(frozen=True)
class Turn:
    answer: Completion
    history_tokens: int  # the prompt's tokens before this turn's question


@dataclass
class Conversation:
    """One user's questions (token ids) and, as it goes, the history and the turns."""

    questions: list[list[int]]
    history: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.turns) == len(self.questions)


def conversations(
    n: int, turns: int, system_tokens: int, question_tokens: int, vocab: int
) -> tuple[list[int], list[Conversation]]:
    """The shared system prompt and ``n`` fresh conversations (the same on every call)."""
    rng = random.Random(0)
    system = [rng.randrange(1, vocab) for _ in range(system_tokens)]
    convs = [
        Conversation([[rng.randrange(1, vocab) for _ in range(question_tokens)]
                      for _ in range(turns)])
        for _ in range(n)
    ]  # fmt: skip
    return system, convs


def unique_prompts(n: int, tokens: int, vocab: int, seed: int = 1) -> list[Conversation]:
    """One-turn conversations that share nothing (random tokens, no system prompt)."""
    rng = random.Random(seed)
    return [Conversation([[rng.randrange(1, vocab) for _ in range(tokens)]]) for _ in range(n)]


@contextmanager
def threads(n: int) -> Iterator[ThreadPoolExecutor]:
    """A thread pool that, on an error or Ctrl-C, does not wait for its requests to end.

    They end when the caller stops the servers they wait on (a plain ``with``
    would wait for them first, up to the request timeout).
    """
    pool = ThreadPoolExecutor(n)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


def converse(ask: Ask, system: list[int], convs: list[Conversation], concurrency: int) -> float:
    """Run every conversation to its end, ``concurrency`` requests in flight; the wall time."""
    ready = deque(convs)
    in_flight: dict[Future[Completion], tuple[Conversation, list[int]]] = {}
    started = time.perf_counter()
    with threads(concurrency) as pool:
        while ready or in_flight:
            while ready and len(in_flight) < concurrency:
                conv = ready.popleft()
                prompt = system + conv.history + conv.questions[len(conv.turns)]
                in_flight[pool.submit(ask, prompt)] = (conv, prompt)
            finished, _ = wait(in_flight, return_when=FIRST_COMPLETED)
            for future in finished:
                conv, prompt = in_flight.pop(future)
                answer = future.result()
                question = conv.questions[len(conv.turns)]
                conv.turns.append(Turn(answer, len(prompt) - len(question)))
                conv.history = prompt[len(system) :] + answer.tokens
                if not conv.done:
                    ready.append(conv)
    return time.perf_counter() - started


def p90(values: list[float]) -> float:
    """Nearest-rank 90th percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def summary(
    convs: list[Conversation], seconds: float, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    """Figures of one timed workload; the engine's counters are deltas of its /metrics.

    ``tokens_per_s`` counts prompt and generated tokens, served from a cache or not.
    """
    answers = [t.answer for c in convs for t in c.turns]
    prompt = sum(a.prompt_tokens for a in answers)
    generated = sum(len(a.tokens) for a in answers)
    per_turn = []
    for i in range(len(convs[0].questions)):
        ttfts = [c.turns[i].answer.ttft_s for c in convs]
        cached = [c.turns[i].answer.cached_tokens for c in convs]
        per_turn.append(
            {
                "ttft_median_s": statistics.median(ttfts),
                "ttft_p90_s": p90(ttfts),
                "cached_tokens_median": statistics.median(cached),
            }
        )
    delta = {name: after[name] - before[name] for name in after}
    # Every turn that carries a history (all but the first), pooled.
    later = [t.answer.ttft_s for c in convs for t in c.turns[1:]] or [0.0]
    return {
        "seconds": seconds,
        "requests": len(answers),
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "tokens_per_s": (prompt + generated) / seconds,
        "per_turn": per_turn,
        "later_turns": {"ttft_median_s": statistics.median(later), "ttft_p90_s": p90(later)},
        "engine_hit_tokens": int(delta["vllm:prefix_cache_hits_total"]),
        "connector_hit_tokens": int(delta["vllm:external_prefix_cache_hits_total"]),
        "disk_hit_tokens": int(delta[DISK_HITS]),
        "preemptions": int(delta["vllm:num_preemptions_total"]),
    }
