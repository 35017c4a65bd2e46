"""Sweeps of the arrival replay: capacity x hints x policy, each against Belady and LRU."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvoffload.errors import ConfigError
from kvoffload.replay.arrivals import ArrivalRow, arrival_bound, replay_arrivals
from kvoffload.replay.engine import EngineSettings
from kvoffload.replay.foresight import Params, trace_hints
from kvoffload.replay.trace import Trace

__all__ = ["HintMode", "format_arrival_table", "parse_hint_modes", "sweep_arrivals"]


class HintMode(NamedTuple):
    """Which client the replay plays: none, or one right ``accuracy`` of the time."""

    label: str
    accuracy: float | None

    def hints(self, trace: Trace) -> tuple[str, Sequence[Params | None]]:
        if self.accuracy is None:
            return self.label, ()
        return self.label, trace_hints(trace, self.accuracy)


def parse_hint_modes(text: str, flag: str = "--hints") -> tuple[HintMode, ...]:
    """``"none,perfect,0.8"`` -> the modes; anything else is a ``ConfigError`` naming it."""
    modes: list[HintMode] = []
    for raw in text.split(","):
        item = raw.strip()
        if item == "none":
            modes.append(HintMode("none", None))
        elif item == "perfect":
            modes.append(HintMode("perfect", 1.0))
        else:
            try:
                accuracy = float(item)
            except ValueError:
                accuracy = -1.0
            if not 0 < accuracy < 1:
                raise ConfigError(
                    f"{flag}: {item!r} is not a client: give none, perfect (the trace's own "
                    "knowledge of which turns continue), or an accuracy such as 0.8"
                )
            modes.append(HintMode(f"{accuracy:.0%} right", accuracy))
    return tuple(dict.fromkeys(modes))


def sweep_arrivals(
    trace: Trace,
    capacities: Sequence[int],
    policies: Sequence[str],
    modes: Sequence[HintMode],
    *,
    load: float,
    settings: EngineSettings,
    progress: bool = False,
) -> list[ArrivalRow]:
    """Every capacity, hint mode and policy; Belady once per capacity, hints once per mode."""
    hints = {mode: mode.hints(trace) for mode in modes}
    rows: list[ArrivalRow] = []
    for capacity in capacities:
        bound = arrival_bound(trace, capacity + settings.gpu_blocks)
        for mode in modes:
            rows += [
                replay_arrivals(
                    trace,
                    capacity,
                    policy,
                    load=load,
                    hints=hints[mode],
                    settings=settings,
                    bound=bound,
                    progress=progress,
                )
                for policy in policies
            ]
    return rows


def format_arrival_table(rows: Sequence[ArrivalRow]) -> str:
    """One line per row: the hit ratio, its share of Belady's, its ratio to LRU's (same
    capacity and hints, when LRU ran), and the queue it ran under."""
    lru = {(r.capacity, r.hints): r.hit_ratio for r in rows if r.policy == "lru"}
    header = ("capacity", "policy", "hints", "hit ratio", "of Belady", "x LRU", "Belady",
              "queue mean/p99/max", "wait mean/p99 s", "busy")  # fmt: skip
    lines = ["{:>8} {:<9} {:<9} {:>9} {:>9} {:>6} {:>7} {:>18} {:>15} {:>5}".format(*header)]
    for r in rows:
        base = lru.get((r.capacity, r.hints))
        versus = f"{r.hit_ratio / base:.2f}" if base else "-"
        q = r.queue
        lines.append(
            f"{r.capacity:>8} {r.policy:<9} {r.hints:<9} {r.hit_ratio:>9.4f} "
            f"{r.of_bound:>9.1%} {versus:>6} {r.bound:>7.4f} "
            f"{f'{q.mean:.1f}/{q.p99}/{q.most}':>18} "
            f"{f'{q.wait_mean_s:.2f}/{q.wait_p99_s:.2f}':>15} {q.busy:>5.0%}"
        )
    lines.append(
        "hit ratio: prompt tokens the engine's GPU cache or the connector served; Belady: the "
        "offline bound over both (capacity + GPU blocks); queue: requests waiting, over time"
    )
    return "\n".join(lines)
