"""What the engine counts (StepStats, for run summaries, benchmarks and /metrics) and what one step hands back
(StepOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from tp_lora.engine.requests import Result


@dataclass
class StepStats:
    steps: int = 0
    graph_steps: int = 0  # steps replayed from a CUDA graph (the others ran eagerly)
    graph_captures: int = 0  # of those, the steps that captured their graph (its first use; slow)
    graph_seconds: float = 0.0  # wall time of those steps: to the sampled tokens on the host, from the launch or from
    # the previous step's tokens, whichever is later (steps launched ahead overlap)
    eager_seconds: float = 0.0  # the same for the eager steps
    # decode steps (one new token per sequence: what a decode benchmark times) by their number of sequences ->
    # [steps, wall seconds (as graph_seconds)]
    decode_by_rows: dict = field(default_factory=dict)
    ahead_steps: int = 0  # steps launched before the previous step's tokens were read (run_ahead)
    mask_steps: int = 0  # steps that sampled grammar rows (structured output)
    mask_wait_seconds: float = 0.0  # the host's wait in those steps for their grammar masks, once the previous
    # step's tokens were on the host (masks filled ahead cost none while the device runs)
    mask_device_wait_seconds: float = 0.0  # on CUDA, the device's wait in those steps for masks filled ahead
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0  # of those, tokens found in the prefix cache (not computed)
    generated_tokens: int = 0
    seconds: float = 0.0
    adapter_loads: int = 0  # copies into device slots
    slot_hits: int = 0  # admissions that found their adapter in a slot
    slot_misses: int = 0
    interrupted: int = 0  # requests a stop left unfinished
    preemptions: int = 0  # running sequences sent back to the queue for want of KV blocks (recomputed later)

    @property
    def decode_steps(self) -> int:
        return sum(n for n, _ in self.decode_by_rows.values())

    @property
    def decode_seconds(self) -> float:
        return sum(t for _, t in self.decode_by_rows.values())

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def slot_hit_rate(self) -> float:
        n = self.slot_hits + self.slot_misses
        return self.slot_hits / n if n else 1.0


@dataclass
class StepOutput:
    """What one Engine.step() did: the results that got a token (streams read their new tokens) and those that
    ended (finished, or failed: their adapter could not be loaded)."""
    advanced: list[Result] = field(default_factory=list)
    finished: list[Result] = field(default_factory=list)


class Gauges(NamedTuple):
    """The engine's state now, for a front end's metrics (a tuple: it travels in the server's frames)."""
    waiting: int  # requests queued
    running: int  # sequences in the batch
    slot_hit_rate: float
    adapter_reads: int  # adapters read from disk (host-cache misses)
    adapter_loads: int  # copies into device slots
    kv_used: int  # KV blocks held by running sequences
    kv_cached: int  # KV blocks in the prefix cache that no sequence holds (evictable)
    kv_free: int
